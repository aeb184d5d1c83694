"""The other conductor replicas' reservations, counted here as if made here. Pure: no
gRPC, no sockets; the clock is injected.

A reservation another replica opens adds, like one of ours, one in-flight request and
running decode, its prefill tokens (until its TTFT has passed) and its blocks to its
engine's `WorkerState`, and its optimistic blocks to the state's overlay, so the next
plan here sees both. Its close takes them back (the overlay after the linger the
origin asks for; into the index when the engine publishes no events).

Nothing of a peer outlives its silence: a peer not heard from for `silence_s` (its
heartbeats stopped: dead, stalled, cut off) loses everything it held here, and a
reservation past its own TTL is released even if its close never comes. A snapshot
(a reconnect, the peer's restart) replaces all that was known of the peer.

Single-threaded by contract, like ConductorState: called from the event loop only.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from quillcache_conductor.records import Reservation
from quillcache_conductor.state import ConductorState
from quillcache_core.model import CacheResidency, WorkerState

logger = logging.getLogger(__name__)

MAX_PEER_RESERVATIONS = 200_000  # per peer: a bound, a peer gone mad cannot exhaust us


@dataclass(frozen=True, slots=True)
class OpenedLoad:
    """A reservation a peer opened (its optimistic records as this replica keys them)."""

    reservation_id: str
    engine_id: str
    prefill_tokens: int
    blocks: int
    prefill_s: float
    expires_s: float
    records: list[CacheResidency]


@dataclass(frozen=True, slots=True)
class ClosedLoad:
    reservation_id: str
    linger_s: float = 0.0
    resident: bool = False


@dataclass(slots=True)
class _Held:
    res: Reservation
    worker: WorkerState | None  # the state its load was added to (None: engine unknown)


@dataclass(slots=True)
class PeerView:
    id: str
    start_time_s: float
    last_heard_s: float
    held: dict[str, _Held] = field(default_factory=dict)
    opened: int = 0
    closed: int = 0


class PeerLoad:
    """The load and overlay of every peer replica (see the module doc)."""

    def __init__(
        self, state: ConductorState, *, clock: Callable[[], float], silence_s: float = 2.0
    ) -> None:
        if silence_s <= 0:
            raise ValueError("silence_s must be positive")
        self.state = state
        self.clock = clock
        self.silence_s = silence_s
        self.peers: dict[str, PeerView] = {}
        self._prefill_due: list[tuple[float, str, str]] = []  # (due, peer, reservation)
        self._expiry: list[tuple[float, str, str]] = []
        self._lingering: deque[tuple[float, Reservation]] = deque()
        self.dropped_silent = 0  # peers dropped for silence
        self.expired = 0  # peer reservations released by their TTL, no close seen

    # --- messages ------------------------------------------------------------------------

    def apply(
        self,
        peer_id: str,
        start_time_s: float,
        *,
        snapshot: bool,
        opened: Sequence[OpenedLoad] = (),
        closed: Sequence[ClosedLoad] = (),
        prefilled: Sequence[str] = (),
    ) -> None:
        """One message of a peer: a heartbeat when empty; opens before first tokens
        before closes (a close in the same message as its open is of a later call)."""
        now = self.clock()
        view = self.peers.get(peer_id)
        if view is not None and (snapshot or view.start_time_s != start_time_s):
            self.drop_peer(peer_id, why="snapshot" if snapshot else "restarted")
            view = None
        if view is None:
            view = self.peers[peer_id] = PeerView(peer_id, start_time_s, now)
        view.last_heard_s = now
        for load in opened:
            self._open(view, load, now)
        for res_id in prefilled:  # its first token came: its prefill is done
            held = view.held.get(res_id)
            if held is not None:
                self._release_prefill(held)
        for load in closed:
            self._close(view, load, now)

    def _open(self, view: PeerView, load: OpenedLoad, now: float) -> None:
        if load.reservation_id in view.held or len(view.held) >= MAX_PEER_RESERVATIONS:
            return
        info = self.state._engine_info(load.engine_id)
        worker = info.state if info is not None else None
        res = Reservation(
            id=load.reservation_id,
            engine_id=load.engine_id,
            prefill_tokens=load.prefill_tokens,
            blocks=load.blocks,
            created_s=now,
            expires_s=now + max(0.0, load.expires_s),
        )
        if worker is not None:
            worker.inflight_requests += 1
            worker.running_decodes += 1
            worker.queued_prefill_tokens += load.prefill_tokens
            worker.inflight_blocks += load.blocks
        if load.records:
            res.optimistic = list(load.records)
            slot = self.state.optimistic.setdefault
            for record in res.optimistic:
                slot(record[0][5], []).append(record)  # key.block_hash
        view.held[res.id] = _Held(res, worker)
        view.opened += 1
        if load.prefill_tokens and load.prefill_s > 0:
            heapq.heappush(self._prefill_due, (now + load.prefill_s, view.id, res.id))
        elif load.prefill_tokens:
            self._release_prefill(view.held[res.id])
        heapq.heappush(self._expiry, (res.expires_s, view.id, res.id))

    def _close(self, view: PeerView, load: ClosedLoad, now: float) -> None:
        held = view.held.pop(load.reservation_id, None)
        if held is None:
            return  # opened before our snapshot and closed since, or already expired
        view.closed += 1
        self._release(held)
        if load.resident and held.res.optimistic:
            self.state.index.put_many(held.res.optimistic)
        if load.linger_s > 0 and held.res.optimistic:
            self._lingering.append((now + load.linger_s, held.res))
        else:
            self.state._forget_optimistic(held.res)

    # --- time and loss -------------------------------------------------------------------

    def tick(self) -> None:
        """Release due prefill tokens, expire reservations past their TTL, forget
        lingering overlays, and drop peers silent for `silence_s`."""
        now = self.clock()
        while self._lingering and self._lingering[0][0] <= now:
            self.state._forget_optimistic(self._lingering.popleft()[1])
        while self._prefill_due and self._prefill_due[0][0] <= now:
            _, peer, res_id = heapq.heappop(self._prefill_due)
            held = self._held(peer, res_id)
            if held is not None:
                self._release_prefill(held)
        while self._expiry and self._expiry[0][0] <= now:
            _, peer, res_id = heapq.heappop(self._expiry)
            view = self.peers.get(peer)
            held = view.held.pop(res_id, None) if view is not None else None
            if held is not None:
                self.expired += 1
                self._release(held)
                self.state._forget_optimistic(held.res)
        for view in [v for v in self.peers.values() if now - v.last_heard_s > self.silence_s]:
            self.dropped_silent += 1
            self.drop_peer(view.id, why=f"silent for {now - view.last_heard_s:.1f}s")
        if len(self._expiry) > 2 * self.open_reservations() + 1024:
            self._expiry = [
                (h.res.expires_s, v.id, r) for v in self.peers.values() for r, h in v.held.items()
            ]
            heapq.heapify(self._expiry)
            self._prefill_due = [e for e in self._prefill_due if self._held(e[1], e[2])]
            heapq.heapify(self._prefill_due)

    def drop_peer(self, peer_id: str, *, why: str) -> int:
        """Take back all a peer's load and overlay. Returns the reservations dropped."""
        view = self.peers.pop(peer_id, None)
        if view is None:
            return 0
        for held in view.held.values():
            self._release(held)
            self.state._forget_optimistic(held.res)
        if view.held:
            logger.info(
                "conductor %s: dropped its %d reservations here (%s)", peer_id, len(view.held), why
            )
        return len(view.held)

    def engine_restarted(self, engine_id: str) -> None:
        """The engine's cache is empty now: the peers' optimistic records on it go (their
        load stays: their requests are the old run's, released as they close)."""
        for view in self.peers.values():
            for held in view.held.values():
                if held.res.engine_id == engine_id:
                    self.state._forget_optimistic(held.res)
        for _, res in self._lingering:
            if res.engine_id == engine_id:
                self.state._forget_optimistic(res)

    def open_reservations(self) -> int:
        return sum(len(v.held) for v in self.peers.values())

    # --- load ----------------------------------------------------------------------------

    def _held(self, peer: str, res_id: str) -> _Held | None:
        view = self.peers.get(peer)
        return view.held.get(res_id) if view is not None else None

    @staticmethod
    def _release_prefill(held: _Held) -> None:
        res = held.res
        if res.prefill_released:
            return
        res.prefill_released = True
        if held.worker is not None:
            held.worker.queued_prefill_tokens = max(
                0, held.worker.queued_prefill_tokens - res.prefill_tokens
            )

    def _release(self, held: _Held) -> None:
        self._release_prefill(held)
        worker = held.worker
        if worker is None:
            return
        worker.inflight_requests = max(0, worker.inflight_requests - 1)
        worker.running_decodes = max(0, worker.running_decodes - 1)
        worker.inflight_blocks = max(0, worker.inflight_blocks - held.res.blocks)
