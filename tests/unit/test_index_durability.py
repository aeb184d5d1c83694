"""On-disk behaviour of the persistent index backends: the fs/art journal (torn tails,
compaction, leftovers of an interrupted one, damage) and what bytes_written counts."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

import pytest

from quillcache_core.errors import Corrupt, InvalidArgument
from quillcache_core.index import ArtIndex, Chain, FsIndex, MemoryIndex, RocksIndex
from quillcache_core.index.fs_index import FORMAT, read_frames
from quillcache_core.model import CacheResidency, CacheTier, IdentityScope, KvBlockKey

pytestmark = pytest.mark.unit

JOURNALED = {"fs": FsIndex, "art": ArtIndex}
SCOPE = ("m0", "tok", None, "t0")


def rec(i: int, worker: str = "w0", tier: CacheTier = CacheTier.HBM) -> CacheResidency:
    key = KvBlockKey(*SCOPE, f"h{i - 1}" if i else "root", f"h{i}", i, 16)
    return CacheResidency(key, worker, tier, 100 + i, last_access_ms=i, ref_count=i % 3)


def drive(index, start: int, count: int) -> None:
    """A deterministic mix of every write, on `index` (and on a reference alike)."""
    for i in range(start, start + count):
        index.put(rec(i, f"w{i % 3}"))
        if i % 4 == 0:
            index.put_many([rec(i, "w9", CacheTier.CPU_DRAM), rec(i + 1, "w9", CacheTier.HBM)])
        if i % 5 == 0:
            hashes = [f"c{i}-{n}" for n in range(6)]
            index.put_chain(Chain(SCOPE, f"h{i}", hashes, i + 1, 16, "w1", CacheTier.LOCAL_SSD, 7))
        if i % 7 == 3:
            index.remove_tier("w9", f"h{i - 3}", "cpu")
            index.remove_block(IdentityScope(*SCOPE), "w1", f"c{i - 3}-2")
        if i % 11 == 10:
            index.set_worker_epoch(f"w{i % 3}", float(i))
        if i % 23 == 22:
            index.clear_worker("w2")


def state(index) -> tuple:
    return (
        Counter(index.snapshot()),
        index.worker_epochs(),
        {w: index.worker_block_count(w) for w in ("w0", "w1", "w2", "w9")},
        index.metrics().resident_bytes,
    )


def log_file(path: Path) -> Path:
    (log,) = path.glob("log-*.qcl")
    return log


@pytest.mark.parametrize("backend", JOURNALED)
def test_a_torn_last_frame_is_dropped_at_every_cut(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "idx"
    idx = JOURNALED[backend](path)
    drive(idx, 0, 12)
    acked = state(idx)
    log = log_file(path)
    whole = log.stat().st_size
    idx.put_many([rec(100 + n, "w5") for n in range(3)])  # the frame a crash will tear
    idx.close()
    data = log.read_bytes()
    assert len(data) > whole
    for cut in [*range(whole + 1, len(data)), len(data) + 1]:
        torn = data[:cut] if cut < len(data) else data[:-1] + bytes([data[-1] ^ 0x55])
        log.write_bytes(torn)
        again = JOURNALED[backend](path)
        try:
            assert state(again) == acked, cut
            assert again.dropped_tail_bytes == len(torn) - whole
            assert log.stat().st_size == whole  # truncated: later frames follow good ones
        finally:
            again.close()
    # After the cut the journal takes writes again, and keeps them.
    idx = JOURNALED[backend](path)
    idx.put(rec(500))
    idx.close()
    idx = JOURNALED[backend](path)
    try:
        assert idx.locate(rec(500).key) == [rec(500)] and idx.dropped_tail_bytes == 0
    finally:
        idx.close()


@pytest.mark.parametrize("backend", JOURNALED)
@pytest.mark.parametrize("tail", [b"\x00" * 64, b"\x10\x00\x00\x00garbage-after-a-crash"])
def test_garbage_after_the_last_frame_is_dropped(tmp_path: Path, backend: str, tail) -> None:
    idx = JOURNALED[backend](tmp_path)
    drive(idx, 0, 5)
    acked = state(idx)
    idx.close()
    with log_file(tmp_path).open("ab") as f:
        f.write(tail)
    idx = JOURNALED[backend](tmp_path)
    try:
        assert state(idx) == acked and idx.dropped_tail_bytes == len(tail)
    finally:
        idx.close()


@pytest.mark.parametrize("backend", JOURNALED)
def test_compaction_keeps_one_snapshot_and_reopen_replays_it_and_the_tail(
    tmp_path: Path, backend: str
) -> None:
    reference = MemoryIndex()
    idx = JOURNALED[backend](tmp_path, compact_bytes=4096)
    drive(reference, 0, 150)
    drive(idx, 0, 150)
    assert idx.compactions >= 2
    assert state(idx) == state(reference)
    names = sorted(os.listdir(tmp_path))
    assert names[0] == "FORMAT" and names[1] == "LOCK" and len(names) == 4, names
    assert names[2].startswith("log-") and names[3].startswith("snapshot-")
    on_disk = sum((tmp_path / n).stat().st_size for n in names if n != "LOCK")
    written = idx.metrics().bytes_written
    assert written > on_disk  # the snapshots it replaced were written too
    idx.close()
    idx = JOURNALED[backend](tmp_path, compact_bytes=4096)
    try:
        assert state(idx) == state(reference)
        assert idx.metrics().bytes_written == 0 and idx.metrics().puts == 0
    finally:
        idx.close()


@pytest.mark.parametrize("backend", JOURNALED)
def test_leftovers_of_an_interrupted_compaction_are_ignored(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "idx"
    idx = JOURNALED[backend](path, compact_bytes=1 << 30)
    drive(idx, 0, 30)
    idx.compact()
    drive(idx, 30, 10)
    idx.flush()
    before = tmp_path / "before"
    shutil.copytree(path, before)  # generation 1: a snapshot and its log
    idx.compact()
    acked = state(idx)
    idx.close()
    # A crash after the new snapshot was renamed in, before the old files went away;
    # and one while a later snapshot was still being written.
    for name in os.listdir(before):
        if name.startswith(("snapshot-", "log-")):
            shutil.copy(before / name, path / name)
    (path / "snapshot-00000003.qcs.tmp").write_bytes(b"half a snapshot")
    idx = JOURNALED[backend](path)
    try:
        assert state(idx) == acked
        assert sorted(os.listdir(path)) == [
            "FORMAT",
            "LOCK",
            "log-00000002.qcl",
            "snapshot-00000002.qcs",
        ]
    finally:
        idx.close()


@pytest.mark.parametrize("backend", JOURNALED)
def test_damage_a_crash_cannot_cause_is_corrupt(tmp_path: Path, backend: str) -> None:
    idx = JOURNALED[backend](tmp_path)
    drive(idx, 0, 10)
    idx.compact()
    idx.close()
    (snapshot,) = tmp_path.glob("snapshot-*.qcs")
    data = bytearray(snapshot.read_bytes())
    data[len(data) // 2] ^= 0xFF
    snapshot.write_bytes(bytes(data))
    with pytest.raises(Corrupt, match="damaged snapshot"):
        JOURNALED[backend](tmp_path)
    (tmp_path / "FORMAT").write_bytes(b"quillcache-index-journal/9\n")
    with pytest.raises(Corrupt, match="unsupported"):
        JOURNALED[backend](tmp_path)
    (tmp_path / "FORMAT").unlink()
    with pytest.raises(Corrupt, match="without a format tag"):
        JOURNALED[backend](tmp_path)


def test_a_journal_opens_once_and_the_backends_share_its_format(tmp_path: Path) -> None:
    idx = FsIndex(tmp_path)
    try:
        with pytest.raises(InvalidArgument, match="open elsewhere"):
            ArtIndex(tmp_path)
        drive(idx, 0, 20)
        acked = state(idx)
    finally:
        idx.close()
    art = ArtIndex(tmp_path)  # the journal is logical: either state replays it
    try:
        assert state(art) == acked
    finally:
        art.close()


@pytest.mark.parametrize("backend", JOURNALED)
def test_unsynced_writes_reach_the_log_at_flush_and_bytes_written_counts_them(
    tmp_path: Path, backend: str
) -> None:
    idx = JOURNALED[backend](tmp_path, sync_commits=False)
    try:
        log = log_file(tmp_path)
        assert idx.metrics().bytes_written == len(FORMAT)
        drive(idx, 0, 10)
        assert log.stat().st_size == 0  # buffered: not acknowledged yet
        idx.flush()
        size = log.stat().st_size
        frames, end, why = read_frames(log.read_bytes())
        assert (end, why) == (size, None) and len(frames) > 10
        assert idx.metrics().bytes_written == len(FORMAT) + size
    finally:
        idx.close()


def test_rocksdb_counts_its_wal_and_its_memtable_flushes(tmp_path: Path) -> None:
    idx = RocksIndex(tmp_path, sync_commits=False)
    try:
        drive(idx, 0, 50)
        wal_only = idx.metrics().bytes_written
        assert wal_only > 0
        idx._db.flush(True)  # write the memtable out as an SST file
        assert idx.metrics().bytes_written > wal_only
    finally:
        idx.close()


@pytest.mark.parametrize("name", sorted(JOURNALED))
def test_a_flush_with_nothing_written_since_the_last_touches_no_disk(tmp_path, name, monkeypatch):
    index = JOURNALED[name](tmp_path / name, sync_commits=False)  # as the conductor's
    syncs = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (syncs.append(fd), real(fd))[1])
    index.flush()
    assert not index.dirty
    first = len(syncs)
    index.flush()
    index.flush()
    assert len(syncs) == first  # idle: no fdatasync at all
    index.put(rec(1))
    assert index.dirty
    index.flush()
    assert len(syncs) == first + 1 and not index.dirty
    index.close()
    reopened = JOURNALED[name](tmp_path / name)
    assert Counter(reopened.snapshot()) == Counter([rec(1)])  # what it skipped lost nothing
    reopened.close()


def test_a_memory_index_is_never_dirty_and_a_mirror_is_while_writes_queue(tmp_path):
    from quillcache_core.index.mirrored import MirroredIndex

    assert not MemoryIndex().dirty
    mirror = MirroredIndex(FsIndex(tmp_path / "fs", sync_commits=False))
    mirror.flush()
    assert not mirror.dirty
    mirror.put(rec(2))
    assert mirror.dirty
    mirror.flush()
    assert not mirror.dirty
    mirror.close()
