"""In-process residency index: hash maps with secondary indexes, nothing persisted."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat

from quillcache_core.index.base import IndexBackend
from quillcache_core.model import (
    CacheResidency,
    CacheTier,
    IdentityScope,
    IndexMetrics,
    KvBlockKey,
)

# A key's copies by (worker_id, tier value). Slots use the tier's value string, not
# the member: Enum.__hash__ is Python code and hashing members cost about a third of
# put()'s time, while a str caches its hash.
_Slot = tuple[str, str]
_Records = dict[_Slot, CacheResidency]
# A hash with exactly one record stores that record inline; only a second record (a
# second copy, or another identity with the same content hash) promotes it to a
# key -> records dict. Chained hashes make one key per hash the rule; skipping two
# dicts per block measured ~3x put() throughput and ~1/4 the memory (about 250 bytes
# a record) against the all-dicts layout at 1M distinct blocks.
_HashCell = CacheResidency | dict[KvBlockKey, _Records]
# (model_id, tokenizer_id, adapter_id, tenant_id): a plain tuple rather than an
# IdentityScope, because building and hashing a tuple of strings stays in C.
_ScopeKey = tuple[str, str, str | None, str]
# The keys with records under one (scope, parent): inline when there is one (the rule
# for a chain), a set otherwise.
_PrefixCell = KvBlockKey | set[KvBlockKey]


_new = tuple.__new__


def _tier_value(tier: object) -> str:
    """The slot spelling of a CacheTier or of any name CacheTier.parse accepts."""
    return (tier if isinstance(tier, CacheTier) else CacheTier.parse(str(tier)))._value_


def _same_key(a: KvBlockKey, b: KvBlockKey) -> bool:
    # The identity test first: the dataclass __eq__ builds two 8-tuples.
    return a is b or a == b


class MemoryIndex(IndexBackend):
    """A residency index held in dicts; lost when the process exits.

    Costs: put, locate and worker_block_count are O(1); locate_hash and prefix_scan
    are O(results); remove_block and remove_tier are O(records under that hash);
    clear_worker is O(that worker's records). Only snapshot() visits everything.
    Emptied containers are dropped at once, so memory tracks the live records.
    """

    name = "memory"

    def __init__(self) -> None:
        # block_hash -> its records. Also the primary index: locate(key) goes through
        # the key's block_hash, so no separate key -> records map is kept.
        self._by_hash: dict[str, _HashCell] = {}
        # scope -> parent hash -> the keys under it. Nested by scope so that a chain of
        # one scope links its blocks by their (existing) parent-hash strings.
        self._by_prefix: dict[_ScopeKey, dict[str, _PrefixCell]] = {}
        # worker -> id(record) -> record: the stored objects themselves, keyed by id
        # because hashing an int is C while hashing a CacheResidency or a (key, tier)
        # tuple calls dataclass __hash__. Safe: the dict keeps each record alive, so
        # ids are unique among its entries.
        self._by_worker: dict[str, dict[int, CacheResidency]] = {}
        self._count = 0
        self._bytes = 0
        self._puts = 0
        self._removes = 0
        self._prefix_scans = 0

    # --- writes ------------------------------------------------------------------------

    def put(self, residency: CacheResidency) -> None:
        """Store one copy, replacing any record for the same (key, worker, tier)."""
        self._puts += 1
        key = residency.key
        block_hash = key.block_hash
        cell = self._by_hash.get(block_hash)
        if cell is None:
            self._by_hash[block_hash] = residency
            self._link_key(key)
            self._added(residency)
            return
        if type(cell) is not dict:
            if _same_key(cell.key, key):
                if cell.worker_id == residency.worker_id and cell.tier is residency.tier:
                    self._by_hash[block_hash] = residency
                    self._replaced(cell, residency)
                    return
            cell = self._by_hash[block_hash] = {
                cell.key: {(cell.worker_id, cell.tier._value_): cell}
            }
        records = cell.get(key)
        if records is None:
            records = cell[key] = {}
            self._link_key(key)
        slot = (residency.worker_id, residency.tier._value_)
        old = records.get(slot)
        records[slot] = residency
        if old is None:
            self._added(residency)
        else:
            self._replaced(old, residency)

    def put_many(self, residencies: Iterable[CacheResidency]) -> None:
        """Put several records, in order (a later record replaces an earlier twin)."""
        put = self.put
        for residency in residencies:
            put(residency)

    def put_chain(
        self,
        scope: _ScopeKey,
        parent: str,
        block_hashes: Sequence[str],
        first_index: int,
        token_count: int,
        worker_id: str,
        tier: CacheTier,
        nbytes: int,
        last_access_ms: int = 0,
    ) -> list[CacheResidency]:
        """Put a chain of blocks of one scope, all on one worker and tier; returns the
        records (in chain order).

        Block i's key is KvBlockKey(*scope, prefix, block_hashes[i], first_index + i,
        token_count) with prefix `parent` for the first block and the previous hash
        after, so this is put_many of those records. The event path's bulk insert: when
        every hash and parent is new to the index (the rule for a fresh chain) the keys
        and records are built and linked with C-level dict updates, no Python call per
        block; otherwise each record goes through put(), in order.
        """
        count = len(block_hashes)
        if not count:
            return []
        prefixes = [parent]
        prefixes += block_hashes[:-1]
        model_id, tokenizer_id, adapter_id, tenant_id = scope
        keys = list(
            map(
                _new,
                repeat(KvBlockKey),
                zip(
                    repeat(model_id),
                    repeat(tokenizer_id),
                    repeat(adapter_id),
                    repeat(tenant_id),
                    prefixes,
                    block_hashes,
                    range(first_index, first_index + count),
                    repeat(token_count),
                ),
            )
        )
        records: list[CacheResidency] = list(
            map(
                _new,
                repeat(CacheResidency),
                zip(
                    keys,
                    repeat(worker_id),
                    repeat(tier),
                    repeat(nbytes),
                    repeat(last_access_ms),
                    repeat(0),
                    repeat(False),
                ),
            )
        )
        by_hash = self._by_hash
        fresh = dict(zip(block_hashes, records, strict=True))
        if len(fresh) != count or not by_hash.keys().isdisjoint(fresh):
            self.put_many(records)
            return records
        self._puts += count
        by_hash.update(fresh)
        cells = self._by_prefix.get(scope)
        if cells is None:
            cells = self._by_prefix[scope] = {}
        links = dict(zip(prefixes, keys, strict=True))
        if len(links) == count and cells.keys().isdisjoint(links):
            cells.update(links)
        else:
            for key in keys:
                self._link_key(key)
        held = self._by_worker.get(worker_id)
        if held is None:
            held = self._by_worker[worker_id] = {}
        held.update(zip(map(id, records), records, strict=True))
        self._count += count
        self._bytes += count * nbytes
        return records

    def remove_block(self, scope: IdentityScope, worker_id: str, block_hash: str) -> int:
        """Remove every tier of this block that `worker_id` holds under `scope`.

        Returns the number of records removed.
        """
        victims = [
            r
            for r in self.locate_hash(block_hash)
            if r.worker_id == worker_id and scope.matches(r.key)
        ]
        for residency in victims:
            self._remove(residency)
        return len(victims)

    def remove_tier(self, worker_id: str, block_hash: str, tier: object) -> int:
        """Remove `worker_id`'s copy on `tier` of every key with this hash, any identity.

        `tier` is a CacheTier or a name CacheTier.parse accepts. Returns records removed.
        """
        value = _tier_value(tier)
        victims = [
            r
            for r in self.locate_hash(block_hash)
            if r.worker_id == worker_id and r.tier._value_ == value
        ]
        for residency in victims:
            self._remove(residency)
        return len(victims)

    def clear_worker(self, worker_id: str) -> int:
        """Drop every record `worker_id` holds; returns how many were dropped."""
        held = self._by_worker.pop(worker_id, None)
        if not held:
            return 0
        for residency in held.values():
            self._unlink(residency)
        removed = len(held)
        self._removes += removed
        return removed

    def clear(self) -> None:
        """Drop every record. Cleared records count as removes; counters keep running."""
        self._removes += self._count
        self._by_hash.clear()
        self._by_prefix.clear()
        self._by_worker.clear()
        self._count = 0
        self._bytes = 0

    # --- bookkeeping -------------------------------------------------------------------

    def _added(self, residency: CacheResidency) -> None:
        self._count += 1
        self._bytes += residency.bytes
        held = self._by_worker.get(residency.worker_id)
        if held is None:
            held = self._by_worker[residency.worker_id] = {}
        held[id(residency)] = residency

    def _replaced(self, old: CacheResidency, new: CacheResidency) -> None:
        self._bytes += new.bytes - old.bytes
        held = self._by_worker[new.worker_id]
        del held[id(old)]
        held[id(new)] = new

    def _remove(self, residency: CacheResidency) -> None:
        """Remove one stored record (the very object the indexes hold) everywhere."""
        held = self._by_worker[residency.worker_id]
        del held[id(residency)]
        if not held:
            del self._by_worker[residency.worker_id]
        self._unlink(residency)
        self._removes += 1

    def _unlink(self, residency: CacheResidency) -> None:
        """Take a stored record out of the hash and prefix indexes and the totals."""
        self._count -= 1
        self._bytes -= residency.bytes
        key = residency.key
        block_hash = key.block_hash
        cell = self._by_hash[block_hash]
        if type(cell) is not dict:
            del self._by_hash[block_hash]
            self._unlink_key(key)
            return
        records = cell[key]
        del records[(residency.worker_id, residency.tier._value_)]
        if not records:
            del cell[key]
            self._unlink_key(key)
        if len(cell) == 1:
            # Demote a hash left with one record back to the inline form, so a dict
            # cell always means two or more records.
            (only,) = cell.values()
            if len(only) == 1:
                (self._by_hash[block_hash],) = only.values()

    def _link_key(self, key: KvBlockKey) -> None:
        """Record that `key` (which had no records until now) has one."""
        scope = key[:4]
        cells = self._by_prefix.get(scope)
        if cells is None:
            cells = self._by_prefix[scope] = {}
        prefix = key.prefix_hash
        cell = cells.get(prefix)
        if cell is None:
            cells[prefix] = key
        elif type(cell) is set:
            cell.add(key)
        else:
            cells[prefix] = {cell, key}

    def _unlink_key(self, key: KvBlockKey) -> None:
        """Record that `key`'s last record is gone."""
        scope = key[:4]
        cells = self._by_prefix[scope]
        prefix = key.prefix_hash
        cell = cells[prefix]
        if type(cell) is not set:
            del cells[prefix]
            if not cells:
                del self._by_prefix[scope]
            return
        cell.remove(key)
        if len(cell) == 1:
            (cells[prefix],) = cell

    # --- reads -------------------------------------------------------------------------

    def locate(self, key: KvBlockKey) -> list[CacheResidency]:
        """Every residency of exactly this key (all workers, all tiers)."""
        cell = self._by_hash.get(key.block_hash)
        if cell is None:
            return []
        if type(cell) is not dict:
            return [cell] if _same_key(cell.key, key) else []
        records = cell.get(key)
        return [] if records is None else list(records.values())

    def locate_hash(self, block_hash: str) -> list[CacheResidency]:
        """Every residency whose key has this content hash, whatever its identity."""
        cell = self._by_hash.get(block_hash)
        if cell is None:
            return []
        if type(cell) is not dict:
            return [cell]
        if len(cell) == 1:
            # Several copies of one key: list() beats the nested comprehension.
            for records in cell.values():
                return list(records.values())
        return [residency for records in cell.values() for residency in records.values()]

    def locate_hashes(self, block_hashes) -> list[list[CacheResidency]]:
        """locate_hash for each hash, inlined for the common one-record case (planner hot path)."""
        get = self._by_hash.get
        out: list[list[CacheResidency]] = []
        append = out.append
        for block_hash in block_hashes:
            cell = get(block_hash)
            if cell is None:
                append([])
            elif type(cell) is not dict:
                append([cell])
            else:
                append(self.locate_hash(block_hash))
        return out

    def locate_prefix(self, block_hashes, extra=None) -> list[list[CacheResidency]]:
        """`IndexBackend.locate_prefix`, inlined like locate_hashes (the Plan hot path)."""
        get = self._by_hash.get
        more = extra.get if extra else None
        out: list[list[CacheResidency]] = []
        append = out.append
        for block_hash in block_hashes:
            cell = get(block_hash)
            if cell is None:
                found = []
            elif type(cell) is not dict:
                found = [cell]
            else:
                found = self.locate_hash(block_hash)
            if more is not None:
                added = more(block_hash)
                if added:
                    found = found + added
            if not found:
                break
            append(found)
        return out

    def prefix_scan(self, scope: IdentityScope, prefix_hash: str) -> list[CacheResidency]:
        """Residencies in `scope` whose key's parent hash is `prefix_hash`."""
        self._prefix_scans += 1
        cells = self._by_prefix.get(
            (scope.model_id, scope.tokenizer_id, scope.adapter_id, scope.tenant_id)
        )
        if cells is None:
            return []
        cell = cells.get(prefix_hash)
        if cell is None:
            return []
        if type(cell) is not set:
            return self.locate(cell)
        return [residency for key in cell for residency in self.locate(key)]

    def snapshot(self) -> list[CacheResidency]:
        """Every record, in no particular order. O(n): the one full scan."""
        out: list[CacheResidency] = []
        for cell in self._by_hash.values():
            if type(cell) is not dict:
                out.append(cell)
            else:
                for records in cell.values():
                    out.extend(records.values())
        return out

    def __len__(self) -> int:
        return self._count

    def worker_block_count(self, worker_id: str) -> int:
        """Records (block copies, counting each tier) held by `worker_id`."""
        held = self._by_worker.get(worker_id)
        return 0 if held is None else len(held)

    def metrics(self) -> IndexMetrics:
        """A fresh copy of the counters; nothing is written, so bytes_written is 0."""
        return IndexMetrics(
            resident_blocks=self._count,
            resident_bytes=self._bytes,
            puts=self._puts,
            removes=self._removes,
            prefix_scans=self._prefix_scans,
            bytes_written=0,
        )
