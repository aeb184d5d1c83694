"""The SSD tier of a store node: LMDB, crash-consistent, LRU by byte budget.

Layout. One LMDB environment in the node's data directory with two sub-databases,
both keyed by `blockcodec.storage_key` (32 bytes, the whole identity):

- `blocks`: the record (blockcodec header + payload);
- `meta`: msgpack `[1, identity, payload_len, record_len, checksum, access_seq]`.

Both are written in the same transaction, so after any crash they agree. On open the
tier rebuilds its in-memory index (keys, sizes, checksums, LRU order) from `meta`
alone, without reading payloads, and reconciles it with the keys of `blocks` (a
keys-only scan). Stale reader slots of dead processes are cleared (`reader_check`).

Writes go through one writer thread that commits in groups (`ssd_writer` has how).

- `put(..., durable=True)` (the default) returns only after its transaction has
  committed; concurrent durable puts share a commit.
- `put(..., durable=False)` returns once queued. The block is visible to this tier's
  readers at once (served from the queue) and is committed, synced, within
  `lazy_commit_window_s`, or sooner when it shares a batch with a durable put.
- `delete` is applied the same way (lazily unless `durable=True`).

Access order is tracked in memory and persisted approximately: touched blocks' access
sequence numbers are rewritten in `meta` with the next batch (or every
`touch_flush_interval_s`, and on close).

Eviction. `put` makes room synchronously: it picks the least recently used blocks
until the records fit `capacity_bytes` (header + payload bytes), drops them from the
index and queues their deletion ahead of the new record (same batch), and returns them
as `(key, payload_len)` so the caller can report BlockRemoved.

Reads. `get` checks every record it reads (header, lengths, identity, xxh3 of the
payload). A corrupt record is deleted, counted in `corrupt_blocks` and reported by
raising `CorruptBlock` (a `quillcache_core.errors.Corrupt` carrying `.key`); its bytes
are never returned.

Measured on this machine class: LMDB with writemap=False is 3-5x faster than writemap
for 2 MiB values; readahead stays on (off made cold reads 16x slower); glibc's malloc
is tuned to keep freed memory (see `tune_malloc_for_large_values`), which makes
batched commits of 2 MiB values ~1.7x faster.

Every method is thread-safe.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Iterable

import lmdb

from quillcache_core.errors import CapacityExceeded, InvalidArgument, NodeUnavailable
from quillcache_core.model import KvBlockKey
from quillcache_core.process.malloc import tune_malloc_for_large_values
from quillcache_core.storeclient.blockcodec import (
    CorruptBlock,
    decode_header,
    encode,
    payload_checksum,
    storage_key,
)
from quillcache_store.tiers.ssd_records import MIB, _Meta, _Op, _Prepared
from quillcache_store.tiers.ssd_writer import GroupCommitWriter

log = logging.getLogger(__name__)


class SsdTier(GroupCommitWriter):
    """LMDB-backed block tier. See the module docstring for the guarantees."""

    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int,
        *,
        group_commit_window_s: float = 0.002,
        lazy_commit_window_s: float = 0.05,
        max_batch_ops: int = 256,
        max_batch_bytes: int = 256 * MIB,
        touch_flush_interval_s: float = 5.0,
        map_size: int | None = None,
        readahead: bool = True,
        tune_malloc: bool = True,
    ) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgument(f"SSD capacity must be positive, got {capacity_bytes}")
        self.path = os.fspath(path)
        self._capacity = int(capacity_bytes)
        self._group_window = max(0.0, group_commit_window_s)
        self._lazy_window = max(0.0, lazy_commit_window_s)
        self._max_ops = max(1, max_batch_ops)
        self._max_bytes = max(1, max_batch_bytes)
        self._touch_interval = touch_flush_interval_s
        if tune_malloc:
            tune_malloc_for_large_values()
        os.makedirs(self.path, exist_ok=True)
        if map_size is None:
            # LMDB needs room for copy-on-write pages and free-list slack beyond the data.
            map_size = 2 * self._capacity + 256 * MIB
        self._env = lmdb.open(
            self.path,
            map_size=map_size,
            subdir=True,
            max_dbs=4,
            max_readers=1024,
            writemap=False,
            readahead=readahead,
            sync=True,
            metasync=True,
            lock=True,
        )
        try:
            self._env.reader_check()
        except lmdb.Error:
            pass
        self._blocks = self._env.open_db(b"blocks")
        self._meta_db = self._env.open_db(b"meta")

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._index: collections.OrderedDict[bytes, _Meta] = collections.OrderedDict()
        self._pending: dict[bytes, _Op] = {}
        self._queue: list[_Op] = []
        self._queue_bytes = 0
        self._first_queued_at = 0.0
        self._first_durable_at: float | None = None
        self._touched: set[bytes] = set()
        self._preparing = 0  # puts between their first check and their enqueue
        self._active_reads = 0
        # Threads that made a durable write lately, and those with one in the queue: a
        # group commit waits (within its window) until every recent writer has queued.
        self._recent_writers: dict[int, float] = {}
        self._queued_writers: set[int] = set()
        self._last_touch_flush = time.monotonic()
        self._used = 0
        self._payload_bytes = 0
        self._seq = 0
        self._closed = False
        self._stopping = False
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._corrupt = 0
        self._commits = 0
        self._puts = 0
        self._durable_puts = 0
        self._deletes = 0
        self._bytes_written = 0
        self._failed_commits = 0
        self.evicted_on_open: list[tuple[KvBlockKey, int]] = []
        self._load_index()
        self._writer = threading.Thread(target=self._run, name="ssd-tier-writer", daemon=True)
        self._writer.start()

    # --- open ------------------------------------------------------------------------

    def _load_index(self) -> None:
        metas: dict[bytes, _Meta] = {}
        bad_meta: list[bytes] = []
        missing: list[bytes] = []
        with self._env.begin(buffers=True) as txn:
            with txn.cursor(db=self._meta_db) as cur:
                for sk, raw in cur:
                    sk = bytes(sk)
                    try:
                        metas[sk] = _Meta.unpack(bytes(raw))
                    except Exception:
                        bad_meta.append(sk)
            stored: set[bytes] = set()
            with txn.cursor(db=self._blocks) as cur:
                for sk in cur.iternext(keys=True, values=False):
                    sk = bytes(sk)
                    stored.add(sk)
                    if sk not in metas:
                        missing.append(sk)
            orphans = [sk for sk in metas if sk not in stored]
            rebuilt: dict[bytes, _Meta] = {}
            corrupt: list[bytes] = []
            for sk in missing:
                # Reads the header only: the payload pages are not touched.
                try:
                    header = decode_header(txn.get(sk, db=self._blocks))
                except CorruptBlock:
                    corrupt.append(sk)
                    continue
                if storage_key(header.key) != sk:
                    corrupt.append(sk)
                    continue
                rebuilt[sk] = _Meta(
                    header.key, header.payload_len, header.record_len, header.checksum, 0
                )
        for sk in orphans:
            metas.pop(sk, None)
        metas.update(rebuilt)
        ordered = sorted(metas.items(), key=lambda item: item[1].seq)
        for sk, meta in ordered:
            self._index[sk] = meta
            self._used += meta.record_len
            self._payload_bytes += meta.payload_len
            self._seq = max(self._seq, meta.seq + 1)
        evict: list[bytes] = []
        while self._used > self._capacity and self._index:
            sk, meta = self._index.popitem(last=False)
            self._used -= meta.record_len
            self._payload_bytes -= meta.payload_len
            self.evicted_on_open.append((meta.key, meta.payload_len))
            evict.append(sk)
        if bad_meta or orphans or rebuilt or corrupt or evict:
            log.warning(
                "ssd tier %s: reconciled on open (bad meta %d, orphan meta %d, rebuilt %d, "
                "corrupt %d, evicted over capacity %d)",
                self.path,
                len(bad_meta),
                len(orphans),
                len(rebuilt),
                len(corrupt),
                len(evict),
            )
            self._corrupt += len(corrupt)
            with self._env.begin(write=True) as txn:
                for sk in bad_meta + orphans:
                    if sk not in self._index:
                        txn.delete(sk, db=self._meta_db)
                for sk in corrupt + evict:
                    txn.delete(sk, db=self._blocks)
                    txn.delete(sk, db=self._meta_db)
                for sk, meta in rebuilt.items():
                    if sk in self._index:
                        txn.put(sk, meta.pack(), db=self._meta_db)
            self._commits += 1

    # --- writing ---------------------------------------------------------------------

    def put(
        self,
        key: KvBlockKey,
        payload: bytes | bytearray | memoryview,
        *,
        checksum: int | None = None,
        durable: bool = True,
    ) -> list[tuple[KvBlockKey, int]]:
        """Store a block; returns the blocks evicted to make room, as (key, payload bytes).

        With `durable` (default) it returns after the commit that holds it. Storing the
        same bytes again (same length and checksum) only refreshes the block's recency.
        Raises CapacityExceeded if the record alone exceeds the capacity.
        """
        return self.put_many([(key, payload, checksum)], durable=durable)

    def put_many(
        self,
        items: Iterable[tuple[KvBlockKey, bytes | bytearray | memoryview, int | None]],
        *,
        durable: bool = True,
    ) -> list[tuple[KvBlockKey, int]]:
        """Store several blocks (key, payload, checksum or None) in one batch.

        All records are queued at once, so they share one commit. Returns the evicted
        blocks, as `put` does.
        """
        prepared = [self._prepare(key, payload, digest) for key, payload, digest in items]
        return self._put_prepared(prepared, durable)

    def put_record(
        self,
        key: KvBlockKey,
        record: bytearray,
        header_len: int,
        digest: int,
        *,
        durable: bool = True,
    ) -> list[tuple[KvBlockKey, int]]:
        """Store a block whose payload already sits in `record[header_len:]`, with
        `header_len` = `blockcodec.header_length(key)` bytes reserved in front: the
        header is written in place and `record` itself is queued (no copy of the
        payload). `digest` must be the payload's checksum, already verified by the
        caller. `record` belongs to the tier from here on. Otherwise as `put`."""
        payload = memoryview(record)[header_len:]
        try:
            item = self._prepare(key, payload, digest)
        finally:
            payload.release()
        if len(item.header) != header_len:
            raise InvalidArgument(
                f"record of block {key.block_hash} reserves {header_len} header bytes, "
                f"its header takes {len(item.header)}"
            )
        record[:header_len] = item.header
        item.view = None
        item.record = record
        return self._put_prepared([item], durable)

    def _put_prepared(self, prepared: list[_Prepared], durable: bool):
        waits: list[_Op] = []
        todo: list[_Prepared] = []
        with self._lock:
            self._check_open()
            for item in prepared:
                cur = self._index.get(item.sk)
                if cur is not None and cur.checksum == item.digest and cur.payload_len == item.n:
                    self._touch(item.sk, cur)  # same bytes: only refresh recency
                    pending = self._pending.get(item.sk)
                    if durable and pending is not None:
                        waits.append(pending)
                else:
                    todo.append(item)
            if todo:
                # Announce the puts: a group commit waits for writers that are this far.
                self._preparing += 1
        evicted: list[tuple[KvBlockKey, int]] = []
        if todo:
            try:
                for item in todo:
                    if item.record is None:
                        item.record = b"".join((item.header, item.view))  # the one copy
                    item.view = None
            finally:
                with self._cond:
                    self._preparing -= 1
                    self._cond.notify_all()
            with self._cond:
                self._check_open()
                for item in todo:
                    evicted.extend(self._enqueue_put(item, durable))
                    if durable:
                        waits.append(item.op)
        for op in waits:
            op.wait()
        return evicted

    def _prepare(self, key: KvBlockKey, payload, digest: int | None) -> _Prepared:
        view = memoryview(payload)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n = view.nbytes
        if digest is None:
            digest = payload_checksum(view)
        header = encode(key, view, digest)
        if len(header) + n > self._capacity:
            raise CapacityExceeded(
                f"block of {n} bytes exceeds the SSD tier capacity of {self._capacity} bytes"
            )
        return _Prepared(key, storage_key(key), n, digest, header, view)

    def _enqueue_put(self, item: _Prepared, durable: bool) -> list[tuple[KvBlockKey, int]]:
        """Make room (LRU), index the block and queue its write. Lock held."""
        sk = item.sk
        record_len = len(item.record)
        evicted = []
        cur = self._index.get(sk)
        freed = cur.record_len if cur is not None else 0
        while self._used - freed + record_len > self._capacity:
            victim_sk = next(iter(self._index))
            if victim_sk == sk:
                self._index.move_to_end(sk)
                continue
            victim = self._remove_locked(victim_sk)
            self._enqueue(_Op("delete", victim_sk))
            evicted.append((victim.key, victim.payload_len))
            self._evictions += 1
        if cur is not None:
            self._remove_locked(sk)
        meta = _Meta(item.key, item.n, record_len, item.digest, self._next_seq())
        self._index[sk] = meta
        self._used += record_len
        self._payload_bytes += item.n
        op = _Op("put", sk, item.record, meta, durable)
        item.op = op
        item.record = None
        self._pending[sk] = op
        self._enqueue(op)
        self._puts += 1
        if durable:
            self._durable_puts += 1
        return evicted

    def delete(self, key: KvBlockKey, *, durable: bool = False) -> bool:
        """Remove a block; False if absent. Committed lazily unless `durable`."""
        sk = storage_key(key)
        with self._cond:
            self._check_open()
            if sk not in self._index:
                return False
            self._remove_locked(sk)
            op = _Op("delete", sk, durable=durable)
            self._enqueue(op)
            self._deletes += 1
        if durable:
            op.wait()
        return True

    def flush(self) -> None:
        """Return once everything queued before the call is committed."""
        op = _Op("barrier", b"", durable=True)
        with self._cond:
            self._check_open()
            self._enqueue(op)
        op.wait()

    # --- reading ---------------------------------------------------------------------

    def get(self, key: KvBlockKey) -> tuple[memoryview, int] | None:
        """The verified payload (a view of a private copy) and its checksum, or None.

        Raises CorruptBlock (after deleting and counting the record) if it fails its
        checks.
        """
        sk = storage_key(key)
        with self._lock:
            self._check_open()
            meta = self._index.get(sk)
            if meta is None:
                self._misses += 1
                return None
            self._touch(sk, meta)
            op = self._pending.get(sk)
            record = op.record if op is not None else None
            if record is None:
                self._active_reads += 1  # close() waits for reads of the map to end
        if record is None:
            try:
                with self._env.begin(buffers=True) as txn:
                    buf = txn.get(sk, db=self._blocks)
                    record = bytes(buf) if buf is not None else None
            except lmdb.Error as exc:
                if self._stopping:
                    raise NodeUnavailable(f"SSD tier at {self.path} is closing") from None
                self._drop_corrupt(sk, meta)
                raise CorruptBlock(
                    f"LMDB failed reading block {key.block_hash}: {exc}", key, meta.payload_len
                ) from None
            finally:
                with self._cond:
                    self._active_reads -= 1
                    if not self._active_reads:
                        self._cond.notify_all()
            if record is None:
                # Deleted or evicted since the index lookup.
                with self._lock:
                    self._misses += 1
                return None
        try:
            header = decode_header(record, expected=key)
            payload = memoryview(record)[header.header_len :]
            actual = payload_checksum(payload)
            if actual != header.checksum or actual != meta.checksum:
                raise CorruptBlock(
                    f"payload checksum mismatch for block {key.block_hash}: computed "
                    f"{actual:016x}, record says {header.checksum:016x}, index says "
                    f"{meta.checksum:016x}",
                    key,
                )
        except CorruptBlock as exc:
            self._drop_corrupt(sk, meta)
            raise CorruptBlock(f"corrupt SSD record: {exc}", key, meta.payload_len) from None
        with self._lock:
            self._hits += 1
        return payload, meta.checksum

    def contains(self, key: KvBlockKey) -> bool:
        with self._lock:
            return storage_key(key) in self._index

    def info(self, key: KvBlockKey) -> tuple[int, int] | None:
        """(payload length, checksum) from the index, without reading the record."""
        with self._lock:
            meta = self._index.get(storage_key(key))
            return None if meta is None else (meta.payload_len, meta.checksum)

    def keys(self) -> list[KvBlockKey]:
        """Stored keys, least recently used first (includes queued puts)."""
        with self._lock:
            return [meta.key for meta in self._index.values()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def commit_count(self) -> int:
        with self._lock:
            return self._commits

    def stats(self) -> dict[str, int]:
        with self._lock:
            stats = {
                "capacity": self._capacity,
                "blocks": len(self._index),
                "bytes": self._payload_bytes,
                "stored_bytes": self._used,
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
                "corrupt_blocks": self._corrupt,
                "commits": self._commits,
                "failed_commits": self._failed_commits,
                "puts": self._puts,
                "durable_puts": self._durable_puts,
                "deletes": self._deletes,
                "bytes_written": self._bytes_written,
                "queued_ops": len(self._queue),
            }
        try:
            stats["file_bytes"] = os.path.getsize(os.path.join(self.path, "data.mdb"))
        except OSError:
            stats["file_bytes"] = 0
        return stats

    # --- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        """Commit what is queued (and the access order), stop the writer, close LMDB."""
        with self._cond:
            if self._closed:
                return
            self._stopping = True
            self._cond.notify_all()
        self._writer.join()
        with self._cond:
            while self._active_reads:
                self._cond.wait()
            self._closed = True
        self._env.close()

    def __enter__(self) -> SsdTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed or self._stopping:
            raise NodeUnavailable(f"SSD tier at {self.path} is closed")

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _touch(self, sk: bytes, meta: _Meta) -> None:
        self._index.move_to_end(sk)
        meta.seq = self._next_seq()
        self._touched.add(sk)

    def _remove_locked(self, sk: bytes) -> _Meta:
        meta = self._index.pop(sk)
        self._used -= meta.record_len
        self._payload_bytes -= meta.payload_len
        self._pending.pop(sk, None)
        self._touched.discard(sk)
        return meta

    def _enqueue(self, op: _Op) -> None:
        now = time.monotonic()
        if not self._queue:
            self._first_queued_at = now
        if op.durable:
            if self._first_durable_at is None:
                self._first_durable_at = now
            writer = threading.get_ident()
            self._recent_writers[writer] = now
            self._queued_writers.add(writer)
        self._queue.append(op)
        self._queue_bytes += op.nbytes
        self._cond.notify_all()

    def _drop_corrupt(self, sk: bytes, meta: _Meta) -> None:
        with self._cond:
            self._corrupt += 1
            if self._index.get(sk) is meta and not self._closed and not self._stopping:
                self._remove_locked(sk)
                self._enqueue(_Op("delete", sk))
        log.warning("ssd tier %s: dropped corrupt block %s", self.path, meta.key.block_hash)
