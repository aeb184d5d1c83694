"""A persistent index served from memory: reads never touch the disk.

The conductor's Plan reads 128 hashes per request and its event path writes every
block an engine stores. With the lmdb backend read directly, each located hash is a
B-tree cursor walk plus decoding the record into Python objects, and each write is a
transaction; both sit on the event loop. `MirroredIndex` keeps a `MemoryIndex` copy
that answers every read and applies every write at once, and queues the writes for
the durable backend, which gets them in order, batched, when `flush()` runs (the
conductor flushes once a second, off the event loop). At start the copy is loaded
from the durable backend, so a restarted conductor plans with everything that was
flushed. A crash loses at most the writes since the last flush, as with
`sync_commits=False` before; the durable backend itself stays consistent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from quillcache_core.index.base import Chain, IndexBackend
from quillcache_core.index.memory import MemoryIndex
from quillcache_core.model import (
    CacheResidency,
    IdentityScope,
    IndexMetrics,
    KvBlockKey,
)

logger = logging.getLogger(__name__)


class MirroredIndex(IndexBackend):
    """`durable` behind an in-memory copy; see the module docstring."""

    def __init__(self, durable: IndexBackend) -> None:
        self._durable = durable
        self._memory = MemoryIndex()
        self._memory.put_many(durable.snapshot())
        for worker_id, epoch in durable.worker_epochs().items():
            self._memory.set_worker_epoch(worker_id, epoch)
        # Writes not yet applied to `durable`, in order: (method name, args).
        self._pending: list[tuple[str, tuple]] = []
        self._pending_lock = threading.Lock()
        self._drain_lock = threading.RLock()
        self.failed_writes = 0  # queued writes the durable backend refused (logged)
        self.name = durable.name

    @property
    def persistent(self) -> bool:
        return self._durable.persistent

    @property
    def dirty(self) -> bool:
        return bool(self._pending) or self._durable.dirty

    @property
    def pending_writes(self) -> int:
        return len(self._pending)

    def _queue(self, op: str, *args) -> None:
        with self._pending_lock:
            self._pending.append((op, args))

    # --- writes: memory now, durable at flush ------------------------------------------

    def put(self, residency: CacheResidency) -> None:
        self._memory.put(residency)
        self._queue_puts([residency])

    def put_many(self, residencies: Iterable[CacheResidency]) -> None:
        batch = residencies if isinstance(residencies, list) else list(residencies)
        if not batch:
            return
        self._memory.put_many(batch)
        self._queue_puts(batch)

    def put_chain(self, chain: Chain) -> None:
        """The memory copy's put_chain; `durable` gets the chain at drain, in order with
        the writes around it (one write batch)."""
        if type(chain.block_hashes) is not list:
            chain = chain._replace(block_hashes=list(chain.block_hashes))
        self._memory.put_chain(chain)
        if chain.block_hashes:
            self._queue_puts([chain])

    def _queue_puts(self, batch: list) -> None:
        """Queue records (and put_chain's Chains, which drain expands)."""
        with self._pending_lock:
            pending = self._pending
            if pending and pending[-1][0] == "put_many":
                pending[-1][1][0].extend(batch)  # one transaction for consecutive puts
            else:
                pending.append(("put_many", (list(batch),)))

    def remove_block(self, scope: IdentityScope, worker_id: str, block_hash: str) -> int:
        removed = self._memory.remove_block(scope, worker_id, block_hash)
        if removed:
            self._queue("remove_block", scope, worker_id, block_hash)
        return removed

    def remove_tier(self, worker_id: str, block_hash: str, tier: object) -> int:
        removed = self._memory.remove_tier(worker_id, block_hash, tier)
        if removed:
            self._queue("remove_tier", worker_id, block_hash, tier)
        return removed

    def clear_worker(self, worker_id: str) -> int:
        removed = self._memory.clear_worker(worker_id)
        self._queue("clear_worker", worker_id)
        return removed

    def clear(self) -> None:
        self._memory.clear()
        with self._pending_lock:
            self._pending = [("clear", ())]  # earlier writes are moot

    # --- reads: memory only ------------------------------------------------------------

    def locate(self, key: KvBlockKey) -> list[CacheResidency]:
        return self._memory.locate(key)

    def locate_hash(self, block_hash: str) -> list[CacheResidency]:
        return self._memory.locate_hash(block_hash)

    def locate_hashes(self, block_hashes) -> list[list[CacheResidency]]:
        return self._memory.locate_hashes(block_hashes)

    def locate_prefix(self, block_hashes, extra=None) -> list[list[CacheResidency]]:
        return self._memory.locate_prefix(block_hashes, extra)

    def prefix_scan(self, scope: IdentityScope, prefix_hash: str) -> list[CacheResidency]:
        return self._memory.prefix_scan(scope, prefix_hash)

    def snapshot(self) -> list[CacheResidency]:
        return self._memory.snapshot()

    def __len__(self) -> int:
        return len(self._memory)

    def worker_block_count(self, worker_id: str) -> int:
        return self._memory.worker_block_count(worker_id)

    def workers(self) -> list[str]:
        return self._memory.workers()

    def worker_epochs(self) -> dict[str, float]:
        return self._memory.worker_epochs()

    def set_worker_epoch(self, worker_id: str, epoch: float) -> None:
        self._memory.set_worker_epoch(worker_id, epoch)
        self._queue("set_worker_epoch", worker_id, epoch)

    def metrics(self) -> IndexMetrics:
        return self._memory.metrics()

    # --- durability --------------------------------------------------------------------

    def drain(self) -> int:
        """Apply the queued writes to the durable backend, in order; returns how many.

        Safe to call from another thread while the owner keeps writing: the queue is
        swapped under a lock and only the draining thread touches the durable backend.
        """
        with self._drain_lock:
            with self._pending_lock:
                ops, self._pending = self._pending, []
            ops = _calls(ops)
            durable = self._durable
            try:  # the whole queue as one write (one LMDB transaction: all or none)
                with durable.write_batch():
                    for op, args in ops:
                        getattr(durable, op)(*args)
                return len(ops)
            except Exception:  # a write the backend refused: again one at a time
                logger.warning(
                    "a batch of %d index writes failed; applying them one by one", len(ops)
                )
            for op, args in ops:
                try:
                    getattr(durable, op)(*args)
                except Exception:  # one write that cannot be stored must not lose the rest
                    if op == "put_many":  # its transaction wrote nothing: put them one by one
                        self._put_each(args[0])
                    elif op == "put_chain":
                        self._put_each(args[0].records())
                    else:
                        self.failed_writes += 1
                        logger.exception("index write %s could not reach the durable backend", op)
            return len(ops)

    def _put_each(self, records: list[CacheResidency]) -> None:
        for record in records:
            try:
                self._durable.put(record)
            except Exception:
                self.failed_writes += 1
                logger.exception("index record %s could not reach the durable backend", record)

    def flush(self) -> None:
        """Apply every queued write and make it durable."""
        with self._drain_lock:
            self.drain()
            self._durable.flush()

    def close(self) -> None:
        self.flush()
        self._durable.close()


def _calls(ops: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """The queued writes as the durable backend's calls, in order: each queued put_many
    split into a put_many per run of records and a put_chain per Chain. The durable
    backend gets a Chain as one (JournaledIndex: one compact frame, never its records;
    others: put_many of its records, as before)."""
    calls: list[tuple[str, tuple]] = []
    for op, args in ops:
        if op != "put_many":
            calls.append((op, args))
            continue
        records: list[CacheResidency] = []
        for item in args[0]:
            if type(item) is Chain:  # (a record is a CacheResidency)
                if records:
                    calls.append(("put_many", (records,)))
                    records = []
                calls.append(("put_chain", (item,)))
            else:
                records.append(item)
        if records:
            calls.append(("put_many", (records,)))
    return calls
