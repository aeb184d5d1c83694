"""The oracle: a router that knows every engine's cache and queue exactly.

The limit to measure the real policies against, available only inside the simulator:
it reads the simulation's true state instead of any index, metric or estimate. For each
engine it computes this request's TTFT exactly as the simulator will run it, given what
is true now:

    ttft(w) = (end of w's prefill in progress - now) + Σ predicted prefills queued on w
              + min over k of [Σ_{i<k} source_i(w) + recompute(tokens after block k)]

where source_i(w) is a hit (5 µs) if block i is in w's HBM now or belongs to a request
queued on w (it will be resident when this one starts), else the cheapest store node
holding it now (DRAM/SSD price, plus the cross-domain penalty outside w's domain), and
the reused prefix ends at the first block held nowhere. It picks the lowest (random
tie-break) and plans exactly those hits and fetches, peers included.

Greedy, per request: it does not hold an engine back for a later request, and its
predictions ignore evictions between now and the prefill's start, so it is the limit
of a router with perfect information, not of any schedule.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from quillcache_core.errors import NodeUnavailable
from quillcache_core.model import MIB, CacheResidency, CacheTier, CostModel, RequestShape
from quillcache_core.routing.actions import ActionKind, BlockAction
from quillcache_core.routing.cost import estimate
from quillcache_core.routing.policy import Fleet, PlanDecision, Policy

_HIT = ActionKind.LOCAL_HIT
_FETCH = ActionKind.FETCH
_RECOMPUTE = ActionKind.RECOMPUTE


class OraclePolicy(Policy):
    """Perfect information about the simulated fleet; see the module docstring."""

    name = "oracle"

    def __init__(self, cost_model: CostModel | None = None) -> None:
        super().__init__(cost_model)
        self.sim = None
        self.now_us = 0.0
        self._backlog: dict[str, float] = {}  # engine -> predicted prefill µs queued
        self._predicted: dict[str, tuple[str, float]] = {}  # request -> engine, prefill µs
        self._pending: dict[str, Counter] = {}  # engine -> blocks of requests not yet prefilled
        self._blocks_of: dict[str, list[str]] = {}

    # --- what the simulator reports ---------------------------------------------------

    def bind_lifecycle(self) -> None:
        pass

    def bind_sim(self, sim) -> None:
        self.sim = sim

    def observe_time(self, now_us: float) -> None:
        self.now_us = now_us

    def observe_metrics(self, metrics) -> None:
        pass

    def observe_prefill_start(self, request_id: str, engine_id: str) -> None:
        entry = self._predicted.pop(request_id, None)
        if entry is not None:
            self._backlog[entry[0]] -= entry[1]

    def observe_first_token(self, request_id: str, engine_id: str) -> None:
        pending = self._pending[engine_id]
        for h in self._blocks_of.pop(request_id, ()):
            left = pending[h] - 1
            if left:
                pending[h] = left
            else:
                del pending[h]

    def observe_finished(self, request_id: str, engine_id: str) -> None:
        pass

    # --- the decision ----------------------------------------------------------------

    def plan(
        self,
        request: RequestShape,
        usable: Sequence[Sequence[CacheResidency]],
        fleet: Fleet,
        rng: random.Random,
    ) -> PlanDecision:
        sim = self.sim
        if sim is None:
            raise NodeUnavailable("the oracle routes only inside the fleet simulator")
        if not fleet.engines:
            raise NodeUnavailable("no engine available for this request")
        cm = self.cost_model
        now = self.now_us
        blocks = request.blocks
        mb = max(1, -(-request.block_bytes // MIB)) if request.block_bytes else 1
        price = {
            CacheTier.CPU_DRAM: cm.cpu_dram_us_per_mb * mb,
            CacheTier.LOCAL_SSD: cm.local_ssd_us_per_mb * mb,
        }
        penalty = cm.cross_domain_penalty_us
        hit_us = float(cm.hbm_hit_us)
        per_token = float(cm.prefill_us_per_token)
        input_tokens = request.input_tokens()
        stores = list(sim.stores.values())
        held: list[list[tuple[object, CacheTier]] | None] = [None] * len(blocks)

        def holders(b: int) -> list[tuple[object, CacheTier]]:
            found = held[b]
            if found is None:
                h = blocks[b].block_hash
                found = []
                for node in stores:
                    tier = node.tier_of(h)
                    if tier is not None:
                        found.append((node, tier))
                held[b] = found
            return found

        best = None
        ties = 0
        for eng in sim.engines:
            state = eng.state
            hbm = eng.hbm.refs
            pending = self._pending.get(state.id, ())
            my_store = eng.store
            plan: list[tuple[ActionKind, object, CacheTier | None, float]] = []
            reused_tokens = 0
            spent = 0.0
            best_k, best_est = 0, input_tokens * per_token
            for b, key in enumerate(blocks):
                h = key.block_hash
                if h in hbm or h in pending:
                    step = (_HIT, None, CacheTier.HBM, hit_us)
                else:
                    step = None
                    for node, tier in holders(b):
                        cost = price[tier]
                        if node is not my_store and node.domain != my_store.domain:
                            cost += penalty
                        if step is None or cost < step[3]:
                            step = (_FETCH, node, tier, cost)
                    if step is None:
                        break
                plan.append(step)
                spent += step[3]
                reused_tokens += key.token_count
                est = spent + (input_tokens - reused_tokens) * per_token
                if est < best_est:
                    best_k, best_est = b + 1, est
            wait = self._backlog.get(state.id, 0.0)
            if eng.busy:
                wait += max(0.0, eng.busy_until - now)
            ttft = wait + best_est
            if best is None or ttft < best[0]:
                best, ties = (ttft, eng, plan[:best_k], best_est), 1
            elif ttft == best[0]:
                ties += 1  # reservoir sampling: each tied engine equally likely
                if rng.randrange(ties) == 0:
                    best = (ttft, eng, plan[:best_k], best_est)
        _, eng, plan, prefill_us = best
        actions = [
            BlockAction(
                kind,
                b,
                blocks[b].block_hash,
                source_node=eng.state.id if kind is _HIT else node.id,
                source_tier=tier,
                cost_us=cost,
            )
            for b, (kind, node, tier, cost) in enumerate(plan)
        ]
        for b in range(len(plan), len(blocks)):
            key = blocks[b]
            actions.append(
                BlockAction(_RECOMPUTE, b, key.block_hash, cost_us=per_token * key.token_count)
            )
        engine_id = eng.state.id
        hashes = [key.block_hash for key in blocks]
        self._blocks_of[request.id] = hashes
        self._pending.setdefault(engine_id, Counter()).update(hashes)
        self._backlog[engine_id] = self._backlog.get(engine_id, 0.0) + prefill_us
        self._predicted[request.id] = (engine_id, prefill_us)
        chosen = estimate(cm, request, eng.state, actions)
        return PlanDecision(self.name, eng.state, actions, chosen, [])
