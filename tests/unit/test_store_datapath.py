"""The block data path's pure parts and its landing in the tiers: framing (pulls and
puts), `TieredStore.put_filled` writing straight into a pooled DRAM buffer or an SSD
record buffer, all or nothing, and a store record's data address."""

from __future__ import annotations

import pytest

from quillcache_core.errors import Corrupt, InvalidArgument
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.storeclient.blockcodec import payload_checksum
from quillcache_core.storeclient.datapath import protocol as dataproto
from quillcache_store.tiers.dram import DramTier
from quillcache_store.tiers.ssd import SsdTier
from quillcache_store.tiers.tiered import TieredStore

pytestmark = pytest.mark.unit

MIB = 1024 * 1024


def key(i: int, tenant: str = "acme") -> KvBlockKey:
    return KvBlockKey("m", "t", None, tenant, "root", f"b{i:04d}", i, 16)


@pytest.fixture
def store(tmp_path):
    s = TieredStore(DramTier(8 * MIB), SsdTier(tmp_path / "ssd", 64 * MIB))
    yield s
    s.close()


def test_request_round_trip_and_malformed_requests():
    keys = [key(i) for i in range(3)] + [key(9, tenant="globex")]
    frame = dataproto.encode_request(keys)
    size = dataproto.REQUEST_HEADER.size
    body_len = dataproto.decode_request_header(frame[:size])
    assert dataproto.decode_request_body(frame[size : size + body_len]) == keys
    with pytest.raises(InvalidArgument):
        dataproto.decode_request_header(b"XXXX" + frame[4:size])
    with pytest.raises(InvalidArgument):
        dataproto.decode_request_body(b"\xc1")
    with pytest.raises(InvalidArgument):
        dataproto.encode_request([])


def test_block_headers_round_trip_and_refuse_nonsense():
    raw = dataproto.encode_block_header(CacheTier.LOCAL_SSD, 4096, 0xABC)
    header = dataproto.decode_block_header(raw, max_payload_bytes=MIB)
    assert (header.status, header.tier, header.payload_len, header.checksum) == (
        dataproto.STATUS_OK,
        CacheTier.LOCAL_SSD,
        4096,
        0xABC,
    )
    with pytest.raises(InvalidArgument):
        dataproto.decode_block_header(raw, max_payload_bytes=1024)  # too large
    error = dataproto.encode_block_error(dataproto.STATUS_NOT_FOUND, "gone")
    header = dataproto.decode_block_header(error[: dataproto.BLOCK_HEADER.size], MIB)
    assert header.status == dataproto.STATUS_NOT_FOUND and header.message_len == 4
    assert dataproto.CODE_NAMES[header.status] == "NOT_FOUND"


def _filler(data: bytes, checksum: int | None = None):
    def fill(view: memoryview) -> None:
        view[:] = data
        if payload_checksum(view) != (checksum if checksum is not None else payload_checksum(data)):
            raise Corrupt("checksum mismatch")

    return fill


def test_put_filled_lands_in_a_reused_pool_buffer(store):
    data = bytes(range(256)) * 4096  # 1 MiB
    assert store.put(key(0), data) is CacheTier.CPU_DRAM
    store.delete(key(0))  # its buffer goes to the free list
    reuses = store.dram.stats()["buffer_reuses"]
    landed = store.put_filled(key(1), len(data), payload_checksum(data), _filler(data))
    assert landed is CacheTier.CPU_DRAM
    assert store.dram.stats()["buffer_reuses"] == reuses + 1
    assert store.get(key(1)) == (data, CacheTier.CPU_DRAM)


def test_a_failed_fill_stores_nothing_and_keeps_the_older_copy(store):
    old, new = b"o" * MIB, b"n" * MIB
    store.put(key(0), old)
    pool = store.dram.stats()["pool_bytes"]
    for failing in (_filler(new, checksum=1), _raise(ConnectionError("source died"))):
        with pytest.raises((Corrupt, ConnectionError)):
            store.put_filled(key(0), len(new), payload_checksum(new), failing)
        with pytest.raises((Corrupt, ConnectionError)):
            store.put_filled(key(1), len(new), payload_checksum(new), failing)
    assert store.get(key(0)) == (old, CacheTier.CPU_DRAM)
    assert not store.exists(key(1))
    stats = store.dram.stats()
    assert stats["reserved_bytes"] == 0 and stats["pool_bytes"] <= max(pool + MIB, 8 * MIB)
    # The buffer of the failed block went back to the pool: the next block reuses it.
    reuses = stats["buffer_reuses"]
    store.put_filled(key(2), len(new), payload_checksum(new), _filler(new))
    assert store.dram.stats()["buffer_reuses"] == reuses + 1


def test_durable_and_ssd_fills_go_through_an_ssd_record_buffer(store):
    data = b"s" * (MIB // 2)
    digest = payload_checksum(data)
    assert store.put_filled(key(0), len(data), digest, _filler(data), durable=True) in (
        CacheTier.CPU_DRAM,
        CacheTier.LOCAL_SSD,
    )
    assert store.ssd.info(key(0)) == (len(data), digest)
    landed = store.put_filled(key(1), len(data), digest, _filler(data), tier=CacheTier.LOCAL_SSD)
    assert landed is CacheTier.LOCAL_SSD and store.get(key(1))[0] == data


def _raise(exc: BaseException):
    def fill(view: memoryview) -> None:
        view[: view.nbytes // 2] = b"x" * (view.nbytes // 2)
        raise exc

    return fill


def test_put_frames_round_trip_and_refuse_nonsense():
    k = key(3)
    raw = dataproto.encode_put(k, 1234, 0xABCD, tier=CacheTier.LOCAL_SSD, durable=True)
    kind, flags, length = dataproto.decode_frame_header(raw[: dataproto.REQUEST_HEADER.size])
    assert kind == dataproto.PUT_MAGIC
    fixed_end = dataproto.REQUEST_HEADER.size + dataproto.PUT_FIXED.size
    put = dataproto.decode_put_fixed(
        flags, length, raw[dataproto.REQUEST_HEADER.size : fixed_end], 4096
    )
    assert put == dataproto.PutHeader(True, CacheTier.LOCAL_SSD, length, 1234, 0xABCD)
    assert dataproto.decode_put_identity(raw[fixed_end:]) == k
    # A pull request header is still a pull request; a put is not one.
    with pytest.raises(InvalidArgument):
        dataproto.decode_request_header(raw[: dataproto.REQUEST_HEADER.size])
    fixed = raw[dataproto.REQUEST_HEADER.size : fixed_end]
    with pytest.raises(InvalidArgument, match="exceeds|1..100"):
        dataproto.decode_put_fixed(flags, length, fixed, 100)  # too large
    with pytest.raises(InvalidArgument, match="flags"):
        dataproto.decode_put_fixed(flags | 4, length, fixed, 4096)
    with pytest.raises(InvalidArgument, match="tier"):
        dataproto.decode_put_fixed(flags, length, b"\x09" + fixed[1:], 4096)
    with pytest.raises(InvalidArgument, match="identity"):
        dataproto.decode_put_fixed(flags, 0, fixed, 4096)
    with pytest.raises(InvalidArgument, match="malformed key"):
        dataproto.decode_put_identity(b"\x93\x01\x02\x03")
    with pytest.raises(InvalidArgument):
        dataproto.encode_put(k, 0, 1, tier=CacheTier.CPU_DRAM, durable=False)


def test_acks_round_trip_and_refuse_nonsense():
    ok = dataproto.decode_ack(dataproto.encode_ack(CacheTier.CPU_DRAM, 77, 0x55))
    assert (ok.status, ok.tier, ok.payload_len, ok.checksum) == (
        dataproto.STATUS_OK,
        CacheTier.CPU_DRAM,
        77,
        0x55,
    )
    raw = dataproto.encode_ack_error(dataproto.STATUS_DATA_LOSS, "bad bytes")
    err = dataproto.decode_ack(raw[: dataproto.BLOCK_HEADER.size])
    assert err.status == dataproto.STATUS_DATA_LOSS and err.message_len == len("bad bytes")
    assert isinstance(dataproto.error_of(err.status, "x"), Corrupt)
    with pytest.raises(InvalidArgument, match="magic"):  # a pull's block header is no ack
        dataproto.decode_ack(dataproto.encode_block_header(CacheTier.CPU_DRAM, 1, 1))


def test_an_ssd_record_buffer_is_stored_as_it_is(store):
    from quillcache_core.storeclient.blockcodec import header_length

    data = bytes(range(256)) * 1024
    digest = payload_checksum(data)
    n = header_length(key(5))
    record = bytearray(n + len(data))
    record[n:] = data
    assert store.ssd.put_record(key(5), record, n, digest) == []
    assert bytes(store.ssd.get(key(5))[0]) == data
    assert store.ssd.info(key(5)) == (len(data), digest)
    with pytest.raises(InvalidArgument, match="reserves"):
        store.ssd.put_record(key(6), bytearray(len(data) + n + 1), n + 1, digest)


def test_a_record_carries_its_data_address_and_old_records_still_resolve():
    from quillcache_core.registry import NodeRecord
    from quillcache_core.registry.records import record_data_address

    rec = NodeRecord("store", "s1", "h:1", "", data_address="h:7100")
    back = NodeRecord.from_json("store", "s1", rec.to_json())
    assert back.data_address == "h:7100" and "data_address" not in back.extra
    assert record_data_address(back) == "h:7100"
    # A node older than the field put it among the extras.
    old = NodeRecord("store", "s2", "h:2", "", extra={"data_address": "h:7200"})
    assert old.data_address == "" and record_data_address(old) == "h:7200"
    assert record_data_address(NodeRecord("store", "s3", "h:3", "")) == ""
    with pytest.raises(InvalidArgument):
        NodeRecord.from_json("store", "s4", b'{"data_address": 7}')
