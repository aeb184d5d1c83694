"""Persistent residency index on RocksDB (an LSM tree), through rocksdict.

One keyspace (the default column family, raw bytes), each entry tagged by its first
byte; msgpack fields are self-delimiting, so every leading run of fields is a byte
prefix and every lookup is a seek plus a short range scan:

- ``r`` + rec body: one entry per residency record. The rec body is LmdbIndex's rec
  key: a msgpack fixarray of ``[block_hash, model_id, tokenizer_id, adapter_id,
  tenant_id, prefix_hash, block_index, token_count, worker_id, tier]``, so locate_hash
  scans ``r`` + the packed hash and locate the 8-field prefix. Value: msgpack
  ``[bytes, last_access_ms, ref_count, pinned]``.
- ``p`` + packed ``(model, tokenizer, adapter, tenant, prefix_hash)`` + rec body ->
  empty: prefix_scan scans the scope + parent prefix and multi-gets the records.
- ``w`` + packed worker + rec body -> empty: clear_worker's scan.
- ``c`` + packed worker -> i64 records held; ``e`` + packed worker -> f64 epoch.
- ``m`` + ``format`` / ``count`` / ``bytes``: the format tag and the totals.

Every write method is one WriteBatch (atomic), the counters it changes included, so
they are right after a reopen or a crash; the process keeps a copy of them (it is the
only writer: RocksDB's LOCK file), so len() and worker_block_count are dict reads.
The WAL is on and recovered point-in-time. Acknowledged (durable): as LmdbIndex, with
`sync_commits` (the default) each write method's batch is written with sync=True and
is durable when the call returns; without it batches reach the WAL unsynced and a
write is acknowledged once a later `flush()` (an fsync of the WAL) returns. Either
way a crash keeps a prefix of the batches, each whole.

`bytes_written` is what RocksDB's statistics say this process wrote to disk: WAL bytes
plus memtable flushes plus compaction output (so compaction's write amplification is
in it); MANIFEST and OPTIONS files are not counted.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterable

import msgpack
from rocksdict import (
    BlockBasedOptions,
    DBRecoveryMode,
    Options,
    Rdict,
    WriteBatch,
    WriteOptions,
)

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

_FORMAT = b"quillcache-index-rocksdb/1"
_META_FORMAT, _META_COUNT, _META_BYTES = b"mformat", b"mcount", b"mbytes"
_REC, _PREFIX, _WORKER, _COUNT, _EPOCH = b"r", b"p", b"w", b"c", b"e"
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_WRITTEN = re.compile(r"rocksdb\.(?:wal|flush\.write|compact\.write)\.bytes COUNT : (\d+)")


def _after(prefix: bytes) -> bytes:
    """The first key past every key starting with `prefix` (for delete_range)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes((stripped[-1] + 1,))


class _Closed:
    def __getattr__(self, name: str):
        raise InvalidArgument("rocksdb index is closed")


class RocksIndex(IndexBackend):
    """A residency index in the RocksDB directory at `path` (module docstring)."""

    name = "rocksdb"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        sync_commits: bool = True,
        write_buffer_bytes: int = 64 << 20,
    ) -> None:
        self._path = os.fspath(path)
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        options.enable_statistics()
        options.set_stats_dump_period_sec(0)
        options.set_wal_recovery_mode(DBRecoveryMode.point_in_time())
        options.set_write_buffer_size(write_buffer_bytes)
        options.set_max_background_jobs(2)
        options.set_level_compaction_dynamic_level_bytes(True)
        table = BlockBasedOptions()
        table.set_bloom_filter(10, False)  # the rec gets of prefix_scan and of each put
        options.set_block_based_table_factory(table)
        self._options = options
        self._db = Rdict(self._path, options)
        self._write_options = WriteOptions()
        self._write_options.sync = sync_commits
        self._pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack
        try:
            self._load()
        except BaseException:
            self._db.close()
            raise
        self._puts = self._removes = self._prefix_scans = 0

    def _load(self) -> None:
        found = self._db.get(_META_FORMAT)
        if found is None:
            if self._first(_REC) is not None:
                raise Corrupt(f"{self._path}: index records without a format tag")
            batch = WriteBatch(raw_mode=True)
            batch.put(_META_FORMAT, _FORMAT)
            batch.put(_META_COUNT, _I64.pack(0))
            batch.put(_META_BYTES, _I64.pack(0))
            self._db.write(batch, self._write_options)
        elif found != _FORMAT:
            raise Corrupt(f"{self._path}: unsupported index format {found!r}")
        (self._count,) = _I64.unpack(self._db.get(_META_COUNT))
        (self._bytes,) = _I64.unpack(self._db.get(_META_BYTES))
        self._held = {unpackb(key[1:]): _I64.unpack(value)[0] for key, value in self._scan(_COUNT)}

    @property
    def persistent(self) -> bool:
        return True

    @property
    def path(self) -> str:
        return self._path

    # --- encoding and scans ------------------------------------------------------------

    def _body(self, r: CacheResidency) -> bytes:
        p = self._pack
        return key_prefix(p, r.key) + p(r.worker_id) + p(r.tier._value_)

    def _scope_prefix(
        self, model: str, tokenizer: str, adapter: str | None, tenant: str, parent: str
    ) -> bytes:
        return _PREFIX + scope_prefix(self._pack, model, tokenizer, adapter, tenant, parent)

    _decode = staticmethod(decode_record)

    def _scan(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """Every (key, value) whose key starts with `prefix`, in key order."""
        it = self._db.iter()
        it.seek(prefix)
        out = []
        while it.valid():
            key = it.key()
            if not key.startswith(prefix):
                break
            out.append((key, it.value()))
            it.next()
        return out

    def _first(self, prefix: bytes) -> bytes | None:
        it = self._db.iter()
        it.seek(prefix)
        return it.key() if it.valid() and it.key().startswith(prefix) else None

    # --- writes ------------------------------------------------------------------------

    def _commit(self, batch: WriteBatch, count: int, nbytes: int, held: dict[str, int]) -> None:
        """Add the totals' changes to `batch`, write it, then adopt them."""
        count += self._count
        nbytes += self._bytes
        batch.put(_META_COUNT, _I64.pack(count))
        batch.put(_META_BYTES, _I64.pack(nbytes))
        for worker_id, n in held.items():
            key = _COUNT + self._pack(worker_id)
            if n:
                batch.put(key, _I64.pack(n))
            else:
                batch.delete(key)
        self._db.write(batch, self._write_options)
        self._count, self._bytes = count, nbytes
        for worker_id, n in held.items():
            if n:
                self._held[worker_id] = n
            else:
                self._held.pop(worker_id, None)

    def put(self, residency: CacheResidency) -> None:
        """Store one copy durably, replacing the record for the same (key, worker, tier)."""
        self.put_many((residency,))

    def put_many(self, residencies: Iterable[CacheResidency]) -> None:
        """Put several records in ONE WriteBatch (all or none), applied in order."""
        batch_records = list(residencies)
        if not batch_records:
            return
        pack = self._pack
        bodies = [self._body(r) for r in batch_records]
        old_values = self._db.get([_REC + body for body in bodies])
        batch = WriteBatch(raw_mode=True)
        sizes: dict[bytes, int | None] = {}  # body -> bytes of the record it now holds
        count = nbytes = 0
        held: dict[str, int] = {}
        for r, body, old in zip(batch_records, bodies, old_values, strict=True):
            value = pack((r.bytes, r.last_access_ms, r.ref_count, r.pinned))
            batch.put(_REC + body, value)
            before = sizes[body] if body in sizes else (None if old is None else unpackb(old)[0])
            sizes[body] = r.bytes
            if before is None:
                k = r.key
                scope = self._scope_prefix(
                    k.model_id, k.tokenizer_id, k.adapter_id, k.tenant_id, k.prefix_hash
                )
                batch.put(scope + body, b"")
                batch.put(_WORKER + pack(r.worker_id) + body, b"")
                count += 1
                nbytes += r.bytes
                held[r.worker_id] = held.get(r.worker_id, self._held.get(r.worker_id, 0)) + 1
            else:
                nbytes += r.bytes - before
        self._commit(batch, count, nbytes, held)
        self._puts += len(batch_records)

    def _delete_records(
        self, victims: list[tuple[bytes, list, int]], batch: WriteBatch, *, worker_entries: bool
    ) -> tuple[int, dict[str, int]]:
        """Delete (body, fields, bytes) records into `batch`; returns (bytes, held)."""
        pack = self._pack
        held: dict[str, int] = {}
        freed = 0
        for body, f, nbytes in victims:
            batch.delete(_REC + body)
            batch.delete(self._scope_prefix(f[1], f[2], f[3], f[4], f[5]) + body)
            if worker_entries:
                batch.delete(_WORKER + pack(f[8]) + body)
            held[f[8]] = held.get(f[8], self._held.get(f[8], 0)) - 1
            freed += nbytes
        return freed, held

    def _remove_matching(self, block_hash: str, doomed) -> int:
        prefix = _REC + REC_HEADER + self._pack(block_hash)
        victims = []
        for key, value in self._scan(prefix):
            f = unpackb(key[1:])
            if doomed(f):
                victims.append((key[1:], f, unpackb(value)[0]))
        if not victims:
            return 0
        batch = WriteBatch(raw_mode=True)
        freed, held = self._delete_records(victims, batch, worker_entries=True)
        self._commit(batch, -len(victims), -freed, held)
        self._removes += len(victims)
        return len(victims)

    def remove_block(self, scope: IdentityScope, worker_id: str, block_hash: str) -> int:
        """Remove every tier of this block that `worker_id` holds under `scope`."""
        want = [scope.model_id, scope.tokenizer_id, scope.adapter_id, scope.tenant_id]
        return self._remove_matching(block_hash, lambda f: f[8] == worker_id and f[1:5] == want)

    def remove_tier(self, worker_id: str, block_hash: str, tier: object) -> int:
        """Remove `worker_id`'s copy on `tier` of every key with this hash, any identity."""
        value = (tier if isinstance(tier, CacheTier) else CacheTier.parse(str(tier))).value
        return self._remove_matching(block_hash, lambda f: f[8] == worker_id and f[9] == value)

    def clear_worker(self, worker_id: str) -> int:
        """Drop every record `worker_id` holds, in one batch (one range tombstone for its
        worker entries); returns how many."""
        prefix = _WORKER + self._pack(worker_id)
        bodies = [key[len(prefix) :] for key, _ in self._scan(prefix)]
        if not bodies:
            return 0
        values = self._db.get([_REC + body for body in bodies])
        victims = []
        for body, value in zip(bodies, values, strict=True):
            if value is None:
                raise Corrupt(f"{self._path}: worker index names a missing record")
            victims.append((body, unpackb(body), unpackb(value)[0]))
        batch = WriteBatch(raw_mode=True)
        freed, held = self._delete_records(victims, batch, worker_entries=False)
        batch.delete_range(prefix, _after(prefix))
        self._commit(batch, -len(victims), -freed, held)
        self._removes += len(victims)
        return len(victims)

    def clear(self) -> None:
        """Drop every record in one batch: a range tombstone per entry family and the
        zeroed totals. They count as removes."""
        removed = self._count
        batch = WriteBatch(raw_mode=True)
        for tag in (_REC, _PREFIX, _WORKER, _COUNT):
            batch.delete_range(tag, _after(tag))
        self._commit(batch, -self._count, -self._bytes, {})
        self._held.clear()
        self._removes += removed

    def set_worker_epoch(self, worker_id: str, epoch: float) -> None:
        batch = WriteBatch(raw_mode=True)
        batch.put(_EPOCH + self._pack(worker_id), _F64.pack(float(epoch)))
        self._db.write(batch, self._write_options)

    # --- reads -------------------------------------------------------------------------

    def locate(self, key: KvBlockKey) -> list[CacheResidency]:
        p = self._pack
        prefix = b"".join(
            (
                _REC,
                REC_HEADER,
                p(key.block_hash),
                p(key.model_id),
                p(key.tokenizer_id),
                p(key.adapter_id),
                p(key.tenant_id),
                p(key.prefix_hash),
                p(key.block_index),
                p(key.token_count),
            )
        )
        decode = self._decode
        return [decode(k[1:], v) for k, v in self._scan(prefix)]

    def locate_hash(self, block_hash: str) -> list[CacheResidency]:
        decode = self._decode
        prefix = _REC + REC_HEADER + self._pack(block_hash)
        return [decode(k[1:], v) for k, v in self._scan(prefix)]

    def locate_hashes(self, block_hashes: Iterable[str]) -> list[list[CacheResidency]]:
        """locate_hash for each hash, all read through one iterator (one snapshot)."""
        decode = self._decode
        pack = self._pack
        it = self._db.iter()
        out = []
        for block_hash in block_hashes:
            prefix = _REC + REC_HEADER + pack(block_hash)
            found = []
            it.seek(prefix)
            while it.valid():
                key = it.key()
                if not key.startswith(prefix):
                    break
                found.append(decode(key[1:], it.value()))
                it.next()
            out.append(found)
        return out

    def prefix_scan(self, scope: IdentityScope, prefix_hash: str) -> list[CacheResidency]:
        """Residencies in `scope` whose key's parent hash is `prefix_hash`."""
        self._prefix_scans += 1
        prefix = self._scope_prefix(
            scope.model_id, scope.tokenizer_id, scope.adapter_id, scope.tenant_id, prefix_hash
        )
        bodies = [key[len(prefix) :] for key, _ in self._scan(prefix)]
        if not bodies:
            return []
        values = self._db.get([_REC + body for body in bodies])
        out = []
        for body, value in zip(bodies, values, strict=True):
            if value is None:
                raise Corrupt(f"{self._path}: prefix index names a missing record")
            out.append(self._decode(body, value))
        return out

    def snapshot(self) -> list[CacheResidency]:
        """Every record, in key order. O(n): the one full scan."""
        decode = self._decode
        return [decode(k[1:], v) for k, v in self._scan(_REC)]

    def _check_open(self) -> None:
        if isinstance(self._db, _Closed):
            raise InvalidArgument(f"rocksdb index at {self._path} is closed")

    def __len__(self) -> int:
        self._check_open()
        return self._count

    def worker_block_count(self, worker_id: str) -> int:
        self._check_open()
        return self._held.get(worker_id, 0)

    def workers(self) -> list[str]:
        self._check_open()
        return sorted(self._held)

    def worker_epochs(self) -> dict[str, float]:
        return {unpackb(k[1:]): _F64.unpack(v)[0] for k, v in self._scan(_EPOCH)}

    def metrics(self) -> IndexMetrics:
        """Stored totals plus this process's counters and RocksDB's bytes written."""
        self._check_open()
        stats = self._options.get_statistics() or ""
        written = sum(int(n) for n in _WRITTEN.findall(stats))
        return IndexMetrics(
            resident_blocks=self._count,
            resident_bytes=self._bytes,
            puts=self._puts,
            removes=self._removes,
            prefix_scans=self._prefix_scans,
            bytes_written=written,
        )

    # --- durability --------------------------------------------------------------------

    def flush(self) -> None:
        """fsync the WAL: every write so far is durable. A no-op once closed."""
        if not isinstance(self._db, _Closed):
            self._db.flush_wal(True)

    def close(self) -> None:
        """Sync the WAL and close the database; later calls raise InvalidArgument."""
        if isinstance(self._db, _Closed):
            return
        db, self._db = self._db, _Closed()
        try:
            db.flush_wal(True)
        finally:
            db.close()
