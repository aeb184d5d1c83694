"""A store node's two tiers as one block store: DRAM in front of SSD.

Writes.
- `put(key, payload)` (default: `tier=CPU_DRAM`, not durable) stores the block in DRAM.
  When DRAM is full, its coldest blocks are demoted first: their bytes are written to
  SSD and committed (one group commit for all of them), and only then freed from DRAM.
  A demotion frees up to `demote_batch_bytes` more than needed (default: 16 MiB or
  1/8 of DRAM, the smaller), so one SSD commit makes room for several following puts.
  A block DRAM cannot hold at all (larger than its capacity, or DRAM pinned full) goes
  to SSD instead.
- `put(..., tier=LOCAL_SSD)` writes to SSD only; `put(..., durable=True)` writes to SSD
  and also keeps a DRAM copy. Both return only after the SSD transaction committed.
- `put` returns the tier the block landed in (the fastest one holding it).

Reads. `get` tries DRAM, then SSD; both verify the payload checksum. An SSD hit is
promoted to DRAM (the SSD copy stays, so demoting it later costs no write). A corrupt
copy is dropped and reported (a "removed" event), never served: a corrupt DRAM copy
falls through to SSD, a corrupt SSD copy raises NotFound.

Events. Every residency change calls `on_event(TierEvent)`: "stored" in DRAM, demotion
("stored" on local_ssd, then "removed" from cpu_dram), promotion ("stored" in cpu_dram),
SSD eviction, delete and corrupt drops ("removed"). The callback runs synchronously on
the calling thread, sometimes with a per-key lock held: it must be quick (e.g. append to
a queue) and must not call back into the store. Its exceptions are logged and ignored.

Thread-safe: operations on one key are serialised by a striped lock; different keys
run concurrently (their SSD writes share group commits).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from quillcache_core.errors import CapacityExceeded, Corrupt, InvalidArgument, NotFound
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.storeclient.blockcodec import CorruptBlock, header_length, payload_checksum
from quillcache_store.tiers.dram import DramTier, Reservation
from quillcache_store.tiers.ssd import SsdTier

log = logging.getLogger(__name__)

STORED = "stored"
REMOVED = "removed"
_STRIPES = 64


@dataclass(frozen=True, slots=True)
class TierEvent:
    """One residency change on this node: `kind` is "stored" or "removed"."""

    kind: str
    key: KvBlockKey
    tier: CacheTier
    bytes: int


class TieredStore:
    """DRAM + SSD with demotion, promotion and residency events. See the module doc."""

    def __init__(
        self,
        dram: DramTier,
        ssd: SsdTier,
        on_event: Callable[[TierEvent], None] | None = None,
        *,
        promote_on_get: bool = True,
        demote_batch_bytes: int | None = None,
    ) -> None:
        self.dram = dram
        self.ssd = ssd
        self._on_event = on_event
        self._promote = promote_on_get
        if demote_batch_bytes is None:
            demote_batch_bytes = min(16 * 1024 * 1024, dram.capacity_bytes // 8)
        self._demote_batch = max(0, demote_batch_bytes)
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._lock = threading.Lock()
        self._hits_dram = 0
        self._hits_ssd = 0
        self._misses = 0
        self._demotions = 0
        self._promotions = 0
        self._evictions = 0
        self._corrupt = 0
        self._dram_fallbacks = 0

    # --- writing ---------------------------------------------------------------------

    def put(
        self,
        key: KvBlockKey,
        payload: bytes | bytearray | memoryview,
        *,
        durable: bool = False,
        tier: CacheTier = CacheTier.CPU_DRAM,
        checksum: int | None = None,
    ) -> CacheTier:
        """Store a block; returns the fastest tier now holding it.

        `checksum` (xxh3-64 of the payload), when given, is checked first: a mismatch
        raises Corrupt and stores nothing.
        """
        if tier not in (CacheTier.CPU_DRAM, CacheTier.LOCAL_SSD):
            raise InvalidArgument(f"a store node holds cpu_dram or local_ssd, not {tier}")
        view = memoryview(payload)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        digest = payload_checksum(view)
        if checksum is not None and checksum != digest:
            raise CorruptBlock(
                f"payload of block {key.block_hash} does not match its checksum "
                f"({checksum:016x} sent, {digest:016x} computed)",
                key,
            )
        return self._place(key, view, digest, durable=durable, tier=tier)

    def _place(
        self,
        key: KvBlockKey,
        view: memoryview,
        digest: int,
        *,
        durable: bool,
        tier: CacheTier,
        record: tuple[bytearray, int] | None = None,
    ) -> CacheTier:
        """`put` of a verified payload. With `record` (a buffer and its header length,
        `view` being the payload inside it) the SSD tier stores that buffer as is."""
        with self._stripe(key):
            if tier is CacheTier.LOCAL_SSD:
                self._put_ssd(key, view, digest, record)
                held = self.dram.info(key)
                if held is not None and held[1] != digest and self.dram.delete(key):
                    self._emit(REMOVED, key, CacheTier.CPU_DRAM, held[0])
                return CacheTier.LOCAL_SSD
            if durable:
                self._put_ssd(key, view, digest, record)
            else:
                held = self.ssd.info(key)
                if held is not None and held[1] != digest and self.ssd.delete(key):
                    self._emit(REMOVED, key, CacheTier.LOCAL_SSD, held[0])
            try:
                self._put_dram(key, view, digest)
            except CapacityExceeded as exc:
                with self._lock:
                    self._dram_fallbacks += 1
                log.debug("block %s goes to SSD: %s", key.block_hash, exc)
                if not durable:
                    self._put_ssd(key, view, digest, record)
                return CacheTier.LOCAL_SSD
            except Exception:
                if not durable:
                    raise
                # Already committed on SSD: the DRAM copy is only a cache.
                log.exception("block %s stored on SSD, not cached in DRAM", key.block_hash)
                return CacheTier.LOCAL_SSD
            return CacheTier.CPU_DRAM

    def _put_ssd(
        self,
        key: KvBlockKey,
        view: memoryview,
        digest: int,
        record: tuple[bytearray, int] | None = None,
    ) -> None:
        """Write to SSD, acknowledged after commit; emits evictions and the store."""
        already = self.ssd.info(key) == (view.nbytes, digest)
        if record is not None:
            evicted = self.ssd.put_record(key, record[0], record[1], digest, durable=True)
        else:
            evicted = self.ssd.put(key, view, checksum=digest, durable=True)
        self._report_ssd_evictions(evicted)
        if not already:
            self._emit(STORED, key, CacheTier.LOCAL_SSD, view.nbytes)

    def put_filled(
        self,
        key: KvBlockKey,
        nbytes: int,
        checksum: int,
        fill: Callable[[memoryview], None],
        *,
        durable: bool = False,
        tier: CacheTier = CacheTier.CPU_DRAM,
    ) -> CacheTier:
        """Store a block of `nbytes` whose bytes `fill(view)` writes (e.g. from a socket).

        `fill` must fill the whole view and verify it against `checksum` (raising
        Corrupt on a mismatch), or raise; it is called exactly once unless an error is
        raised first (the caller then still owns the unread bytes). Into DRAM (the
        default) `fill` writes straight into a pooled buffer: one copy of the bytes.
        For the SSD tier and durable puts it fills an SSD record buffer (header room
        reserved) that the SSD tier stores as it is, copied to DRAM after the commit
        for a durable DRAM put; for blocks DRAM cannot hold, a scratch buffer. If `fill` raises, nothing is stored and
        a block already held under the key is left as it was.
        """
        if tier not in (CacheTier.CPU_DRAM, CacheTier.LOCAL_SSD):
            raise InvalidArgument(f"a store node holds cpu_dram or local_ssd, not {tier}")
        if nbytes <= 0:
            raise InvalidArgument(f"block size must be positive, got {nbytes}")

        def via_record() -> CacheTier:
            # The bytes land in an SSD record buffer with its header's room reserved,
            # so the SSD tier stores that very buffer (no joining copy); `fill` has
            # verified them.
            header_len = header_length(key)
            record = bytearray(header_len + nbytes)
            payload = memoryview(record)[header_len:]
            fill(payload)
            return self._place(
                key, payload, checksum, durable=durable, tier=tier, record=(record, header_len)
            )

        if tier is CacheTier.LOCAL_SSD or durable:
            return via_record()
        with self._stripe(key):
            if self.dram.refresh(key, nbytes, checksum):
                fill(memoryview(bytearray(nbytes)))  # the same bytes: read and verify them
                return CacheTier.CPU_DRAM
            try:
                self._put_dram_with(
                    key,
                    nbytes,
                    lambda reservation: self.dram.commit_fill(reservation, fill, checksum),
                )
            except CapacityExceeded as exc:
                if getattr(exc, "deleted", None) is not None:
                    raise  # fill already ran (or the pool stayed full after the victims left)
                with self._lock:
                    self._dram_fallbacks += 1
                log.debug("block %s goes to SSD: %s", key.block_hash, exc)
            else:
                held = self.ssd.info(key)
                if held is not None and held[1] != checksum and self.ssd.delete(key):
                    self._emit(REMOVED, key, CacheTier.LOCAL_SSD, held[0])
                return CacheTier.CPU_DRAM
        scratch = memoryview(bytearray(nbytes))
        fill(scratch)
        with self._stripe(key):
            self._put_ssd(key, scratch, checksum)
        return CacheTier.LOCAL_SSD

    def _put_dram(self, key: KvBlockKey, view: memoryview, digest: int) -> None:
        """Store in DRAM, demoting (write + commit on SSD) the victims before freeing them."""
        if self.dram.refresh(key, view.nbytes, digest):
            return  # the same bytes are already there
        self._put_dram_with(
            key, view.nbytes, lambda reservation: self.dram.commit(reservation, view, digest)
        )

    def _put_dram_with(
        self, key: KvBlockKey, nbytes: int, commit: Callable[[Reservation], list[KvBlockKey]]
    ) -> None:
        """Reserve room, demote the victims, then `commit(reservation)` (`DramTier.commit`
        or `commit_fill`, returning the victims deleted meanwhile)."""
        reservation = self.dram.reserve(key, nbytes, headroom_bytes=self._demote_batch)
        written: set[KvBlockKey] = set()
        corrupt: set[KvBlockKey] = set()
        try:
            items = []
            for victim in reservation.victims:
                if payload_checksum(victim.payload) != victim.checksum:
                    corrupt.add(victim.key)
                elif self.ssd.info(victim.key) != (victim.nbytes, victim.checksum):
                    items.append((victim.key, victim.payload, victim.checksum))
                    written.add(victim.key)
            evicted = self.ssd.put_many(items, durable=True) if items else []
        except BaseException:
            self.dram.abort(reservation)
            raise
        failure: BaseException | None = None
        try:
            deleted = set(commit(reservation))
        except BaseException as exc:
            if getattr(exc, "deleted", None) is None:
                if reservation.state == "open":
                    self.dram.abort(reservation)
                raise
            # The victims are gone (demoted), the block is not stored.
            failure = exc
            deleted = set(exc.deleted)
        # A victim evicted from SSD by its own demotion batch was never visible there.
        lost = {k for k, _ in evicted if k in written}
        self._report_ssd_evictions([(k, n) for k, n in evicted if k not in lost])
        for victim in reservation.victims:
            if victim.key in deleted:
                # Deleted while being demoted: undo the SSD copy (the delete reported it).
                if victim.key in written:
                    self.ssd.delete(victim.key)
                continue
            if victim.key in corrupt:
                with self._lock:
                    self._corrupt += 1
                log.warning("dropped corrupt DRAM block %s instead of demoting it", victim.key)
            else:
                if victim.key in written and victim.key not in lost:
                    self._emit(STORED, victim.key, CacheTier.LOCAL_SSD, victim.nbytes)
                with self._lock:
                    self._demotions += 1
            self._emit(REMOVED, victim.key, CacheTier.CPU_DRAM, victim.nbytes)
        if failure is not None:
            raise failure
        self._emit(STORED, key, CacheTier.CPU_DRAM, nbytes)

    def _report_ssd_evictions(self, evicted: list[tuple[KvBlockKey, int]]) -> None:
        if not evicted:
            return
        with self._lock:
            self._evictions += len(evicted)
        for victim_key, nbytes in evicted:
            self._emit(REMOVED, victim_key, CacheTier.LOCAL_SSD, nbytes)

    # --- reading ---------------------------------------------------------------------

    def get(self, key: KvBlockKey) -> tuple[bytes | memoryview, CacheTier]:
        """The block's verified payload and the tier it was read from; NotFound if absent."""
        try:
            hit = self.dram.get(key)
        except Corrupt as exc:
            hit = None
            self._count_corrupt(key, CacheTier.CPU_DRAM, getattr(exc, "nbytes", 0))
        if hit is not None:
            with self._lock:
                self._hits_dram += 1
            return hit[0], CacheTier.CPU_DRAM
        try:
            hit = self.ssd.get(key)
        except Corrupt as exc:
            self._count_corrupt(key, CacheTier.LOCAL_SSD, getattr(exc, "nbytes", 0))
            with self._lock:
                self._misses += 1
            raise NotFound(
                f"block {key.block_hash} was corrupt on SSD and has been dropped"
            ) from exc
        if hit is None:
            with self._lock:
                self._misses += 1
            raise NotFound(f"block {key.block_hash} is not stored on this node")
        payload, digest = hit
        with self._lock:
            self._hits_ssd += 1
        if self._promote:
            self._promote_block(key, payload, digest)
        return payload, CacheTier.LOCAL_SSD

    def _promote_block(self, key: KvBlockKey, payload: memoryview, digest: int) -> None:
        with self._stripe(key):
            if self.dram.contains(key) or self.ssd.info(key) != (payload.nbytes, digest):
                return  # stored, replaced or deleted meanwhile
            try:
                self._put_dram(key, payload, digest)
            except (CapacityExceeded, Corrupt) as exc:
                log.debug("no promotion of %s: %s", key.block_hash, exc)
                return
            except Exception:
                log.exception("promotion of %s failed", key.block_hash)
                return
        with self._lock:
            self._promotions += 1

    def locate(self, key: KvBlockKey) -> CacheTier | None:
        """The fastest tier holding the block, or None. Reads no payload."""
        if self.dram.contains(key):
            return CacheTier.CPU_DRAM
        if self.ssd.contains(key):
            return CacheTier.LOCAL_SSD
        return None

    def exists(self, key: KvBlockKey) -> bool:
        return self.locate(key) is not None

    def keys(self) -> dict[CacheTier, list[KvBlockKey]]:
        """Keys per tier, least recently used first."""
        return {CacheTier.CPU_DRAM: self.dram.keys(), CacheTier.LOCAL_SSD: self.ssd.keys()}

    def residency(self) -> list[TierEvent]:
        """A "stored" event for every block held, e.g. to announce the node on start."""
        events = []
        for tier_obj, tier in ((self.dram, CacheTier.CPU_DRAM), (self.ssd, CacheTier.LOCAL_SSD)):
            for key in tier_obj.keys():
                info = tier_obj.info(key)
                if info is not None:
                    events.append(TierEvent(STORED, key, tier, info[0]))
        return events

    # --- removing --------------------------------------------------------------------

    def delete(self, key: KvBlockKey) -> bool:
        """Remove the block from both tiers; False if neither held it."""
        with self._stripe(key):
            in_dram = self.dram.info(key)
            in_ssd = self.ssd.info(key)
            removed_dram = self.dram.delete(key)
            removed_ssd = self.ssd.delete(key)
            if removed_dram:
                self._emit(REMOVED, key, CacheTier.CPU_DRAM, in_dram[0] if in_dram else 0)
            if removed_ssd:
                self._emit(REMOVED, key, CacheTier.LOCAL_SSD, in_ssd[0] if in_ssd else 0)
            return removed_dram or removed_ssd

    def stats(self) -> dict:
        """Bytes and blocks per tier, hit/miss, demotion, eviction and corruption counts.

        Flat integer counters plus the two tiers' own stats under "cpu_dram" and
        "local_ssd".
        """
        dram = self.dram.stats()
        ssd = self.ssd.stats()
        with self._lock:
            return {
                "cpu_dram_bytes": dram["bytes"],
                "cpu_dram_blocks": dram["blocks"],
                "cpu_dram_capacity": dram["capacity"],
                "local_ssd_bytes": ssd["bytes"],
                "local_ssd_blocks": ssd["blocks"],
                "local_ssd_capacity": ssd["capacity"],
                "hits": self._hits_dram + self._hits_ssd,
                "hits_cpu_dram": self._hits_dram,
                "hits_local_ssd": self._hits_ssd,
                "misses": self._misses,
                "demotions": self._demotions,
                "promotions": self._promotions,
                "evictions": self._evictions,
                "corrupt": self._corrupt,
                "dram_fallbacks": self._dram_fallbacks,
                "cpu_dram": dram,
                "local_ssd": ssd,
            }

    def close(self) -> None:
        """Close the SSD tier (commits what is queued). DRAM contents are dropped."""
        self.ssd.close()

    # --- internals -------------------------------------------------------------------

    def _stripe(self, key: KvBlockKey) -> threading.Lock:
        return self._stripes[hash(key) % _STRIPES]

    def _count_corrupt(self, key: KvBlockKey, tier: CacheTier, nbytes: int) -> None:
        with self._lock:
            self._corrupt += 1
        self._emit(REMOVED, key, tier, nbytes)

    def _emit(self, kind: str, key: KvBlockKey, tier: CacheTier, nbytes: int) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(TierEvent(kind, key, tier, nbytes))
        except Exception:
            log.exception("residency event callback failed")
