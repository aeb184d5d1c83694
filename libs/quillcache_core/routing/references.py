"""Reference routing policies, each as its original routes, behind our planner's interface.

Every reference gets what it gets in reality, no more: its own bookkeeping of the
requests it routed, the engines' KV events (our index, which the simulator feeds
exactly as events would) where the original listens to them, and engine metrics only
where it scrapes them. None of them orchestrates peer fetches: an engine reuses what
it holds itself or its own store node holds (vLLM with a local LMCache/KVBM tier).
Every decision also carries our cost function's estimate for the chosen engine, so
benchmarks compare like with like. Where the source was ambiguous the stronger reading
was taken; each is named below.

**Dynamo KV router** (ai-dynamo/dynamo lib/llm/src/kv_router/scheduler.rs, sequence.rs;
docs/router/kv_cache_routing.md). Minimum wins:

    logit_w = overlap_score_weight * potential_prefill_blocks_w + potential_blocks_w
    potential_prefill_blocks_w = (active_prefill_tokens_w + ISL - credit_w * B) / B
    potential_blocks_w = |unique blocks of w's active requests ∪ this request's blocks|

Defaults `overlap_score_weight` 1.0, `router_temperature` 0 (argmin, random tie-break),
KV events on. Overlap comes from KV events; credit = 1.0 per device block, 0.75 per
host block, 0.25 per disk block of the contiguous prefix (the newer tiered credit of
Dynamo's lib/kv-router). The active-sequence tracking is the router's own: a request's
prefill tokens (ISL less the credit on its engine) count from routing to its first
token, its blocks (each counted once per engine however many requests share it) from
routing to its end. Choice: the blocks of generated tokens are not added (the engines
here never make them resident); the partial last block counts as a block.

**llm-d inference scheduler** (llm-d/llm-d-inference-scheduler
pkg/plugins/scorer/precise_prefix_cache.go and utils.go; gateway-api-inference-extension
queue and kv-cache-utilization scorers; weights precise-prefix 3, kv-cache-utilization 2,
queue 2 as in llm-d's precise-prefix deployment configs). Maximum wins,
ties at random (max-score-picker):

    S_w = 2 * queue_w + 2 * (1 - kv_usage_w) + 3 * prefix_w
    queue_w = (Q_max - Q_w) / (Q_max - Q_min), 1 when all equal; Q = num_requests_waiting
    prefix_w = (P_w - P_min) / (P_max - P_min) over the engines with P > 0 (1 when they
               all score the same), 0 for the others; P_w = consecutive leading blocks
               the index holds for w (computeScoresFromKeyToPods: 1 per block, any tier)

Q and kv_usage are the engines' metrics as last scraped (every 50 ms, GIE's
refresh-metrics-interval); the simulator scrapes at the first decision after each
interval (a little fresher than a timer: the stronger reading). The index is KV events
(device and CPU-tier blocks: an engine's own store node is its CPU tier) plus
speculative entries (speculativeIndexing on, as the precise-prefix guide recommends):
at routing the chosen engine is recorded as holding all the request's blocks until the
entries' TTL (defaultSpeculativeTTL, 30 s in the source; some of
llm-d's prose says about 2 s: the source wins), so a repeat lands there before any event; a BlockRemoved event does not remove
a speculative entry.

**SGLang router, cache_aware** (sgl-project/sglang sgl-router/src/policies/cache_aware.rs,
tree.rs; defaults from the router's CLI: cache_threshold 0.3, balance_abs_threshold 64,
balance_rel_threshold 1.5, eviction every 120 s to max_tree_size 2^26 characters):

    L_w = the router's own count of requests it sent to w and that have not finished
    if max L - min L > 64 and max L > 1.5 * min L: argmin L
    else: longest match of the request against the router's tree of routed prompts;
          match rate > 0.3: a worker holding the deepest matched node, else the worker
          with the fewest characters in the tree
    the routed prompt is inserted for the chosen worker in both branches

The tree never hears of engine evictions. Choices: the tree is kept at block
granularity (a prompt's chained block hashes; a partial last block counts towards the
worker's size but is never matched), "characters" are tokens; the source takes the
first tenant of the deepest node in hash-map order, here one at random.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What a metrics scrape of one engine reports (vLLM's Prometheus gauges)."""

    waiting_requests: int  # vllm:num_requests_waiting
    kv_usage: float  # vllm:gpu_cache_usage_perc, 0..1 (blocks held by running requests)


class _ReferencePolicy(Policy):
    """Shared plumbing: score engines, pick one, derive local-only actions.

    A router's lifecycle signals (the clock, a request's first token and its end, metric
    scrapes) reach it through the `observe_*` hooks; the fleet simulator calls them
    after `bind_lifecycle()`. Without it (the conductor, which does not report them) a
    policy falls back to the load columns of `WorkerState`.
    """

    # Policies that ignore the cache skip computing every engine's local prefix.
    uses_prefixes = True
    # How often the original scrapes engine metrics (µs); 0: it does not.
    scrape_interval_us = 0.0

    def __init__(self, cost_model: CostModel | None = None) -> None:
        super().__init__(cost_model)
        self.lifecycle = False
        self.now_us = 0.0

    def bind_lifecycle(self) -> None:
        """The caller will report the clock, first tokens, ends and scrapes from now on."""
        self.lifecycle = True

    def observe_time(self, now_us: float) -> None:
        self.now_us = now_us

    def observe_prefill_start(self, request_id: str, engine_id: str) -> None:
        """The engine began the request's prefill."""

    def observe_first_token(self, request_id: str, engine_id: str) -> None:
        """The engine produced the request's first token (its prefill is done)."""

    def observe_finished(self, request_id: str, engine_id: str) -> None:
        """The request's stream ended."""

    def observe_metrics(self, metrics: Mapping[str, EngineMetrics]) -> None:
        """A scrape of every engine's metrics."""

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
        costs = self.costs(request, engines, prefixes, usable)
        chosen_index = self.choose(costs, engines, prefixes, request, rng)
        engine = engines[chosen_index]
        self.routed(request, engine, prefixes[chosen_index])
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
        usable: Sequence[Sequence[CacheResidency]],
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

    def routed(
        self, request: RequestShape, engine: WorkerState, prefix: Sequence[CacheTier]
    ) -> None:
        """The router records its own decision (as the original does when it routes)."""


# --- Dynamo ----------------------------------------------------------------------------


_DYNAMO_CREDIT = {
    CacheTier.HBM: 1.0,
    CacheTier.REMOTE_HBM: 1.0,
    CacheTier.CPU_DRAM: 0.75,
    CacheTier.LOCAL_SSD: 0.25,
    CacheTier.OBJECT_STORE: 0.25,
}


def _block_tokens(request: RequestShape) -> int:
    return request.blocks[0].token_count if request.blocks else 16


def _request_hashes(request: RequestShape) -> list[str]:
    """The request's block identities, its partial last block included (as its own key)."""
    hashes = [key.block_hash for key in request.blocks]
    covered = sum(key.token_count for key in request.blocks)
    if request.input_tokens() > covered:
        hashes.append(f"{request.id}#tail")
    return hashes


class DynamoPolicy(_ReferencePolicy):
    """Dynamo's KV router: weighted potential prefill blocks plus potential active blocks."""

    name = "dynamo"

    def __init__(
        self,
        cost_model: CostModel | None = None,
        temperature: float = 0.0,
        overlap_score_weight: float = 1.0,
    ) -> None:
        super().__init__(cost_model)
        self.temperature = temperature
        self.overlap_score_weight = overlap_score_weight
        # The router's own active-sequence tracking, per engine.
        self._blocks: dict[str, dict[str, int]] = {}  # engine -> block -> active requests
        self._prefill_tokens: dict[str, int] = {}  # engine -> tokens still to prefill
        self._requests: dict[str, tuple[str, list[str], int]] = {}  # id -> engine, blocks, tokens

    def active_blocks(self, engine_id: str) -> int:
        """Unique blocks of the requests in flight on the engine (the decode load)."""
        return len(self._blocks.get(engine_id, ()))

    def active_prefill_tokens(self, engine_id: str) -> int:
        return self._prefill_tokens.get(engine_id, 0)

    def _new_tokens(self, request: RequestShape, prefix: Sequence[CacheTier]) -> float:
        credit = sum(_DYNAMO_CREDIT[tier] for tier in prefix)
        return max(0.0, request.input_tokens() - credit * _block_tokens(request))

    def costs(self, request, engines, prefixes, usable):
        block = _block_tokens(request)
        weight = self.overlap_score_weight
        out = np.empty(len(engines))
        if not self.lifecycle:  # no lifecycle reports: the conductor's live load columns
            for i, worker in enumerate(engines):
                prefill = (
                    worker.queued_prefill_tokens + self._new_tokens(request, prefixes[i])
                ) / block
                out[i] = weight * prefill + worker.inflight_blocks + len(request.blocks)
            return out
        hashes = _request_hashes(request)
        for i, worker in enumerate(engines):
            active = self._blocks.get(worker.id)
            if active:
                potential_blocks = len(active) + sum(1 for h in hashes if h not in active)
            else:
                potential_blocks = len(hashes)
            tokens = self._prefill_tokens.get(worker.id, 0) + self._new_tokens(request, prefixes[i])
            out[i] = weight * tokens / block + potential_blocks
        return out

    def choose(self, costs, engines, prefixes, request, rng):
        return pick_min(costs, rng, self.temperature)

    def routed(self, request, engine, prefix):
        if not self.lifecycle:
            return
        hashes = _request_hashes(request)
        tokens = int(round(self._new_tokens(request, prefix)))
        active = self._blocks.setdefault(engine.id, {})
        for h in hashes:
            active[h] = active.get(h, 0) + 1
        self._prefill_tokens[engine.id] = self._prefill_tokens.get(engine.id, 0) + tokens
        self._requests[request.id] = (engine.id, hashes, tokens)

    def observe_first_token(self, request_id, engine_id):
        entry = self._requests.get(request_id)
        if entry is None or entry[2] == 0:
            return
        engine, hashes, tokens = entry
        self._prefill_tokens[engine] -= tokens
        self._requests[request_id] = (engine, hashes, 0)

    def observe_finished(self, request_id, engine_id):
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        engine, hashes, tokens = entry
        self._prefill_tokens[engine] -= tokens
        active = self._blocks[engine]
        for h in hashes:
            left = active[h] - 1
            if left:
                active[h] = left
            else:
                del active[h]


# --- llm-d -----------------------------------------------------------------------------


class LlmdPolicy(_ReferencePolicy):
    """llm-d's EPP: queue, kv-cache-utilization and precise prefix-cache scorers; max wins."""

    name = "llm-d"
    scrape_interval_us = 50_000.0
    QUEUE_WEIGHT = 2.0
    KV_WEIGHT = 2.0
    PREFIX_WEIGHT = 3.0
    SPECULATIVE_TTL_US = 30_000_000.0
    MAX_SPECULATIVE_BLOCKS = 1_000_000

    def __init__(self, cost_model: CostModel | None = None) -> None:
        super().__init__(cost_model)
        self._metrics: dict[str, EngineMetrics] = {}
        # block hash -> engine -> expiry (µs): speculative entries, until KV events land.
        self._speculative: dict[str, dict[str, float]] = {}
        self._expiries: OrderedDict[tuple[str, str], float] = OrderedDict()

    def observe_metrics(self, metrics):
        self._metrics = dict(metrics)

    def _expire(self) -> None:
        now = self.now_us
        expiries = self._expiries
        while expiries:
            (h, engine), expiry = next(iter(expiries.items()))
            if expiry > now and len(expiries) <= self.MAX_SPECULATIVE_BLOCKS:
                break
            expiries.popitem(last=False)
            holders = self._speculative.get(h)
            if holders is not None and holders.get(engine) == expiry:
                del holders[engine]
                if not holders:
                    del self._speculative[h]

    def prefix_scores(
        self, request: RequestShape, engines: Sequence[WorkerState], prefixes
    ) -> np.ndarray:
        """Longest-prefix scores (KV events + speculative entries), min-max normalised."""
        self._expire()
        raw = np.zeros(len(engines))
        spec = self._speculative
        for i, worker in enumerate(engines):
            tiers = prefixes[i]
            score = 0.0
            for b, key in enumerate(request.blocks):
                holders = spec.get(key.block_hash)
                if holders is not None and worker.id in holders:
                    score += 1.0
                elif b < len(tiers):
                    score += 1.0
                else:
                    break
            raw[i] = score
        matched = raw > 0
        if not matched.any():
            return raw
        low, high = float(raw[matched].min()), float(raw[matched].max())
        if high == low:
            return matched.astype(np.float64)
        return np.where(matched, (raw - low) / (high - low), 0.0)

    def costs(self, request, engines, prefixes, usable):
        if self._metrics:
            waiting = [self._metrics.get(w.id, EngineMetrics(0, 0.0)) for w in engines]
            queues = np.array([m.waiting_requests for m in waiting], dtype=np.float64)
            kv_score = np.array([1.0 - m.kv_usage for m in waiting])
        else:  # nothing scraped (the conductor): its live load columns instead
            queues = np.array([w.inflight_requests for w in engines], dtype=np.float64)
            kv_score = np.array([1.0 - w.kv_utilisation() for w in engines])
        q_max, q_min = float(queues.max()), float(queues.min())
        if q_max == q_min:
            queue_score = np.ones(len(engines))
        else:
            queue_score = (q_max - queues) / (q_max - q_min)
        prefix_score = self.prefix_scores(request, engines, prefixes)
        score = (
            self.QUEUE_WEIGHT * np.clip(queue_score, 0, 1)
            + self.KV_WEIGHT * np.clip(kv_score, 0, 1)
            + self.PREFIX_WEIGHT * np.clip(prefix_score, 0, 1)
        )
        return -score

    def routed(self, request, engine, prefix):
        if not self.lifecycle:
            return
        expiry = self.now_us + self.SPECULATIVE_TTL_US
        spec, expiries, me = self._speculative, self._expiries, engine.id
        for key in request.blocks:
            h = key.block_hash
            spec.setdefault(h, {})[me] = expiry
            expiries.pop((h, me), None)
            expiries[(h, me)] = expiry


# --- SGLang ----------------------------------------------------------------------------


class SglangCacheAwarePolicy(_ReferencePolicy):
    """SGLang router cache_aware: a load switch, else its own tree of routed prompts."""

    name = "sglang"
    uses_prefixes = False  # it never sees the engines' caches

    def __init__(
        self,
        cost_model: CostModel | None = None,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        cache_threshold: float = 0.3,
        eviction_interval_us: float = 120e6,
        max_tree_size: int = 2**26,
    ) -> None:
        super().__init__(cost_model)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold
        self.eviction_interval_us = eviction_interval_us
        self.max_tree_size = max_tree_size
        self._holders: dict[str, set[str]] = {}  # block hash -> workers whose tree has it
        self._trees: dict[str, OrderedDict[str, int]] = {}  # worker -> block -> tokens, LRU first
        self._sizes: dict[str, int] = {}  # worker -> tokens in its tree (partial tails too)
        self._next_eviction_us = eviction_interval_us

    def tree_size(self, worker_id: str) -> int:
        return self._sizes.get(worker_id, 0)

    def match(self, request: RequestShape) -> tuple[int, set[str]]:
        """Tokens of the longest tree match and the workers holding its deepest block."""
        holders = self._holders
        alive: set[str] | None = None
        matched = 0
        for key in request.blocks:
            found = holders.get(key.block_hash)
            if not found:
                break
            nxt = found if alive is None else alive & found
            if not nxt:
                break
            alive = nxt
            matched += key.token_count
        return matched, alive or set()

    def choose(self, costs, engines, prefixes, request, rng):
        self._maybe_evict()
        loads = [w.inflight_requests for w in engines]
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            return pick_min(np.array(loads, dtype=np.float64), rng)
        matched, holders = self.match(request)
        text = request.input_tokens()
        if text and matched / text > self.cache_threshold:
            candidates = [i for i, w in enumerate(engines) if w.id in holders]
            if candidates:
                return candidates[rng.randrange(len(candidates))]
        sizes = np.array([self._sizes.get(w.id, 0) for w in engines], dtype=np.float64)
        return pick_min(sizes, rng)

    def routed(self, request, engine, prefix):
        me = engine.id
        tree = self._trees.setdefault(me, OrderedDict())
        size = self._sizes.get(me, 0)
        for key in request.blocks:
            h = key.block_hash
            if h in tree:
                tree.move_to_end(h)
                continue
            tree[h] = key.token_count
            size += key.token_count
            self._holders.setdefault(h, set()).add(me)
        size += request.input_tokens() - sum(k.token_count for k in request.blocks)
        self._sizes[me] = size
        if not self.lifecycle and size > self.max_tree_size:  # no clock: bound it now
            self._evict()

    def _maybe_evict(self) -> None:
        if self.now_us >= self._next_eviction_us:
            self._next_eviction_us = self.now_us + self.eviction_interval_us
            self._evict()

    def _evict(self) -> None:
        """Each worker's least recently routed blocks out until its tree fits."""
        for worker, tree in self._trees.items():
            size = self._sizes[worker]
            while size > self.max_tree_size and tree:
                h, tokens = tree.popitem(last=False)
                size -= tokens
                holders = self._holders[h]
                holders.discard(worker)
                if not holders:
                    del self._holders[h]
            self._sizes[worker] = max(0, size)


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

    def costs(self, request, engines, prefixes, usable):
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


def make_policy(
    name: str,
    cost_model: CostModel | None = None,
    temperature: float = 0.0,
    *,
    clock: Callable[[], float] | None = None,
) -> Policy:
    """A fresh policy by name (see POLICY_NAMES); InvalidArgument for an unknown one.

    `clock` (µs) is handed to our planner (`CostPlanner.bind_clock`: its queue term
    drains with time and it weighs duplicated work under load); the references ignore
    it (their clock comes through their lifecycle hooks).
    """
    factory = _FACTORIES.get(name)
    if factory is None:
        raise InvalidArgument(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    policy = factory(cost_model or CostModel(), temperature)
    if clock is not None and isinstance(policy, CostPlanner):
        policy.bind_clock(clock)
    return policy
