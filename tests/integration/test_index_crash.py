"""kill -9 recovery of every persistent index backend, in a real subprocess.

This module is also the child (``python -m tests.integration.test_index_crash BACKEND
PATH MODE START ACKS``). The child applies a deterministic stream of index writes
(chains, put_many, remove_tier, remove_block, clear_worker, worker epochs) and appends
``ACK n`` to the ACKS file once the first n ops are acknowledged: after each op with
sync_commits on (mode "sync"), or after each flush() with it off (mode "flush", a flush
every 7 ops). The parent SIGKILLs it at a random point mid-stream, reopens the index
and requires that it holds exactly the state after some prefix of the stream no shorter
than the acknowledged one (every acknowledged write, nothing torn or half-applied,
nothing invented), that it serves locate / prefix_scan at once, and that it takes
writes again. Further children continue the stream on the recovered index and are
killed too (RUNS kills per test). Small memtables (rocksdb) and compaction thresholds (fs, art) make memtable
flushes and snapshots happen mid-stream, so some kills land inside them.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from quillcache_core.index import (
    ArtIndex,
    Chain,
    FsIndex,
    IndexBackend,
    LmdbIndex,
    MemoryIndex,
    RocksIndex,
    open_index,
)
from quillcache_core.model import CacheResidency, CacheTier, IdentityScope, KvBlockKey

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCOPES = [("m0", "tok", None, "acme"), ("m0", "tok", "lora", "globex")]
CHAIN = 8
FLUSH_EVERY = 7
ACKED_BEFORE_KILL = 120  # ops acknowledged before the kill may come
MAX_UNACKED = 200_000  # how far past the acknowledged ops the recovered state may be
RUNS = 4  # kills per test, each continuing the stream on the recovered index


def _chain_op(i: int) -> Chain:
    """What op i writes when it is a chain (i % 10 <= 5)."""
    scope = SCOPES[i % 2]
    parent = f"c{i - 1}-{CHAIN - 1}" if i % 10 else "root"
    hashes = [f"c{i}-{n}" for n in range(CHAIN)]
    return Chain(scope, parent, hashes, CHAIN * (i % 10), 16, f"w{i % 3}", CacheTier.HBM, 4096, i)


def apply(index: IndexBackend, i: int) -> None:
    """Op i of the stream: a function of i alone."""
    step = i % 10
    if step <= 5:
        index.put_chain(_chain_op(i))
    elif step == 6:  # copies of the last chain's first blocks on another worker and tier
        records = _chain_op(i - 1).records()[:4]
        index.put_many([r._replace(worker_id="w9", tier=CacheTier.CPU_DRAM) for r in records])
    elif step == 7:
        index.remove_tier("w9", f"c{i - 2}-0", "cpu")
    elif step == 8:
        chain = _chain_op(i - 5)
        index.remove_block(IdentityScope(*chain.scope), chain.worker_id, chain.block_hashes[3])
    elif i % 50 == 49:
        index.clear_worker("w9")
    else:
        index.set_worker_epoch(f"w{i % 3}", i + 0.5)


def _open_child(backend: str, path: str, sync: bool) -> IndexBackend:
    if backend == "lmdb":
        return LmdbIndex(path, sync_commits=sync)
    if backend == "rocksdb":
        return RocksIndex(path, sync_commits=sync, write_buffer_bytes=256 << 10)
    kind = FsIndex if backend == "fs" else ArtIndex
    return kind(path, sync_commits=sync, compact_bytes=64 << 10)


def child(backend: str, path: str, mode: str, start: int, acks: str) -> None:
    index = _open_child(backend, path, sync=mode == "sync")
    fd = os.open(acks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, b"READY\n")
    deadline = time.monotonic() + 60  # never outlive a parent that failed to kill it
    i = start
    while time.monotonic() < deadline:
        apply(index, i)
        i += 1
        if mode == "sync":
            os.write(fd, b"ACK %d\n" % i)
        elif i % FLUSH_EVERY == 0:
            index.flush()
            os.write(fd, b"ACK %d\n" % i)
    sys.exit(3)


# --- the parent ------------------------------------------------------------------------


def _acked(acks: Path) -> tuple[bool, int]:
    ready, acked = False, 0
    for line in acks.read_text().splitlines(keepends=True):
        if line == "READY\n":
            ready = True
        elif line.startswith("ACK ") and line.endswith("\n"):
            acked = max(acked, int(line[4:]))
    return ready, acked


def _run_and_kill(
    backend: str, path: Path, mode: str, start: int, acks: Path, rng: random.Random
) -> int:
    """Start a child at op `start`, SIGKILL it mid-stream; returns the ops it acked."""
    err = acks.with_suffix(".err")
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.test_index_crash"]
            + [backend, str(path), mode, str(start), str(acks)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            deadline = time.monotonic() + 30
            while not acks.exists() or _acked(acks)[1] < start + ACKED_BEFORE_KILL:
                assert proc.poll() is None, f"child exited {proc.returncode}: {err.read_text()}"
                assert time.monotonic() < deadline, "the child acknowledged too little"
                time.sleep(0.002)
            time.sleep(rng.uniform(0, 0.03))
            assert proc.poll() is None, err.read_text()
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return _acked(acks)[1]


def _fingerprint(index: IndexBackend) -> tuple:
    return (len(index), index.metrics().resident_bytes, index.worker_epochs())


def _recovered_prefix(index: IndexBackend, model: MemoryIndex, done: int, acked: int) -> int:
    """Advance `model` (now after `done` ops) to the prefix `index` holds; returns its
    length. Fails unless that prefix has every acknowledged op and the whole state."""
    for i in range(done, acked):
        apply(model, i)
    target = _fingerprint(index)
    records = Counter(index.snapshot())
    for n in range(acked, acked + MAX_UNACKED):
        if _fingerprint(model) == target and Counter(model.snapshot()) == records:
            return n
        apply(model, n)
    raise AssertionError(f"the recovered index is no prefix of the stream from op {acked} on")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["flush", "sync"])
@pytest.mark.parametrize("backend", ["lmdb", "rocksdb", "fs", "art"])
def test_kill_9_mid_write_loses_no_acknowledged_write(
    tmp_path: Path, backend: str, mode: str
) -> None:
    path = tmp_path / "index"
    rng = random.Random(f"{backend}-{mode}")
    model = MemoryIndex()
    done = 0  # ops in model; the stream resumes here after each recovery
    for run in range(RUNS):
        acked = _run_and_kill(backend, path, mode, done, tmp_path / f"acks-{run}", rng)
        assert acked >= done + ACKED_BEFORE_KILL

        began = time.perf_counter()
        index = open_index(backend, str(path))
        try:
            newest = _chain_op(acked - 1 - (acked - 1) % 10)  # an acknowledged chain
            found = index.prefix_scan(IdentityScope(*newest.scope), newest.parent)
            serving_s = time.perf_counter() - began
            assert newest.records()[0] in found
            assert index.locate(newest.records()[1].key) == [newest.records()[1]]

            done = _recovered_prefix(index, model, done, acked)
            for worker in ("w0", "w1", "w2", "w9"):
                assert index.worker_block_count(worker) == model.worker_block_count(worker)
            hashes = newest.block_hashes
            assert [Counter(f) for f in index.locate_prefix(hashes)] == [
                Counter(f) for f in model.locate_prefix(hashes)
            ]
            print(
                f"{backend}/{mode} run {run}: {acked} ops acked, {done} recovered "
                f"({done - acked} unacknowledged), {len(index)} records, "
                f"serving after {serving_s * 1000:.1f} ms"
            )
            # The recovered index takes writes again.
            extra = CacheResidency(
                KvBlockKey(*SCOPES[0], "root", f"after-{run}", 0, 16), "w7", CacheTier.HBM, 1
            )
            index.put(extra)
            index.flush()
            assert index.locate_hash(f"after-{run}") == [extra]
            assert index.remove_block(IdentityScope(*SCOPES[0]), "w7", f"after-{run}") == 1
        finally:
            index.close()


if __name__ == "__main__":
    backend_arg, path_arg, mode_arg, start_arg, acks_arg = sys.argv[1:6]
    child(backend_arg, path_arg, mode_arg, int(start_arg), acks_arg)
