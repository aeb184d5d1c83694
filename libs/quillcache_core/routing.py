"""One routing decision: locate the request's blocks, audit them, run the policy."""

from __future__ import annotations

import random

from quillcache_core.guard import audit_reuse
from quillcache_core.index.base import IndexBackend
from quillcache_core.model import RequestShape
from quillcache_core.planner import Fleet, PlanDecision, Policy


def plan_request(
    index: IndexBackend,
    policy: Policy,
    request: RequestShape,
    fleet: Fleet,
    rng: random.Random,
) -> PlanDecision:
    """Look up only this request's blocks, refuse other identities, then choose.

    The decision carries the guard's refusals; refused residencies never reach the policy.
    """
    located = index.locate_hashes([key.block_hash for key in request.blocks])
    audit = audit_reuse(request.scope(), located)
    decision = policy.plan(request, audit.usable, fleet, rng)
    decision.refusals = audit.refusals
    return decision
