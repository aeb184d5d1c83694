"""The DRAM tier of a store node: an LRU byte budget over a pool of reused buffers.

Memory. Payloads live in pooled buffers of a size class (powers of two up to 64 KiB,
then multiples of 64 KiB), so a 2 MiB block takes exactly 2 MiB. A freed buffer goes
to a per-class free list and the next block of that class is copied into it: copying
into a warm buffer runs at memcpy speed (~20-40 GB/s here), a fresh buffer costs its
page faults (~1-2 GB/s): with `prefault` the tier's capacity is touched in the
background when it starts and new buffers are carved from it (`dram_arena`). Otherwise
buffers of 1 MiB and more are anonymous mmaps advised
MADV_HUGEPAGE (best effort). The pool's total (buffers holding blocks, buffers still
pinned after removal, free buffers, buffers being filled) never exceeds `capacity_bytes`:
free buffers of other classes are dropped when a new buffer is needed.

Capacity is charged by size class, not by payload length; `stats()["bytes"]` reports
payload bytes, `resident_bytes` the classes.

Writing with demotion, in two steps so a victim is never freed before it is safe
elsewhere::

    res = dram.reserve(key, len(payload))   # picks victims, coldest first
    for v in res.victims:                    # still in DRAM and readable meanwhile
        ssd.put(v.key, v.payload, checksum=v.checksum)
    gone = dram.commit(res, payload, checksum)  # frees the victims, stores the block
    # or dram.abort(res): the victims stay, nothing is stored

`dram.commit_fill(res, fill, checksum)` commits with `fill(view)` writing the payload
straight into the pooled buffer (e.g. `recv_into` from a peer), so received bytes are
copied once; if `fill` raises, nothing is stored and the buffer returns to the pool.
`put(key, payload, checksum, demote=fn)` does the same as `commit` with a callback. Victims' views
are valid until `commit`/`abort` returns. A block whose size class exceeds the capacity
raises `CapacityExceeded` at `reserve`; so does a tier whose blocks are all pinned by
readers. Room held by other open reservations is waited for (up to `commit_wait_s`).

Reading. `get` returns a private copy (`bytes`) and verifies the checksum; `pin` is
the zero-copy path: it returns a `PinnedBlock` whose read-only view stays valid until
`release()` (or the end of its `with` block, or its garbage collection). A pinned block
is never chosen as a victim; if it is deleted, its buffer is reused only once unpinned.
Views derived from a pinned or victim view (slices) must not outlive its release.

Every method is thread-safe (one lock; copies of payloads are done outside it).
"""

from __future__ import annotations

import collections
import mmap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from quillcache_core.errors import CapacityExceeded, InvalidArgument
from quillcache_core.model import KvBlockKey
from quillcache_core.storeclient.blockcodec import CorruptBlock, payload_checksum
from quillcache_store.tiers.dram_arena import DramArena

KIB = 1024
MIB = 1024 * KIB
_CLASS_STEP = 64 * KIB
_MIN_CLASS = 256
_MMAP_MIN_BYTES = 1 * MIB


def size_class(nbytes: int) -> int:
    """The pooled buffer size for a payload of `nbytes` bytes."""
    if nbytes < 0:
        raise InvalidArgument(f"negative block size {nbytes}")
    if nbytes <= _CLASS_STEP:
        return max(_MIN_CLASS, 1 << (max(nbytes, 1) - 1).bit_length())
    return -(-nbytes // _CLASS_STEP) * _CLASS_STEP


def _allocate(nbytes: int) -> bytearray | mmap.mmap:
    if nbytes >= _MMAP_MIN_BYTES:
        try:
            buf = mmap.mmap(-1, nbytes)
        except OSError:
            return bytearray(nbytes)
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError, ValueError):
            pass
        return buf
    return bytearray(nbytes)


class _Entry:
    __slots__ = ("key", "buf", "size_class", "nbytes", "checksum", "pins", "evicting", "dead")

    def __init__(self, key, buf, cls, nbytes, checksum):
        self.key = key
        self.buf = buf
        self.size_class = cls
        self.nbytes = nbytes
        self.checksum = checksum
        self.pins = 0
        self.evicting = False
        self.dead = False

    def view(self) -> memoryview:
        return memoryview(self.buf)[: self.nbytes].toreadonly()


@dataclass(slots=True)
class Victim:
    """A block chosen for eviction by `reserve`. `payload` is valid until commit/abort."""

    key: KvBlockKey
    payload: memoryview
    checksum: int
    nbytes: int
    _entry: _Entry | None = None


@dataclass(frozen=True, slots=True)
class Evicted:
    """A block that left the tier to make room (returned by `put`)."""

    key: KvBlockKey
    nbytes: int
    checksum: int


class Reservation:
    """Room for one block, pending `DramTier.commit` or `DramTier.abort`.

    Usable as a context manager: leaving the block without a commit aborts it.
    """

    __slots__ = ("key", "nbytes", "size_class", "victims", "state", "_tier")

    def __init__(self, tier: DramTier, key: KvBlockKey, nbytes: int, cls: int, victims):
        self._tier = tier
        self.key = key
        self.nbytes = nbytes
        self.size_class = cls
        self.victims: list[Victim] = victims
        self.state = "open"

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        if self.state == "open":
            self._tier.abort(self)


class PinnedBlock:
    """A zero-copy read of a DRAM block; `payload` is valid until `release()`."""

    __slots__ = ("key", "payload", "checksum", "_tier", "_entry")

    def __init__(self, tier, entry: _Entry | None, key, payload: memoryview, checksum: int):
        self._tier = tier
        self._entry = entry
        self.key = key
        self.payload = payload
        self.checksum = checksum

    def release(self) -> None:
        entry, self._entry = self._entry, None
        if entry is not None:
            self._release_view()
            self._tier._unpin_entry(entry)

    def _release_view(self) -> None:
        try:
            self.payload.release()
        except BufferError:
            pass  # the caller exported it further; the buffer is still not reused early

    def __enter__(self) -> PinnedBlock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        entry, self._entry = self._entry, None
        if entry is not None:
            # Never take the lock from a finalizer: defer to the next locked call.
            self._tier._deferred_unpins.append(entry)


class DramTier:
    """LRU byte budget over pooled buffers. See the module docstring for the protocol."""

    def __init__(
        self, capacity_bytes: int, *, commit_wait_s: float = 30.0, prefault: bool = False
    ) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgument(f"DRAM capacity must be positive, got {capacity_bytes}")
        self._capacity = int(capacity_bytes)
        # With `prefault`, new buffers are carved from memory touched in the background.
        self._arena = DramArena(self._capacity) if prefault else None
        self._commit_wait_s = commit_wait_s
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._lru: collections.OrderedDict[KvBlockKey, _Entry] = collections.OrderedDict()
        self._free: dict[int, list] = {}
        self._deferred_unpins: collections.deque[_Entry] = collections.deque()
        # Accounting, in size-class bytes:
        self._resident = 0  # entries in the map (including in-flight victims)
        self._retired = 0  # removed entries whose buffer is still pinned
        self._evicting = 0  # in-flight victims of open reservations
        self._reserved = 0  # open reservations (room promised, buffer not yet in the map)
        self._inhand = 0  # buffers taken by a commit, being filled
        self._free_bytes = 0
        self._payload_bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._corrupt = 0
        self._allocations = 0
        self._reuses = 0
        self._dropped = 0

    # --- properties and sizes --------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def _logical(self) -> int:
        return self._resident + self._retired - self._evicting + self._reserved

    def _physical(self) -> int:
        return self._resident + self._retired + self._free_bytes + self._inhand

    # --- writing ---------------------------------------------------------------------

    def reserve(self, key: KvBlockKey, nbytes: int, *, headroom_bytes: int = 0) -> Reservation:
        """Promise room for a block of `nbytes`, choosing victims (coldest first).

        Victims stay readable until `commit`. When victims are needed at all, more are
        chosen as long as the extra room stays within `headroom_bytes`, so that one
        demotion batch makes room for the next few blocks too. When the room is held by
        other open reservations, waits (up to `commit_wait_s`) for them to finish.
        Raises CapacityExceeded when the block's size class exceeds the capacity, or
        when the blocks that could be evicted (not pinned, not in flight) cannot make
        room.
        """
        cls = size_class(nbytes)
        if cls > self._capacity:
            raise CapacityExceeded(
                f"block of {nbytes} bytes (class {cls}) exceeds the DRAM tier capacity "
                f"of {self._capacity} bytes"
            )
        deadline = None
        with self._cond:
            while True:
                self._drain_deferred()
                chosen = self._choose_victims(key, cls, headroom_bytes)
                if chosen is not None:
                    break
                if not (self._reserved or self._evicting):
                    raise CapacityExceeded(
                        f"DRAM tier cannot make room for {cls} bytes: {self._capacity} "
                        f"bytes capacity, {self._retired} bytes held by readers, the rest "
                        f"pinned"
                    )
                if deadline is None:
                    deadline = time.monotonic() + self._commit_wait_s
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CapacityExceeded(
                        f"DRAM tier stayed full of pinned or in-flight blocks for "
                        f"{self._commit_wait_s}s; no room for {cls} bytes"
                    )
                self._cond.wait(min(remaining, 0.5))
            victims = []
            for entry in chosen:
                entry.evicting = True
                entry.pins += 1
                self._evicting += entry.size_class
                victims.append(Victim(entry.key, entry.view(), entry.checksum, entry.nbytes, entry))
            self._reserved += cls
            return Reservation(self, key, nbytes, cls, victims)

    def _choose_victims(self, key, cls: int, headroom: int) -> list[_Entry] | None:
        """Coldest evictable entries making room for `cls` bytes; None if impossible."""
        need = self._logical() + cls - self._capacity
        if need <= 0:
            return []
        chosen: list[_Entry] = []
        freed = 0
        for entry in self._lru.values():
            if entry.pins or entry.evicting or entry.key == key:
                continue
            if freed >= need and freed - need + entry.size_class > headroom:
                break
            chosen.append(entry)
            freed += entry.size_class
        return chosen if freed >= need else None

    def commit(
        self, reservation: Reservation, payload: bytes | bytearray | memoryview, checksum: int
    ) -> list[KvBlockKey]:
        """Free the reservation's victims, then store `payload` under its key.

        Returns the victims that had been deleted meanwhile (by `delete`), so a caller
        that copied them elsewhere can drop that copy. Replaces an existing block of
        the same key. Raises CapacityExceeded if pinned or in-flight buffers keep the
        pool full for longer than `commit_wait_s`: the block is then not stored, but the
        victims are gone all the same (the exception's `deleted` lists those deleted
        meanwhile, as above).
        """
        view = memoryview(payload)
        if view.nbytes != reservation.nbytes:
            raise InvalidArgument(
                f"payload is {view.nbytes} bytes, reservation was for {reservation.nbytes}"
            )

        def write(target: memoryview) -> None:
            target[:] = view

        return self._commit(reservation, write, checksum, replace_early=True)

    def commit_fill(
        self, reservation: Reservation, fill: Callable[[memoryview], None], checksum: int
    ) -> list[KvBlockKey]:
        """Like `commit`, but `fill(view)` writes the payload straight into the pooled
        buffer (e.g. `socket.recv_into` and a checksum check), so its bytes are copied
        once. `fill` runs without the tier's lock and must fill the whole view or raise.

        If `fill` raises, nothing is stored: a block already held under the key stays,
        the buffer goes back to the pool, and the exception propagates with `.deleted`
        set as for CapacityExceeded above (the victims are gone all the same).
        """
        return self._commit(reservation, fill, checksum, replace_early=False)

    def _commit(self, reservation: Reservation, write, checksum: int, *, replace_early: bool):
        if reservation.state != "open":
            raise InvalidArgument(f"reservation is already {reservation.state}")
        cls = reservation.size_class
        nbytes = reservation.nbytes
        with self._cond:
            self._drain_deferred()
            reservation.state = "committed"
            deleted = self._settle_victims(reservation, evict=True)
            old = self._lru.get(reservation.key) if replace_early else None
            if old is not None:
                self._unlink(old)
            try:
                buf = self._take_buffer(cls, reservation)
            except CapacityExceeded as exc:
                reservation.state = "failed"
                exc.deleted = deleted  # the victims are gone all the same
                raise
        if buf is None:
            buf = (self._arena.carve(cls) if self._arena is not None else None) or _allocate(cls)
        try:
            write(memoryview(buf)[:nbytes])
        except BaseException as exc:
            with self._cond:
                reservation.state = "failed"
                self._inhand -= cls
                self._reserved -= cls
                self._free.setdefault(cls, []).append(buf)
                self._free_bytes += cls
                self._cond.notify_all()
            exc.deleted = deleted
            raise
        entry = _Entry(reservation.key, buf, cls, nbytes, checksum)
        with self._cond:
            old = self._lru.get(reservation.key)
            if old is not None:
                self._unlink(old)
            self._inhand -= cls
            self._reserved -= cls
            self._lru[reservation.key] = entry
            self._resident += cls
            self._payload_bytes += entry.nbytes
            self._cond.notify_all()
        return deleted

    def abort(self, reservation: Reservation) -> None:
        """Give the reservation's room back; its victims stay (still the coldest)."""
        with self._cond:
            if reservation.state != "open":
                return
            reservation.state = "aborted"
            self._settle_victims(reservation, evict=False)
            self._reserved -= reservation.size_class
            self._cond.notify_all()

    def put(
        self,
        key: KvBlockKey,
        payload: bytes | bytearray | memoryview,
        checksum: int,
        *,
        demote: Callable[[list[Victim]], None] | None = None,
    ) -> list[Evicted]:
        """Store a block, evicting the coldest blocks to make room.

        `demote(victims)` is called before the victims are freed (with their bytes still
        valid); if it raises, nothing changes and the exception propagates. Returns the
        evicted blocks (key, size, checksum), coldest first. Storing the same bytes
        again (same length and checksum) only refreshes the block's recency.
        """
        nbytes = memoryview(payload).nbytes
        if self.refresh(key, nbytes, checksum):
            return []
        reservation = self.reserve(key, nbytes)
        try:
            if demote is not None and reservation.victims:
                demote(reservation.victims)
        except BaseException:
            self.abort(reservation)
            raise
        gone = set(self.commit(reservation, payload, checksum))
        return [
            Evicted(v.key, v.nbytes, v.checksum) for v in reservation.victims if v.key not in gone
        ]

    # --- reading ---------------------------------------------------------------------

    def get(self, key: KvBlockKey, *, verify: bool = True) -> tuple[bytes, int] | None:
        """A copy of the block's payload and its checksum, or None; refreshes recency.

        With `verify` the copy is checked against the stored checksum; on a mismatch
        the block is dropped, counted and `CorruptBlock` is raised.
        """
        block = self.pin(key)
        if block is None:
            return None
        try:
            data = bytes(block.payload)
            expected = block.checksum
        finally:
            block.release()
        if verify and payload_checksum(data) != expected:
            self._drop_corrupt(key, expected)
            raise CorruptBlock(
                f"DRAM copy of block {key.block_hash} failed its checksum", key, len(data)
            )
        return data, expected

    def pin(self, key: KvBlockKey) -> PinnedBlock | None:
        """A zero-copy, read-only view of the block (see `PinnedBlock`), or None."""
        with self._lock:
            self._drain_deferred()
            entry = self._lru.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._hits += 1
            if entry.evicting:
                # In flight to another tier: serve a copy so the victim's buffer is never
                # held past its commit.
                data = bytes(entry.view())
                return PinnedBlock(self, None, key, memoryview(data).toreadonly(), entry.checksum)
            self._lru.move_to_end(key)
            entry.pins += 1
            return PinnedBlock(self, entry, key, entry.view(), entry.checksum)

    def refresh(self, key: KvBlockKey, nbytes: int, checksum: int) -> bool:
        """Mark the block most recently used if it holds these bytes (length, checksum)."""
        with self._lock:
            entry = self._lru.get(key)
            if entry is None or entry.evicting:
                return False
            if entry.nbytes != nbytes or entry.checksum != checksum:
                return False
            self._lru.move_to_end(key)
            return True

    def contains(self, key: KvBlockKey) -> bool:
        with self._lock:
            return key in self._lru

    def info(self, key: KvBlockKey) -> tuple[int, int] | None:
        """(payload length, checksum) of a block without touching it, or None."""
        with self._lock:
            entry = self._lru.get(key)
            return None if entry is None else (entry.nbytes, entry.checksum)

    def keys(self) -> list[KvBlockKey]:
        """Resident keys, coldest first."""
        with self._lock:
            return list(self._lru)

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    # --- removing --------------------------------------------------------------------

    def delete(self, key: KvBlockKey) -> bool:
        """Remove a block; its buffer is reused once no reader pins it."""
        with self._cond:
            self._drain_deferred()
            entry = self._lru.get(key)
            if entry is None:
                return False
            self._unlink(entry)
            self._cond.notify_all()
            return True

    def trim(self) -> int:
        """Drop every free buffer; returns the bytes released."""
        with self._lock:
            freed = self._free_bytes
            for bufs in self._free.values():
                for buf in bufs:
                    self._forget(buf)
            self._free.clear()
            self._free_bytes = 0
            self._dropped += freed
            return freed

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._drain_deferred()
            return {
                "capacity": self._capacity,
                "bytes": self._payload_bytes,
                "blocks": len(self._lru),
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
                "corrupt_blocks": self._corrupt,
                "resident_bytes": self._resident,
                "retired_bytes": self._retired,
                "free_bytes": self._free_bytes,
                "pool_bytes": self._physical(),
                "reserved_bytes": self._reserved,
                "buffer_allocations": self._allocations,
                "buffer_reuses": self._reuses,
                "buffer_bytes_dropped": self._dropped,
            } | (self._arena.stats() if self._arena is not None else {})

    # --- internals (lock held) -------------------------------------------------------

    def _drain_deferred(self) -> None:
        while self._deferred_unpins:
            self._unpin(self._deferred_unpins.popleft())

    def _unpin_entry(self, entry: _Entry) -> None:
        with self._cond:
            self._unpin(entry)
            self._drain_deferred()

    def _unpin(self, entry: _Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0 and entry.dead:
            self._recycle(entry)

    def _unlink(self, entry: _Entry) -> None:
        """Take an entry out of the map; its buffer is recycled once unpinned."""
        del self._lru[entry.key]
        entry.dead = True
        self._resident -= entry.size_class
        self._payload_bytes -= entry.nbytes
        self._retired += entry.size_class
        if entry.pins == 0:
            self._recycle(entry)

    def _recycle(self, entry: _Entry) -> None:
        self._retired -= entry.size_class
        if entry.buf is not None:
            self._free.setdefault(entry.size_class, []).append(entry.buf)
            self._free_bytes += entry.size_class
            entry.buf = None
        self._cond.notify_all()

    def _settle_victims(self, reservation: Reservation, *, evict: bool) -> list[KvBlockKey]:
        deleted = []
        for victim in reservation.victims:
            entry = victim._entry
            victim._entry = None
            try:
                victim.payload.release()
            except BufferError:
                pass
            if entry is None:
                continue
            entry.evicting = False
            self._evicting -= entry.size_class
            if entry.dead:
                deleted.append(entry.key)
            elif evict:
                self._unlink(entry)
                self._evictions += 1
            self._unpin(entry)
        return deleted

    def _take_buffer(self, cls: int, reservation: Reservation):
        """A free buffer of class `cls`, or None after making room for a new one."""
        free = self._free.get(cls)
        if free:
            buf = free.pop()
            self._free_bytes -= cls
            self._inhand += cls
            self._reuses += 1
            return buf
        deadline = None
        while True:
            self._drop_free_until(self._capacity - cls)
            if self._physical() + cls <= self._capacity:
                self._inhand += cls
                self._allocations += 1
                return None
            # Other reservations' victims are still being demoted: wait for them.
            if deadline is None:
                deadline = time.monotonic() + self._commit_wait_s
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._reserved -= cls
                raise CapacityExceeded(
                    f"DRAM tier stayed full of pinned or in-flight buffers for "
                    f"{self._commit_wait_s}s; block {reservation.key.block_hash} not stored"
                )
            self._cond.wait(min(remaining, 0.5))
            self._drain_deferred()
            free = self._free.get(cls)
            if free:
                return self._take_buffer(cls, reservation)

    def _drop_free_until(self, limit: int) -> None:
        if self._physical() <= limit:
            return
        for cls in sorted(self._free, reverse=True):
            bufs = self._free[cls]
            while bufs and self._physical() > limit:
                self._forget(bufs.pop())
                self._free_bytes -= cls
                self._dropped += cls
            if not bufs:
                del self._free[cls]
            if self._physical() <= limit:
                return

    def _forget(self, buf) -> None:
        """A free buffer dropped: one carved from the prefaulted arena gives its pages back."""
        if self._arena is not None:
            self._arena.release(buf)

    def _drop_corrupt(self, key: KvBlockKey, checksum: int) -> None:
        with self._cond:
            entry = self._lru.get(key)
            if entry is not None and entry.checksum == checksum and not entry.evicting:
                self._unlink(entry)
            self._corrupt += 1
