"""Reference routing policies, behind the same interface as our planner.

Formulas from ../shared/ANCHORS.md (NVIDIA Dynamo's KV router, llm-d's EPP default
scorer weights, SGLang router's cache_aware switch), plus round robin and least-loaded.
They see the same residency our planner sees but reuse only what an engine holds
itself or its own store node holds (as vLLM with a local LMCache/KVBM tier would):
none of them orchestrates peer fetches. Every decision also carries our cost
function's estimate for the chosen engine, so benchmarks compare like with like.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import numpy as np

from quillcache_core.errors import InvalidArgument, NodeUnavailable
from quillcache_core.model import CacheResidency, CacheTier, CostModel, RequestShape, WorkerState
from quillcache_core.routing.cost import actions_for_prefix, estimate, pick_min
from quillcache_core.routing.planner import CostPlanner
from quillcache_core.routing.policy import EngineCost, Fleet, PlanDecision, Policy


def local_prefix_tiers(
    request: RequestShape,
    usable: Sequence[Sequence[CacheResidency]],
    engines: Sequence[WorkerState],
) -> list[list[CacheTier]]:
    """Per engine, the tiers of the contiguous prefix it holds locally (best tier per block).

    Local means on the engine itself or on its own store node. O(residencies + engines).
    """
    holders_of: dict[str, list[int]] = {}
    for i, worker in enumerate(engines):
        holders_of.setdefault(worker.id, []).append(i)
        if worker.store_node_id:
            holders_of.setdefault(worker.store_node_id, []).append(i)
    prefixes: list[list[CacheTier]] = [[] for _ in engines]
    alive = set(range(len(engines)))
    rank = _TIER_RANK
    for found in usable[: len(request.blocks)]:
        best: dict[int, CacheTier] = {}
        for residency in found:
            holders = holders_of.get(residency.worker_id)
            if holders is None:
                continue
            tier = residency.tier
            for holder in holders:
                if holder in alive:
                    current = best.get(holder)
                    if current is None or rank[tier] < rank[current]:
                        best[holder] = tier
        if not best:
            break
        alive = best.keys()
        for holder, tier in best.items():
            prefixes[holder].append(tier)
    return prefixes


_TIER_RANK = {
    CacheTier.HBM: 0,
    CacheTier.REMOTE_HBM: 1,
    CacheTier.CPU_DRAM: 2,
    CacheTier.LOCAL_SSD: 3,
    CacheTier.OBJECT_STORE: 4,
}


class _ReferencePolicy(Policy):
    """Shared plumbing: score engines, pick one, derive local-only actions."""

    # Policies that ignore the cache skip computing every engine's local prefix.
    uses_prefixes = True

    def plan(
        self,
        request: RequestShape,
        usable: Sequence[Sequence[CacheResidency]],
        fleet: Fleet,
        rng: random.Random,
    ) -> PlanDecision:
        engines = list(fleet.engines)
        if not engines:
            raise NodeUnavailable("no engine available for this request")
        if self.uses_prefixes:
            prefixes = local_prefix_tiers(request, usable, engines)
        else:
            prefixes = [[] for _ in engines]
        costs = self.costs(request, engines, prefixes)
        chosen_index = self.choose(costs, engines, prefixes, request, rng)
        engine = engines[chosen_index]
        actions = actions_for_prefix(
            self.cost_model,
            request,
            engine,
            usable,
            fleet.store_domains,
            len(request.blocks),
            local_only=True,
        )
        chosen = estimate(self.cost_model, request, engine, actions)
        chosen.score = float(costs[chosen_index])
        others = [
            EngineCost(
                engine_id=w.id,
                cost_us=float(costs[i]),
                score=float(costs[i]),
                prefix_blocks=len(prefixes[i]),
            )
            for i, w in enumerate(engines)
            if i != chosen_index
        ]
        return PlanDecision(self.name, engine, actions, chosen, others)

    def costs(
        self,
        request: RequestShape,
        engines: Sequence[WorkerState],
        prefixes: Sequence[Sequence[CacheTier]],
    ) -> np.ndarray:
        """Lower is better. Policies that maximise a score return its negation."""
        return np.zeros(len(engines))

    def choose(
        self,
        costs: np.ndarray,
        engines: Sequence[WorkerState],
        prefixes: Sequence[Sequence[CacheTier]],
        request: RequestShape,
        rng: random.Random,
    ) -> int:
        return pick_min(costs, rng)


class DynamoPolicy(_ReferencePolicy):
    """Dynamo's KV router: prefill blocks less tiered credit, plus decode blocks; min wins.

    credit = 1.0*O_device + 0.75*O_host + 0.25*O_disk;
    cost_w = max(0, (active_prefill_tokens_w + ISL)/B - credit) + decode_blocks_w.
    """

    name = "dynamo"

    def __init__(self, cost_model: CostModel | None = None, temperature: float = 0.0) -> None:
        super().__init__(cost_model)
        self.temperature = temperature

    def costs(self, request, engines, prefixes):
        block = request.blocks[0].token_count if request.blocks else 16
        isl = request.input_tokens()
        out = np.empty(len(engines))
        for i, worker in enumerate(engines):
            credit = sum(_DYNAMO_CREDIT[tier] for tier in prefixes[i])
            raw = (worker.queued_prefill_tokens + isl) / block
            out[i] = max(0.0, raw - credit) + worker.inflight_blocks
        return out

    def choose(self, costs, engines, prefixes, request, rng):
        return pick_min(costs, rng, self.temperature)


_DYNAMO_CREDIT = {
    CacheTier.HBM: 1.0,
    CacheTier.REMOTE_HBM: 1.0,
    CacheTier.CPU_DRAM: 0.75,
    CacheTier.LOCAL_SSD: 0.25,
    CacheTier.OBJECT_STORE: 0.25,
}


class LlmdPolicy(_ReferencePolicy):
    """llm-d EPP default weights: 2*queue + 2*(1 - kv_util) + 3*prefix_match; max wins.

    queue(w) = (Q_max - Q_w)/(Q_max - Q_min), 1 if all equal; prefix_match is the matched
    consecutive blocks over all blocks, a GPU hit counting 1.0 and a CPU hit 0.8.
    """

    name = "llm-d"

    def costs(self, request, engines, prefixes):
        queues = np.array([w.inflight_requests for w in engines], dtype=np.float64)
        q_max, q_min = float(queues.max()), float(queues.min())
        if q_max == q_min:
            queue_score = np.ones(len(engines))
        else:
            queue_score = (q_max - queues) / (q_max - q_min)
        kv_score = np.array([1.0 - w.kv_utilisation() for w in engines])
        total = len(request.blocks)
        prefix_score = np.array(
            [
                (sum(1.0 if tier is CacheTier.HBM else 0.8 for tier in tiers) / total)
                if total
                else 0.0
                for tiers in prefixes
            ]
        )
        score = (
            2 * np.clip(queue_score, 0, 1)
            + 2 * np.clip(kv_score, 0, 1)
            + 3 * np.clip(prefix_score, 0, 1)
        )
        return -score


class SglangCacheAwarePolicy(_ReferencePolicy):
    """SGLang router cache_aware: a load switch, else longest prefix, else smallest tree.

    Its radix tree takes a request's text when it is routed, not when the engine
    reports it: hence optimistic residency.
    """

    name = "sglang"
    optimistic_residency = True

    def __init__(
        self,
        cost_model: CostModel | None = None,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        cache_threshold: float = 0.3,
    ) -> None:
        super().__init__(cost_model)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold

    def choose(self, costs, engines, prefixes, request, rng):
        loads = np.array([w.inflight_requests for w in engines], dtype=np.float64)
        high, low = float(loads.max()), float(loads.min())
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            return pick_min(loads, rng)
        isl = max(1, request.input_tokens())
        matched = np.array(
            [_hbm_run_tokens(request, tiers) for tiers in prefixes], dtype=np.float64
        )
        if float(matched.max()) / isl > self.cache_threshold:
            return pick_min(-matched, rng)
        return pick_min(np.array([w.resident_blocks for w in engines], dtype=np.float64), rng)


def _hbm_run_tokens(request: RequestShape, tiers: Sequence[CacheTier]) -> int:
    """Tokens of the leading run of HBM blocks (SGLang's tree sees only device cache)."""
    tokens = 0
    for b, tier in enumerate(tiers):
        if tier is not CacheTier.HBM:
            break
        tokens += request.blocks[b].token_count
    return tokens


class RoundRobinPolicy(_ReferencePolicy):
    """Engines in id order, one after another; ignores cache and load."""

    name = "round-robin"
    uses_prefixes = False

    def __init__(self, cost_model: CostModel | None = None) -> None:
        super().__init__(cost_model)
        self._next = 0

    def choose(self, costs, engines, prefixes, request, rng):
        order = sorted(range(len(engines)), key=lambda i: engines[i].id)
        picked = order[self._next % len(order)]
        self._next += 1
        return picked


class LeastLoadedPolicy(_ReferencePolicy):
    """Fewest in-flight requests; ties at random; ignores cache."""

    name = "least-loaded"
    uses_prefixes = False

    def costs(self, request, engines, prefixes):
        return np.array([w.inflight_requests for w in engines], dtype=np.float64)


POLICY_NAMES = ("quillcache", "dynamo", "llm-d", "sglang", "round-robin", "least-loaded")

_FACTORIES: dict[str, Callable[[CostModel, float], Policy]] = {
    "quillcache": lambda cm, t: CostPlanner(cm, temperature=t),
    "dynamo": lambda cm, t: DynamoPolicy(cm, temperature=t),
    "llm-d": lambda cm, t: LlmdPolicy(cm),
    "sglang": lambda cm, t: SglangCacheAwarePolicy(cm),
    "round-robin": lambda cm, t: RoundRobinPolicy(cm),
    "least-loaded": lambda cm, t: LeastLoadedPolicy(cm),
}


def make_policy(name: str, cost_model: CostModel | None = None, temperature: float = 0.0) -> Policy:
    """A fresh policy by name (see POLICY_NAMES); InvalidArgument for an unknown one."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise InvalidArgument(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return factory(cost_model or CostModel(), temperature)
