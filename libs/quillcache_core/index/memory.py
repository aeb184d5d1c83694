"""In-process residency index: hash maps with secondary indexes, nothing persisted."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import compress, count, repeat

from quillcache_core import hotpath
from quillcache_core.index.base import Chain, IndexBackend
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


# The key of a pending chain's cell: {_PENDING: the Chain}, one dict shared
# by every hash of the chain. A dict, so that the read paths' common case (a record)
# keeps its one type test; the rare dict case (locate_hash) builds the chain.
_PENDING = "pending chain"
_LIVE = "blocks left"  # ... and how many of its blocks are still held (not removed)


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
    clear_worker is O(that worker's records). Only snapshot() visits everything, and
    the first prefix_scan, which builds the parent-hash index that later writes keep
    up to date: no service scans by prefix, so writes skip that index until then.
    put_chain is O(1) a block with no object per block; the first read or put that
    touches one of its blocks builds the chain's records (O(chain), once).
    Emptied containers are dropped at once, so memory tracks the live records.
    """

    name = "memory"

    def __init__(self) -> None:
        # block_hash -> its records. Also the primary index: locate(key) goes through
        # the key's block_hash, so no separate key -> records map is kept.
        self._by_hash: dict[str, _HashCell] = {}
        # scope -> parent hash -> the keys under it. Nested by scope so that a chain of
        # one scope links its blocks by their (existing) parent-hash strings. None until
        # the first prefix_scan: only that reads it, and keeping it costs each new key
        # a dict insert (about a tenth of a put_chain block).
        self._by_prefix: dict[_ScopeKey, dict[str, _PrefixCell]] | None = None
        # worker -> id(record) -> record: the stored objects themselves, keyed by id
        # because hashing an int is C while hashing a CacheResidency or a (key, tier)
        # tuple calls dataclass __hash__. Safe: the dict keeps each record alive, so
        # ids are unique among its entries.
        # Also a pending chain (see put_chain), under id(cell).
        self._by_worker: dict[str, dict[int, CacheResidency | dict]] = {}
        # worker -> records it holds (a pending chain counts its blocks).
        self._held: dict[str, int] = {}
        self._epochs: dict[str, float] = {}
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
        if type(cell) is dict and _PENDING in cell:
            cell = self._build(cell, block_hash)
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

    def put_chain(self, chain: Chain) -> None:
        """Put a chain of blocks of one scope, all on one worker and tier: put_many of
        `chain.records()` (see IndexBackend.put_chain).

        The event path's bulk insert. When every hash is new to the index (the rule for
        a fresh chain) nothing is built per block: each hash maps to one shared pending
        cell holding the Chain, and the chain's records are built, in C-level
        passes, when a read or a put first touches one of its blocks. Removing a block
        (remove_tier, remove_block, clear_worker) needs no record, so a block removed
        before anything read its chain never has one: no KvBlockKey, no CacheResidency
        for the cycle collector to walk. Otherwise, or once prefix_scan has built its
        index, the records are built now.
        """
        block_hashes = chain.block_hashes
        count = len(block_hashes)
        if not count:
            return
        by_hash = self._by_hash
        if self._by_prefix is None and by_hash.keys().isdisjoint(block_hashes):
            # Its own copy of the hashes: the cell outlives the caller's list.
            chain = chain._replace(block_hashes=list(block_hashes))
            hashes = chain.block_hashes
            cell = {_PENDING: chain, _LIVE: count}
            before = len(by_hash)
            by_hash.update(zip(hashes, repeat(cell)))
            if len(by_hash) - before == count:
                worker_id = chain.worker_id
                held = self._by_worker.get(worker_id)
                if held is None:
                    held = self._by_worker[worker_id] = {}
                held[id(cell)] = cell
                self._held[worker_id] = self._held.get(worker_id, 0) + count
                self._puts += count
                self._count += count
                self._bytes += count * chain.nbytes
                return
            for block_hash in hashes:  # a hash repeats in the chain: undo, then put in order
                by_hash.pop(block_hash, None)
        self.put_many(chain.records())

    def remove_block(self, scope: IdentityScope, worker_id: str, block_hash: str) -> int:
        """Remove every tier of this block that `worker_id` holds under `scope`.

        Returns the number of records removed.
        """
        cell = self._by_hash.get(block_hash)
        if type(cell) is dict and _PENDING in cell:
            chain = cell[_PENDING]
            if chain.worker_id != worker_id or tuple(chain.scope) != (
                scope.model_id,
                scope.tokenizer_id,
                scope.adapter_id,
                scope.tenant_id,
            ):
                return 0
            self._remove_pending(cell, block_hash)
            return 1
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
        cell = self._by_hash.get(block_hash)
        if type(cell) is dict and _PENDING in cell:
            chain = cell[_PENDING]
            if chain.worker_id != worker_id or chain.tier._value_ != value:
                return 0
            self._remove_pending(cell, block_hash)
            return 1
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
        removed = self._held.pop(worker_id, 0)
        if not held:
            return 0
        by_hash = self._by_hash
        for item in held.values():
            if type(item) is dict:  # a pending chain: the hashes still mapped to it go
                for block_hash in item[_PENDING].block_hashes:
                    if by_hash.get(block_hash) is item:
                        del by_hash[block_hash]
                self._count -= item[_LIVE]
                self._bytes -= item[_LIVE] * item[_PENDING].nbytes
            else:
                self._unlink(item)
        self._removes += removed
        return removed

    def clear(self) -> None:
        """Drop every record. Cleared records count as removes; counters keep running."""
        self._removes += self._count
        self._by_hash.clear()
        if self._by_prefix is not None:
            self._by_prefix.clear()
        self._by_worker.clear()
        self._held.clear()
        self._count = 0
        self._bytes = 0

    # --- bookkeeping -------------------------------------------------------------------

    def _added(self, residency: CacheResidency) -> None:
        self._count += 1
        self._bytes += residency.bytes
        worker_id = residency.worker_id
        held = self._by_worker.get(worker_id)
        if held is None:
            held = self._by_worker[worker_id] = {}
        held[id(residency)] = residency
        self._held[worker_id] = self._held.get(worker_id, 0) + 1

    def _replaced(self, old: CacheResidency, new: CacheResidency) -> None:
        self._bytes += new.bytes - old.bytes
        held = self._by_worker[new.worker_id]
        del held[id(old)]
        held[id(new)] = new

    def _remove(self, residency: CacheResidency) -> None:
        """Remove one stored record (the very object the indexes hold) everywhere."""
        worker_id = residency.worker_id
        held = self._by_worker[worker_id]
        del held[id(residency)]
        if not held:
            del self._by_worker[worker_id]
            del self._held[worker_id]
        else:
            self._held[worker_id] -= 1
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

    def _build(self, cell: dict, block_hash: str) -> _HashCell:
        """Build a pending chain's records into its hashes' places; returns the cell
        that `block_hash` has now."""
        chain = cell[_PENDING]
        by_hash = self._by_hash
        records = chain.records()
        if cell[_LIVE] != len(records):  # some blocks were removed meanwhile
            records = [r for r in records if by_hash.get(r.key.block_hash) is cell]
        by_hash.update(zip([r.key.block_hash for r in records], records, strict=True))
        held = self._by_worker[chain.worker_id]
        del held[id(cell)]
        held.update(zip(map(id, records), records, strict=True))
        return by_hash[block_hash]

    def _remove_pending(self, cell: dict, block_hash: str) -> None:
        """Remove the one record a pending chain has under `block_hash`, unbuilt."""
        chain = cell[_PENDING]
        worker_id = chain.worker_id
        del self._by_hash[block_hash]
        self._count -= 1
        self._bytes -= chain.nbytes
        self._removes += 1
        cell[_LIVE] -= 1
        if cell[_LIVE]:
            self._held[worker_id] -= 1
            return
        held = self._by_worker[worker_id]
        del held[id(cell)]
        if held:
            self._held[worker_id] -= 1
        else:
            del self._by_worker[worker_id]
            del self._held[worker_id]

    def _build_all(self) -> None:
        """Build every pending chain (before a full scan)."""
        pending = {
            id(cell): (cell, block_hash)
            for block_hash, cell in self._by_hash.items()
            if type(cell) is dict and _PENDING in cell
        }
        for cell, block_hash in pending.values():
            self._build(cell, block_hash)

    def _link_key(self, key: KvBlockKey) -> None:
        """Record that `key` (which had no records until now) has one."""
        if self._by_prefix is None:
            return
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
        if self._by_prefix is None:
            return
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
        if _PENDING in cell:
            self._build(cell, key.block_hash)
            return self.locate(key)
        records = cell.get(key)
        return [] if records is None else list(records.values())

    def locate_hash(self, block_hash: str) -> list[CacheResidency]:
        """Every residency whose key has this content hash, whatever its identity."""
        cell = self._by_hash.get(block_hash)
        if cell is None:
            return []
        if type(cell) is not dict:
            return [cell]
        if _PENDING in cell:
            return [self._build(cell, block_hash)]  # a chain's block has one record
        if len(cell) == 1:
            # Several copies of one key: list() beats the nested comprehension.
            for records in cell.values():
                return list(records.values())
        return [residency for records in cell.values() for residency in records.values()]

    def locate_hashes(self, block_hashes) -> list[list[CacheResidency]]:
        """locate_hash for each hash, in one pass (`hotpath.locate`) for the common cells."""
        hashes = block_hashes if type(block_hashes) is list else list(block_hashes)
        found, todo = hotpath.locate(self._by_hash, hashes, False, _PENDING)
        if todo:
            for i in todo:  # pending chains, several keys under one hash
                found[i] = self.locate_hash(hashes[i])
        return found

    def locate_prefix(self, block_hashes, extra=None) -> list[list[CacheResidency]]:
        """`IndexBackend.locate_prefix` in one pass (`hotpath.locate`, the Plan hot path)
        up to the index's first miss; only a pending chain's or a shared hash's cell
        takes a Python step, and `extra`'s records a Python step per block past it."""
        hashes = block_hashes if type(block_hashes) is list else list(block_hashes)
        found, todo = hotpath.locate(self._by_hash, hashes, True, _PENDING)
        if todo:
            # Pending chains (located again: building one rewrites its other hashes'
            # cells) and hashes shared by several keys.
            for i in todo:
                found[i] = self.locate_hash(hashes[i])
        if extra:
            held = len(found)
            added = list(map(extra.get, hashes[:held]))
            for i in compress(count(), added):
                found[i] = found[i] + added[i]
            for block_hash in hashes[held:]:  # the index holds none of these at once
                more = self.locate_hash(block_hash)
                plus = extra.get(block_hash)
                if plus:
                    more = more + plus
                if not more:
                    break
                found.append(more)
        return found

    def prefix_scan(self, scope: IdentityScope, prefix_hash: str) -> list[CacheResidency]:
        """Residencies in `scope` whose key's parent hash is `prefix_hash`."""
        self._prefix_scans += 1
        by_prefix = self._by_prefix
        if by_prefix is None:
            by_prefix = self._build_prefix_index()
        cells = by_prefix.get(
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

    def _build_prefix_index(self) -> dict[_ScopeKey, dict[str, _PrefixCell]]:
        """Link every key held so far; from now on writes keep the index current."""
        self._build_all()
        self._by_prefix = {}
        for cell in self._by_hash.values():
            if type(cell) is not dict:
                self._link_key(cell.key)
            else:
                for key in cell:
                    self._link_key(key)
        return self._by_prefix

    def snapshot(self) -> list[CacheResidency]:
        """Every record, in no particular order. O(n): the one full scan."""
        self._build_all()
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
        return self._held.get(worker_id, 0)

    def workers(self) -> list[str]:
        return sorted(worker for worker, held in self._held.items() if held)

    def worker_epochs(self) -> dict[str, float]:
        return dict(self._epochs)

    def set_worker_epoch(self, worker_id: str, epoch: float) -> None:
        self._epochs[worker_id] = float(epoch)

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
