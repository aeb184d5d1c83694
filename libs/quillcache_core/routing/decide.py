"""One routing decision: locate the request's blocks, audit them, run the policy."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from operator import itemgetter

from quillcache_core.index.base import IndexBackend
from quillcache_core.model import CacheResidency, CacheTier, RequestShape
from quillcache_core.routing.guard import audit_reuse
from quillcache_core.routing.policy import Fleet, PlanDecision, Policy

_block_hash = itemgetter(5)  # KvBlockKey.block_hash


def plan_request(
    index: IndexBackend,
    policy: Policy,
    request: RequestShape,
    fleet: Fleet,
    rng: random.Random,
    overlay: Mapping[str, list[CacheResidency]] | None = None,
    block_parts: Mapping[str, int] | None = None,
) -> PlanDecision:
    """Look up only this request's blocks, refuse other identities, then choose.

    The decision carries the guard's refusals; refused residencies never reach the policy.
    `overlay` adds residencies the index does not hold (the conductor's optimistic
    records), by block hash. The lookup stops at the first block held nowhere: a
    chained prefix cannot be reused past it, so the policies never look further
    (`decision.usable` is then shorter than the request's blocks).
    `block_parts` names the engines whose own blocks are several of the request's
    (an engine with 32-token blocks under a 16-token index: 2); their copies count only
    in whole engine blocks (`whole_engine_blocks`).
    """
    located = index.locate_prefix(list(map(_block_hash, request.blocks)), overlay)
    if block_parts:
        located = whole_engine_blocks(located, block_parts)
    audit = audit_reuse(request.scope(), located)
    decision = policy.plan(request, audit.usable, fleet, rng)
    decision.refusals = audit.refusals
    decision.usable = audit.usable
    return decision


def record_optimistic(
    index: IndexBackend, decision: PlanDecision, request: RequestShape, nbytes: int
) -> list[str]:
    """Record the request's blocks in the chosen engine's HBM now, as the prefill will.

    Returns the hashes newly recorded (not already in that engine's HBM), so a failed
    request can take them back. Only for policies with `optimistic_residency`.
    """
    engine = decision.engine.id
    hbm = CacheTier.HBM
    new = []
    for key, found in zip(
        request.blocks, index.locate_hashes([k.block_hash for k in request.blocks]), strict=True
    ):
        if not any(r.worker_id == engine and r.tier is hbm for r in found):
            new.append(key)
    index.put_many(CacheResidency(key, engine, hbm, nbytes) for key in new)
    return [key.block_hash for key in new]


def whole_engine_blocks(
    located: Sequence[Sequence[CacheResidency]], block_parts: Mapping[str, int]
) -> list[Sequence[CacheResidency]]:
    """`located` without the copies an engine cannot reuse: past the last whole block of
    its own size in its prefix of copies.

    An engine block of k index blocks is cached as one: its first sub-block can match a
    request while the rest does not (vLLM's last block of a request holds generated
    tokens too), and the engine can reuse none of it. So an engine with k > 1 keeps its
    copies of blocks [0, floor(h / k) * k), h being how many leading blocks it holds.
    """
    parted = {engine: parts for engine, parts in block_parts.items() if parts > 1}
    if not parted:
        return list(located)
    hbm = CacheTier.HBM
    held = dict.fromkeys(parted, 0)  # each engine's leading blocks held, in one pass
    holding = set(parted)
    for found in located:
        holding = holding.intersection([r.worker_id for r in found if r.tier is hbm])
        if not holding:
            break
        for engine in holding:
            held[engine] += 1
    cut = {
        engine: count - count % parted[engine]
        for engine, count in held.items()
        if count % parted[engine]
    }
    if not cut:
        return list(located)
    first = min(cut.values())  # before it, no copy is cut
    out: list[Sequence[CacheResidency]] = list(located[:first])
    for position in range(first, len(located)):
        found = located[position]
        if any(r.worker_id in cut and position >= cut[r.worker_id] for r in found):
            found = [
                r
                for r in found
                if not (r.worker_id in cut and position >= cut[r.worker_id] and r.tier is hbm)
            ]
        if not found:
            break  # as locate_prefix: the usable prefix ends at a block held nowhere
        out.append(found)
    return out
