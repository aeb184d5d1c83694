"""One routing decision: locate the request's blocks, audit them, run the policy."""

from __future__ import annotations

import random
from collections.abc import Mapping

from quillcache_core.index.base import IndexBackend
from quillcache_core.model import CacheResidency, CacheTier, RequestShape
from quillcache_core.routing.guard import audit_reuse
from quillcache_core.routing.policy import Fleet, PlanDecision, Policy


def plan_request(
    index: IndexBackend,
    policy: Policy,
    request: RequestShape,
    fleet: Fleet,
    rng: random.Random,
    overlay: Mapping[str, list[CacheResidency]] | None = None,
) -> PlanDecision:
    """Look up only this request's blocks, refuse other identities, then choose.

    The decision carries the guard's refusals; refused residencies never reach the policy.
    `overlay` adds residencies the index does not hold (the conductor's optimistic
    records), by block hash. The lookup stops at the first block held nowhere: a
    chained prefix cannot be reused past it, so the policies never look further
    (`decision.usable` is then shorter than the request's blocks).
    """
    located = index.locate_prefix([key.block_hash for key in request.blocks], overlay)
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
