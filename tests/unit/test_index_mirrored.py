"""MirroredIndex: reads from memory, writes reach lmdb in order at flush, reopen restores."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache_core.index import Chain, LmdbIndex, MemoryIndex, MirroredIndex, open_index
from quillcache_core.model import CacheResidency, CacheTier
from tests.unit.factories import make_request

pytestmark = pytest.mark.unit

CHAIN = 6  # KEYS[:CHAIN] is one chain
KEYS = make_request(CHAIN).blocks + make_request(4, tenant="globex").blocks
WORKERS = ("e0", "e1", "s0")
TIERS = (CacheTier.HBM, CacheTier.CPU_DRAM, CacheTier.LOCAL_SSD)

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("put"),
            st.sampled_from(range(len(KEYS))),
            st.sampled_from(WORKERS),
            st.sampled_from(TIERS),
        ),
        st.tuples(
            st.just("remove_tier"),
            st.sampled_from(range(len(KEYS))),
            st.sampled_from(WORKERS),
            st.sampled_from(TIERS),
        ),
        st.tuples(
            st.just("remove_block"), st.sampled_from(range(len(KEYS))), st.sampled_from(WORKERS)
        ),
        st.tuples(
            st.just("put_chain"),
            st.sampled_from(range(CHAIN)),
            st.integers(1, CHAIN),
            st.sampled_from(WORKERS),
            st.sampled_from(TIERS),
        ),
        st.tuples(st.just("clear_worker"), st.sampled_from(WORKERS)),
        st.tuples(st.just("flush")),
    ),
    max_size=40,
)


def _apply(index, op) -> object:
    name = op[0]
    if name == "put":
        key = KEYS[op[1]]
        return index.put(CacheResidency(key, op[2], op[3], 1024))
    if name == "remove_tier":
        return index.remove_tier(op[2], KEYS[op[1]].block_hash, op[3])
    if name == "remove_block":
        key = KEYS[op[1]]
        return index.remove_block(key.scope(), op[2], key.block_hash)
    if name == "put_chain":
        chain = KEYS[op[1] : min(op[1] + op[2], CHAIN)]
        first = chain[0]
        return index.put_chain(
            Chain(
                first[:4],
                first.prefix_hash,
                [k.block_hash for k in chain],
                first.block_index,
                first.token_count,
                op[3],
                op[4],
                1024,
            )
        )
    if name == "clear_worker":
        return index.clear_worker(op[1])
    if name == "flush":
        return index.flush()
    raise AssertionError(name)


def _rows(records) -> list:
    return sorted((r.key, r.worker_id, r.tier.value, r.bytes) for r in records)


def _state(index) -> list:
    return _rows(index.snapshot())


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(sequence=ops)
@pytest.mark.parametrize("backend", ["lmdb", "fs"])
def test_mirrored_index_answers_like_memory_and_reopens_with_the_same_records(
    tmp_path_factory, backend, sequence
):
    directory = Path(tmp_path_factory.mktemp("mirror")) / "index"
    reference = MemoryIndex()
    mirrored = open_index(backend, str(directory), sync_commits=False, mirror=True)
    assert isinstance(mirrored, MirroredIndex) and mirrored.persistent
    for op in sequence:
        assert _apply(mirrored, op) == _apply(reference, op), op
        for key in KEYS:
            assert _rows(mirrored.locate_hash(key.block_hash)) == _rows(
                reference.locate_hash(key.block_hash)
            )
    assert _state(mirrored) == _state(reference)
    assert len(mirrored) == len(reference)
    for worker in WORKERS:
        assert mirrored.worker_block_count(worker) == reference.worker_block_count(worker)
    mirrored.close()
    reopened = open_index(backend, str(directory))
    assert _state(reopened) == _state(reference), "every write reached the disk, in order"
    reopened.close()
    again = open_index(backend, str(directory), mirror=True)
    assert _state(again) == _state(reference), "a restart plans with what was flushed"
    again.close()


def test_writes_wait_for_flush_and_a_drain_in_another_thread_keeps_order(tmp_path):
    directory = tmp_path / "index"
    mirrored = MirroredIndex(LmdbIndex(str(directory), sync_commits=False))
    first = [CacheResidency(k, "e0", CacheTier.HBM, 1) for k in KEYS[:6]]
    mirrored.put_many(first)
    mirrored.put_many([CacheResidency(k, "e1", CacheTier.HBM, 1) for k in KEYS[6:]])
    assert mirrored.pending_writes == 1, "consecutive puts share one transaction"
    assert len(mirrored) == len(KEYS), "reads see the writes at once"
    drained = threading.Thread(target=mirrored.flush)
    drained.start()
    mirrored.clear_worker("e0")  # while the other thread may be draining
    drained.join()
    mirrored.flush()
    assert mirrored.pending_writes == 0
    mirrored.close()
    reopened = LmdbIndex(str(directory))
    assert reopened.worker_block_count("e0") == 0
    assert reopened.worker_block_count("e1") == len(KEYS) - 6
    reopened.close()


def test_worker_epochs_reach_lmdb_at_flush_and_come_back_on_reopen(tmp_path):
    mirrored = MirroredIndex(LmdbIndex(tmp_path / "idx"))
    mirrored.set_worker_epoch("e0", 42.0)
    assert mirrored.worker_epochs() == {"e0": 42.0}  # at once, from memory
    assert mirrored.pending_writes == 1
    mirrored.close()  # flushes
    reopened = MirroredIndex(LmdbIndex(tmp_path / "idx"))
    try:
        assert reopened.worker_epochs() == {"e0": 42.0}
    finally:
        reopened.close()


def test_a_write_lmdb_refuses_is_counted_and_the_writes_after_it_still_land(tmp_path):
    mirrored = MirroredIndex(LmdbIndex(tmp_path / "idx"))
    bad = CacheResidency(KEYS[0], "e0", CacheTier.HBM, 1, last_access_ms=2**70)  # no int64
    good = CacheResidency(KEYS[1], "e1", CacheTier.HBM, 1)
    mirrored.put(bad)
    mirrored.put(good)  # one queued put_many with the bad record
    mirrored.set_worker_epoch("e1", 3.0)
    mirrored.flush()
    assert mirrored.failed_writes == 1
    mirrored.close()
    reopened = LmdbIndex(tmp_path / "idx")
    try:
        assert [r.worker_id for r in reopened.snapshot()] == ["e1"]
        assert reopened.worker_epochs() == {"e1": 3.0}
    finally:
        reopened.close()


def test_a_flush_is_one_lmdb_transaction_and_a_failed_batch_loses_nothing_else(tmp_path):
    durable = LmdbIndex(tmp_path / "idx")
    mirrored = MirroredIndex(durable)
    mirrored.put_many([CacheResidency(k, "e0", CacheTier.HBM, 1) for k in KEYS[:4]])
    for k in KEYS[:3]:  # puts, evictions and an epoch interleaved, as the conductor writes
        mirrored.remove_block(k.scope(), "e0", k.block_hash)
        mirrored.put(CacheResidency(k, "e1", CacheTier.HBM, 2))
    mirrored.set_worker_epoch("e1", 7.0)
    commits = []
    durable._env = _CountingEnv(durable._env, commits)
    mirrored.flush()
    assert commits == [True]  # one write transaction for the whole queue
    assert sorted((r.key, r.worker_id) for r in durable.snapshot()) == sorted(
        [(KEYS[3], "e0")] + [(k, "e1") for k in KEYS[:3]]
    )
    # A write lmdb refuses aborts the batch; applied one by one, only that write is lost.
    bad = CacheResidency(KEYS[4], "e2", CacheTier.HBM, 1, last_access_ms=2**70)
    mirrored.remove_block(KEYS[3].scope(), "e0", KEYS[3].block_hash)
    mirrored.put(bad)
    mirrored.put(CacheResidency(KEYS[5], "e2", CacheTier.HBM, 1))
    mirrored.flush()
    assert mirrored.failed_writes == 1
    assert sorted((r.key, r.worker_id) for r in durable.snapshot()) == sorted(
        [(KEYS[5], "e2")] + [(k, "e1") for k in KEYS[:3]]
    )
    mirrored.close()


class _CountingEnv:
    """An lmdb Environment that records each write transaction it begins."""

    def __init__(self, env, commits: list) -> None:
        self._env, self._commits = env, commits

    def begin(self, write: bool = False, **kwargs):
        if write:
            self._commits.append(True)
        return self._env.begin(write=write, **kwargs)

    def __getattr__(self, name):
        return getattr(self._env, name)


def test_a_mirrored_journal_logs_a_chain_as_one_chain_not_its_records(tmp_path):
    """The conductor's index (fs behind the mirror) journals an engine's run of stored
    blocks as the chain it came as: a few bytes a block, not a row per record."""
    request = make_request(256)
    first = request.blocks[0]
    chain = Chain(
        first[:4],
        first.prefix_hash,
        [k.block_hash for k in request.blocks],
        first.block_index,
        first.token_count,
        "e0",
        CacheTier.HBM,
        16384,
    )
    as_chain = open_index("fs", str(tmp_path / "chain"), sync_commits=False, mirror=True)
    as_chain.put_chain(chain)
    as_chain.flush()
    as_records = open_index("fs", str(tmp_path / "records"), sync_commits=False, mirror=True)
    as_records.put_many(chain.records())
    as_records.flush()
    chain_bytes = as_chain._durable.metrics().bytes_written
    record_bytes = as_records._durable.metrics().bytes_written
    assert chain_bytes * 3 < record_bytes, (chain_bytes, record_bytes)
    assert _state(as_chain) == _state(as_records)
    as_chain.close()
    as_records.close()
    reopened = open_index("fs", str(tmp_path / "chain"))
    assert _state(reopened) == _rows(chain.records())
    reopened.close()
