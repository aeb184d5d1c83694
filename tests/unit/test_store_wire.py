"""Hand-framed store chunks are ordinary protobuf messages, both ways."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.v1 import common_pb2, store_pb2
from quillcache_core.errors import InvalidArgument
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.storeclient import wire
from quillcache_core.wire.tiers import tier_from_proto, tier_to_proto

pytestmark = pytest.mark.unit

KEY = KvBlockKey("llama-3-8b", "llama-3", None, "acme", "root", "ab" * 16, 0, 16)


def _put_header(**kw) -> store_pb2.PutChunk:
    return store_pb2.PutChunk(
        key=wire.key_to_proto(KEY),
        total_bytes=kw.get("total", 3 << 20),
        checksum=kw.get("checksum", 0xDEADBEEFCAFEF00D),
        durable=kw.get("durable", True),
        tier=common_pb2.TIER_LOCAL_SSD,
    )


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16383, 16384, 1 << 20, (1 << 21) + 7])
def test_hand_framed_put_chunk_parses_with_protobuf(size):
    data = random.Random(size).randbytes(size)
    header = _put_header()
    raw = wire.encode_put_chunk(header, data)
    parsed = store_pb2.PutChunk.FromString(raw)
    assert parsed.data == data
    parsed.ClearField("data")
    assert parsed == header


@pytest.mark.parametrize("size", [0, 5, 1 << 20])
def test_protobuf_serialised_chunks_parse_by_hand(size):
    data = random.Random(size).randbytes(size)
    msg = _put_header()
    msg.data = data
    frame = wire.decode_put_chunk(msg.SerializeToString())
    assert isinstance(frame.data, memoryview)
    assert frame.data.tobytes() == data
    assert frame.header == _put_header()

    get = store_pb2.GetChunk(total_bytes=size, checksum=7, tier=3, served_from="n1", data=data)
    got = wire.decode_get_chunk(get.SerializeToString())
    assert got.data.tobytes() == data
    assert (got.header.total_bytes, got.header.served_from) == (size, "n1")


def test_data_view_points_into_the_received_buffer():
    raw = wire.encode_get_chunk(None, b"x" * 4096)
    frame = wire.decode_get_chunk(raw)
    assert frame.data.obj is raw  # no copy
    assert frame.header == store_pb2.GetChunk()


def test_data_field_may_come_first_and_the_last_occurrence_wins():
    header = store_pb2.GetChunk(total_bytes=9, served_from="x").SerializeToString()
    raw = wire.frame(b"", b"first") + header + wire.frame(b"", b"second")
    frame = wire.decode_get_chunk(raw)
    assert frame.data.tobytes() == b"second"
    assert frame.header.total_bytes == 9
    assert store_pb2.GetChunk.FromString(raw).data == b"second"


@pytest.mark.parametrize(
    "raw",
    [
        b"\x7a\x05abc",  # data runs past the end
        b"\x08",  # truncated varint value
        b"\x7a" + b"\xff" * 11,  # varint too long
        b"\x0b\x00",  # wire type 3 (group)
        b"\x00\x01",  # field number 0
        b"\x19\x01\x02",  # fixed64 truncated
    ],
)
def test_malformed_chunks_raise_invalid_argument(raw):
    with pytest.raises(InvalidArgument):
        wire.decode_put_chunk(raw)


@settings(max_examples=200, deadline=None)
@given(
    data=st.binary(max_size=5000),
    total=st.integers(0, 2**64 - 1),
    checksum=st.integers(0, 2**64 - 1),
    served=st.text(max_size=20),
)
def test_roundtrip_property(data, total, checksum, served):
    header = store_pb2.GetChunk(total_bytes=total, checksum=checksum, served_from=served)
    raw = wire.encode_get_chunk(header, data)
    assert (
        raw
        == store_pb2.GetChunk(
            total_bytes=total, checksum=checksum, served_from=served, data=data
        ).SerializeToString()
    )
    frame = wire.decode_get_chunk(raw)
    assert frame.data.tobytes() == data and frame.header == header


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_split_never_raises_anything_but_invalid_argument(raw):
    try:
        wire.decode_put_chunk(raw)
    except InvalidArgument:
        pass


@pytest.mark.parametrize("value", [0, 1, 127, 128, 2**32, 2**64 - 1])
def test_varint_roundtrip(value):
    enc = wire.encode_varint(value)
    assert wire.decode_varint(enc, 0) == (value, len(enc))


def test_key_conversion_roundtrip_and_validation():
    with_adapter = KvBlockKey("m", "t", "lora-1", "acme", "p", "h", 3, 16)
    for key in (KEY, with_adapter):
        assert wire.key_from_proto(wire.key_to_proto(key)) == key
    for field in ("model_id", "tokenizer_id", "tenant_id", "prefix_hash", "block_hash"):
        msg = wire.key_to_proto(KEY)
        setattr(msg, field, "")
        with pytest.raises(InvalidArgument, match=field):
            wire.key_from_proto(msg)
    assert tier_from_proto(tier_to_proto(CacheTier.LOCAL_SSD)) is CacheTier.LOCAL_SSD
    assert tier_from_proto(0) is None
