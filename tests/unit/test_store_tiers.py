"""The store node's data plane: record codec, DRAM tier, SSD tier, tiered store."""

from __future__ import annotations

import os
import random
import struct
import threading
import time

import lmdb
import pytest

from quillcache_core.errors import CapacityExceeded, Corrupt, InvalidArgument, NotFound
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.storeclient import blockcodec
from quillcache_core.storeclient.blockcodec import (
    CorruptBlock,
    decode,
    decode_header,
    encode,
    encode_record,
    payload_checksum,
    storage_key,
)
from quillcache_store.tiers.dram import DramTier, size_class
from quillcache_store.tiers.ssd import SsdTier
from quillcache_store.tiers.tiered import TieredStore, TierEvent

pytestmark = pytest.mark.unit

KIB = 1024
MIB = 1024 * KIB
BLOCK = 64 * KIB  # one DRAM size class exactly


def key(
    i: int, *, tenant: str = "acme", adapter: str | None = None, model: str = "m"
) -> KvBlockKey:
    return KvBlockKey(
        model_id=model,
        tokenizer_id="tok",
        adapter_id=adapter,
        tenant_id=tenant,
        prefix_hash="root" if i == 0 else f"{i - 1:032x}",
        block_hash=f"{i:032x}",
        block_index=i,
        token_count=16,
    )


def payload(i: int, size: int = BLOCK) -> bytes:
    return random.Random(i).randbytes(size)


def marked(i: int, size: int = BLOCK) -> bytes:
    """A payload that starts with a marker unique to `i` (to find it inside data.mdb)."""
    mark = f"<<QUILLBLOCK-{i:08d}>>".encode()
    return mark + payload(i, size - len(mark))


# --- codec -----------------------------------------------------------------------------


def test_codec_round_trip_keeps_identity_and_bytes():
    for k, data in [
        (key(3), payload(3, 1000)),
        (key(4, adapter="lora-a"), payload(4, 2 * MIB + 17)),
        (key(5, tenant="ünïcode"), b""),
    ]:
        header = encode(k, data)
        record = header + data
        got_key, view = decode(record)
        assert got_key == k
        assert isinstance(view, memoryview) and bytes(view) == data
        parsed = decode_header(record)
        assert parsed.payload_len == len(data)
        assert parsed.checksum == payload_checksum(data)
        assert parsed.header_len == len(header)
        assert encode_record(k, data) == record
        # decode also accepts a memoryview or a bytearray
        assert bytes(decode(memoryview(bytearray(record)), expected=k)[1]) == data


def test_storage_key_covers_the_whole_identity():
    base = key(1)
    sk = storage_key(base)
    assert len(sk) == 32 and storage_key(key(1)) == sk
    variants = [
        key(1, tenant="other"),
        key(1, model="other"),
        key(1, adapter=""),
        key(1, adapter="lora"),
        KvBlockKey(**{**_fields(base), "tokenizer_id": "tok2"}),
        KvBlockKey(**{**_fields(base), "prefix_hash": "other"}),
        KvBlockKey(**{**_fields(base), "block_index": 2}),
        KvBlockKey(**{**_fields(base), "token_count": 15}),
        # fields may not run into each other
        KvBlockKey(**{**_fields(base), "model_id": "mt", "tokenizer_id": "ok"}),
    ]
    keys = {storage_key(v) for v in variants}
    assert sk not in keys and len(keys) == len(variants)


def _fields(k: KvBlockKey) -> dict:
    return k._asdict()


def _record(i=7, size=300):
    k = key(i)
    data = payload(i, size)
    return k, data, encode(k, data) + data


def test_codec_rejects_truncation_at_every_length():
    k, _, record = _record()
    for cut in range(len(record)):
        with pytest.raises(Corrupt):
            decode(record[:cut])
    with pytest.raises(Corrupt, match="truncated record"):
        decode(record[:10])
    with pytest.raises(Corrupt, match="truncated payload"):
        decode(record[:-1])


def test_codec_rejects_trailing_bytes():
    _, _, record = _record()
    with pytest.raises(Corrupt, match="wrong record length"):
        decode(record + b"\0")


def test_codec_detects_a_bit_flip_anywhere():
    _, _, record = _record(size=200)
    for pos in range(len(record)):
        for bit in (0, 7):
            broken = bytearray(record)
            broken[pos] ^= 1 << bit
            with pytest.raises(Corrupt):
                decode(bytes(broken))


def test_codec_messages_name_the_problem():
    k, data, record = _record()
    header_len = len(record) - len(data)
    flipped = bytearray(record)
    flipped[header_len + 5] ^= 0x10
    with pytest.raises(CorruptBlock, match="payload checksum mismatch") as info:
        decode(bytes(flipped))
    assert info.value.key == k
    with pytest.raises(Corrupt, match="bad magic"):
        decode(b"XXXX" + record[4:])
    with pytest.raises(Corrupt, match="unsupported record format version"):
        decode(record[:4] + b"\x09" + record[5:])
    # a wrong length field (or any header field) fails the header checksum
    wrong_len = bytearray(record)
    struct.pack_into("<Q", wrong_len, 12, len(data) - 1)
    with pytest.raises(Corrupt, match="header checksum mismatch"):
        decode(bytes(wrong_len))
    flipped_identity = bytearray(record)
    flipped_identity[blockcodec.FIXED_HEADER_BYTES + 3] ^= 1
    with pytest.raises(Corrupt, match="header checksum mismatch"):
        decode(bytes(flipped_identity))
    with pytest.raises(Corrupt, match="does not match the requested key"):
        decode(record, expected=key(8))


# --- DRAM tier -------------------------------------------------------------------------


def test_size_classes():
    assert size_class(0) == 256
    assert size_class(1000) == 1024
    assert size_class(64 * KIB) == 64 * KIB
    assert size_class(64 * KIB + 1) == 128 * KIB
    assert size_class(2 * MIB) == 2 * MIB
    assert size_class(2 * MIB + 1) == 2 * MIB + 64 * KIB
    with pytest.raises(InvalidArgument):
        size_class(-1)


def test_dram_put_get_delete_and_stats():
    dram = DramTier(8 * BLOCK)
    data = payload(1)
    assert dram.put(key(1), data, payload_checksum(data)) == []
    got, digest = dram.get(key(1))
    assert got == data and digest == payload_checksum(data)
    assert dram.contains(key(1)) and not dram.contains(key(2))
    assert dram.get(key(2)) is None
    assert dram.keys() == [key(1)]
    stats = dram.stats()
    assert (stats["blocks"], stats["bytes"], stats["capacity"]) == (1, BLOCK, 8 * BLOCK)
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (1, 1, 0)
    assert dram.delete(key(1)) and not dram.delete(key(1))
    assert dram.get(key(1)) is None
    assert dram.stats()["blocks"] == 0


def test_dram_evicts_least_recently_used_first():
    dram = DramTier(3 * BLOCK)
    for i in range(3):
        dram.put(key(i), payload(i), payload_checksum(payload(i)))
    assert dram.get(key(0)) is not None  # 0 is now the most recent; 1 is the coldest
    evicted = dram.put(key(3), payload(3), payload_checksum(payload(3)))
    assert [e.key for e in evicted] == [key(1)]
    assert dram.keys() == [key(2), key(0), key(3)]
    evicted = dram.put(key(4), payload(4, 2 * BLOCK), payload_checksum(payload(4, 2 * BLOCK)))
    assert [e.key for e in evicted] == [key(2), key(0)]  # coldest first
    assert dram.stats()["evictions"] == 3


def test_dram_rejects_a_block_larger_than_capacity():
    dram = DramTier(4 * BLOCK)
    with pytest.raises(CapacityExceeded):
        dram.put(key(1), b"x" * (4 * BLOCK + 1), 0)
    with pytest.raises(CapacityExceeded):
        dram.reserve(key(1), 5 * BLOCK)
    assert dram.stats()["pool_bytes"] == 0


def test_dram_pool_reuses_buffers_and_never_grows_past_capacity():
    capacity = 16 * BLOCK
    dram = DramTier(capacity)
    rng = random.Random(0)
    sizes = [BLOCK, 2 * BLOCK, 40 * KIB, 3 * BLOCK + 5]
    live: list[KvBlockKey] = []
    for step in range(600):
        if live and rng.random() < 0.4:
            dram.delete(live.pop(rng.randrange(len(live))))
        else:
            k = key(step)
            n = rng.choice(sizes)
            evicted = dram.put(k, payload(step % 7, n), payload_checksum(payload(step % 7, n)))
            live = [x for x in live if x not in {e.key for e in evicted}]
            live.append(k)
        stats = dram.stats()
        assert stats["pool_bytes"] <= capacity
        assert stats["resident_bytes"] <= capacity
    stats = dram.stats()
    assert stats["buffer_reuses"] > stats["buffer_allocations"]


def test_dram_same_size_cycles_allocate_once():
    dram = DramTier(4 * BLOCK)
    for i in range(200):
        dram.put(key(i), payload(i % 3), payload_checksum(payload(i % 3)))
        dram.delete(key(i))
    stats = dram.stats()
    assert stats["buffer_allocations"] == 1 and stats["buffer_reuses"] == 199
    assert stats["free_bytes"] == BLOCK and stats["pool_bytes"] == BLOCK
    for i in range(200):  # a full tier recycles its victims' buffers
        dram.put(key(i), payload(i % 3), payload_checksum(payload(i % 3)))
    stats = dram.stats()
    assert stats["buffer_allocations"] == 4 and stats["pool_bytes"] == 4 * BLOCK
    assert dram.trim() == 0
    dram.delete(key(199))
    assert dram.trim() == BLOCK and dram.stats()["pool_bytes"] == 3 * BLOCK


def test_dram_free_buffers_of_another_class_are_dropped_to_make_room():
    dram = DramTier(4 * BLOCK)
    for i in range(4):
        dram.put(key(i), payload(i), payload_checksum(payload(i)))
    for i in range(4):
        dram.delete(key(i))
    assert dram.stats()["free_bytes"] == 4 * BLOCK
    dram.put(key(9), payload(9, 3 * BLOCK), payload_checksum(payload(9, 3 * BLOCK)))
    stats = dram.stats()
    assert stats["pool_bytes"] <= 4 * BLOCK and stats["free_bytes"] == BLOCK


def test_dram_reserve_keeps_victims_readable_until_commit():
    dram = DramTier(2 * BLOCK)
    for i in range(2):
        dram.put(key(i), payload(i), payload_checksum(payload(i)))
    res = dram.reserve(key(5), BLOCK)
    assert [v.key for v in res.victims] == [key(0)]
    victim = res.victims[0]
    assert bytes(victim.payload) == payload(0)
    assert dram.get(key(0))[0] == payload(0)  # still served while being demoted
    assert dram.commit(res, payload(5), payload_checksum(payload(5))) == []
    assert not dram.contains(key(0)) and dram.contains(key(5))
    with pytest.raises(ValueError):
        bytes(victim.payload)  # released at commit


def test_dram_abort_keeps_victims_and_commit_reports_concurrent_deletes():
    dram = DramTier(2 * BLOCK)
    for i in range(2):
        dram.put(key(i), payload(i), payload_checksum(payload(i)))
    with dram.reserve(key(5), BLOCK) as res:
        assert [v.key for v in res.victims] == [key(0)]
    assert res.state == "aborted" and dram.keys() == [key(0), key(1)]
    res = dram.reserve(key(5), BLOCK)
    assert dram.delete(key(0))
    assert dram.commit(res, payload(5), payload_checksum(payload(5))) == [key(0)]
    assert dram.keys() == [key(1), key(5)]
    assert dram.stats()["pool_bytes"] <= 2 * BLOCK


def _mixed_tier(wait_s):
    dram = DramTier(4 * BLOCK, commit_wait_s=wait_s)
    for i, size in ((0, 2 * BLOCK), (1, BLOCK), (2, BLOCK)):
        dram.put(key(i), payload(i, size), payload_checksum(payload(i, size)))
    first = dram.reserve(key(10), BLOCK)  # takes the 2-block victim
    assert [v.key for v in first.victims] == [key(0)]
    second = dram.reserve(key(11), BLOCK)  # fits once the victim is gone: no victims
    assert second.victims == []
    return dram, first, second


def test_dram_commit_waits_for_other_reservations_victims():
    dram, first, second = _mixed_tier(wait_s=10.0)
    timer = threading.Timer(0.05, dram.commit, (first, payload(10), payload_checksum(payload(10))))
    timer.start()
    started = time.monotonic()
    dram.commit(second, payload(11), payload_checksum(payload(11)))  # waits for `first`
    timer.join()
    assert time.monotonic() - started >= 0.04
    stats = dram.stats()
    assert stats["pool_bytes"] <= 4 * BLOCK and stats["reserved_bytes"] == 0
    assert sorted(k.block_index for k in dram.keys()) == [1, 2, 10, 11]


def test_dram_commit_gives_up_when_the_pool_stays_full():
    dram, first, second = _mixed_tier(wait_s=0.05)
    with pytest.raises(CapacityExceeded) as info:
        dram.commit(second, payload(11), payload_checksum(payload(11)))
    assert info.value.deleted == []
    assert dram.stats()["reserved_bytes"] == BLOCK  # only `first` is still open
    dram.abort(first)
    stats = dram.stats()
    assert stats["reserved_bytes"] == 0 and stats["pool_bytes"] == 4 * BLOCK
    assert sorted(k.block_index for k in dram.keys()) == [0, 1, 2]


def test_dram_put_calls_demote_before_freeing_and_undoes_on_error():
    dram = DramTier(2 * BLOCK)
    for i in range(2):
        dram.put(key(i), payload(i), payload_checksum(payload(i)))
    seen = []

    def demote(victims):
        seen.extend((v.key, bytes(v.payload)) for v in victims)
        assert dram.contains(victims[0].key)

    evicted = dram.put(key(2), payload(2), payload_checksum(payload(2)), demote=demote)
    assert seen == [(key(0), payload(0))] and [e.key for e in evicted] == [key(0)]

    def failing(victims):
        raise OSError("disk gone")

    with pytest.raises(OSError):
        dram.put(key(3), payload(3), payload_checksum(payload(3)), demote=failing)
    assert dram.keys() == [key(1), key(2)]


def test_dram_pinned_blocks_are_not_evicted_and_stay_valid_after_delete():
    dram = DramTier(2 * BLOCK)
    dram.put(key(0), payload(0), payload_checksum(payload(0)))
    dram.put(key(1), payload(1), payload_checksum(payload(1)))
    pinned = dram.pin(key(0))
    dram.get(key(1))  # 0 is the coldest, but pinned
    evicted = dram.put(key(2), payload(2), payload_checksum(payload(2)))
    assert [e.key for e in evicted] == [key(1)]
    assert dram.delete(key(0))
    # room is still taken by the pinned buffer: the tier cannot take two more blocks
    with pytest.raises(CapacityExceeded):
        dram.reserve(key(3), 2 * BLOCK)
    assert bytes(pinned.payload) == payload(0)
    assert dram.stats()["retired_bytes"] == BLOCK
    pinned.release()
    stats = dram.stats()
    assert stats["retired_bytes"] == 0 and stats["free_bytes"] == BLOCK
    dram.put(key(3), payload(3), payload_checksum(payload(3)))
    assert dram.stats()["buffer_reuses"] >= 1


def test_dram_pin_released_by_garbage_collection():
    dram = DramTier(BLOCK)
    dram.put(key(0), payload(0), payload_checksum(payload(0)))
    pinned = dram.pin(key(0))
    dram.delete(key(0))
    del pinned
    assert dram.stats()["retired_bytes"] == 0


def test_dram_get_verifies_the_checksum():
    dram = DramTier(2 * BLOCK)
    data = payload(0)
    dram.put(key(0), data, payload_checksum(data))
    entry = dram._lru[key(0)]  # white box: a bit flip in memory
    entry.buf[100] ^= 0x01
    with pytest.raises(CorruptBlock):
        dram.get(key(0))
    assert not dram.contains(key(0))
    assert dram.stats()["corrupt_blocks"] == 1


def test_dram_concurrent_use_keeps_the_budget():
    capacity = 8 * BLOCK
    dram = DramTier(capacity)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(300):
                i = rng.randrange(40)
                op = rng.random()
                if op < 0.5:
                    data = payload(i, BLOCK * rng.choice((1, 2)))
                    dram.put(key(i), data, payload_checksum(data))
                elif op < 0.8:
                    got = dram.get(key(i))
                    if got is not None:
                        assert payload_checksum(got[0]) == got[1]
                elif op < 0.9:
                    with dram.pin(key(i)) or _null() as block:
                        if block is not None:
                            assert payload_checksum(block.payload) == block.checksum
                else:
                    dram.delete(key(i))
                assert dram.stats()["pool_bytes"] <= capacity
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = dram.stats()
    assert stats["pool_bytes"] <= capacity and stats["retired_bytes"] == 0
    assert stats["reserved_bytes"] == 0


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


# --- SSD tier --------------------------------------------------------------------------


@pytest.fixture
def ssd_path(tmp_path):
    return tmp_path / "ssd"


def test_ssd_put_get_and_reopen(ssd_path):
    ssd = SsdTier(ssd_path, 64 * MIB)
    blocks = {key(i): payload(i, BLOCK + i) for i in range(10)}
    for k, data in blocks.items():
        assert ssd.put(k, data) == []
    for k, data in blocks.items():
        got, digest = ssd.get(k)
        assert bytes(got) == data and digest == payload_checksum(data)
    assert ssd.delete(key(9))
    del blocks[key(9)]
    stats = ssd.stats()
    ssd.close()

    ssd = SsdTier(ssd_path, 64 * MIB)
    try:
        assert set(ssd.keys()) == set(blocks)
        reopened = ssd.stats()
        assert reopened["blocks"] == stats["blocks"] == 9
        assert reopened["bytes"] == stats["bytes"] == sum(len(d) for d in blocks.values())
        assert reopened["stored_bytes"] == stats["stored_bytes"]
        assert reopened["hits"] == 0  # the index came from metadata, not payload reads
        for k, data in blocks.items():
            assert bytes(ssd.get(k)[0]) == data
        assert ssd.get(key(9)) is None
    finally:
        ssd.close()


def test_ssd_evicts_least_recently_used_by_byte_budget(ssd_path):
    record = len(encode(key(1), payload(1))) + BLOCK  # key(0) has a shorter header
    ssd = SsdTier(ssd_path, 3 * record + 10)
    for i in range(3):
        assert ssd.put(key(i), payload(i)) == []
    ssd.get(key(0))
    assert ssd.put(key(3), payload(3)) == [(key(1), BLOCK)]
    assert ssd.put(key(4), payload(4, 2 * BLOCK)) == [(key(2), BLOCK), (key(0), BLOCK)]
    assert ssd.keys() == [key(3), key(4)]
    assert ssd.stats()["evictions"] == 3 and ssd.stats()["stored_bytes"] <= 3 * record + 10
    with pytest.raises(CapacityExceeded):
        ssd.put(key(9), payload(9, 4 * BLOCK))
    ssd.close()


def test_ssd_access_order_survives_reopen(ssd_path):
    record = len(encode(key(1), payload(1))) + BLOCK  # key(0) has a shorter header
    ssd = SsdTier(ssd_path, 3 * record)
    for i in range(3):
        ssd.put(key(i), payload(i))
    ssd.get(key(0))
    ssd.close()
    ssd = SsdTier(ssd_path, 3 * record)
    assert ssd.keys() == [key(1), key(2), key(0)]
    assert ssd.put(key(3), payload(3)) == [(key(1), BLOCK)]
    ssd.close()


def test_ssd_shrunk_capacity_evicts_on_open(ssd_path):
    record = len(encode(key(1), payload(1))) + BLOCK  # key(0) has a shorter header
    ssd = SsdTier(ssd_path, 4 * record)
    for i in range(4):
        ssd.put(key(i), payload(i))
    ssd.close()
    ssd = SsdTier(ssd_path, 2 * record)
    assert ssd.evicted_on_open == [(key(0), BLOCK), (key(1), BLOCK)]
    assert ssd.keys() == [key(2), key(3)]
    ssd.close()


def _flip_in_file(path, marker: bytes, offset: int) -> None:
    data_file = os.path.join(path, "data.mdb")
    with open(data_file, "r+b") as f:
        content = f.read()
        pos = content.find(marker)
        assert pos >= 0 and content.find(marker, pos + 1) < 0
        f.seek(pos + offset)
        byte = f.read(1)
        f.seek(pos + offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_ssd_corrupt_record_on_disk_is_detected_dropped_and_never_served(ssd_path):
    ssd = SsdTier(ssd_path, 64 * MIB)
    for i in range(5):
        ssd.put(key(i), marked(i))
    ssd.close()
    _flip_in_file(ssd_path, b"<<QUILLBLOCK-00000002>>", 1000)

    ssd = SsdTier(ssd_path, 64 * MIB)
    assert ssd.contains(key(2))  # open does not read payloads
    with pytest.raises(Corrupt) as info:
        ssd.get(key(2))
    assert isinstance(info.value, CorruptBlock) and info.value.key == key(2)
    assert ssd.stats()["corrupt_blocks"] == 1
    assert not ssd.contains(key(2)) and key(2) not in ssd.keys()
    assert ssd.get(key(2)) is None
    for i in (0, 1, 3, 4):
        assert bytes(ssd.get(key(i))[0]) == marked(i)
    ssd.close()
    ssd = SsdTier(ssd_path, 64 * MIB)  # the drop was committed
    assert sorted(k.block_index for k in ssd.keys()) == [0, 1, 3, 4]
    ssd.close()


def test_ssd_corrupt_records_written_through_raw_lmdb(ssd_path):
    ssd = SsdTier(ssd_path, 64 * MIB)
    for i in range(4):
        ssd.put(key(i), payload(i))
    ssd.close()
    env = lmdb.open(str(ssd_path), max_dbs=4, subdir=True)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        good = bytes(txn.get(storage_key(key(0)), db=blocks))
        txn.put(storage_key(key(0)), good[:-100], db=blocks)  # truncated
        txn.put(storage_key(key(1)), encode_record(key(2), payload(2)), db=blocks)  # misfiled
        txn.put(storage_key(key(3)), b"garbage", db=blocks)
    env.close()
    ssd = SsdTier(ssd_path, 64 * MIB)
    for i in (0, 1, 3):
        with pytest.raises(CorruptBlock):
            ssd.get(key(i))
        assert not ssd.contains(key(i))
    assert bytes(ssd.get(key(2))[0]) == payload(2)
    assert ssd.stats()["corrupt_blocks"] == 3
    ssd.close()


def test_ssd_rebuilds_missing_metadata_from_headers(ssd_path):
    ssd = SsdTier(ssd_path, 64 * MIB)
    for i in range(3):
        ssd.put(key(i), payload(i))
    ssd.close()
    env = lmdb.open(str(ssd_path), max_dbs=4, subdir=True)
    meta = env.open_db(b"meta")
    blocks = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        txn.delete(storage_key(key(1)), db=meta)
        txn.put(storage_key(key(7)), b"\x93\x01\x02\x03", db=meta)  # meta without a block
        txn.put(b"\x01" * 32, b"not a record", db=blocks)  # block without meta, corrupt
    env.close()
    ssd = SsdTier(ssd_path, 64 * MIB)
    assert sorted(k.block_index for k in ssd.keys()) == [0, 1, 2]
    assert bytes(ssd.get(key(1))[0]) == payload(1)
    ssd.close()


def test_ssd_identity_includes_the_tenant(ssd_path):
    ssd = SsdTier(ssd_path, 64 * MIB)
    ssd.put(key(1, tenant="a"), payload(1))
    assert ssd.get(key(1, tenant="b")) is None
    assert not ssd.contains(key(1, tenant="b"))
    ssd.put(key(1, tenant="b"), payload(2))
    assert bytes(ssd.get(key(1, tenant="a"))[0]) == payload(1)
    assert bytes(ssd.get(key(1, tenant="b"))[0]) == payload(2)
    ssd.close()


def test_ssd_group_commit_shares_commits_between_threads(ssd_path):
    ssd = SsdTier(ssd_path, 256 * MIB, group_commit_window_s=0.002)
    per_thread = 12
    barrier = threading.Barrier(8)
    errors = []

    def worker(t):
        barrier.wait()
        try:
            for j in range(per_thread):
                i = t * 100 + j
                ssd.put(key(i), payload(i, 16 * KIB), durable=True)
                assert ssd.contains(key(i))
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    before = ssd.commit_count
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    puts = 8 * per_thread
    commits = ssd.commit_count - before
    assert errors == []
    assert commits <= puts // 3, f"{commits} commits for {puts} durable puts"
    assert ssd.stats()["durable_puts"] == puts
    ssd.close()
    ssd = SsdTier(ssd_path, 256 * MIB)
    assert len(ssd) == puts
    ssd.close()


def test_ssd_non_durable_puts_are_visible_at_once_and_committed_soon(ssd_path):
    ssd = SsdTier(ssd_path, 64 * MIB, lazy_commit_window_s=0.05)
    for i in range(5):
        ssd.put(key(i), payload(i), durable=False)
    assert bytes(ssd.get(key(3))[0]) == payload(3)  # served from the queue
    deadline = time.monotonic() + 2.0
    while ssd.stats()["queued_ops"] or ssd.commit_count == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert ssd.commit_count <= 2
    ssd.flush()
    ssd.close()
    ssd = SsdTier(ssd_path, 64 * MIB)
    assert len(ssd) == 5
    ssd.close()


def test_ssd_same_bytes_again_is_a_touch_and_closed_tier_refuses(ssd_path):
    ssd = SsdTier(ssd_path, 64 * MIB)
    ssd.put(key(1), payload(1))
    commits = ssd.commit_count
    ssd.put(key(1), payload(1))
    assert ssd.commit_count == commits and ssd.stats()["puts"] == 1
    ssd.put(key(1), payload(2))  # new bytes replace the old
    assert bytes(ssd.get(key(1))[0]) == payload(2)
    assert ssd.stats()["blocks"] == 1 and ssd.stats()["bytes"] == BLOCK
    ssd.close()
    ssd.close()  # idempotent
    with pytest.raises(Exception, match="closed"):
        ssd.get(key(1))


# --- tiered store ----------------------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    events: list[TierEvent] = []
    ssd = SsdTier(tmp_path / "ssd", 64 * MIB)
    tiered = TieredStore(DramTier(4 * BLOCK), ssd, events.append)
    tiered.events = events  # type: ignore[attr-defined]
    yield tiered
    tiered.close()


def _events_for(events, k):
    return [(e.kind, e.tier) for e in events if e.key == k]


def test_tiered_demotes_the_coldest_blocks_to_ssd(store):
    for i in range(6):
        assert store.put(key(i), payload(i)) is CacheTier.CPU_DRAM
    assert store.locate(key(0)) is CacheTier.LOCAL_SSD
    assert store.locate(key(1)) is CacheTier.LOCAL_SSD
    assert all(store.locate(key(i)) is CacheTier.CPU_DRAM for i in range(2, 6))
    stats = store.stats()
    assert stats["cpu_dram_blocks"] == 4 and stats["local_ssd_blocks"] == 2
    assert stats["demotions"] == 2
    for i in (0, 1):
        assert _events_for(store.events, key(i)) == [
            ("stored", CacheTier.CPU_DRAM),
            ("stored", CacheTier.LOCAL_SSD),
            ("removed", CacheTier.CPU_DRAM),
        ]
        assert store.ssd.commit_count >= 1
    store.events.clear()
    for i in (0, 1):
        data, tier = store.get(key(i))
        assert tier is CacheTier.LOCAL_SSD and bytes(data) == payload(i)
    assert all(e.bytes == BLOCK for e in store.events)


def test_tiered_demotes_in_batches_to_share_ssd_commits(tmp_path):
    events = []
    ssd = SsdTier(tmp_path / "ssd", 64 * MIB)
    store = TieredStore(DramTier(8 * BLOCK), ssd, events.append, demote_batch_bytes=3 * BLOCK)
    for i in range(8):
        store.put(key(i), payload(i))
    assert ssd.commit_count == 0
    store.put(key(8), payload(8))  # needs one block, demotes four in one commit
    assert ssd.commit_count == 1 and [k.block_index for k in ssd.keys()] == [0, 1, 2, 3]
    for i in range(9, 12):
        store.put(key(i), payload(i))  # reuse the freed buffers: no demotion
    assert ssd.commit_count == 1
    stats = store.stats()
    assert stats["demotions"] == 4 and stats["cpu_dram_blocks"] == 8
    assert stats["cpu_dram"]["pool_bytes"] <= 8 * BLOCK
    assert stats["cpu_dram"]["buffer_allocations"] == 8
    removed = [e.key.block_index for e in events if e.kind == "removed"]
    assert removed == [0, 1, 2, 3]
    store.close()


def test_tiered_promotes_ssd_hits_and_keeps_the_ssd_copy(store):
    for i in range(5):
        store.put(key(i), payload(i))
    store.events.clear()
    data, tier = store.get(key(0))
    assert tier is CacheTier.LOCAL_SSD and bytes(data) == payload(0)
    assert store.locate(key(0)) is CacheTier.CPU_DRAM
    assert store.ssd.contains(key(0))  # promotion copies
    assert _events_for(store.events, key(0)) == [("stored", CacheTier.CPU_DRAM)]
    assert _events_for(store.events, key(1)) == [
        ("stored", CacheTier.LOCAL_SSD),
        ("removed", CacheTier.CPU_DRAM),
    ]
    data, tier = store.get(key(0))
    assert tier is CacheTier.CPU_DRAM and data == payload(0)
    stats = store.stats()
    assert (stats["hits_local_ssd"], stats["hits_cpu_dram"], stats["promotions"]) == (1, 1, 1)
    # demoting a block that is still on SSD writes nothing
    writes = store.ssd.stats()["puts"]
    for i in range(10, 14):
        store.put(key(i), payload(i))
    assert not store.dram.contains(key(0)) and store.ssd.contains(key(0))
    assert store.ssd.stats()["puts"] == writes + 3  # 2, 3, 4 written; 0 was not


def test_tiered_durable_and_ssd_puts_survive_reopen(tmp_path):
    ssd = SsdTier(tmp_path / "ssd", 64 * MIB)
    events = []
    store = TieredStore(DramTier(4 * BLOCK), ssd, events.append)
    assert store.put(key(1), payload(1), durable=True) is CacheTier.CPU_DRAM
    assert store.dram.contains(key(1)) and ssd.contains(key(1))
    assert store.put(key(2), payload(2), tier=CacheTier.LOCAL_SSD) is CacheTier.LOCAL_SSD
    assert not store.dram.contains(key(2))
    store.put(key(3), payload(3))  # DRAM only: lost on restart
    assert {(e.key.block_index, e.tier) for e in events} == {
        (1, CacheTier.LOCAL_SSD),
        (1, CacheTier.CPU_DRAM),
        (2, CacheTier.LOCAL_SSD),
        (3, CacheTier.CPU_DRAM),
    }
    with pytest.raises(InvalidArgument):
        store.put(key(4), payload(4), tier=CacheTier.HBM)
    store.close()
    store = TieredStore(DramTier(4 * BLOCK), SsdTier(tmp_path / "ssd", 64 * MIB))
    assert bytes(store.get(key(1))[0]) == payload(1)
    assert bytes(store.get(key(2))[0]) == payload(2)
    with pytest.raises(NotFound):
        store.get(key(3))
    assert {e.key for e in store.residency()} >= {key(1), key(2)}
    store.close()


def test_tiered_block_too_big_for_dram_goes_to_ssd(store):
    assert store.put(key(1), payload(1, 5 * BLOCK)) is CacheTier.LOCAL_SSD
    assert store.stats()["dram_fallbacks"] == 1
    data, tier = store.get(key(1))
    assert tier is CacheTier.LOCAL_SSD and bytes(data) == payload(1, 5 * BLOCK)


def test_tiered_corrupt_ssd_block_is_reported_and_not_found(tmp_path):
    path = tmp_path / "ssd"
    ssd = SsdTier(path, 64 * MIB)
    ssd.put(key(1), marked(1))
    ssd.close()
    _flip_in_file(path, b"<<QUILLBLOCK-00000001>>", 333)
    events = []
    store = TieredStore(DramTier(4 * BLOCK), SsdTier(path, 64 * MIB), events.append)
    assert store.exists(key(1))
    with pytest.raises(NotFound, match="corrupt"):
        store.get(key(1))
    assert events == [TierEvent("removed", key(1), CacheTier.LOCAL_SSD, BLOCK)]
    assert not store.exists(key(1))
    assert store.stats()["corrupt"] == 1 and store.stats()["misses"] == 1
    with pytest.raises(NotFound):
        store.get(key(1))
    store.close()


def test_tiered_corrupt_dram_copy_falls_back_to_ssd(store):
    store.put(key(1), payload(1), durable=True)
    store.dram._lru[key(1)].buf[7] ^= 0xFF  # white box: a bit flip in memory
    store.events.clear()
    data, tier = store.get(key(1))
    assert tier is CacheTier.LOCAL_SSD and bytes(data) == payload(1)
    assert ("removed", CacheTier.CPU_DRAM) in _events_for(store.events, key(1))
    assert store.stats()["corrupt"] == 1


def test_tiered_identity_is_per_tenant(store):
    store.put(key(1, tenant="a"), payload(1))
    store.put(key(2, tenant="a"), payload(2), tier=CacheTier.LOCAL_SSD)
    for i in (1, 2):
        with pytest.raises(NotFound):
            store.get(key(i, tenant="b"))
        assert not store.exists(key(i, tenant="b"))
    assert store.stats()["misses"] == 2


def test_tiered_delete_and_checksum_mismatch(store):
    store.put(key(1), payload(1), durable=True)
    store.events.clear()
    assert store.delete(key(1)) and not store.delete(key(1))
    assert sorted((e.kind, e.tier.value) for e in store.events) == [
        ("removed", "cpu_dram"),
        ("removed", "local_ssd"),
    ]
    with pytest.raises(NotFound):
        store.get(key(1))
    with pytest.raises(Corrupt):
        store.put(key(2), payload(2), checksum=payload_checksum(payload(2)) ^ 1)
    assert not store.exists(key(2))


def test_tiered_ssd_eviction_is_reported(tmp_path):
    record = len(encode(key(1), payload(1))) + BLOCK  # key(0) has a shorter header
    events = []
    store = TieredStore(DramTier(2 * BLOCK), SsdTier(tmp_path / "ssd", 2 * record), events.append)
    for i in range(6):
        store.put(key(i), payload(i))
    removed_ssd = [
        e.key.block_index for e in events if e.kind == "removed" and e.tier.value == "local_ssd"
    ]
    assert removed_ssd == [0, 1]
    assert store.stats()["evictions"] == 2
    assert [k.block_index for k in store.ssd.keys()] == [2, 3]
    store.close()


def test_tiered_concurrent_puts_and_gets(tmp_path):
    store = TieredStore(DramTier(6 * BLOCK), SsdTier(tmp_path / "ssd", 128 * MIB))
    errors = []

    def worker(t):
        rng = random.Random(t)
        try:
            for _ in range(40):
                i = rng.randrange(30)
                if rng.random() < 0.5:
                    store.put(key(i), payload(i))
                else:
                    try:
                        data, _ = store.get(key(i))
                        assert bytes(data) == payload(i)
                    except NotFound:
                        pass
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = store.stats()
    assert stats["cpu_dram"]["pool_bytes"] <= 6 * BLOCK
    assert stats["corrupt"] == 0
    for k in store.keys()[CacheTier.LOCAL_SSD]:
        assert bytes(store.ssd.get(k)[0]) == payload(k.block_index)
    store.close()
