"""The cost-function planner: which engine, and what to do with each block.

For request R (blocks b_0..b_{m-1}) and engine w, each block's cheapest usable source
on w is: HBM (or another tier) on w itself, a tier of w's own store node, or a peer
store node (plus the cross-domain penalty when its locality domain differs). Engines
reuse only a contiguous prefix, so for each w the planner picks the prefix length k
minimising

    est_ttft(w, k) = queue(w) + sum_{i<k} fetch_cost(i, w) + prefill(tokens after block k)

and cost(w) = min_k est_ttft(w, k) + decode_cost(w). Lowest cost wins; exact ties
break at random with the injected RNG; temperature T > 0 samples
p_w ~ exp(-(c_w - c_min) / ((c_max - c_min) * T)) as Dynamo does.

Given a clock (µs, `bind_clock`; the fleet simulator passes its virtual one) the queue
term drains with time, duplicated work weighs more under load and exact ties go to the
emptiest cache (`CostPlanner`, `_weighted_totals`); without one the planner is exactly
the function above.

Pure: no I/O, and no clock but the one it is given. Blocks with the same copies (same workers, tiers and sizes)
form runs, and within a run the estimate is linear in the prefix length, so the best
prefix ends at a run boundary. Costs are rows of per-run prices: one per locality
domain (store-node copies priced once per domain), plus one for each engine that holds
a copy itself or on its own store node; every other engine shares its domain's row. A
128-block prompt over 64 engines is a few runs and a few rows, not 8,192 cells, so the
arithmetic is plain Python (numpy's per-call cost outweighed these small arrays), and
our planner's actions are held as runs (`ActionRuns`) that expand to per-block actions
only when asked.
"""

from __future__ import annotations

import heapq
import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate
from operator import add, itemgetter
from typing import NamedTuple

import numpy as np

from quillcache_core import hotpath
from quillcache_core.errors import InvalidArgument, NodeUnavailable
from quillcache_core.model import (
    MIB,
    CacheResidency,
    CacheTier,
    CostModel,
    RequestShape,
    WorkerState,
)
from quillcache_core.routing.actions import ActionKind, ActionRun, ActionRuns
from quillcache_core.routing.cost import best_source, pick_min, tier_prices_per_mb
from quillcache_core.routing.policy import (
    EngineCost,
    Fleet,
    LazyCosts,
    PlanDecision,
    Policy,
    token_count,
)

logger = logging.getLogger(__name__)


# --- our planner ---------------------------------------------------------------------


class _Layout(NamedTuple):
    """What the planner derives from a fleet's membership (not its load)."""

    engine_index: dict[str, int]
    by_store: dict[str, list[int]]  # store node -> the engines it is local to
    domains: dict[str, int]  # locality domain -> row
    engine_domain: list[int]  # engine -> its domain's row
    ids: tuple[str, ...]  # engine -> its id


def _layout(engines: Sequence[WorkerState]) -> _Layout:
    engine_index = {w.id: i for i, w in enumerate(engines)}
    by_store: dict[str, list[int]] = {}
    domains: dict[str, int] = {}
    engine_domain: list[int] = []
    for i, worker in enumerate(engines):
        engine_domain.append(domains.setdefault(worker.locality_domain, len(domains)))
        if worker.store_node_id:
            by_store.setdefault(worker.store_node_id, []).append(i)
    ids = tuple(w.id for w in engines)
    return _Layout(engine_index, by_store, domains, engine_domain, ids)


def _load_costs(
    cm: CostModel, engines: Sequence[WorkerState], decode_tokens: int
) -> tuple[list[float], list[float]]:
    """Per engine, queue and decode cost: CostModel's formulas over load columns."""
    if type(cm) is not CostModel:  # a subclass may price load its own way
        queue = [float(cm.queue_cost_us(w)) for w in engines]
        decode = [float(cm.decode_cost_us(decode_tokens, w.running_decodes)) for w in engines]
        return queue, decode
    per_queued = float(cm.queue_us_per_prefill_token)
    per_running = float(cm.running_decode_penalty_us)
    decoding = float(cm.decode_us_per_token * decode_tokens)
    # Comprehensions: their attribute reads are specialised, faster than attrgetter maps.
    queue = [per_queued * w.queued_prefill_tokens for w in engines]
    decode = [decoding + per_running * w.running_decodes for w in engines]
    return queue, decode


def block_runs(usable: Sequence[Sequence[CacheResidency]]) -> list[tuple[int, int]]:
    """(first block, block count) of each run of blocks with the same residencies.

    "Same" means the same (worker, tier, bytes) copies: every block of a run then costs
    the same on every engine. A chain offloaded together is one run, so the planner's
    work follows the number of runs (a handful), not the number of blocks.
    """
    runs = hotpath.block_runs(usable) if type(usable) is list else None
    return hotpath.block_runs_py(usable) if runs is None else runs


_best_us = itemgetter(1)  # _Row.best_us


class CostPlanner(Policy):
    """QuillCache's planner: the cost function above over every eligible engine.

    `alternatives` caps how many other engines get a cost breakdown in the decision
    (None: all of them); the conductor replies with only a few.

    `clock` (µs, optional; `bind_clock`): with it the queue term drains with time. An
    engine's queued prefill tokens count in full until the request's first token, but
    the engine works on them meanwhile; the planner keeps per engine a fluid estimate
    of the work left, drained at one µs of queue per µs elapsed, raised by the work each
    of its own plans adds and by any other rise of the observed queue, and never above
    the observed queue. With a clock the choice also weighs
    duplicated work under load (`_weighted_totals`), and `cost_us` is that weighted
    total while `est_ttft_us` stays queue + fetch + prefill; exact ties go to the engine
    caching the fewest blocks. Without a clock the planner is the plain cost function
    above.
    """

    name = "quillcache"
    optimistic_residency = True

    def __init__(
        self,
        cost_model: CostModel | None = None,
        temperature: float = 0.0,
        alternatives: int | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(cost_model)
        if temperature < 0 or math.isnan(temperature):
            raise InvalidArgument(f"temperature must be >= 0, got {temperature}")
        self.temperature = temperature
        self.alternatives = alternatives
        self.clock = clock
        self._fluid: dict[str, tuple[float, float]] = {}  # engine -> (work left, last seen), µs
        self._fluid_at = 0.0
        # The layout of the last fleet object seen: a caller that keeps its Fleet
        # while membership is unchanged (the conductor) skips rebuilding it.
        self._layout_of: tuple[Fleet | None, _Layout | None] = (None, None)

    def bind_clock(self, clock: Callable[[], float]) -> None:
        """Use `clock` (µs) to drain the queue term with time (see the class docstring)."""
        self.clock = clock

    def _planned(self, engine_id: str, queue_us: float) -> None:
        """Count the queue work this plan adds to the engine (the caller reserves its
        recompute tokens there) in the fluid estimate now.

        Without this, the estimate learned of new work only as a rise of the observed
        queue between two plans, and a request's reservation released in between (its
        first token) hid the new one. At load the estimate lost much of the new work
        and requests piled on engines that looked idle (`quillcache bench` docqa at 1x
        saturation with write-through: TTFT estimated 153 ms against 248 ms simulated,
        engine load max/mean 1.74; with this, 1.20).
        """
        left, seen = self._fluid.get(engine_id, (0.0, 0.0))
        self._fluid[engine_id] = (left + queue_us, seen + queue_us)

    def _drained(self, engines: Sequence[WorkerState], queue: list[float]) -> list[float]:
        """Per engine, the queue work still left now: the observed queue, drained by time."""
        now = self.clock()
        elapsed = max(0.0, now - self._fluid_at)
        self._fluid_at = now
        fluid = self._fluid
        out = []
        for worker, observed in zip(engines, queue, strict=True):
            left, seen = fluid.get(worker.id, (0.0, 0.0))
            left = left - elapsed if left > elapsed else 0.0
            if observed > seen:
                left += observed - seen
            if left > observed:
                left = observed
            fluid[worker.id] = (left, observed)
            out.append(left)
        return out

    def _layout(self, fleet: Fleet) -> _Layout:
        seen, layout = self._layout_of
        if seen is not fleet or layout is None:
            layout = _layout(fleet.engines)
            self._layout_of = (fleet, layout)
        return layout

    def plan(
        self,
        request: RequestShape,
        usable: Sequence[Sequence[CacheResidency]],
        fleet: Fleet,
        rng: random.Random,
    ) -> PlanDecision:
        engines = fleet.engines
        if not engines:
            raise NodeUnavailable("no engine available for this request")
        cm = self.cost_model
        engine_index, by_store, domains, engine_domain, ids = self._layout(fleet)
        blocks = request.blocks
        usable = usable[: len(blocks)]
        runs = block_runs(usable)
        domain_rows, engine_cells = _run_costs(
            cm, engine_index, by_store, domains, usable, runs, fleet.store_domains
        )
        width = len(domain_rows[0]) if domain_rows else 0  # runs up to the first block nobody holds
        del runs[width:]
        n = len(engines)

        lengths = [length for _, length in runs]
        # Costs at run boundaries: within a run the estimate is linear in the prefix
        # length, so the best prefix always ends at a boundary. Tokens before each
        # boundary: summed over the runs only (blocks usually all hold 16).
        boundaries = [0, *accumulate(lengths)]
        token_cum = [0]
        for first, length in runs:
            token_cum.append(token_cum[-1] + sum(map(token_count, blocks[first : first + length])))
        input_tokens = request.input_tokens()
        per_token = cm.prefill_us_per_token
        prefill = [float(per_token * (input_tokens - tokens)) for tokens in token_cum]

        # Every engine without a copy of its own (or on its own store node) shares its
        # domain's row: best prefix per row, each row once.
        rows: list[_Row] = [_best_prefix(row, lengths, prefill) for row in domain_rows]
        row_of = list(map(rows.__getitem__, engine_domain))
        if engine_cells:
            own: dict[int, tuple[list[float], list[bool]]] = {}
            for (i, col), (cost, local) in engine_cells.items():
                entry = own.get(i)
                if entry is None:
                    entry = own[i] = (list(domain_rows[engine_domain[i]]), [False] * width)
                costs, flags = entry
                if cost < costs[col] or (cost == costs[col] and local):
                    costs[col] = cost
                    flags[col] = local
            for i, (costs, flags) in own.items():
                row_of[i] = _best_prefix(costs, lengths, prefill, flags)

        queue, decode = _load_costs(cm, engines, request.estimated_decode_tokens)
        if self.clock is None:
            total = list(map(add, map(add, queue, map(_best_us, row_of)), decode))
        else:
            queue = self._drained(engines, queue)
            total = _weighted_totals(queue, row_of, decode)
        if self.clock is not None and self.temperature == 0.0:
            chosen_index = _pick_lowest_emptiest(total, engines, rng)
        else:
            chosen_index = _pick_lowest(total, rng, self.temperature)
        engine = engines[chosen_index]
        if self.clock is not None:
            recompute_tokens = input_tokens - token_cum[row_of[chosen_index][0]]
            self._planned(engine.id, float(cm.queue_us_per_prefill_token * recompute_tokens))
        actions = _run_actions(
            cm,
            request,
            engine,
            usable,
            fleet.store_domains,
            runs[: row_of[chosen_index][0]],
        )
        alternatives = self.alternatives
        if request.max_others is not None:
            alternatives = (
                request.max_others
                if alternatives is None
                else min(alternatives, request.max_others)
            )
        if alternatives is None or alternatives >= n - 1:
            picked = [*range(chosen_index), *range(chosen_index + 1, n)]
        elif alternatives <= 0:
            picked = []
        else:
            # nsmallest is sorted()[:k]: stable, cheapest first.
            order = heapq.nsmallest(alternatives + 1, range(n), key=total.__getitem__)
            picked = [i for i in order if i != chosen_index][:alternatives]

        def cost_of(i: int) -> EngineCost:
            k, best, fetch, hits = row_of[i]
            prefix_blocks = boundaries[k]
            return EngineCost(
                engine_id=ids[i],
                cost_us=total[i],
                est_ttft_us=queue[i] + best,
                queue_us=queue[i],
                fetch_us=fetch,
                prefill_us=prefill[k],
                decode_us=decode[i],
                prefix_blocks=prefix_blocks,
                hit_blocks=hits,
                fetch_blocks=prefix_blocks - hits,
            )

        chosen = cost_of(chosen_index)
        # Built when read: every value cost_of reads was computed for this plan.
        others = LazyCosts(cost_of, picked)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "plan %s -> %s cost=%.0f queue=%.0f fetch=%.0f prefill=%.0f decode=%.0f "
                "prefix=%d hits=%d fetches=%d; others=%s",
                request.id,
                engine.id,
                chosen.cost_us,
                chosen.queue_us,
                chosen.fetch_us,
                chosen.prefill_us,
                chosen.decode_us,
                chosen.prefix_blocks,
                chosen.hit_blocks,
                chosen.fetch_blocks,
                [(o.engine_id, round(o.cost_us)) for o in others],
            )
        return PlanDecision(self.name, engine, actions, chosen, others)


# The most a µs of duplicated prefill work may weigh beyond the requester's own µs.
WORK_WEIGHT_CAP = 4.0


def _weighted_totals(queue: list[float], row_of: list[_Row], decode: list[float]) -> list[float]:
    """Each engine's cost: queue + its best prefix's work (fetch + prefill) + decode, plus
    a weight on the work it would duplicate.

    Under load a plan's prefill work also delays the requests that will queue behind it,
    so an engine that must recompute what another engine already holds is charged
    `weight * (its work - the least work any engine needs)` on top. weight =
    min(WORK_WEIGHT_CAP, (busy / (1 - busy))^2), busy being the share of engines with
    queued prefill work now: about 0 on an idle fleet (own TTFT alone decides), the cap
    once most engines are busy. It applies only while one engine alone needs the least
    work: a prefix already held by several engines is a popular one, and another copy
    of it adds capacity rather than waste. Uses only the load and residency the
    planner already sees, and the clock (`queue` is the drained estimate): a planner
    without a clock minimises the plain sum. The cap and the exponent were chosen on
    `quillcache bench`'s workloads (README).
    """
    n = len(queue)
    works = [row[1] for row in row_of]
    least = min(works)
    weight = 0.0
    if works.count(least) == 1:
        busy = sum(1 for q in queue if q > 0)
        if busy:
            weight = (
                WORK_WEIGHT_CAP if busy == n else min(WORK_WEIGHT_CAP, (busy / (n - busy)) ** 2)
            )
    if weight == 0.0:
        return [q + w + d for q, w, d in zip(queue, works, decode, strict=True)]
    return [q + w + weight * (w - least) + d for q, w, d in zip(queue, works, decode, strict=True)]


class _Row(NamedTuple):
    """One cost row's best prefix: its run count, estimate, fetch cost and local hits."""

    runs: int
    best_us: float
    fetch_us: float
    hit_blocks: int


def _best_prefix(
    costs: Sequence[float],
    lengths: Sequence[int],
    prefill: Sequence[float],
    local: Sequence[bool] | None = None,
) -> _Row:
    """The prefix (in runs) minimising fetch + prefill; the first of equal ones."""
    fetch = 0.0
    best = prefill[0]
    best_runs, best_fetch, hits, best_hits = 0, 0.0, 0, 0
    for col, cost in enumerate(costs):
        length = lengths[col]
        fetch += cost * length
        if local is not None and local[col]:
            hits += length
        est = fetch + prefill[col + 1]
        if est < best:
            best, best_runs, best_fetch, best_hits = est, col + 1, fetch, hits
    return _Row(best_runs, best, best_fetch, best_hits)


def _pick_lowest(total: list[float], rng: random.Random, temperature: float) -> int:
    """`pick_min` over a list: the same choice, the same draws from `rng`."""
    if temperature > 0.0:
        return pick_min(np.array(total, dtype=np.float64), rng, temperature)
    low = min(total)
    if total.count(low) == 1:  # the rule: no draw from rng
        return total.index(low)
    ties = [i for i, cost in enumerate(total) if cost == low]
    return ties[rng.randrange(len(ties))]


def _pick_lowest_emptiest(
    total: list[float], engines: Sequence[WorkerState], rng: random.Random
) -> int:
    """The lowest cost; among exact ties the engine caching the fewest blocks, then at random.

    Ties are idle engines offered a prefix nobody holds: the emptiest cache evicts the
    least that later requests could reuse (SGLang's smallest tree, by KV events).
    """
    low = min(total)
    ties = [i for i, cost in enumerate(total) if cost == low]
    if len(ties) > 1:
        fewest = min(engines[i].resident_blocks for i in ties)
        ties = [i for i in ties if engines[i].resident_blocks == fewest]
    if len(ties) == 1:
        return ties[0]
    return ties[rng.randrange(len(ties))]


def _run_costs(
    cm: CostModel,
    engine_index: Mapping[str, int],
    by_store: Mapping[str, list[int]],
    domains: Mapping[str, int],
    usable: Sequence[Sequence[CacheResidency]],
    runs: Sequence[tuple[int, int]],
    store_domains: Mapping[str, str],
) -> tuple[list[list[float]], dict[tuple[int, int], tuple[float, bool]]]:
    """Per locality domain and run, the cheapest per-block cost (inf: none), and the
    engine-specific cells that may beat their domain's.

    Only runs up to the first block with no source anywhere are columns: no engine
    can reuse past it. A store-node copy is priced once per domain (the cross-domain
    penalty outside its own); engine-local copies and an engine's own store node are
    sparse (engine, run) -> (cost, is-a-local-hit) cells, applied to that engine's copy
    of its domain row (a cell wins when cheaper, or as cheap and local).
    """
    per_mb = tier_prices_per_mb(cm)
    hbm_hit = float(cm.hbm_hit_us)
    penalty = cm.cross_domain_penalty_us
    inf = math.inf
    hbm = CacheTier.HBM
    domain_cells: dict[tuple[int, int], float] = {}
    cross: list[float] = []
    engine_cells: dict[tuple[int, int], tuple[float, bool]] = {}
    width = 0
    for first, _length in runs:
        col = width
        cross_best = inf
        any_source = False
        for residency in usable[first]:
            worker = residency.worker_id
            mb = (residency.bytes + MIB - 1) // MIB or 1
            owner = engine_index.get(worker)
            if owner is not None:
                any_source = True
                tier = residency.tier
                cost = hbm_hit if tier is hbm else float(per_mb[tier] * mb)
                cell = (owner, col)
                old = engine_cells.get(cell)
                if old is None or cost < old[0] or (cost == old[0] and not old[1]):
                    engine_cells[cell] = (cost, True)
                continue
            domain = store_domains.get(worker)
            if domain is None:
                continue
            any_source = True
            base = float(per_mb[residency.tier] * mb)
            if base + penalty < cross_best:
                cross_best = base + penalty
            row = domains.get(domain)
            if row is not None:
                cell = (row, col)
                if base < domain_cells.get(cell, inf):
                    domain_cells[cell] = base
            for own in by_store.get(worker, ()):
                cell = (own, col)
                old = engine_cells.get(cell)
                if old is None or base < old[0]:
                    engine_cells[cell] = (base, False)
        if not any_source:
            break
        cross.append(cross_best)
        width += 1
    rows = [list(cross) for _ in range(len(domains))]
    for (row, col), cost in domain_cells.items():
        if cost < rows[row][col]:
            rows[row][col] = cost
    return rows, engine_cells


def _run_actions(
    cm: CostModel,
    request: RequestShape,
    engine: WorkerState,
    usable: Sequence[Sequence[CacheResidency]],
    store_domains: Mapping[str, str],
    runs: Sequence[tuple[int, int]],
) -> ActionRuns:
    """`actions_for_prefix` for a prefix made of whole runs: one source choice per run."""
    blocks = request.blocks
    out: list[ActionRun] = []
    reused = 0
    for first, length in runs:
        cost, best, local = best_source(cm, engine, usable[first], store_domains, False)
        if best is None:  # cannot happen for a prefix the rows priced finite
            break
        kind = ActionKind.LOCAL_HIT if local else ActionKind.FETCH
        out.append(ActionRun(kind, first, length, best.worker_id, best.tier, cost, cost * length))
        reused = first + length
    if reused < len(blocks):
        per_token = cm.prefill_us_per_token
        tokens = sum(map(token_count, blocks[reused:]))
        out.append(
            ActionRun(
                ActionKind.RECOMPUTE,
                reused,
                len(blocks) - reused,
                None,
                None,
                0.0,
                float(per_token * tokens),
            )
        )
    return ActionRuns(out, blocks, cm.prefill_us_per_token)
