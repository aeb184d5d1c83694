"""The cost function every policy prices with, from the seed's `CostModel`.

A block's cheapest usable source on an engine (HBM or another tier on the engine
itself, a tier of its own store node, or a peer store node plus the cross-domain
penalty), the estimated TTFT of reusing a prefix and recomputing the rest, and the
lowest-cost pick (exact ties at random with the injected RNG; temperature T > 0
samples p_w ~ exp(-(c_w - c_min) / ((c_max - c_min) * T)) as Dynamo does).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping, Sequence

import numpy as np

from quillcache_core.errors import NodeUnavailable
from quillcache_core.model import (
    MIB,
    CacheResidency,
    CacheTier,
    CostModel,
    RequestShape,
    WorkerState,
)
from quillcache_core.routing.actions import ActionKind, BlockAction
from quillcache_core.routing.policy import EngineCost

logger = logging.getLogger(__name__)


# --- shared pieces -------------------------------------------------------------------


def source_cost(
    cost_model: CostModel,
    engine: WorkerState,
    residency: CacheResidency,
    store_domains: Mapping[str, str],
) -> tuple[float, ActionKind] | None:
    """Cost of using one residency on `engine`, or None when it is no source for it.

    The readable definition: the cost rows (`_run_costs`) and `actions_for_prefix` inline exactly
    this arithmetic on the hot path, and the tests check them against it.
    """
    if residency.worker_id == engine.id:
        cost = cost_model.transfer_cost_us(residency.tier, residency.bytes, True, True)
        return float(cost), ActionKind.LOCAL_HIT
    domain = store_domains.get(residency.worker_id)
    if domain is None:
        return None
    # The engine's own store node is local (no cross-domain penalty) but is not the
    # engine itself: even an HBM-tier copy there is a transfer, not a hit.
    own = residency.worker_id == engine.store_node_id
    same_domain = own or domain == engine.locality_domain
    cost = cost_model.transfer_cost_us(residency.tier, residency.bytes, False, same_domain)
    return float(cost), ActionKind.FETCH


def actions_for_prefix(
    cost_model: CostModel,
    request: RequestShape,
    engine: WorkerState,
    usable: Sequence[Sequence[CacheResidency]],
    store_domains: Mapping[str, str],
    prefix_blocks: int,
    *,
    local_only: bool = False,
) -> list[BlockAction]:
    """Per-block actions: the cheapest source for blocks < prefix_blocks, then RECOMPUTE.

    Prices exactly as `source_cost`. Local copies win ties. Stops reusing at the first
    block with no source (engines reuse a contiguous prefix). With `local_only`, only
    the engine itself and its own store node are sources.
    """
    actions: list[BlockAction] = []
    blocks = request.blocks
    for index in range(min(prefix_blocks, len(usable), len(blocks))):
        cost, best, local = best_source(
            cost_model, engine, usable[index], store_domains, local_only
        )
        if best is None:
            break
        actions.append(
            BlockAction(
                ActionKind.LOCAL_HIT if local else ActionKind.FETCH,
                index,
                blocks[index].block_hash,
                source_node=best.worker_id,
                source_tier=best.tier,
                cost_us=cost,
            )
        )
    per_token = cost_model.prefill_us_per_token
    for index in range(len(actions), len(blocks)):
        key = blocks[index]
        actions.append(
            BlockAction(
                ActionKind.RECOMPUTE,
                index,
                key.block_hash,
                cost_us=float(per_token * key.token_count),
            )
        )
    return actions


def best_source(
    cost_model: CostModel,
    engine: WorkerState,
    found: Sequence[CacheResidency],
    store_domains: Mapping[str, str],
    local_only: bool,
) -> tuple[float, CacheResidency | None, bool]:
    """The cheapest of one block's residencies on `engine`: (cost, residency, is local).

    `source_cost`'s arithmetic inlined (it runs per block or per run of every plan).
    """
    per_mb = tier_prices_per_mb(cost_model)
    me, own, my_domain = engine.id, engine.store_node_id, engine.locality_domain
    best_cost = math.inf
    best: CacheResidency | None = None
    best_local = False
    for residency in found:
        worker = residency.worker_id
        tier = residency.tier
        if worker == me:
            mb = (residency.bytes + MIB - 1) // MIB or 1
            cost = (
                float(cost_model.hbm_hit_us) if tier is CacheTier.HBM else float(per_mb[tier] * mb)
            )
            if cost < best_cost or (cost == best_cost and not best_local):
                best_cost, best, best_local = cost, residency, True
            continue
        if local_only and worker != own:
            continue
        domain = store_domains.get(worker)
        if domain is None:
            continue
        mb = (residency.bytes + MIB - 1) // MIB or 1
        cost = float(per_mb[tier] * mb)
        if worker != own and domain != my_domain:
            cost += cost_model.cross_domain_penalty_us
        if cost < best_cost:
            best_cost, best, best_local = cost, residency, False
    return best_cost, best, best_local


# id(cost model) -> (the model, its prices). By identity: an lru_cache hashed the frozen
# dataclass (ten fields, in Python) on each of a plan's calls. The entry holds the
# model, so its id cannot be reused while cached.
_PRICES: dict[int, tuple[CostModel, dict[CacheTier, int]]] = {}


def tier_prices_per_mb(cost_model: CostModel) -> dict[CacheTier, int]:
    hit = _PRICES.get(id(cost_model))
    if hit is not None and hit[0] is cost_model:
        return hit[1]
    prices = {tier: cost_model.tier_us_per_mb(tier) for tier in CacheTier}
    if len(_PRICES) >= 64:
        _PRICES.clear()
    _PRICES[id(cost_model)] = (cost_model, prices)
    return prices


def estimate(
    cost_model: CostModel,
    request: RequestShape,
    engine: WorkerState,
    actions: Sequence[BlockAction],
) -> EngineCost:
    """Our cost function evaluated for a fixed set of actions (any policy's choice)."""
    queue = float(cost_model.queue_cost_us(engine))
    fetch = 0.0
    reused_tokens = 0
    hits = fetches = prefix = 0
    for action in actions:
        if action.kind is ActionKind.RECOMPUTE:
            continue
        prefix += 1
        fetch += action.cost_us
        reused_tokens += request.blocks[action.block_index].token_count
        if action.kind is ActionKind.LOCAL_HIT:
            hits += 1
        else:
            fetches += 1
    prefill = float(cost_model.prefill_cost_us(request.input_tokens() - reused_tokens))
    decode = float(
        cost_model.decode_cost_us(request.estimated_decode_tokens, engine.running_decodes)
    )
    ttft = queue + fetch + prefill
    return EngineCost(
        engine_id=engine.id,
        cost_us=ttft + decode,
        est_ttft_us=ttft,
        queue_us=queue,
        fetch_us=fetch,
        prefill_us=prefill,
        decode_us=decode,
        prefix_blocks=prefix,
        hit_blocks=hits,
        fetch_blocks=fetches,
    )


def pick_min(costs: np.ndarray, rng: random.Random, temperature: float = 0.0) -> int:
    """Index of the lowest cost; exact ties at random; T > 0 samples as Dynamo does."""
    if costs.size == 0:
        raise NodeUnavailable("no engine available for this request")
    low = float(costs.min())
    if temperature > 0.0:
        high = float(costs.max())
        if high > low:
            weights = np.exp(-(costs - low) / ((high - low) * temperature))
            return _weighted_choice(weights, rng)
    ties = np.flatnonzero(costs == low)
    if ties.size == 1:
        return int(ties[0])
    return int(ties[rng.randrange(ties.size)])


def _weighted_choice(weights: np.ndarray, rng: random.Random) -> int:
    total = float(weights.sum())
    point = rng.random() * total
    running = 0.0
    for index, weight in enumerate(weights):
        running += float(weight)
        if point < running:
            return index
    return int(weights.size - 1)
