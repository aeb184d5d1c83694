"""The conductor's bookkeeping records: reservations, engines, departures, counters,
plan outcomes (used by `state.ConductorState` and the modules around it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from quillcache_core.model import CacheResidency, WorkerState
from quillcache_core.registry import NodeRecord
from quillcache_core.routing import disagg
from quillcache_core.routing.policy import PlanDecision

OUTCOMES = ("success", "error", "cancelled")
# After a successful Finish on an engine that publishes KV events, its optimistic records
# stay this long: the Finish can reach the conductor before the engine's own events for
# the request do (another socket; a subscription still connecting), and a repeat of the
# prompt planned in between must still find them.
OPTIMISTIC_LINGER_S = 2.0


@dataclass(slots=True)
class Reservation:
    id: str
    engine_id: str
    prefill_tokens: int
    blocks: int
    created_s: float
    expires_s: float
    prefill_released: bool = False
    model_id: str = ""
    # The prefill tokens of a request, the prefill tokens queued ahead of it on its
    # engine when it was planned (counted by the reservations, every replica's), and,
    # for one planned on an idle engine that fetches, what the default cost model prices
    # its fetches at: with its TTFT, a sample of the engines' prefill speed (no fetch)
    # or of the fetch price (-1: not a sample).
    sample_tokens: int = -1
    sample_ahead: int = 0
    sample_fetch_us: float = 0.0
    # The measured TTFT it was learned from, once it was (0: it taught nothing).
    sample_ttft_us: float = 0.0
    # The blocks its plan claimed in the engine's HBM (a prefix of the prompt's), and
    # the ones it has the engine load from the pool after them, as many as the engine
    # can report cached (ConductorState._expect_cached).
    hit_blocks: int = 0
    fetch_blocks: int = 0
    # Blocks recorded on the engine at plan time (in the state's overlay); made
    # resident on success, taken back if the request fails or expires.
    optimistic: list[CacheResidency] = field(default_factory=list)


@dataclass(slots=True)
class EngineInfo:
    record: NodeRecord
    state: WorkerState


@dataclass(slots=True)
class Departure:
    """A node whose registry record went, in its leave grace (`node_left`). While
    `held` it is still in `engines`/`stores` (routable); else out of them, only its
    residency records kept until `drop_s`."""

    kind: str
    record: NodeRecord
    left_s: float
    drop_s: float
    routable_until_s: float
    held: bool
    info: EngineInfo | None = None  # an excluded engine's entry, restored if it returns


@dataclass(slots=True)
class Counters:
    plans: int = 0
    finishes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    reservations_expired: int = 0
    guard_refusals: int = 0
    observed_blocks: int = 0
    store_events: int = 0
    departed_records_dropped: int = 0
    restart_records_dropped: int = 0
    nodes_returned: int = 0  # came back within their leave grace (same run)
    nodes_dropped_after_grace: int = 0
    # Engine id -> Finishes whose delivered hits corrected the engine's residency (lost
    # planned blocks dropped, unknown held ones recorded); an entry per engine corrected.
    residency_corrections: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PlanOutcome:
    reservation_id: str
    decision: PlanDecision
    # Prefill/decode disaggregation: the choice, and the prefill's own reservation.
    split: disagg.SplitChoice | None = None
    prefill_reservation_id: str = ""
