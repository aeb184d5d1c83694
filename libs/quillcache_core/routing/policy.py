"""The routing policy interface: a policy sees a request, its usable copies and the fleet,
and returns a `PlanDecision` (the engine, the per-block actions, every engine's cost).
"""

from __future__ import annotations

import abc
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

from quillcache_core.model import (
    CacheResidency,
    CostModel,
    RequestShape,
    WorkerState,
)
from quillcache_core.routing.actions import ActionKind, BlockAction, action_runs
from quillcache_core.routing.guard import Refusal

logger = logging.getLogger(__name__)


token_count = itemgetter(7)  # KvBlockKey.token_count, without the property call


@dataclass(slots=True)
class EngineCost:
    """One engine's cost breakdown in microseconds; `score` is a reference policy's own."""

    engine_id: str
    cost_us: float
    est_ttft_us: float = 0.0
    queue_us: float = 0.0
    fetch_us: float = 0.0
    prefill_us: float = 0.0
    decode_us: float = 0.0
    prefix_blocks: int = 0
    hit_blocks: int = 0
    fetch_blocks: int = 0
    score: float = 0.0


class LazyCosts(Sequence[EngineCost]):
    """Other engines' cost breakdowns, built on first use.

    A plan over 64 engines with no `alternatives` cap owes 63 breakdowns; building
    them was about a third of our planner's time while most callers read none or a
    few. `make(i)` builds engine i's from values the plan captured (never from live
    worker state), so a later read sees the costs as of the plan.
    """

    __slots__ = ("_make", "_picked", "_built")

    def __init__(self, make: Callable[[int], EngineCost], picked: list[int]) -> None:
        self._make = make
        self._picked = picked
        self._built: list[EngineCost] | None = None

    def _list(self) -> list[EngineCost]:
        built = self._built
        if built is None:  # two threads may both build: the same values either way
            built = self._built = list(map(self._make, self._picked))
        return built

    def __len__(self) -> int:
        return len(self._picked)

    def __getitem__(self, index):
        return self._list()[index]

    def __iter__(self):
        return iter(self._list())

    def __eq__(self, other) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return self._list() == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"LazyCosts({self._list()!r})"


@dataclass(slots=True)
class PlanDecision:
    policy: str
    engine: WorkerState
    actions: Sequence[BlockAction]  # a list, or ActionRuns
    chosen: EngineCost
    others: Sequence[EngineCost]  # a list, or LazyCosts
    refusals: list[Refusal] = field(default_factory=list)
    # Per block, the residencies the policy saw (set by routing.plan_request).
    usable: Sequence[Sequence[CacheResidency]] | None = None

    def count(self, kind: ActionKind) -> int:
        return sum(1 for action in self.actions if action.kind is kind)

    def recompute_tokens(self, request: RequestShape) -> int:
        """Tokens the engine must prefill: recomputed blocks plus the uncached tail."""
        blocks = request.blocks
        recompute = ActionKind.RECOMPUTE
        reused = sum(
            sum(map(token_count, blocks[run.first : run.first + run.count]))
            for run in action_runs(self.actions)
            if run.kind is not recompute
        )
        return request.input_tokens() - reused


@dataclass(frozen=True, slots=True)
class Fleet:
    """The engines eligible for a request and the live store nodes' locality domains.

    A residency on a worker that is neither one of `engines` nor in `store_domains`
    (a dead node, another engine's HBM) is never used as a source.
    """

    engines: Sequence[WorkerState]
    store_domains: Mapping[str, str]


class Policy(abc.ABC):
    """A routing policy: given the guard's usable residencies, choose an engine."""

    name: str = "abstract"
    # Record a routed request's blocks on its engine at plan time (before the engine
    # reports them), so the next request with that prefix follows it.
    optimistic_residency: bool = False

    def __init__(self, cost_model: CostModel | None = None) -> None:
        self.cost_model = cost_model or CostModel()

    @abc.abstractmethod
    def plan(
        self,
        request: RequestShape,
        usable: Sequence[Sequence[CacheResidency]],
        fleet: Fleet,
        rng: random.Random,
    ) -> PlanDecision:
        """Choose an engine. Raises NodeUnavailable when the fleet has no engine."""
