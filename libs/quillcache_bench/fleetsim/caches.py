"""An engine's HBM block cache and a store node's DRAM and SSD tiers, for the fleet simulator.

Pure bookkeeping (no clock): `HbmCache` pins the blocks of running requests and evicts
unpinned ones in LRU order; `StoreNode` keeps DRAM and SSD block budgets in LRU order
and reports every residency change to the index it is given.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from quillcache_core.model import CacheResidency, CacheTier

_DRAM = CacheTier.CPU_DRAM
_SSD = CacheTier.LOCAL_SSD


class HbmCache:
    """An engine's cached blocks: reference counts, and the unpinned ones in LRU order."""

    __slots__ = ("capacity", "refs", "free", "pinned", "overcommits")

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.refs: dict[str, int] = {}  # block hash -> running requests using it
        self.free: OrderedDict[str, object] = OrderedDict()  # refs == 0, LRU first
        self.pinned = 0
        self.overcommits = 0

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self.refs

    def __len__(self) -> int:
        return len(self.refs)

    def admit(self, keys: Sequence) -> tuple[list, list]:
        """Pin `keys` (inserting missing ones); evict LRU unpinned blocks over capacity.

        Returns (inserted keys, evicted keys). When every block is pinned the cache
        runs over capacity (counted in `overcommits`) rather than fail a request.
        """
        refs, free = self.refs, self.free
        inserted = []
        for key in keys:
            h = key.block_hash
            r = refs.get(h)
            if r is None:
                refs[h] = 1
                self.pinned += 1
                inserted.append(key)
            else:
                if r == 0:
                    del free[h]
                    self.pinned += 1
                refs[h] = r + 1
        evicted = []
        while len(refs) > self.capacity and free:
            h, key = free.popitem(last=False)
            del refs[h]
            evicted.append(key)
        if len(refs) > self.capacity:
            self.overcommits += 1
        return inserted, evicted

    def release(self, keys: Sequence) -> list:
        """Unpin `keys`; freed blocks join the LRU tail last block first (evicted first).

        Returns the blocks evicted because the cache had run over capacity.
        """
        refs, free = self.refs, self.free
        for key in reversed(keys):
            h = key.block_hash
            r = refs[h] - 1
            refs[h] = r
            if r == 0:
                free[h] = key
                self.pinned -= 1
        evicted = []
        while len(refs) > self.capacity and free:
            h, key = free.popitem(last=False)
            del refs[h]
            evicted.append(key)
        return evicted


class StoreNode:
    """A store node's DRAM and SSD tiers (block budgets, LRU); reports changes to the index."""

    __slots__ = ("id", "domain", "dram", "ssd", "dram_blocks", "ssd_blocks", "index", "nbytes")

    def __init__(
        self, node_id: str, domain: str, dram_blocks: int, ssd_blocks: int, index, nbytes: int
    ) -> None:
        self.id = node_id
        self.domain = domain
        self.dram: OrderedDict[str, object] = OrderedDict()
        self.ssd: OrderedDict[str, object] = OrderedDict()
        self.dram_blocks = dram_blocks
        self.ssd_blocks = ssd_blocks
        self.index = index
        self.nbytes = nbytes

    def tier_of(self, block_hash: str) -> CacheTier | None:
        if block_hash in self.dram:
            return _DRAM
        if block_hash in self.ssd:
            return _SSD
        return None

    def touch(self, block_hash: str) -> None:
        if block_hash in self.dram:
            self.dram.move_to_end(block_hash)
        elif block_hash in self.ssd:
            self.ssd.move_to_end(block_hash)

    def offload(self, key) -> None:
        """Write an evicted HBM block to DRAM, demoting DRAM's coldest to SSD."""
        h = key.block_hash
        dram = self.dram
        if h in dram:
            dram.move_to_end(h)
            return
        dram[h] = key
        self.index.put(CacheResidency(key, self.id, _DRAM, self.nbytes))
        while len(dram) > self.dram_blocks:
            old_h, old = dram.popitem(last=False)
            self.index.remove_tier(self.id, old_h, _DRAM)
            self._to_ssd(old_h, old)

    def _to_ssd(self, h: str, key) -> None:
        ssd = self.ssd
        if h in ssd:
            ssd.move_to_end(h)
            return
        ssd[h] = key
        self.index.put(CacheResidency(key, self.id, _SSD, self.nbytes))
        while len(ssd) > self.ssd_blocks:
            old_h, _ = ssd.popitem(last=False)
            self.index.remove_tier(self.id, old_h, _SSD)
