"""Wire helpers of the store and transfer services: chunk framing and key conversion.

Block bytes travel in field 15 (`data`) of `PutChunk` and `GetChunk`. Building a
protobuf message around a 2 MiB bytes field copies it through a message object (about
3.5 ms here), so chunks are framed by hand instead, in the same wire format::

    chunk = <header message, serialised normally, without data> 0x7A <varint len> <bytes>

0x7A is the tag of field 15 with wire type 2 (length-delimited). The result is a valid
protobuf encoding of the whole message (fields may come in any order), so grpcurl and
any generated client read and write these chunks as ordinary messages. On receive,
`split_data` walks the top-level fields and returns the data as a memoryview into the
received buffer (no copy); the remaining fields are parsed by protobuf.

Pure code: no sockets, no asyncio.
"""

from __future__ import annotations

from dataclasses import dataclass

from quillcache.v1 import common_pb2, store_pb2
from quillcache_core.errors import InvalidArgument
from quillcache_core.model import KvBlockKey
from quillcache_core.storeclient.blockcodec import check_key
from quillcache_core.wire.keys import key_to_proto  # noqa: F401 - store callers use wire.key_to_proto

DATA_FIELD = 15
DATA_TAG = bytes([(DATA_FIELD << 3) | 2])  # b"\x7a"
MAX_VARINT_BYTES = 10

_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5


# --- varints and field walking ----------------------------------------------------------


def encode_varint(value: int) -> bytes:
    """Base-128 varint of a non-negative integer (protobuf's encoding)."""
    if value < 0:
        raise InvalidArgument(f"varint of a negative number {value}")
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """(value, next position) of the varint at `pos`; InvalidArgument if malformed."""
    result = 0
    shift = 0
    end = len(buf)
    for _ in range(MAX_VARINT_BYTES):
        if pos >= end:
            raise InvalidArgument("truncated varint in chunk")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise InvalidArgument("varint longer than 10 bytes in chunk")


def split_data(buf: bytes) -> tuple[bytes, memoryview]:
    """Split a serialised chunk into (its other fields, a view of field 15).

    The view points into `buf` (no copy). As protobuf does for a singular field, the
    last occurrence of field 15 wins; a missing field gives an empty view. Raises
    InvalidArgument on anything that is not well-formed wire format.
    """
    view = memoryview(buf)
    n = len(view)
    # The common case: the data field is last, after a (possibly empty) header.
    data_start = data_end = -1
    rest: list[memoryview] = []
    pos = 0
    while pos < n:
        field_start = pos
        tag, pos = decode_varint(view, pos)
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise InvalidArgument("field number 0 in chunk")
        if wire == _WIRE_VARINT:
            _, pos = decode_varint(view, pos)
        elif wire == _WIRE_I64:
            pos += 8
        elif wire == _WIRE_I32:
            pos += 4
        elif wire == _WIRE_LEN:
            length, pos = decode_varint(view, pos)
            if field == DATA_FIELD:
                if pos + length > n:
                    raise InvalidArgument("chunk data runs past the end of the message")
                data_start, data_end = pos, pos + length
                pos += length
                continue
            pos += length
        else:
            raise InvalidArgument(f"unsupported wire type {wire} in chunk")
        if pos > n:
            raise InvalidArgument("truncated field in chunk")
        rest.append(view[field_start:pos])
    if data_start < 0:
        data = view[0:0]
    else:
        data = view[data_start:data_end]
    if not rest:
        head = b""
    elif len(rest) == 1:
        head = bytes(rest[0])
    else:
        head = b"".join(rest)
    return head, data


def frame(header: bytes, data: bytes | memoryview) -> bytes:
    """A serialised chunk: `header` (other fields, serialised) then `data` as field 15.

    One copy of `data` (into the returned bytes). An empty `data` is omitted, as a
    protobuf serialiser would omit it.
    """
    size = memoryview(data).nbytes
    if size == 0:
        return bytes(header)
    return b"".join((header, DATA_TAG, encode_varint(size), data))


# --- chunk messages -----------------------------------------------------------------------


@dataclass(slots=True)
class PutFrame:
    """A received PutChunk: its fields except data, and a view of data (no copy)."""

    header: store_pb2.PutChunk
    data: memoryview


@dataclass(slots=True)
class GetFrame:
    """A received GetChunk: its fields except data, and a view of data (no copy)."""

    header: store_pb2.GetChunk
    data: memoryview


def encode_put_chunk(header: store_pb2.PutChunk | None, data: bytes | memoryview) -> bytes:
    """A PutChunk on the wire; `header` (first chunk only) must not carry data itself."""
    return frame(header.SerializeToString() if header is not None else b"", data)


def encode_get_chunk(header: store_pb2.GetChunk | None, data: bytes | memoryview) -> bytes:
    """A GetChunk on the wire; `header` (first chunk only) must not carry data itself."""
    return frame(header.SerializeToString() if header is not None else b"", data)


def decode_put_chunk(buf: bytes) -> PutFrame:
    """Parse a PutChunk without copying its data. Raises InvalidArgument if malformed."""
    head, data = split_data(buf)
    try:
        header = store_pb2.PutChunk.FromString(head)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise InvalidArgument(f"malformed PutChunk: {exc}") from None
    return PutFrame(header, data)


def decode_get_chunk(buf: bytes) -> GetFrame:
    """Parse a GetChunk without copying its data. Raises InvalidArgument if malformed."""
    head, data = split_data(buf)
    try:
        header = store_pb2.GetChunk.FromString(head)
    except Exception as exc:
        raise InvalidArgument(f"malformed GetChunk: {exc}") from None
    return GetFrame(header, data)


# --- keys and tiers -------------------------------------------------------------------------


def key_from_proto(msg: common_pb2.BlockKey, what: str = "key") -> KvBlockKey:
    """The domain key of a BlockKey; InvalidArgument naming the first empty field, or
    one longer than `blockcodec.MAX_KEY_FIELD_BYTES`.

    model_id, tokenizer_id, tenant_id, prefix_hash and block_hash are required. An
    empty adapter_id means no adapter.
    """
    for name in ("model_id", "tokenizer_id", "tenant_id", "prefix_hash", "block_hash"):
        if not getattr(msg, name):
            raise InvalidArgument(f"{what}.{name} is empty")
    adapter = msg.adapter_id if msg.HasField("adapter_id") else None
    key = KvBlockKey(
        model_id=msg.model_id,
        tokenizer_id=msg.tokenizer_id,
        adapter_id=adapter or None,
        tenant_id=msg.tenant_id,
        prefix_hash=msg.prefix_hash,
        block_hash=msg.block_hash,
        block_index=msg.block_index,
        token_count=msg.token_count,
    )
    return check_key(key, what)


def identity_of(key: KvBlockKey) -> common_pb2.Identity:
    """The reuse identity of a block (for the conductor's Locate and KV events)."""
    msg = common_pb2.Identity(
        model_id=key.model_id, tokenizer_id=key.tokenizer_id, tenant_id=key.tenant_id
    )
    if key.adapter_id is not None:
        msg.adapter_id = key.adapter_id
    return msg
