"""Filesystem residency index: an in-memory index made durable by a journal and snapshots.

`JournaledIndex` serves every read from an in-memory index (its *state*) and appends
every change to an append-only log; periodic snapshots (compaction) bound the log, so a
reopen loads the newest snapshot and replays the log written since. `FsIndex` is the
journal over a `MemoryIndex` (the "fs" backend); `ArtIndex` (art_index.py) is the same
journal over an adaptive radix tree. Both share this on-disk format.

On-disk layout (the directory at `path`):

- ``FORMAT``: ``quillcache-index-journal/1``; written once, by tmp + rename.
- ``LOCK``: flock'd while open, so two processes never write one journal.
- ``snapshot-<gen>.qcs`` (``<gen>`` 8 decimal digits; none for generation 0): the whole
  state when generation ``gen`` began. Frames: ``[SNAP_BEGIN, gen]``, one ``EPOCH`` per
  worker epoch, ``PUT`` frames of up to 4096 records, ``[SNAP_END, records]``. Written
  to ``.tmp``, fdatasync'd, renamed in, directory fsync'd; loaded strictly (Corrupt on
  any damage: a renamed snapshot was whole).
- ``log-<gen>.qcl``: the changes since that snapshot, one frame per call (put_many and
  put_chain are one frame each, so a call is replayed whole or not at all).

A frame is ``u32 length | u32 crc32(length field + payload) | payload`` (little-endian),
the payload a msgpack array ``[op, args...]``: ``PUT [rows]`` (a row is the 8 key fields,
worker, tier value, bytes, last_access_ms, ref_count, pinned), ``CHAIN`` (a Chain's
fields, not its expanded records), ``REMOVE_BLOCK``, ``REMOVE_TIER``, ``CLEAR_WORKER``,
``CLEAR``, ``EPOCH``. Ops are logical and deterministic, so replay rebuilds exactly the
state that wrote them. Recovery reads log frames up to the first one that is cut short
or fails its checksum (a write the crash tore, never acknowledged), truncates the log
there and drops the rest, with a warning. Damage in the middle of a log (bit rot, not a
crash) looks the same and loses the frames after it too: residency is a routing hint
the engines' events rebuild, so serving beats refusing to open.

Acknowledged (durable): with `sync_commits` (the default, as LmdbIndex) every write
method appends its frame and fdatasyncs before returning. Without it frames are buffered
in the process (written to the file without fsync past `write_buffer_bytes`), and a
write is acknowledged once a later `flush()` returns; a crash loses at most the writes
since, and a reopen returns the state after some prefix of the calls (never a torn or
partial call). Compaction runs at flush (or at each synced write) once the log exceeds
max(`compact_bytes`, the last snapshot's size), so snapshots write at most about twice
what the log does.

`bytes_written` counts every byte this process hands to write(2) for the journal
(frames, snapshots, the format tag): what the file system is asked to store, not its
block-granular writes.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import struct
import zlib
from collections.abc import Iterable

import msgpack

from quillcache_core.errors import Corrupt, InvalidArgument
from quillcache_core.index.base import Chain, IndexBackend
from quillcache_core.index.memory import MemoryIndex
from quillcache_core.model import (
    CacheResidency,
    CacheTier,
    IdentityScope,
    IndexMetrics,
    KvBlockKey,
)

logger = logging.getLogger(__name__)

FORMAT = b"quillcache-index-journal/1\n"
_FRAME = struct.Struct("<II")  # payload length, crc32 over (length field + payload)
_LEN = struct.Struct("<I")
_MAX_FRAME = 1 << 30
_SNAP_CHUNK = 4096  # records per snapshot PUT frame
_TIERS = {tier.value: tier for tier in CacheTier}
_SNAPSHOT_RE = re.compile(r"snapshot-(\d{8})\.qcs")
_LOG_RE = re.compile(r"log-(\d{8})\.qcl")

# Journal ops (the first element of a frame's payload).
PUT, CHAIN, REMOVE_BLOCK, REMOVE_TIER, CLEAR_WORKER, CLEAR, EPOCH, SNAP_BEGIN, SNAP_END = range(
    1, 10
)


def frame(payload: bytes) -> bytes:
    """One journal frame around `payload`."""
    length = _LEN.pack(len(payload))
    return length + _LEN.pack(zlib.crc32(payload, zlib.crc32(length))) + payload


def read_frames(data: bytes) -> tuple[list[memoryview], int, str | None]:
    """The whole frames at the start of `data`, the offset just past the last of them,
    and why reading stopped before the end (None when every byte was a good frame)."""
    view = memoryview(data)
    frames: list[memoryview] = []
    pos, end = 0, len(data)
    unpack = _FRAME.unpack_from
    crc32 = zlib.crc32
    while pos < end:
        if end - pos < _FRAME.size:
            return frames, pos, "a frame header cut short"
        length, crc = unpack(view, pos)
        stop = pos + _FRAME.size + length
        if not 0 < length <= _MAX_FRAME:
            return frames, pos, f"a frame length of {length}"
        if stop > end:
            return frames, pos, "a frame cut short"
        payload = view[pos + _FRAME.size : stop]
        if crc32(payload, crc32(view[pos : pos + 4])) != crc:
            return frames, pos, "a frame failing its checksum"
        frames.append(payload)
        pos = stop
    return frames, pos, None


def record_row(r: CacheResidency) -> tuple:
    """A record as a journal row (msgpack-able, all fields flat)."""
    return (*r.key, r.worker_id, r.tier._value_, r.bytes, r.last_access_ms, r.ref_count, r.pinned)


def row_record(row: list) -> CacheResidency:
    try:
        tier = _TIERS[row[9]]
    except (KeyError, IndexError):
        raise Corrupt(f"journal record with a bad tier: {row!r}") from None
    return CacheResidency(
        KvBlockKey(*row[:8]), row[8], tier, row[10], row[11], row[12], bool(row[13])
    )


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> int:
    view = memoryview(data)
    total = len(view)
    done = 0
    while done < total:
        done += os.write(fd, view[done:])
    return total


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Closed:
    """Stands in for a closed index's state: every use raises InvalidArgument."""

    def __init__(self, what: str) -> None:
        self._what = what

    def __getattr__(self, name: str):
        raise InvalidArgument(f"{self._what} is closed")

    def __len__(self) -> int:
        raise InvalidArgument(f"{self._what} is closed")


class JournaledIndex(IndexBackend):
    """`state` (an in-memory IndexBackend) made durable in the directory `path`.

    See the module docstring for the format and what a write's acknowledgement means.
    Not thread-safe, like every backend: behind MirroredIndex (open_index's `mirror`)
    flush() may run on another thread than the writes. `dropped_tail_bytes` tells how
    many torn bytes the last recovery cut from the log; `compactions` counts this
    process's snapshots.
    """

    name = "journal"

    def __init__(
        self,
        path: str | os.PathLike[str],
        state: IndexBackend,
        *,
        sync_commits: bool = True,
        compact_bytes: int = 16 << 20,
        write_buffer_bytes: int = 1 << 20,
    ) -> None:
        self._dir = os.fspath(path)
        self._sync = sync_commits
        self._compact_bytes = compact_bytes
        self._buffer_bytes = write_buffer_bytes
        self._pending = bytearray()  # frames not yet handed to write(2)
        self._unsynced = True  # frames written since the last fdatasync (or not known)
        self._pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack
        self._puts = self._removes = self._prefix_scans = 0
        self._bytes_written = 0
        self.compactions = 0
        self.dropped_tail_bytes = 0
        self._fd = -1
        os.makedirs(self._dir, exist_ok=True)
        self._lock_fd = os.open(os.path.join(self._dir, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise InvalidArgument(f"index journal {self._dir} is open elsewhere") from None
        try:
            self._state: IndexBackend = state
            self._recover()
        except BaseException:
            if self._fd >= 0:
                os.close(self._fd)
            os.close(self._lock_fd)
            raise

    @property
    def persistent(self) -> bool:
        return True

    @property
    def path(self) -> str:
        return self._dir

    # --- recovery ----------------------------------------------------------------------

    def _file(self, kind: str, gen: int) -> str:
        suffix = "qcs" if kind == "snapshot" else "qcl"
        return os.path.join(self._dir, f"{kind}-{gen:08d}.{suffix}")

    def _recover(self) -> None:
        names = os.listdir(self._dir)
        snaps = {int(m[1]) for n in names if (m := _SNAPSHOT_RE.fullmatch(n))}
        logs = {int(m[1]) for n in names if (m := _LOG_RE.fullmatch(n))}
        format_path = os.path.join(self._dir, "FORMAT")
        if "FORMAT" in names:
            with open(format_path, "rb") as f:
                found = f.read()
            if found != FORMAT:
                raise Corrupt(f"{self._dir}: unsupported index journal format {found!r}")
        else:
            if snaps or logs:
                raise Corrupt(f"{self._dir}: index journal files without a format tag")
            tmp = format_path + ".tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                self._bytes_written += _write_all(fd, FORMAT)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, format_path)
            _fsync_dir(self._dir)
        gen = max(snaps, default=0)
        if logs and max(logs) > gen:
            raise Corrupt(f"{self._dir}: log generation {max(logs)} has no snapshot")
        self._snapshot_bytes = self._load_snapshot(gen) if gen else 0
        log_path = self._file("log", gen)
        good = 0
        if gen in logs:
            with open(log_path, "rb") as f:
                data = f.read()
            frames, good, why = read_frames(data)
            for payload in frames:
                self._apply(payload)
            if why is not None:
                self.dropped_tail_bytes = len(data) - good
                logger.warning(
                    "index journal %s: dropped %d bytes from offset %d (%s): writes a crash "
                    "cut before they were acknowledged",
                    log_path,
                    self.dropped_tail_bytes,
                    good,
                    why,
                )
                with open(log_path, "r+b") as f:
                    f.truncate(good)
                    os.fsync(f.fileno())
        self._fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if gen not in logs:
            _fsync_dir(self._dir)
        self._gen = gen
        self._log_bytes = good
        # Leftovers of an interrupted compaction or of generations a snapshot replaced.
        for name in names:
            m = _SNAPSHOT_RE.fullmatch(name) or _LOG_RE.fullmatch(name)
            if (m and int(m[1]) != gen) or name.endswith(".tmp"):
                try:
                    os.unlink(os.path.join(self._dir, name))
                except FileNotFoundError:
                    pass

    def _load_snapshot(self, gen: int) -> int:
        path = self._file("snapshot", gen)
        with open(path, "rb") as f:
            data = f.read()
        frames, _, why = read_frames(data)
        if why is not None or len(frames) < 2:
            raise Corrupt(f"{path}: damaged snapshot ({why or 'too short'})")
        head, tail = msgpack.unpackb(frames[0]), msgpack.unpackb(frames[-1])
        if head != [SNAP_BEGIN, gen] or tail[:1] != [SNAP_END]:
            raise Corrupt(f"{path}: not a whole snapshot of generation {gen}")
        for payload in frames[1:-1]:
            self._apply(payload)
        if len(self._state) != tail[1]:
            raise Corrupt(f"{path}: snapshot holds {len(self._state)} records, says {tail[1]}")
        return len(data)

    def _apply(self, payload: memoryview) -> None:
        """Replay one journal op onto the state."""
        try:
            self._dispatch(msgpack.unpackb(payload))
        except Corrupt:
            raise
        except Exception as exc:  # a frame that passed its checksum: real corruption
            raise Corrupt(f"{self._dir}: journal frame that cannot be replayed: {exc!r}") from None

    def _dispatch(self, op: list) -> None:
        code = op[0]
        state = self._state
        if code == PUT:
            state.put_many([row_record(row) for row in op[1]])
        elif code == CHAIN:
            _, scope, parent, hashes, first, tokens, worker, tier, nbytes, stamp = op
            state.put_chain(
                Chain(
                    tuple(scope), parent, hashes, first, tokens, worker, _TIERS[tier], nbytes, stamp
                )
            )
        elif code == REMOVE_BLOCK:
            state.remove_block(IdentityScope(*op[1]), op[2], op[3])
        elif code == REMOVE_TIER:
            state.remove_tier(op[1], op[2], op[3])
        elif code == CLEAR_WORKER:
            state.clear_worker(op[1])
        elif code == CLEAR:
            state.clear()
        elif code == EPOCH:
            state.set_worker_epoch(op[1], op[2])
        else:
            raise Corrupt(f"{self._dir}: unknown journal op {code!r}")

    # --- the journal -------------------------------------------------------------------

    def _log(self, op: tuple) -> None:
        """Append one op's frame; durable before return with sync_commits."""
        self._pending += frame(self._pack(op))
        if self._sync:
            self._write_out(sync=True)
            self._maybe_compact()
        elif len(self._pending) >= self._buffer_bytes:
            self._write_out(sync=False)

    def _write_out(self, *, sync: bool) -> None:
        if self._fd < 0:
            raise InvalidArgument(f"index journal {self._dir} is closed")
        if self._pending:
            try:
                written = _write_all(self._fd, self._pending)
            except OSError:
                # Leave no partial frame for later frames to follow: recovery would stop at it.
                os.ftruncate(self._fd, self._log_bytes)
                raise
            self._bytes_written += written
            self._log_bytes += written
            self._pending.clear()
            self._unsynced = True
        if sync and self._unsynced:
            os.fdatasync(self._fd)
            self._unsynced = False

    def _maybe_compact(self) -> None:
        if self._log_bytes >= max(self._compact_bytes, self._snapshot_bytes):
            self.compact()

    def compact(self) -> None:
        """Write a snapshot of the whole state and start a new, empty log.

        Everything written so far is durable when this returns.
        """
        self._write_out(sync=False)  # the old log stays whole if the snapshot fails
        gen = self._gen + 1
        final = self._file("snapshot", gen)
        tmp = final + ".tmp"
        records = self._state.snapshot()
        pack = self._pack
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            out = bytearray(frame(pack((SNAP_BEGIN, gen))))
            for worker_id, epoch in sorted(self._state.worker_epochs().items()):
                out += frame(pack((EPOCH, worker_id, epoch)))
            size = 0
            for start in range(0, len(records), _SNAP_CHUNK):
                rows = [record_row(r) for r in records[start : start + _SNAP_CHUNK]]
                out += frame(pack((PUT, rows)))
                if len(out) >= 1 << 20:
                    size += _write_all(fd, out)
                    out.clear()
            out += frame(pack((SNAP_END, len(records))))
            size += _write_all(fd, out)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        self._bytes_written += size
        os.replace(tmp, final)
        new_fd = os.open(
            self._file("log", gen), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644
        )
        _fsync_dir(self._dir)
        old_gen, old_fd = self._gen, self._fd
        self._fd, self._gen, self._log_bytes, self._snapshot_bytes = new_fd, gen, 0, size
        self._unsynced = False
        os.close(old_fd)
        for stale in (self._file("snapshot", old_gen), self._file("log", old_gen)):
            try:
                os.unlink(stale)
            except FileNotFoundError:
                pass
        self.compactions += 1

    # --- writes: the state now, the journal before return (or at flush) ----------------

    def put(self, residency: CacheResidency) -> None:
        self.put_many((residency,))

    def put_many(self, residencies: Iterable[CacheResidency]) -> None:
        """Put several records as one journal frame: a crash keeps all or none."""
        batch = list(residencies)
        if not batch:
            return
        rows = [record_row(r) for r in batch]  # raises, changing nothing, on a bad record
        self._state.put_many(batch)
        self._puts += len(batch)
        self._log((PUT, rows))

    def put_chain(self, chain: Chain) -> None:
        """The state's put_chain; the journal gets the Chain, not its records."""
        hashes = list(chain.block_hashes)
        if not hashes:
            return
        chain = chain._replace(block_hashes=hashes)
        op = (CHAIN, tuple(chain.scope), chain.parent, hashes, chain.first_index)
        op += (chain.token_count, chain.worker_id, chain.tier._value_, chain.nbytes)
        self._state.put_chain(chain)
        self._puts += len(hashes)
        self._log((*op, chain.last_access_ms))

    def remove_block(self, scope: IdentityScope, worker_id: str, block_hash: str) -> int:
        removed = self._state.remove_block(scope, worker_id, block_hash)
        if removed:
            self._removes += removed
            fields = (scope.model_id, scope.tokenizer_id, scope.adapter_id, scope.tenant_id)
            self._log((REMOVE_BLOCK, fields, worker_id, block_hash))
        return removed

    def remove_tier(self, worker_id: str, block_hash: str, tier: object) -> int:
        value = (tier if isinstance(tier, CacheTier) else CacheTier.parse(str(tier))).value
        removed = self._state.remove_tier(worker_id, block_hash, value)
        if removed:
            self._removes += removed
            self._log((REMOVE_TIER, worker_id, block_hash, value))
        return removed

    def clear_worker(self, worker_id: str) -> int:
        removed = self._state.clear_worker(worker_id)
        if removed:
            self._removes += removed
            self._log((CLEAR_WORKER, worker_id))
        return removed

    def clear(self) -> None:
        removed = len(self._state)
        self._state.clear()
        self._removes += removed
        self._log((CLEAR,))

    def set_worker_epoch(self, worker_id: str, epoch: float) -> None:
        epoch = float(epoch)
        self._state.set_worker_epoch(worker_id, epoch)
        self._log((EPOCH, worker_id, epoch))

    # --- reads: the state --------------------------------------------------------------

    def locate(self, key: KvBlockKey) -> list[CacheResidency]:
        return self._state.locate(key)

    def locate_hash(self, block_hash: str) -> list[CacheResidency]:
        return self._state.locate_hash(block_hash)

    def locate_hashes(self, block_hashes) -> list[list[CacheResidency]]:
        return self._state.locate_hashes(block_hashes)

    def locate_prefix(self, block_hashes, extra=None) -> list[list[CacheResidency]]:
        return self._state.locate_prefix(block_hashes, extra)

    def prefix_scan(self, scope: IdentityScope, prefix_hash: str) -> list[CacheResidency]:
        found = self._state.prefix_scan(scope, prefix_hash)
        self._prefix_scans += 1
        return found

    def snapshot(self) -> list[CacheResidency]:
        return self._state.snapshot()

    def __len__(self) -> int:
        return len(self._state)

    def worker_block_count(self, worker_id: str) -> int:
        return self._state.worker_block_count(worker_id)

    def workers(self) -> list[str]:
        return self._state.workers()

    def worker_epochs(self) -> dict[str, float]:
        return self._state.worker_epochs()

    def metrics(self) -> IndexMetrics:
        """Resident totals from the state; puts, removes, prefix_scans and bytes_written
        count this process's calls (as LmdbIndex)."""
        m = self._state.metrics()
        return IndexMetrics(
            resident_blocks=m.resident_blocks,
            resident_bytes=m.resident_bytes,
            puts=self._puts,
            removes=self._removes,
            prefix_scans=self._prefix_scans,
            bytes_written=self._bytes_written,
        )

    # --- durability --------------------------------------------------------------------

    @property
    def dirty(self) -> bool:
        return self._fd >= 0 and bool(self._pending or self._unsynced)

    def flush(self) -> None:
        """Write and fdatasync every buffered frame (compacting if the log is due);
        every write so far is acknowledged when this returns. A no-op once closed, and
        no fdatasync when nothing was written since the last."""
        if self._fd >= 0:
            self._write_out(sync=True)
            self._maybe_compact()

    def close(self) -> None:
        """Flush, release the files and drop the state; later calls raise
        InvalidArgument. Idempotent."""
        if self._fd < 0:
            return
        try:
            self.flush()
        finally:
            os.close(self._fd)
            self._fd = -1
            os.close(self._lock_fd)
            self._state = _Closed(f"index at {self._dir}")  # type: ignore[assignment]


class FsIndex(JournaledIndex):
    """The "fs" backend: a MemoryIndex made durable by the journal (module docstring)."""

    name = "fs"

    def __init__(self, path: str | os.PathLike[str], **options) -> None:
        super().__init__(path, MemoryIndex(), **options)
