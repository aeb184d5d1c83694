"""Replaying a trace against one index backend, and its kill -9 recovery.

Both run in child processes forked from the command (`in_child`), one per backend and
measurement: each starts from the same heap (the traces, built once by the parent),
/proc/self/io then counts that backend's work alone, and the command's own process
never opens a backend (a fork after RocksDB started its background threads would
leave the child a thread pool without threads).

**Replay** (`replay_backend`): each trace into a fresh index opened as the conductor
opens its durable backend (`open_index(name, dir, sync_commits=False)`), with
`flush()` after every `flush_every` write ops (the conductor flushes once a second:
this is a fleet reporting `flush_every` events a second). Timed: the write ops and
flushes (`puts_per_s` = records put / that time; removals and clears are part of
it), each lookup's `locate_prefix` over the prompt's hash chain (what Plan reads)
and, after it, a `prefix_scan` of the deepest block it found (the blocks that continue
the matched prefix; "root" when nothing matched). Reads go to the backend itself,
not to the conductor's in-memory mirror.

**Crash** (`crash_and_recover`): a child replays a trace's writes the same way and
appends ``ACK n`` to a file after each flush (n write ops acknowledged); the parent
SIGKILLs it once it is past `kill_after` of them, at a random point (so mid-write,
sometimes mid-flush); another child reopens the directory and times until a `locate`
is answered (`recovery_s`), and a copy of the directory, taken before that reopen,
behind the conductor's mirror (`open_index(mirror=True)`: the whole index loaded
into memory, what a restarted conductor pays before serving). Every record of the
state after the acknowledged ops must be there unless a later op (not acknowledged,
but which may have reached the disk) removed it: the others are `records_lost`.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from quillcache_bench.index_traces import CLEAR, LOOKUP, PUT, REMOVE, Trace
from quillcache_core.index import MemoryIndex, open_index
from quillcache_core.index.base import IndexBackend
from quillcache_core.model import IdentityScope
from quillcache_core.process.heap import HeapSettler

_IO_FIELDS = ("wchar", "write_bytes", "cancelled_write_bytes")


def proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters (all its threads: RocksDB's included)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            name, _, value = line.partition(":")
            out[name.strip()] = int(value)
    return out


def disk_bytes(path: str | os.PathLike) -> int:
    """Bytes allocated on disk under `path` (st_blocks, so sparse files count as stored)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def in_child(fn: Callable, *args) -> object:
    """Run fn(*args) in a forked child and return its result (or raise its error)."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def target() -> None:
        try:
            send.send(("ok", fn(*args)))
        except BaseException:  # report anything, the parent raises it
            send.send(("error", traceback.format_exc()))
        finally:
            send.close()

    proc = ctx.Process(target=target, daemon=True)
    proc.start()
    send.close()
    try:
        status, value = receive.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"child for {fn.__name__} died (exit {proc.exitcode})") from None
    proc.join()
    if status != "ok":
        raise RuntimeError(f"child for {fn.__name__} failed:\n{value}")
    return value


def apply_write(index: IndexBackend, op: tuple) -> None:
    kind = op[0]
    if kind == PUT:
        index.put_many(op[1])
    elif kind == REMOVE:
        index.remove_tier(op[1], op[2], op[3])
    elif kind == CLEAR:
        index.clear_worker(op[1])
    else:
        raise ValueError(f"not a write op: {kind!r}")


def fingerprint(index: IndexBackend) -> tuple:
    """Cheap state summary: records, resident bytes, records per worker holding any."""
    counts = ((w, index.worker_block_count(w)) for w in index.workers())
    return (len(index), index.metrics().resident_bytes, tuple(c for c in counts if c[1]))


# --- replay ------------------------------------------------------------------------------


def replay_backend(name: str, directory: str, traces: list[Trace], flush_every: int) -> dict:
    """Replay every trace into a fresh `name` index under `directory` (module docstring).

    Runs in a child (in_child): its /proc/self/io is this backend's alone.
    """
    import gc

    gc.freeze()  # the traces are the harness's: no collection walks them
    heap = HeapSettler()  # the backend's own objects: as the conductor's tick does
    out: dict[str, dict] = {}
    for trace in traces:
        path = os.path.join(directory, trace.name)
        io_before = proc_io()
        index = open_index(name, path if name != "memory" else None, sync_commits=False)
        put_s = remove_s = flush_s = 0.0
        writes = puts = 0
        locate_s: list[float] = []
        scan_s: list[float] = []
        clock = time.perf_counter
        started = clock()
        wrote = False
        for op in trace.ops:
            kind = op[0]
            if kind != LOOKUP:
                t = clock()
                apply_write(index, op)
                if kind == PUT:
                    put_s += clock() - t
                    puts += len(op[1])
                else:
                    remove_s += clock() - t
                writes += 1
                if writes % flush_every == 0:
                    t = clock()
                    index.flush()
                    flush_s += clock() - t
                wrote = True
                continue
            if wrote:  # between two lookups, as the conductor's tick runs between plans
                heap.maybe_settle()
                wrote = False
            hashes = op[2]
            t = clock()
            found = index.locate_prefix(hashes)
            locate_s.append(clock() - t)
            parent = hashes[len(found) - 1] if found else "root"
            scope = IdentityScope(*op[1])
            t = clock()
            index.prefix_scan(scope, parent)
            scan_s.append(clock() - t)
        t = clock()
        index.flush()
        flush_s += clock() - t
        elapsed = clock() - started
        metrics = index.metrics()
        state = fingerprint(index)
        index.close()
        io_after = proc_io()
        io = {k: io_after[k] - io_before[k] for k in _IO_FIELDS}
        out[trace.name] = {
            "records_put": puts,
            "write_ops": writes,
            "write_s": put_s + remove_s + flush_s,
            "put_s": put_s,
            "remove_s": remove_s,
            "flush_s": flush_s,
            "elapsed_s": elapsed,
            "locate_s": locate_s,
            "prefix_scan_s": scan_s,
            "bytes_written_storage": io["write_bytes"] - io["cancelled_write_bytes"],
            "bytes_written_syscalls": io["wchar"],
            "bytes_written_reported": metrics.bytes_written,
            "resident_blocks": metrics.resident_blocks,
            "resident_bytes": metrics.resident_bytes,
            "fingerprint": state,
            "disk_bytes": disk_bytes(path) if name != "memory" else 0,
        }
        shutil.rmtree(path, ignore_errors=True)
    return out


# --- crash and recovery -----------------------------------------------------------------


def _writes(trace: Trace) -> list[tuple]:
    return [op for op in trace.ops if op[0] != LOOKUP]


def _crash_child(name: str, path: str, trace: Trace, flush_every: int, acks: str) -> None:
    """Replay the trace's writes, acknowledging each flush; never returns (killed)."""
    index = open_index(name, path, sync_commits=False)
    fd = os.open(acks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, b"READY\n")
    for n, op in enumerate(_writes(trace), 1):
        apply_write(index, op)
        if n % flush_every == 0:
            index.flush()
            os.write(fd, b"ACK %d\n" % n)
    os.write(fd, b"DONE\n")
    time.sleep(120)  # the parent kills it (it missed the stream's end); never flush again
    os._exit(3)


def _acked(acks: Path) -> tuple[int, bool]:
    acked, done = 0, False
    if acks.exists():
        for line in acks.read_text().splitlines(keepends=True):
            if line.startswith("ACK ") and line.endswith("\n"):
                acked = max(acked, int(line[4:]))
            elif line == "DONE\n":
                done = True
    return acked, done


def crash_and_recover(
    name: str,
    directory: str,
    trace: Trace,
    flush_every: int,
    kill_after: float,
    rng: random.Random,
) -> dict:
    """One kill -9 mid-write and the reopen after it (module docstring)."""
    path = os.path.join(directory, "crash")
    copy = os.path.join(directory, "crash-copy")
    acks = Path(directory) / "acks"
    writes = _writes(trace)
    target = int(len(writes) * kill_after)
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_crash_child, args=(name, path, trace, flush_every, str(acks)))
    proc.start()
    try:
        deadline = time.monotonic() + 300
        while _acked(acks)[0] < target:
            if not proc.is_alive():
                raise RuntimeError(f"{name}: the crash child exited {proc.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the crash child acknowledged too little")
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 0.02))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
    acked, done = _acked(acks)
    shutil.copytree(path, copy)
    on_disk = disk_bytes(path)
    # Measured in a child too: this process must never open a backend itself. RocksDB
    # starts process-wide background threads, and a child forked after that (the next
    # run's writer) inherits a thread pool without its threads: its memtable flushes
    # never run and its writes stall.
    measured = in_child(_recover, name, path, copy, writes, acked)
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(copy, ignore_errors=True)
    acks.unlink()
    return {
        "write_ops": len(writes),
        "acked_ops": acked,
        "killed_mid_stream": not done,
        **measured,
        "disk_bytes_at_crash": on_disk,
    }


def _recover(name: str, path: str, copy: str, writes: list[tuple], acked: int) -> dict:
    """Reopen the crashed index (and its copy behind the mirror); compare with the
    state after the `acked` ops (crash_and_recover, in a child)."""
    # The state the acknowledged ops make, and a record of it to locate.
    model = MemoryIndex()
    probe = None
    for op in writes[:acked]:
        apply_write(model, op)
        if op[0] == PUT:
            probe = op[1][-1].key

    began = time.perf_counter()
    index = open_index(name, path)
    index.locate(probe)
    recovery_s = time.perf_counter() - began
    try:
        recovered_records = index.snapshot()
        recovered_state = fingerprint(index)
    finally:
        index.close()

    # records_lost: acknowledged records missing that no later op could have removed.
    recovered = Counter(recovered_records)
    later_removed = set()
    later_cleared = set()
    for op in writes[acked:]:
        if op[0] == REMOVE:
            later_removed.add((op[1], op[2], op[3]))
        elif op[0] == CLEAR:
            later_cleared.add(op[1])
    lost = [
        r
        for r in model.snapshot()
        if r not in recovered
        and r.worker_id not in later_cleared
        and (r.worker_id, r.key.block_hash, r.tier) not in later_removed
    ]
    # Which prefix of the stream the recovered index holds (at least the acknowledged one).
    prefix = None
    for n in range(acked, len(writes) + 1):
        if fingerprint(model) == recovered_state and Counter(model.snapshot()) == recovered:
            prefix = n
            break
        if n < len(writes):
            apply_write(model, writes[n])

    began = time.perf_counter()
    mirrored = open_index(name, copy, mirror=True)
    mirrored.locate(probe)
    conductor_s = time.perf_counter() - began
    mirrored.close()
    return {
        "recovered_records": len(recovered_records),
        "recovered_prefix_ops": prefix,
        "unacked_ops_recovered": None if prefix is None else prefix - acked,
        "records_lost": len(lost),
        "recovery_s": recovery_s,
        "recovery_conductor_s": conductor_s,
    }
