"""The block data protocol: store-to-store block bytes over a raw TCP connection.

A store node also listens on a block-data port (`datapath.server`), announced in its
registry record as `data_address`. A destination node (`datapath.pull`) connects, sends a
request naming the blocks, and receives them back to back, in request order, each
straight into its own DRAM pool buffer. One connection carries one request at a time
and may carry many requests in turn. All integers are little-endian.

Request (destination -> source)::

    offset  size  field
    0       4     magic b"QCDQ"
    4       2     protocol version (1)
    6       2     flags (0; reserved)
    8       4     body length B (u32)
    12      B     body: msgpack array of the blocks' identities (each the bytes of
                  `blockcodec.encode_identity`: model, tokenizer, adapter, tenant,
                  prefix hash, block hash, block index, token count)

Response, per requested block in order (source -> destination)::

    0       4     magic b"QCDB"
    4       1     status (`STATUS_*`: 0 ok, else why the block is not sent)
    5       1     tier the block was read from (`TIER_CODES`; 0 when not ok)
    6       2     reserved (0)
    8       4     message length M (u32; an error text when not ok, else 0)
    12      8     payload length N (u64; 0 when not ok)
    20      8     xxh3-64 of the payload (u64; the checksum recorded when the block
                  was stored, so the destination verifies end to end)
    28      M     message (UTF-8)
    28+M    N     payload

Put (a client -> this node; blocks pushed instead of pulled: an engine offloading,
or any writer that wants a put without gRPC's per-chunk cost)::

    0       4     magic b"QCDP"
    4       2     protocol version (1)
    6       2     flags (`FLAG_DURABLE`: acknowledged after the SSD commit)
    8       4     identity length I (u32)
    12      1     tier wanted (`TIER_CODES`)
    13      3     reserved (0)
    16      8     payload length N (u64)
    24      8     xxh3-64 of the payload (u64; checked before anything is stored)
    32      I     identity (`blockcodec.encode_identity`)
    32+I    N     payload

Each put is answered, in order, by an ack with the block header's layout and magic
b"QCDA": status, the tier the block landed in, message length, payload length (the
bytes stored), checksum, then the message. A client may send several puts before
reading their acks. A put whose header is malformed is answered with its error and
the connection closed; a put refused for what it asks (capacity, a checksum
mismatch) is answered with its error and the connection goes on.

A source that cannot parse a request closes the connection. A connection that ends
inside a block's header or payload loses that block and every later one of the
request; the destination stores only blocks whose payload arrived whole and matched
its checksum.

This module is pure: framing only, no sockets.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack

from quillcache_core.errors import (
    CapacityExceeded,
    Corrupt,
    InvalidArgument,
    NodeUnavailable,
    NotFound,
)
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.storeclient.blockcodec import (
    MAX_IDENTITY_BYTES,
    check_key,
    decode_identity,
    encode_identity,
)

REQUEST_MAGIC = b"QCDQ"
BLOCK_MAGIC = b"QCDB"
PUT_MAGIC = b"QCDP"
ACK_MAGIC = b"QCDA"
FLAG_DURABLE = 1
VERSION = 1
MAX_REQUEST_KEYS = 4096
MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
MAX_MESSAGE_BYTES = 64 * 1024

REQUEST_HEADER = struct.Struct("<4sHHI")
BLOCK_HEADER = struct.Struct("<4sBBHIQQ")
PUT_FIXED = struct.Struct("<BxxxQQ")  # after REQUEST_HEADER: tier, payload length, checksum

STATUS_OK = 0
STATUS_NOT_FOUND = 1
STATUS_DATA_LOSS = 2
STATUS_UNAVAILABLE = 3
STATUS_INVALID_ARGUMENT = 4
STATUS_RESOURCE_EXHAUSTED = 5
STATUS_INTERNAL = 6

# The gRPC status name of each status, as transfer results report it.
CODE_NAMES = {
    STATUS_OK: "OK",
    STATUS_NOT_FOUND: "NOT_FOUND",
    STATUS_DATA_LOSS: "DATA_LOSS",
    STATUS_UNAVAILABLE: "UNAVAILABLE",
    STATUS_INVALID_ARGUMENT: "INVALID_ARGUMENT",
    STATUS_RESOURCE_EXHAUSTED: "RESOURCE_EXHAUSTED",
    STATUS_INTERNAL: "INTERNAL",
}
_ERROR_STATUS = (
    (NotFound, STATUS_NOT_FOUND),
    (Corrupt, STATUS_DATA_LOSS),
    (NodeUnavailable, STATUS_UNAVAILABLE),
    (InvalidArgument, STATUS_INVALID_ARGUMENT),
    (CapacityExceeded, STATUS_RESOURCE_EXHAUSTED),
)
_STATUS_ERROR = {status: cls for cls, status in _ERROR_STATUS}

TIER_CODES = {CacheTier.CPU_DRAM: 1, CacheTier.LOCAL_SSD: 2}
TIERS_BY_CODE = {code: tier for tier, code in TIER_CODES.items()}


def status_of(exc: BaseException) -> int:
    """The status of a domain error (INTERNAL for anything else)."""
    for cls, status in _ERROR_STATUS:
        if isinstance(exc, cls):
            return status
    return STATUS_INTERNAL


def code_name(exc: BaseException) -> str:
    """The gRPC status name of a domain error, e.g. "NOT_FOUND"."""
    return CODE_NAMES[status_of(exc)]


def error_of(status: int, message: str) -> Exception:
    """The domain error a non-ok status stands for."""
    cls = _STATUS_ERROR.get(status, RuntimeError)
    return cls(message)


# --- request ------------------------------------------------------------------------------


def encode_request(keys: list[KvBlockKey]) -> bytes:
    """A whole request frame for `keys` (1..MAX_REQUEST_KEYS of them)."""
    if not 1 <= len(keys) <= MAX_REQUEST_KEYS:
        raise InvalidArgument(f"a data request names 1..{MAX_REQUEST_KEYS} blocks, not {len(keys)}")
    body = msgpack.packb([encode_identity(k) for k in keys], use_bin_type=True)
    if len(body) > MAX_REQUEST_BODY_BYTES:
        raise InvalidArgument(f"data request body of {len(body)} bytes is too large")
    return REQUEST_HEADER.pack(REQUEST_MAGIC, VERSION, 0, len(body)) + body


def decode_request_header(raw: bytes | memoryview) -> int:
    """The body length of a request header; InvalidArgument if it is not one."""
    kind, _flags, length = decode_frame_header(raw)
    if kind != REQUEST_MAGIC:
        raise InvalidArgument(f"bad request magic {kind!r}")
    return length


def decode_frame_header(raw: bytes | memoryview) -> tuple[bytes, int, int]:
    """(magic, flags, body length) of a pull request or put header; InvalidArgument
    when it is neither."""
    magic, version, flags, length = REQUEST_HEADER.unpack(raw)
    magic = bytes(magic)
    if magic not in (REQUEST_MAGIC, PUT_MAGIC):
        raise InvalidArgument(f"bad request magic {magic!r}")
    if version != VERSION:
        raise InvalidArgument(f"unsupported data protocol version {version}")
    limit = MAX_REQUEST_BODY_BYTES if magic == REQUEST_MAGIC else MAX_IDENTITY_BYTES
    if length > limit:
        raise InvalidArgument(f"request body of {length} bytes exceeds the limit")
    return magic, flags, length


# --- put ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PutHeader:
    """What a put asks for; its identity (`identity_len` bytes) and payload follow."""

    durable: bool
    tier: CacheTier
    identity_len: int
    payload_len: int
    checksum: int


def encode_put(
    key: KvBlockKey, payload_len: int, checksum: int, *, tier: CacheTier, durable: bool
) -> bytes:
    """Header and identity of a put; the payload follows them."""
    if tier not in TIER_CODES:
        raise InvalidArgument(f"a store node holds cpu_dram or local_ssd, not {tier}")
    if payload_len <= 0:
        raise InvalidArgument("cannot store an empty block")
    ident = encode_identity(key)
    flags = FLAG_DURABLE if durable else 0
    return (
        REQUEST_HEADER.pack(PUT_MAGIC, VERSION, flags, len(ident))
        + PUT_FIXED.pack(TIER_CODES[tier], payload_len, checksum)
        + ident
    )


def decode_put_fixed(
    flags: int, identity_len: int, raw: bytes | memoryview, max_payload_bytes: int
) -> PutHeader:
    """The put described by its frame header's flags and length and the PUT_FIXED part;
    InvalidArgument when it is malformed or asks too much."""
    tier, payload_len, checksum = PUT_FIXED.unpack(raw)
    if flags & ~FLAG_DURABLE:
        raise InvalidArgument(f"unknown put flags {flags:#x}")
    if tier not in TIERS_BY_CODE:
        raise InvalidArgument(f"unknown tier code {tier}")
    if not 0 < identity_len <= MAX_IDENTITY_BYTES:
        raise InvalidArgument(f"put identity of {identity_len} bytes")
    if not 0 < payload_len <= max_payload_bytes:
        raise InvalidArgument(
            f"block of {payload_len} bytes: a put carries 1..{max_payload_bytes} bytes"
        )
    return PutHeader(
        bool(flags & FLAG_DURABLE), TIERS_BY_CODE[tier], identity_len, payload_len, checksum
    )


def decode_put_identity(raw: bytes | memoryview) -> KvBlockKey:
    """The key of a put; InvalidArgument when malformed or a field is too long."""
    try:
        key = decode_identity(raw)
    except Corrupt as exc:
        raise InvalidArgument(f"malformed key in put: {exc}") from None
    return check_key(key, "put key")


def encode_ack(tier: CacheTier, payload_len: int, checksum: int) -> bytes:
    """The ack of a stored block."""
    return BLOCK_HEADER.pack(ACK_MAGIC, STATUS_OK, TIER_CODES[tier], 0, 0, payload_len, checksum)


def encode_ack_error(status: int, message: str) -> bytes:
    """Header and message of a put that stored nothing."""
    text = message.encode("utf-8")[:MAX_MESSAGE_BYTES]
    return BLOCK_HEADER.pack(ACK_MAGIC, status, 0, 0, len(text), 0, 0) + text


def decode_ack(raw: bytes | memoryview) -> BlockHeader:
    """Parse an ack (its message, `message_len` bytes, follows); InvalidArgument if it
    is not one."""
    magic, status, tier, _res, msg_len, payload_len, checksum = BLOCK_HEADER.unpack(raw)
    if magic != ACK_MAGIC:
        raise InvalidArgument(f"bad ack magic {bytes(magic)!r}")
    if status not in CODE_NAMES:
        raise InvalidArgument(f"unknown ack status {status}")
    if msg_len > MAX_MESSAGE_BYTES:
        raise InvalidArgument(f"ack message of {msg_len} bytes exceeds the limit")
    if status == STATUS_OK and tier not in TIERS_BY_CODE:
        raise InvalidArgument(f"ok ack with tier {tier}")
    return BlockHeader(status, TIERS_BY_CODE.get(tier), msg_len, payload_len, checksum)


def decode_request_body(body: bytes | memoryview) -> list[KvBlockKey]:
    """The keys of a request body; InvalidArgument on anything malformed or too long."""
    try:
        raw = msgpack.unpackb(body, raw=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise InvalidArgument(f"request body is not valid msgpack: {exc}") from None
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_REQUEST_KEYS:
        raise InvalidArgument(f"request body must be an array of 1..{MAX_REQUEST_KEYS} keys")
    keys = []
    for i, item in enumerate(raw):
        if not isinstance(item, bytes):
            raise InvalidArgument("request key is not a binary identity")
        try:
            key = decode_identity(item)
        except Corrupt as exc:
            raise InvalidArgument(f"malformed key in request: {exc}") from None
        keys.append(check_key(key, f"keys[{i}]"))
    return keys


# --- per-block response -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """One block's response header (what follows it: `message_len`, then `payload_len`)."""

    status: int
    tier: CacheTier | None
    message_len: int
    payload_len: int
    checksum: int


def encode_block_header(tier: CacheTier, payload_len: int, checksum: int) -> bytes:
    """The header of a block that follows (status ok)."""
    return BLOCK_HEADER.pack(BLOCK_MAGIC, STATUS_OK, TIER_CODES[tier], 0, 0, payload_len, checksum)


def encode_block_error(status: int, message: str) -> bytes:
    """Header and message of a block that is not sent."""
    text = message.encode("utf-8")[:MAX_MESSAGE_BYTES]
    return BLOCK_HEADER.pack(BLOCK_MAGIC, status, 0, 0, len(text), 0, 0) + text


def decode_block_header(raw: bytes | memoryview, max_payload_bytes: int) -> BlockHeader:
    """Parse a block header; InvalidArgument when it is not one (a desynchronised stream)."""
    magic, status, tier, _res, msg_len, payload_len, checksum = BLOCK_HEADER.unpack(raw)
    if magic != BLOCK_MAGIC:
        raise InvalidArgument(f"bad block magic {bytes(magic)!r}")
    if status not in CODE_NAMES:
        raise InvalidArgument(f"unknown block status {status}")
    if msg_len > MAX_MESSAGE_BYTES:
        raise InvalidArgument(f"block message of {msg_len} bytes exceeds the limit")
    if status == STATUS_OK:
        if tier not in TIERS_BY_CODE or payload_len == 0:
            raise InvalidArgument(f"ok block with tier {tier} and {payload_len} bytes")
        if payload_len > max_payload_bytes:
            raise InvalidArgument(
                f"block of {payload_len} bytes exceeds the largest accepted ({max_payload_bytes})"
            )
    elif payload_len:
        raise InvalidArgument("a failed block carries no payload")
    return BlockHeader(status, TIERS_BY_CODE.get(tier), msg_len, payload_len, checksum)
