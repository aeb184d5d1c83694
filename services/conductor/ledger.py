"""Open reservations and the load they hold: the one owner of both.

A reservation charges its engine's `WorkerState` when it opens: one in-flight request
and running decode, the prefill tokens its plan leaves to compute, its blocks. Its
prefill tokens are released when due (the estimated TTFT has passed, or the first token
was reported), the rest when it closes or its TTL passes. The overlay records it holds
(`overlay`, the plans' view of what engines are about to compute) go with it, or linger
a little after a successful close (the engine's own events may still be on their way).

Two owners keep a ledger: the state, for this replica's plans (and the prefill half of
a split), and `PeerLoad`, for the reservations other replicas stream here. They differ
in one thing, which engine entry a close releases: the state's is the engine's entry as
it is then (`resolve`; an engine in its leave grace still releases), a peer's the entry
charged at open.

Called from the conductor's event loop only. No clock: callers pass `now`.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from quillcache_conductor import overlay
from quillcache_conductor.records import Reservation
from quillcache_core.model import CacheResidency, WorkerState


class ReservationLedger:
    def __init__(
        self,
        optimistic: overlay.Overlay,
        *,
        resolve: Callable[[Reservation], WorkerState | None] | None = None,
        on_release: Callable[[Reservation, WorkerState], None] | None = None,
    ) -> None:
        self.optimistic = optimistic  # shared by every ledger of the conductor
        self.open: dict[str, Reservation] = {}
        self._resolve = resolve
        self._on_release = on_release
        self._charged: dict[str, WorkerState | None] = {}  # without `resolve`: by id
        self._prefill_due: list[tuple[float, str]] = []
        self._expiry: list[tuple[float, str]] = []
        self._lingering: deque[tuple[float, Reservation]] = deque()

    def __len__(self) -> int:
        return len(self.open)

    def __contains__(self, reservation_id: str) -> bool:
        return reservation_id in self.open

    def get(self, reservation_id: str) -> Reservation | None:
        return self.open.get(reservation_id)

    def on_engine(self, engine_id: str) -> list[Reservation]:
        return [res for res in self.open.values() if res.engine_id == engine_id]

    # --- opening ---------------------------------------------------------------------

    def add(
        self,
        res: Reservation,
        worker: WorkerState | None,
        prefill_due_s: float | None,
        records: Sequence[CacheResidency] = (),
    ) -> None:
        """Open `res` and charge `worker` (None: an engine not known here, nothing is
        charged). Its prefill is released at `prefill_due_s`; None: at once. `records`
        are overlay records it brings (a peer's), put in the overlay now."""
        self.open[res.id] = res
        if self._resolve is None:
            self._charged[res.id] = worker
        if worker is not None:
            worker.inflight_requests += 1
            worker.running_decodes += 1
            worker.queued_prefill_tokens += res.prefill_tokens
            worker.inflight_blocks += res.blocks
        if records:
            res.optimistic = list(records)
            slot = self.optimistic.setdefault
            for made in res.optimistic:
                slot(made[0][5], []).append(made)  # key.block_hash
        if prefill_due_s is not None:
            heapq.heappush(self._prefill_due, (prefill_due_s, res.id))
        elif res.prefill_tokens:
            self.release_prefill(res)
        heapq.heappush(self._expiry, (res.expires_s, res.id))

    def shrink_prefill(self, res: Reservation, worker: WorkerState, tokens: int) -> None:
        """Its plan now leaves only `tokens` to prefill on `worker` (a split: the rest is
        another engine's)."""
        if not res.prefill_released:
            worker.queued_prefill_tokens = max(
                0, worker.queued_prefill_tokens - res.prefill_tokens + tokens
            )
        res.prefill_tokens = tokens

    # --- releasing -------------------------------------------------------------------

    def _worker(self, res: Reservation) -> WorkerState | None:
        if self._resolve is not None:
            return self._resolve(res)
        return self._charged.get(res.id)

    def release_prefill(self, res: Reservation) -> None:
        """Its prefill is done: its tokens no longer queue on its engine (once)."""
        if res.prefill_released:
            return
        res.prefill_released = True
        worker = self._worker(res)
        if worker is not None:
            worker.queued_prefill_tokens = max(0, worker.queued_prefill_tokens - res.prefill_tokens)

    def _release(self, res: Reservation) -> None:
        self.release_prefill(res)
        worker = self._worker(res)
        self._charged.pop(res.id, None)
        if worker is None:
            return
        worker.inflight_requests = max(0, worker.inflight_requests - 1)
        worker.running_decodes = max(0, worker.running_decodes - 1)
        worker.inflight_blocks = max(0, worker.inflight_blocks - res.blocks)
        if self._on_release is not None:
            self._on_release(res, worker)

    def close(self, reservation_id: str) -> Reservation | None:
        """Close an open reservation and release its load; None if it is not open. Its
        overlay records stay until `forget` or `linger` says what becomes of them."""
        res = self.open.pop(reservation_id, None)
        if res is not None:
            self._release(res)
        return res

    def drop(self, reservation_id: str) -> Reservation | None:
        """Close it without releasing load: its engine is gone, and its entry with it."""
        self._charged.pop(reservation_id, None)
        return self.open.pop(reservation_id, None)

    # --- the overlay -----------------------------------------------------------------

    def forget(self, res: Reservation) -> None:
        """Take the reservation's overlay records back."""
        overlay.forget(self.optimistic, res.optimistic)
        res.optimistic = []

    def linger(self, res: Reservation, until_s: float) -> None:
        """Keep a closed reservation's overlay records until `until_s`."""
        self._lingering.append((until_s, res))

    def lingering(self) -> Iterator[tuple[float, Reservation]]:
        return iter(self._lingering)

    def forget_engine(self, engine_id: str) -> None:
        """The engine's cache is empty: no record of an open or lingering reservation
        may claim anything there."""
        for res in self.open.values():
            if res.engine_id == engine_id:
                self.forget(res)
        if any(res.engine_id == engine_id for _, res in self._lingering):
            kept = deque()
            for item in self._lingering:
                if item[1].engine_id == engine_id:
                    self.forget(item[1])
                else:
                    kept.append(item)
            self._lingering = kept

    # --- time ------------------------------------------------------------------------

    def prefill_due_at(self) -> dict[str, float]:
        """Reservation id -> when its prefill is due (those not yet released)."""
        return {res_id: at for at, res_id in self._prefill_due}

    def advance(self, now: float) -> list[Reservation]:
        """Forget overlays whose linger is over, release prefills that are due, and
        close the reservations past their TTL (load released). Returns those expired:
        their overlay records are the caller's to forget."""
        lingering = self._lingering
        while lingering and lingering[0][0] <= now:
            self.forget(lingering.popleft()[1])
        if len(self._expiry) > 2 * len(self.open) + 1024:
            # Closed reservations leave stale heap entries; rebuild from the open ones.
            self._expiry = [(r.expires_s, r.id) for r in self.open.values()]
            heapq.heapify(self._expiry)
            self._prefill_due = [e for e in self._prefill_due if e[1] in self.open]
            heapq.heapify(self._prefill_due)
        while self._prefill_due and self._prefill_due[0][0] <= now:
            _, res_id = heapq.heappop(self._prefill_due)
            res = self.open.get(res_id)
            if res is not None and not res.prefill_released:
                self.release_prefill(res)
        expired = []
        while self._expiry and self._expiry[0][0] <= now:
            _, res_id = heapq.heappop(self._expiry)
            res = self.close(res_id)
            if res is not None:
                expired.append(res)
        return expired
