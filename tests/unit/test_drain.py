"""Draining: a draining engine is planned no new request, its prefixes held in the pool
are planned as FETCH on another engine, and the engine record carries its state."""

from __future__ import annotations

import random

import pytest

from quillcache_conductor.state import ConductorState
from quillcache_core.errors import InvalidArgument, NotFound
from quillcache_core.index import MemoryIndex
from quillcache_core.model import CacheResidency, CacheTier, CostModel
from quillcache_core.registry import NodeRecord
from quillcache_core.routing.planner import CostPlanner
from quillcache_simengine.kvcache import CachedBlock, PrefixCache
from tests.unit.factories import engine_record, make_request

pytestmark = pytest.mark.unit


def make_state() -> ConductorState:
    state = ConductorState(
        MemoryIndex(), CostPlanner(CostModel()), clock=lambda: 1000.0, rng=random.Random(1)
    )
    for node in ("e0", "e1"):
        state.engine_joined(engine_record(node, store_node="s0"))
    state.store_joined(NodeRecord(kind="store", id="s0", address="s0:1", locality_domain="rack-a"))
    return state


def hold(state: ConductorState, request, worker: str, tier: CacheTier) -> None:
    state.index.put_many([CacheResidency(k, worker, tier, 2 << 20) for k in request.blocks])


def test_a_drained_engines_prefixes_load_from_the_pool_on_another_engine():
    state = make_state()
    request = make_request(32)
    hold(state, request, "e0", CacheTier.HBM)
    before = state.plan(request).decision
    assert (before.engine.id, before.chosen.hit_blocks) == ("e0", 32)
    hold(state, request, "s0", CacheTier.CPU_DRAM)  # what the drain saved
    state.drain("e0")
    after = state.plan(request).decision
    assert after.engine.id == "e1"
    assert after.chosen.fetch_blocks == 32
    assert after.recompute_tokens(request) < 16  # at most the last token's block


def test_an_engine_whose_record_says_draining_gets_no_plan_on_any_replica():
    state = make_state()
    request = make_request(8)
    hold(state, request, "e1", CacheTier.HBM)
    state.engine_joined(engine_record("e1", store_node="s0", state="draining"))
    assert {state.plan(make_request(8, seed=s)).decision.engine.id for s in range(20)} == {"e0"}
    state.engine_joined(engine_record("e1", store_node="s0", state="drained"))
    assert state.plan(request).decision.engine.id == "e0"


def test_when_every_engine_drains_requests_still_get_an_engine():
    state = make_state()
    state.drain("e0")
    state.drain("e1")
    assert state.plan(make_request(4)).decision.engine.id in ("e0", "e1")


def test_draining_an_unknown_engine_is_not_found_and_a_new_run_serves_again():
    state = make_state()
    with pytest.raises(NotFound):
        state.drain("nope")
    state.drain("e0")
    assert state.drains.state_of(state.engines["e0"].record) == "draining"
    restarted = NodeRecord(
        **{**engine_record("e0", store_node="s0").__dict__, "start_time_s": 200.0}
    )
    state.engine_joined(restarted)
    assert state.drains.state_of(state.engines["e0"].record) == "serving"


def test_an_engine_records_state_round_trips_and_a_bad_one_is_refused():
    record = engine_record("e0", store_node="s0", state="draining")
    assert NodeRecord.from_json("engine", "e0", record.to_json()).state == "draining"
    assert NodeRecord.from_json("engine", "e0", b'{"base_url": "x"}').state == "serving"
    with pytest.raises(InvalidArgument, match="state must be one of"):
        NodeRecord.from_json("engine", "e0", b'{"state": "asleep"}')


def test_the_hottest_blocks_are_those_in_use_then_the_most_recently_released():
    cache = PrefixCache(8)
    blocks = [CachedBlock(h, None, 0, (), key=None, cache_salt=None) for h in range(5)]
    cache.insert(blocks)
    cache.release([0, 1, 2, 3], cache.generation)  # 4 stays in use; 0 released last
    assert [b.engine_hash for b in cache.hottest(3)] == [4, 0, 1]
    assert len(cache.hottest(100)) == 5
