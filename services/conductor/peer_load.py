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

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from quillcache_conductor.ledger import ReservationLedger
from quillcache_conductor.records import Reservation
from quillcache_conductor.state import ConductorState
from quillcache_core.model import CacheResidency

logger = logging.getLogger(__name__)

MAX_PEER_RESERVATIONS = 200_000  # per peer: a bound, a peer gone mad cannot exhaust us
# A peer that opened a reservation this recently plans (`planning`); one that did not
# is a standby, to which this replica's own reservations may go coalesced.
PLANNING_S = 2.0


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
class PeerView:
    id: str
    start_time_s: float
    last_heard_s: float
    held: set[str] = field(default_factory=set)  # its open reservations' ids
    opened: int = 0
    closed: int = 0
    last_opened_s: float = -math.inf  # when a message of it last opened a reservation


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
        # Every peer's reservations: each releases the engine entry it charged.
        self.ledger = ReservationLedger(state.optimistic)
        self._owner: dict[str, str] = {}  # reservation id -> peer
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
        if opened:
            view.last_opened_s = now
        for load in opened:
            self._open(view, load, now)
        for res_id in prefilled:  # its first token came: its prefill is done
            if res_id in view.held:
                self.ledger.release_prefill(self.ledger.open[res_id])
        for load in closed:
            self._close(view, load, now)

    def planning(self, peer_id: str, within_s: float = PLANNING_S) -> bool:
        """Whether the peer opened a reservation in the last `within_s` (it plans; a
        standby does not)."""
        view = self.peers.get(peer_id)
        return view is not None and self.clock() - view.last_opened_s <= within_s

    def any_planning(self, within_s: float = PLANNING_S) -> bool:
        """Whether some peer opened a reservation in the last `within_s`."""
        since = self.clock() - within_s
        return any(view.last_opened_s >= since for view in self.peers.values())

    def _open(self, view: PeerView, load: OpenedLoad, now: float) -> None:
        if (
            load.reservation_id in view.held
            or load.reservation_id in self.ledger
            or len(view.held) >= MAX_PEER_RESERVATIONS
        ):
            return
        info = self.state.engine_info(load.engine_id)
        res = Reservation(
            id=load.reservation_id,
            engine_id=load.engine_id,
            prefill_tokens=load.prefill_tokens,
            blocks=load.blocks,
            created_s=now,
            expires_s=now + max(0.0, load.expires_s),
        )
        due = now + load.prefill_s if load.prefill_tokens and load.prefill_s > 0 else None
        self.ledger.add(res, info.state if info is not None else None, due, load.records)
        view.held.add(res.id)
        self._owner[res.id] = view.id
        view.opened += 1

    def _close(self, view: PeerView, load: ClosedLoad, now: float) -> None:
        if load.reservation_id not in view.held:
            return  # opened before our snapshot and closed since, or already expired
        view.held.discard(load.reservation_id)
        self._owner.pop(load.reservation_id, None)
        view.closed += 1
        res = self.ledger.close(load.reservation_id)
        if load.resident and res.optimistic:
            self.state.index.put_many(res.optimistic)
        if load.linger_s > 0 and res.optimistic:
            self.ledger.linger(res, now + load.linger_s)
        else:
            self.ledger.forget(res)

    # --- time and loss -------------------------------------------------------------------

    def tick(self) -> None:
        """`release_due`, and drop peers silent for `silence_s`."""
        now = self.release_due()
        for view in [v for v in self.peers.values() if now - v.last_heard_s > self.silence_s]:
            self.dropped_silent += 1
            self.drop_peer(view.id, why=f"silent for {now - view.last_heard_s:.1f}s")

    def release_due(self) -> float:
        """Release due prefill tokens, expire reservations past their TTL, forget
        lingering overlays (every plan does it first: what it weighs is current).
        Returns the time it went by."""
        now = self.clock()
        for res in self.ledger.advance(now):
            view = self.peers.get(self._owner.pop(res.id, ""))
            if view is not None:
                view.held.discard(res.id)
            self.expired += 1
            self.ledger.forget(res)
        return now

    def drop_peer(self, peer_id: str, *, why: str) -> int:
        """Take back all a peer's load and overlay. Returns the reservations dropped."""
        view = self.peers.pop(peer_id, None)
        if view is None:
            return 0
        for res_id in view.held:
            self._owner.pop(res_id, None)
            res = self.ledger.close(res_id)
            if res is not None:
                self.ledger.forget(res)
        if view.held:
            logger.info(
                "conductor %s: dropped its %d reservations here (%s)", peer_id, len(view.held), why
            )
        return len(view.held)

    def engine_restarted(self, engine_id: str) -> None:
        """The engine's cache is empty now: the peers' optimistic records on it go (their
        load stays: their requests are the old run's, released as they close)."""
        self.ledger.forget_engine(engine_id)

    def open_reservations(self) -> int:
        return len(self.ledger)
