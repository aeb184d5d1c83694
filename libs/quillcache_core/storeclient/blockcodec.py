"""The record format of a stored KV block, on disk (SSD tier) and on the wire.

A record is a header followed by the payload (the block's KV bytes)::

    offset  size  field
    0       4     magic b"QKVB"
    4       1     format version (1)
    5       1     flags (0; reserved)
    6       2     reserved (0)
    8       4     identity length I (bytes, u32)
    12      8     payload length N (bytes, u64)
    20      8     xxh3-64 of the payload (u64)
    28      8     xxh3-64 of bytes [0, 28) followed by the identity (u64)
    36      I     identity: msgpack array of the KvBlockKey's eight fields
    36+I    N     payload

All integers are little-endian. The header checksum covers the identity and the
lengths, so a flipped bit anywhere in a record, a truncated record or a record with
trailing bytes is reported as `Corrupt` by `decode`, never returned.

`storage_key` is the fixed 32-byte key a record is stored under (LMDB key, map key):
a BLAKE2b-256 digest of a canonical, length-prefixed encoding of every identity field,
so the same content hash under another tenant (or model, adapter...) is another key.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from hashlib import blake2b

import msgpack
import xxhash

from quillcache_core.errors import Corrupt, InvalidArgument
from quillcache_core.identity.hashing import hash_fields
from quillcache_core.model import KvBlockKey

MAGIC = b"QKVB"
FORMAT_VERSION = 1
STORAGE_KEY_BYTES = 32
MAX_IDENTITY_BYTES = 64 * 1024
MAX_KEY_FIELD_BYTES = 1024
"""The longest string field of a block key (model, tokenizer, adapter, tenant, prefix
hash, block hash; UTF-8 bytes), and of a node id or address a store call names. Six
fields at this length encode to about 6 KiB, well within MAX_IDENTITY_BYTES, the most
a record's header holds, so every key a store accepts can be demoted to its SSD tier."""
KEY_INT_END = 1 << 32  # block_index and token_count are uint32 on the wire

_FIXED = struct.Struct("<4sBBHIQQQ")
FIXED_HEADER_BYTES = _FIXED.size  # 36
_CHECKED = 28  # bytes of the fixed header covered by the header checksum
_STORAGE_DOMAIN = b"quillcache/v1/store-key"

payload_checksum = xxhash.xxh3_64_intdigest
"""xxh3-64 of a bytes-like object, as an int: the payload checksum of a record."""

payload_hasher = xxhash.xxh3_64
"""A streaming `payload_checksum`: `update(piece)` in order, then `intdigest()`."""


class CorruptBlock(Corrupt):
    """A stored block failed verification; carries the key and size when known."""

    def __init__(self, message: str, key: KvBlockKey | None = None, nbytes: int = 0) -> None:
        super().__init__(message)
        self.key = key
        self.nbytes = nbytes


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """A verified header: identity, where the payload starts, its length and checksum."""

    key: KvBlockKey
    header_len: int
    payload_len: int
    checksum: int

    @property
    def record_len(self) -> int:
        return self.header_len + self.payload_len


def _identity_fields(key: KvBlockKey) -> list:
    return [
        key.model_id,
        key.tokenizer_id,
        key.adapter_id,
        key.tenant_id,
        key.prefix_hash,
        key.block_hash,
        key.block_index,
        key.token_count,
    ]


_KEY_STRINGS = ("model_id", "tokenizer_id", "adapter_id", "tenant_id", "prefix_hash", "block_hash")


def check_field_size(what: str, value: str) -> None:
    """InvalidArgument naming `what` when `value` is longer than MAX_KEY_FIELD_BYTES."""
    # A character is at most 4 bytes: most values need no encoding to be judged.
    if len(value) * 4 > MAX_KEY_FIELD_BYTES:
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > MAX_KEY_FIELD_BYTES:
            raise InvalidArgument(
                f"{what} is {size} bytes, longer than the limit of {MAX_KEY_FIELD_BYTES}"
            )


def check_key(key: KvBlockKey, what: str = "key") -> KvBlockKey:
    """`key`, when every field is within what a record can hold (`MAX_KEY_FIELD_BYTES`
    per string, `KEY_INT_END` for the integers); else InvalidArgument naming the field."""
    for name, value in zip(_KEY_STRINGS, key[:6], strict=True):
        if value is not None:
            check_field_size(f"{what}.{name}", value)
    for name, value in (("block_index", key.block_index), ("token_count", key.token_count)):
        if not 0 <= value < KEY_INT_END:
            raise InvalidArgument(f"{what}.{name} {value} is outside 0..{KEY_INT_END - 1}")
    return key


def encode_identity(key: KvBlockKey) -> bytes:
    """The compact identity of a header: a msgpack array of the key's fields."""
    return msgpack.packb(_identity_fields(key), use_bin_type=True)


def decode_identity(raw: bytes | memoryview) -> KvBlockKey:
    """Inverse of `encode_identity`; raises Corrupt on anything malformed."""
    try:
        fields = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise Corrupt(f"record identity is not valid msgpack: {exc}") from None
    if not isinstance(fields, list) or len(fields) != 8:
        raise Corrupt("record identity is not an array of 8 fields")
    model, tokenizer, adapter, tenant, prefix, block, index, tokens = fields
    strs = (model, tokenizer, tenant, prefix, block)
    if not all(isinstance(s, str) for s in strs) or not (
        adapter is None or isinstance(adapter, str)
    ):
        raise Corrupt("record identity has a field of the wrong type")
    if type(index) is not int or type(tokens) is not int:
        raise Corrupt("record identity has a non-integer block_index or token_count")
    return KvBlockKey(model, tokenizer, adapter, tenant, prefix, block, index, tokens)


def storage_key(key: KvBlockKey) -> bytes:
    """The 32-byte key under which `key`'s record is stored; covers the whole identity.

    Strings are UTF-8 with a 4-byte length prefix, a missing adapter is a distinct
    marker (so None and "" differ), integers are 8-byte signed.
    """
    h = blake2b(_STORAGE_DOMAIN, digest_size=STORAGE_KEY_BYTES)
    hash_fields(h, key[:6])  # model, tokenizer, adapter, tenant, prefix, block hash
    h.update(key.block_index.to_bytes(8, "little", signed=True))
    h.update(key.token_count.to_bytes(8, "little", signed=True))
    return h.digest()


def encode(key: KvBlockKey, payload: bytes | memoryview, digest: int | None = None) -> bytes:
    """The header of the record of `payload` under `key`; the payload follows it.

    `digest` (the payload's xxh3-64) may be passed when already known; it is computed
    otherwise.
    """
    ident = encode_identity(key)
    if len(ident) > MAX_IDENTITY_BYTES:
        raise InvalidArgument(f"block identity too large: {len(ident)} bytes")
    n = memoryview(payload).nbytes
    if digest is None:
        digest = payload_checksum(payload)
    fixed = bytearray(_FIXED.pack(MAGIC, FORMAT_VERSION, 0, 0, len(ident), n, digest, 0))
    header_digest = xxhash.xxh3_64_intdigest(bytes(fixed[:_CHECKED]) + ident)
    struct.pack_into("<Q", fixed, _CHECKED, header_digest)
    return bytes(fixed) + ident


def header_length(key: KvBlockKey) -> int:
    """The length of `encode(key, ...)`'s header (it does not depend on the payload), so
    a record buffer can be allocated with the header's room reserved before the
    payload arrives."""
    return _FIXED.size + len(encode_identity(key))


def encode_record(key: KvBlockKey, payload: bytes | memoryview, digest: int | None = None) -> bytes:
    """Header and payload as one contiguous bytes object (one copy of the payload)."""
    return b"".join((encode(key, payload, digest), payload))


def _byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def decode_header(
    record: bytes | bytearray | memoryview, expected: KvBlockKey | None = None
) -> RecordHeader:
    """Verify a record's header (magic, version, lengths, header checksum, identity).

    Does not read the payload. Raises `CorruptBlock` on any mismatch, including a total
    length that disagrees with the header (truncation or trailing bytes).
    """
    view = _byte_view(record)
    total = view.nbytes
    if total < FIXED_HEADER_BYTES:
        raise CorruptBlock(
            f"truncated record: {total} bytes, shorter than the {FIXED_HEADER_BYTES}-byte header",
            expected,
        )
    magic, version, _flags, _res, ident_len, payload_len, payload_digest, header_digest = (
        _FIXED.unpack_from(view, 0)
    )
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}", expected)
    if version != FORMAT_VERSION:
        raise CorruptBlock(f"unsupported record format version {version}", expected)
    header_len = FIXED_HEADER_BYTES + ident_len
    if ident_len > MAX_IDENTITY_BYTES or header_len > total:
        raise CorruptBlock(
            f"truncated record: identity of {ident_len} bytes does not fit in {total} bytes",
            expected,
        )
    ident = view[FIXED_HEADER_BYTES:header_len]
    actual = xxhash.xxh3_64_intdigest(bytes(view[:_CHECKED]) + bytes(ident))
    if actual != header_digest:
        raise CorruptBlock(
            f"header checksum mismatch: stored {header_digest:016x}, computed {actual:016x}",
            expected,
        )
    try:
        key = decode_identity(ident)
    except Corrupt as exc:
        raise CorruptBlock(str(exc), expected) from None
    if expected is not None and key != expected:
        raise CorruptBlock(f"record identity {key} does not match the requested key", expected)
    if total != header_len + payload_len:
        kind = "truncated payload" if total < header_len + payload_len else "wrong record length"
        raise CorruptBlock(
            f"{kind}: header says {payload_len} payload bytes, record holds {total - header_len}",
            key,
        )
    return RecordHeader(key, header_len, payload_len, payload_digest)


def decode(
    record: bytes | bytearray | memoryview, expected: KvBlockKey | None = None
) -> tuple[KvBlockKey, memoryview]:
    """Verify a whole record and return its identity and a view of its payload.

    The view points into `record` (no copy). Raises `CorruptBlock` (a `Corrupt`) on a
    bad header, a length mismatch, a payload checksum mismatch, or an identity that is
    not `expected` (when given).
    """
    header = decode_header(record, expected)
    view = _byte_view(record)
    payload = view[header.header_len :]
    actual = payload_checksum(payload)
    if actual != header.checksum:
        raise CorruptBlock(
            f"payload checksum mismatch for block {header.key.block_hash}: stored "
            f"{header.checksum:016x}, computed {actual:016x} over {header.payload_len} bytes",
            header.key,
        )
    return header.key, payload
