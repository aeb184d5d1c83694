"""Persistent residency index on LMDB: survives a restart of the process that owns it.

Layout (four named databases in one environment):

- ``rec``: one entry per residency record. Key: a msgpack array of 10 elements,
  ``[block_hash, model_id, tokenizer_id, adapter_id, tenant_id, prefix_hash,
  block_index, token_count, worker_id, tier]``, written as the fixarray header followed
  by each element packed on its own. msgpack items are self-delimiting, so the
  encoding of the first n elements is a byte prefix of the whole key: locate_hash
  range-scans the 1-element prefix and locate the 8-element prefix, and the whole key
  still decodes with one ``msgpack.unpackb``. Value: ``[bytes, last_access_ms,
  ref_count, pinned]``.
- ``prefix`` (dupsort): packed ``(model_id, tokenizer_id, adapter_id, tenant_id,
  prefix_hash)`` -> the ``rec`` keys under it, for prefix_scan.
- ``worker`` (dupsort): packed worker_id -> the ``rec`` keys it holds, for
  clear_worker; mdb_cursor_count makes worker_block_count O(1).
- ``meta``: the format tag and ``resident_bytes``, rewritten in the same transaction
  as the records it sums, so it is right after a reopen or a crash.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import lmdb
import msgpack

from quillcache_core.errors import Corrupt, InvalidArgument
from quillcache_core.index.base import IndexBackend
from quillcache_core.index.codec import (
    REC_HEADER,
    decode_record,
    key_prefix,
    scope_prefix,
    unpackb,
)
from quillcache_core.model import (
    CacheResidency,
    CacheTier,
    IdentityScope,
    IndexMetrics,
    KvBlockKey,
)

_FORMAT = b"quillcache-index/1"
_META_FORMAT = b"format"
_META_BYTES = b"resident_bytes"
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")


class _Shared:
    """A write call's `with` over the batch's transaction: neither commits nor aborts it
    (the batch does; an exception still propagates and aborts the whole batch)."""

    __slots__ = ("_txn",)

    def __init__(self, txn: lmdb.Transaction) -> None:
        self._txn = txn

    def __enter__(self) -> lmdb.Transaction:
        return self._txn

    def __exit__(self, *exc: object) -> bool:
        return False


def _tier_value(tier: object) -> str:
    return (tier if isinstance(tier, CacheTier) else CacheTier.parse(str(tier))).value


class LmdbIndex(IndexBackend):
    """A residency index stored in an LMDB environment directory at `path`.

    Every write method is one write transaction; put_many commits all of its records
    together. With `sync_commits` (the default) a record is durable once the call
    returns. Without it, commits are not fsynced: `flush()` makes everything so far
    durable (the conductor calls it every second), and a crash loses at most the
    commits since, never the database's consistency. Residency is a routing hint
    the engines' events rebuild, so the conductor trades that second for a Plan that
    does not wait on the disk. Reopening the same path gives back the same records, len() and
    resident_bytes. puts, removes, prefix_scans and bytes_written count this
    process's calls only. Costs match MemoryIndex with a B-tree lookup in place of
    each hash lookup; only snapshot() reads every record.
    """

    name = "lmdb"

    def __init__(
        self,
        path: str | os.PathLike[str],
        map_size_bytes: int = 8 << 30,
        *,
        sync_commits: bool = True,
    ) -> None:
        self._path = os.fspath(path)
        self._env = lmdb.open(
            self._path,
            map_size=map_size_bytes,
            subdir=True,
            max_dbs=5,
            writemap=False,
            readahead=True,
            sync=sync_commits,
            metasync=sync_commits,
        )
        self._closed = False
        self._batch: lmdb.Transaction | None = None  # write_batch's transaction
        try:
            self._rec = self._env.open_db(b"rec")
            self._prefix = self._env.open_db(b"prefix", dupsort=True)
            self._worker = self._env.open_db(b"worker", dupsort=True)
            self._meta = self._env.open_db(b"meta")
            self._epoch = self._env.open_db(b"epoch")  # packed worker_id -> f64
            with self._env.begin(write=True) as txn:
                found = txn.get(_META_FORMAT, db=self._meta)
                if found is None:
                    if txn.stat(self._rec)["entries"]:
                        raise Corrupt(f"{self._path}: index records without a format tag")
                    txn.put(_META_FORMAT, _FORMAT, db=self._meta)
                    txn.put(_META_BYTES, _I64.pack(0), db=self._meta)
                elif found != _FORMAT:
                    raise Corrupt(f"{self._path}: unsupported index format {found!r}")
        except BaseException:
            self._env.close()
            self._closed = True
            raise
        self._max_key = self._env.max_key_size()
        # One packer per index: Packer.pack is several times cheaper than packb, and
        # a packer shared across instances would race if they live on two threads.
        self._pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack
        self._puts = 0
        self._removes = 0
        self._prefix_scans = 0
        self._bytes_written = 0

    @property
    def persistent(self) -> bool:
        return True

    @property
    def path(self) -> str:
        return self._path

    # --- encoding ----------------------------------------------------------------------

    def _key_prefix(self, key: KvBlockKey) -> bytes:
        """The `rec` key prefix shared by every record of `key`."""
        return key_prefix(self._pack, key)

    def _scope_prefix(
        self, model_id: str, tokenizer_id: str, adapter_id: str | None, tenant_id: str, parent: str
    ) -> bytes:
        return scope_prefix(self._pack, model_id, tokenizer_id, adapter_id, tenant_id, parent)

    _decode = staticmethod(decode_record)

    # --- transactions ------------------------------------------------------------------

    def _read(self) -> lmdb.Transaction:
        if self._closed:
            raise InvalidArgument(f"lmdb index at {self._path} is closed")
        return self._env.begin()

    def _write(self) -> lmdb.Transaction | _Shared:
        if self._closed:
            raise InvalidArgument(f"lmdb index at {self._path} is closed")
        if self._batch is not None:
            return _Shared(self._batch)
        return self._env.begin(write=True)

    @contextmanager
    def write_batch(self) -> Iterator[None]:
        """Every write inside is ONE transaction: committed at the end, aborted (nothing
        written) if anything inside raises. A copy-on-write B-tree pays its page copies
        and commit once per batch instead of once per call: the conductor's mirror
        drains a second of evictions and puts so."""
        if self._batch is not None:  # nested: the outer batch's transaction
            yield
            return
        with self._write() as txn:
            self._batch = txn
            try:
                yield
            finally:
                self._batch = None

    def _add_resident_bytes(self, txn: lmdb.Transaction, delta: int) -> int:
        """Add `delta` to the stored total inside `txn`; returns bytes written."""
        if not delta:
            return 0
        (total,) = _I64.unpack(txn.get(_META_BYTES, db=self._meta))
        txn.put(_META_BYTES, _I64.pack(total + delta), db=self._meta)
        return len(_META_BYTES) + _I64.size

    # --- writes ------------------------------------------------------------------------

    def put(self, residency: CacheResidency) -> None:
        """Store one copy durably, replacing the record for the same (key, worker, tier)."""
        self.put_many((residency,))

    def put_many(self, residencies: Iterable[CacheResidency]) -> None:
        """Put several records in ONE write transaction: all are stored or none is.

        Applied in order, so a later record replaces an earlier one for the same
        (key, worker, tier). Raises InvalidArgument, storing nothing, for a record
        whose encoded identity exceeds LMDB's key size limit.
        """
        pack = self._pack
        count = 0
        delta = 0
        written = 0
        with self._write() as txn:
            for residency in residencies:
                key = residency.key
                worker = pack(residency.worker_id)
                rec_key = self._key_prefix(key) + worker + pack(residency.tier.value)
                scope_key = self._scope_prefix(
                    key.model_id, key.tokenizer_id, key.adapter_id, key.tenant_id, key.prefix_hash
                )
                if len(rec_key) > self._max_key or len(scope_key) > self._max_key:
                    raise InvalidArgument(
                        f"block identity too long for the lmdb index ({len(rec_key)} bytes "
                        f"encoded, limit {self._max_key}): {key!r} on {residency.worker_id!r}"
                    )
                value = pack(
                    (
                        residency.bytes,
                        residency.last_access_ms,
                        residency.ref_count,
                        residency.pinned,
                    )
                )
                old = txn.get(rec_key, db=self._rec)
                txn.put(rec_key, value, db=self._rec)
                written += len(rec_key) + len(value)
                if old is None:
                    txn.put(scope_key, rec_key, db=self._prefix)
                    txn.put(worker, rec_key, db=self._worker)
                    written += len(scope_key) + len(worker) + 2 * len(rec_key)
                    delta += residency.bytes
                else:
                    delta += residency.bytes - unpackb(old)[0]
                count += 1
            written += self._add_resident_bytes(txn, delta)
        self._puts += count
        self._bytes_written += written

    def _remove_matching(self, block_hash: str, keep: Callable[[list], bool]) -> int:
        """Delete the records under `block_hash` for which `keep(fields)` is false."""
        prefix = REC_HEADER + self._pack(block_hash)
        with self._write() as txn:
            victims: list[tuple[bytes, list, int]] = []
            cursor = txn.cursor(db=self._rec)
            if cursor.set_range(prefix):
                for rec_key, value in cursor:
                    if not rec_key.startswith(prefix):
                        break
                    fields = unpackb(rec_key)
                    if not keep(fields):
                        victims.append((rec_key, fields, unpackb(value)[0]))
            if not victims:
                return 0
            written = 0
            delta = 0
            for rec_key, f, nbytes in victims:
                written += self._delete_record(txn, rec_key, f, worker=True)
                delta -= nbytes
            written += self._add_resident_bytes(txn, delta)
        self._removes += len(victims)
        self._bytes_written += written
        return len(victims)

    def _delete_record(self, txn: lmdb.Transaction, rec_key: bytes, f: list, worker: bool) -> int:
        """Delete one record and its index entries (the worker's too if `worker`).

        Returns the tombstone bytes written (keys, and the dup values that name them).
        """
        scope_key = self._scope_prefix(f[1], f[2], f[3], f[4], f[5])
        txn.delete(rec_key, db=self._rec)
        txn.delete(scope_key, rec_key, db=self._prefix)
        written = len(rec_key) + len(scope_key) + len(rec_key)
        if worker:
            worker_key = self._pack(f[8])
            txn.delete(worker_key, rec_key, db=self._worker)
            written += len(worker_key) + len(rec_key)
        return written

    def remove_block(self, scope: IdentityScope, worker_id: str, block_hash: str) -> int:
        """Remove every tier of this block that `worker_id` holds under `scope`.

        Returns the number of records removed.
        """
        want = [scope.model_id, scope.tokenizer_id, scope.adapter_id, scope.tenant_id]
        return self._remove_matching(block_hash, lambda f: f[8] != worker_id or f[1:5] != want)

    def remove_tier(self, worker_id: str, block_hash: str, tier: object) -> int:
        """Remove `worker_id`'s copy on `tier` of every key with this hash, any identity.

        `tier` is a CacheTier or a name CacheTier.parse accepts. Returns records removed.
        """
        value = _tier_value(tier)
        return self._remove_matching(block_hash, lambda f: f[8] != worker_id or f[9] != value)

    def clear_worker(self, worker_id: str) -> int:
        """Drop every record `worker_id` holds, in one transaction; returns how many."""
        worker_key = self._pack(worker_id)
        with self._write() as txn:
            cursor = txn.cursor(db=self._worker)
            if not cursor.set_key(worker_key):
                return 0
            rec_keys = list(cursor.iternext_dup())
            written = len(worker_key)
            delta = 0
            for rec_key in rec_keys:
                value = txn.get(rec_key, db=self._rec)
                if value is None:
                    raise Corrupt(f"{self._path}: worker index names a missing record")
                delta -= unpackb(value)[0]
                written += self._delete_record(txn, rec_key, unpackb(rec_key), worker=False)
            # One delete with no value drops the worker's whole duplicate list.
            txn.delete(worker_key, db=self._worker)
            written += self._add_resident_bytes(txn, delta)
        self._removes += len(rec_keys)
        self._bytes_written += written
        return len(rec_keys)

    def clear(self) -> None:
        """Drop every record (one transaction). They count as removes."""
        with self._write() as txn:
            removed = txn.stat(self._rec)["entries"]
            for db in (self._rec, self._prefix, self._worker):
                txn.drop(db, delete=False)
            txn.put(_META_BYTES, _I64.pack(0), db=self._meta)
        self._removes += removed
        self._bytes_written += len(_META_BYTES) + _I64.size

    # --- reads -------------------------------------------------------------------------

    def _scan(self, txn: lmdb.Transaction, prefix: bytes) -> Iterator[CacheResidency]:
        cursor = txn.cursor(db=self._rec)
        if not cursor.set_range(prefix):
            return
        for rec_key, value in cursor:
            if not rec_key.startswith(prefix):
                return
            yield self._decode(rec_key, value)

    def locate(self, key: KvBlockKey) -> list[CacheResidency]:
        """Every residency of exactly this key (all workers, all tiers)."""
        with self._read() as txn:
            return list(self._scan(txn, self._key_prefix(key)))

    def locate_hash(self, block_hash: str) -> list[CacheResidency]:
        """Every residency whose key has this content hash, whatever its identity."""
        with self._read() as txn:
            return list(self._scan(txn, REC_HEADER + self._pack(block_hash)))

    def locate_hashes(self, block_hashes: Iterable[str]) -> list[list[CacheResidency]]:
        """locate_hash for each hash, all read from one consistent snapshot."""
        pack = self._pack
        with self._read() as txn:
            return [list(self._scan(txn, REC_HEADER + pack(h))) for h in block_hashes]

    def prefix_scan(self, scope: IdentityScope, prefix_hash: str) -> list[CacheResidency]:
        """Residencies in `scope` whose key's parent hash is `prefix_hash`."""
        self._prefix_scans += 1
        scope_key = self._scope_prefix(
            scope.model_id, scope.tokenizer_id, scope.adapter_id, scope.tenant_id, prefix_hash
        )
        out: list[CacheResidency] = []
        with self._read() as txn:
            cursor = txn.cursor(db=self._prefix)
            if not cursor.set_key(scope_key):
                return out
            for rec_key in cursor.iternext_dup():
                value = txn.get(rec_key, db=self._rec)
                if value is None:
                    raise Corrupt(f"{self._path}: prefix index names a missing record")
                out.append(self._decode(rec_key, value))
        return out

    def snapshot(self) -> list[CacheResidency]:
        """Every record, in key order. O(n): the one full scan."""
        decode = self._decode
        with self._read() as txn:
            return [decode(k, v) for k, v in txn.cursor(db=self._rec)]

    def __len__(self) -> int:
        with self._read() as txn:
            return txn.stat(self._rec)["entries"]

    def worker_block_count(self, worker_id: str) -> int:
        """Records (block copies, counting each tier) held by `worker_id`."""
        with self._read() as txn:
            cursor = txn.cursor(db=self._worker)
            return cursor.count() if cursor.set_key(self._pack(worker_id)) else 0

    def worker_epochs(self) -> dict[str, float]:
        with self._read() as txn:
            return {
                unpackb(key): _F64.unpack(value)[0] for key, value in txn.cursor(db=self._epoch)
            }

    def set_worker_epoch(self, worker_id: str, epoch: float) -> None:
        key = self._pack(worker_id)
        with self._write() as txn:
            txn.put(key, _F64.pack(epoch), db=self._epoch)
        self._bytes_written += len(key) + _F64.size

    def workers(self) -> list[str]:
        """One step per worker (its duplicates are skipped), in key order."""
        with self._read() as txn:
            cursor = txn.cursor(db=self._worker)
            return sorted(unpackb(key) for key in cursor.iternext_nodup(keys=True, values=False))

    def metrics(self) -> IndexMetrics:
        """Stored totals (resident_*) plus this process's counters."""
        with self._read() as txn:
            blocks = txn.stat(self._rec)["entries"]
            (resident_bytes,) = _I64.unpack(txn.get(_META_BYTES, db=self._meta))
        return IndexMetrics(
            resident_blocks=blocks,
            resident_bytes=resident_bytes,
            puts=self._puts,
            removes=self._removes,
            prefix_scans=self._prefix_scans,
            bytes_written=self._bytes_written,
        )

    def flush(self) -> None:
        """Make every commit so far durable (an fsync); a no-op once closed."""
        if not self._closed:
            self._env.sync(True)

    def close(self) -> None:
        """Flush and close the environment; later calls raise InvalidArgument. Idempotent."""
        if not self._closed:
            self._env.sync(True)
            self._closed = True
            self._env.close()
