"""Persistent backends (lmdb, rocksdb, fs, art) across close and reopen, and after close."""

from __future__ import annotations

from pathlib import Path

import pytest

from quillcache_core.errors import InvalidArgument
from quillcache_core.index import LmdbIndex, open_index
from quillcache_core.model import CacheTier, IdentityScope
from tests.unit.test_index_contract import PERSISTENT, bag, key, rec

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("backend", PERSISTENT)
def test_persistent_backend_survives_close_and_reopen(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "idx"
    idx = open_index(backend, str(path))
    records = [
        rec(key(f"h{i}", tenant=f"t{i % 3}", parent=f"h{i - 1}"), f"w{i % 4}", tier, i * 7 + 1)
        for i in range(40)
        for tier in (CacheTier.HBM, CacheTier.LOCAL_SSD)
    ]
    idx.put_many(records)
    idx.put(rec(key("h3", tenant="t0", parent="h2"), "w3", CacheTier.HBM, 9999, pinned=True))
    assert idx.clear_worker("w1") == 20
    assert idx.remove_tier("w2", "h2", "ssd") == 1
    before = idx.snapshot()
    before_metrics = idx.metrics()
    assert before_metrics.bytes_written > 0
    assert before_metrics.resident_bytes == sum(r.bytes for r in before) > 0
    counts = {w: idx.worker_block_count(w) for w in ("w0", "w1", "w2", "w3")}
    idx.close()

    reopened = open_index(backend, str(path))
    try:
        assert bag(reopened.snapshot()) == bag(before)
        assert len(reopened) == len(before) == 80 - 20 - 1
        m = reopened.metrics()
        assert (m.resident_blocks, m.resident_bytes) == (len(before), before_metrics.resident_bytes)
        assert (m.puts, m.removes, m.bytes_written) == (0, 0, 0)  # per process
        assert {w: reopened.worker_block_count(w) for w in counts} == counts
        scope = IdentityScope("m0", "tok", None, "t0")
        assert {(r.worker_id, r.tier) for r in reopened.prefix_scan(scope, "h2")} == {
            ("w3", CacheTier.HBM),
            ("w3", CacheTier.LOCAL_SSD),
        }
        assert bag(reopened.locate(key("h3", tenant="t0", parent="h2"))) == bag(
            [
                rec(key("h3", tenant="t0", parent="h2"), "w3", CacheTier.HBM, 9999, pinned=True),
                rec(key("h3", tenant="t0", parent="h2"), "w3", CacheTier.LOCAL_SSD, 22),
            ]
        )
        reopened.put(rec(key("new"), "w9"))
        assert reopened.metrics().bytes_written > 0
    finally:
        reopened.close()


def test_lmdb_put_many_is_one_transaction(tmp_path: Path) -> None:
    idx = LmdbIndex(tmp_path / "idx")
    try:
        too_long = rec(key("x" * 600))
        with pytest.raises(InvalidArgument, match="too long"):
            idx.put_many([rec(key("a")), rec(key("b")), too_long])
        assert len(idx) == 0
        assert idx.metrics().resident_bytes == 0
        assert idx.metrics().puts == 0
    finally:
        idx.close()


@pytest.mark.parametrize("backend", PERSISTENT)
def test_persistent_backend_refuses_calls_after_close(tmp_path: Path, backend: str) -> None:
    idx = open_index(backend, str(tmp_path / "idx"))
    idx.close()
    idx.close()  # idempotent
    idx.flush()  # a no-op once closed
    with pytest.raises(InvalidArgument, match="closed"):
        idx.locate_hash("h1")
    with pytest.raises(InvalidArgument, match="closed"):
        idx.put(rec(key()))
    with pytest.raises(InvalidArgument, match="closed"):
        len(idx)


@pytest.mark.parametrize("backend", PERSISTENT)
def test_persistent_backend_keeps_worker_epochs_across_reopen(tmp_path: Path, backend: str) -> None:
    idx = open_index(backend, str(tmp_path / "idx"))
    idx.set_worker_epoch("engine-a", 123.5)
    idx.close()
    reopened = open_index(backend, str(tmp_path / "idx"))
    try:
        assert reopened.worker_epochs() == {"engine-a": 123.5}
    finally:
        reopened.close()


@pytest.mark.parametrize("backend", PERSISTENT)
def test_mirrored_backend_reaches_the_disk_at_flush_and_reopens(
    tmp_path: Path, backend: str
) -> None:
    path = str(tmp_path / "idx")
    mirrored = open_index(backend, path, sync_commits=False, mirror=True)
    records = [rec(key(f"h{i}", parent=f"h{i - 1}"), f"w{i % 3}", nbytes=i) for i in range(30)]
    mirrored.put_many(records)
    assert mirrored.remove_block(IdentityScope("m0", "tok", None, "t0"), "w1", "h4") == 1
    mirrored.set_worker_epoch("w2", 9.5)
    mirrored.close()  # flushes
    reopened = open_index(backend, path)
    try:
        assert bag(reopened.snapshot()) == bag(records[:4] + records[5:])
        assert reopened.worker_epochs() == {"w2": 9.5}
    finally:
        reopened.close()
