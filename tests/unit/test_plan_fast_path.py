"""The Plan fast path: packed hashes, block runs, ActionRuns, the optimistic overlay."""

from __future__ import annotations

import random

import pytest

from quillcache_conductor.state import ConductorState
from quillcache_core.errors import InvalidArgument
from quillcache_core.index import MemoryIndex
from quillcache_core.model import MIB, CacheResidency, CacheTier, CostModel
from quillcache_core.registry import NodeRecord
from quillcache_core.routing.actions import ActionKind, ActionRuns, action_runs
from quillcache_core.routing.cost import actions_for_prefix
from quillcache_core.routing.planner import CostPlanner, block_runs
from quillcache_core.routing.policy import Fleet
from quillcache_core.wire.plan import pack_hashes, unpack_hashes
from tests.unit.factories import MODEL, TOKENIZER, engine, make_request

pytestmark = pytest.mark.unit


def test_packed_hashes_round_trip_and_reject_bad_input():
    hashes = [k.block_hash for k in make_request(5).blocks]
    packed = pack_hashes(hashes)
    assert len(packed) == 5 * 16
    assert unpack_hashes(packed) == hashes
    assert unpack_hashes(b"") == []
    with pytest.raises(InvalidArgument, match="multiple of 16"):
        unpack_hashes(packed[:-1])
    with pytest.raises(InvalidArgument, match="hex"):
        pack_hashes(["zz" * 16])
    with pytest.raises(InvalidArgument, match="32 hex characters"):
        pack_hashes(["ab"])


def _residencies(request, worker, tier, indexes, nbytes=2 * MIB):
    return {i: CacheResidency(request.blocks[i], worker, tier, nbytes) for i in indexes}


def test_block_runs_group_blocks_with_the_same_copies():
    request = make_request(10)
    on_e0 = _residencies(request, "e0", CacheTier.HBM, range(6))
    on_s0 = _residencies(request, "s0", CacheTier.CPU_DRAM, range(3, 8))
    usable = [
        [r for r in (on_e0.get(i), on_s0.get(i)) if r is not None]
        for i in range(len(request.blocks))
    ]
    # Blocks 0-2 on e0, 3-5 on e0 and s0, 6-7 on s0, 8-9 nowhere.
    assert block_runs(usable) == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert block_runs([]) == []


def test_action_runs_expand_to_the_same_actions_as_the_per_block_planner():
    request = make_request(12, extra_tokens=5)
    e0, e1 = engine("e0", store="s0"), engine("e1", domain="rack-b")
    on_e0 = _residencies(request, "e0", CacheTier.HBM, range(4))
    on_s0 = _residencies(request, "s0", CacheTier.CPU_DRAM, range(7))
    usable = [[r for r in (on_e0.get(i), on_s0.get(i)) if r is not None] for i in range(7)]
    fleet = Fleet([e0, e1], {"s0": "rack-a"})
    decision = CostPlanner(CostModel()).plan(request, usable, fleet, random.Random(1))
    assert isinstance(decision.actions, ActionRuns)
    assert decision.engine.id == "e0"
    runs = action_runs(decision.actions)
    assert [(r.kind, r.first, r.count) for r in runs] == [
        (ActionKind.LOCAL_HIT, 0, 4),
        (ActionKind.FETCH, 4, 3),
        (ActionKind.RECOMPUTE, 7, 5),
    ]
    expected = actions_for_prefix(CostModel(), request, e0, usable, fleet.store_domains, 7)
    assert list(decision.actions) == expected
    assert len(decision.actions) == 12
    # Grouping a per-block list gives the same runs.
    assert action_runs(expected) == runs
    assert sum(r.cost_us for r in runs) == pytest.approx(sum(a.cost_us for a in expected))
    assert decision.recompute_tokens(request) == 5 * 16 + 5


def _state(policy=None) -> ConductorState:
    state = ConductorState(
        MemoryIndex(),
        policy or CostPlanner(CostModel()),
        clock=lambda: 0.0,
        rng=random.Random(3),
    )
    for eid in ("e0", "e1"):
        state.engine_joined(_engine_record(eid))
    return state


def _engine_record(eid: str, start_time_s: float = 0.0) -> NodeRecord:
    return NodeRecord(
        kind="engine",
        id=eid,
        address="",
        locality_domain="rack-a",
        base_url=f"http://{eid}",
        model=MODEL,
        tokenizer=TOKENIZER,
        start_time_s=start_time_s,
    )


def test_optimistic_overlay_steers_the_next_plan_and_is_taken_back_on_error():
    state = _state()
    request = make_request(8)
    first = state.plan(request)
    engine_id = first.decision.engine.id
    assert len(state.optimistic) == 8, "all 8 blocks recorded on the chosen engine"
    assert state.index.metrics().resident_blocks == 0, "in the overlay, not the index"
    second = state.plan(request)
    assert second.decision.engine.id == engine_id
    assert second.decision.chosen.hit_blocks == 8
    state.finish(second.reservation_id, "error")
    state.finish(first.reservation_id, "error")
    assert state.optimistic == {}
    assert state.index.metrics().resident_blocks == 0


def test_success_promotes_overlay_records_to_the_index_and_engine_left_drops_them():
    state = _state()
    request = make_request(6)
    done = state.plan(request)
    state.finish(done.reservation_id, "success")
    assert state.optimistic == {}
    assert state.index.metrics().resident_blocks == 6
    assert state.index.worker_block_count(done.decision.engine.id) == 6
    # A reservation still open when its engine leaves loses its overlay records too.
    other = make_request(4, seed=9)
    open_plan = state.plan(other)
    assert state.optimistic
    state.engine_left(open_plan.decision.engine.id)
    assert state.optimistic == {}


def test_observing_finish_does_not_promote_twice():
    state = _state()
    request = make_request(3)
    plan = state.plan(request)
    engine_id = state.finish(plan.reservation_id, "success", promote=False)
    assert state.index.metrics().resident_blocks == 0
    state.observe(engine_id, request.blocks)
    assert state.index.worker_block_count(engine_id) == 3


@pytest.mark.parametrize("backend", ["memory", "lmdb", "mirrored"])
def test_locate_prefix_stops_at_the_first_block_held_nowhere(backend, tmp_path):
    from quillcache_core.index import open_index

    index = (
        open_index("memory")
        if backend == "memory"
        else open_index("lmdb", str(tmp_path / "i"), mirror=backend == "mirrored")
    )
    request = make_request(8)
    keys = request.blocks
    hashes = [k.block_hash for k in keys]
    index.put_many(
        [CacheResidency(k, "e0", CacheTier.HBM, 1) for k in keys[:3]]
        + [CacheResidency(keys[1], "s0", CacheTier.CPU_DRAM, 1)]
        + [CacheResidency(k, "e1", CacheTier.HBM, 1) for k in keys[5:]]
    )
    found = index.locate_prefix(iter(hashes))
    assert [sorted(r.worker_id for r in f) for f in found] == [["e0"], ["e0", "s0"], ["e0"]]
    # An overlay record for block 3 carries the prefix on to block 4 (held nowhere).
    extra = {hashes[3]: [CacheResidency(keys[3], "e2", CacheTier.HBM, 1)]}
    found = index.locate_prefix(hashes, extra)
    assert [sorted(r.worker_id for r in f) for f in found] == [["e0"], ["e0", "s0"], ["e0"], ["e2"]]
    assert index.locate_prefix([]) == []
    index.close()


def test_an_engine_registering_a_new_run_loses_its_residency_and_overlay():
    state = ConductorState(
        MemoryIndex(), CostPlanner(CostModel()), clock=lambda: 0.0, rng=random.Random(3)
    )
    assert state.engine_joined(_engine_record("e0", 100.0)) is False  # first seen
    assert state.engine_joined(_engine_record("e1", 100.0)) is False
    request = make_request(6)
    done = state.plan(request)
    state.finish(done.reservation_id, "success")
    hot = done.decision.engine.id
    other = "e1" if hot == "e0" else "e0"
    for n in range(4):  # open plans: their optimistic copies sit in the overlay
        state.plan(make_request(4, tenant=f"t{n}"))

    def overlay_on(engine_id: str) -> int:
        return sum(r.worker_id == engine_id for found in state.optimistic.values() for r in found)

    assert overlay_on(hot) > 0
    kept = overlay_on(other)
    assert state.engine_joined(_engine_record(hot, 100.0)) is False  # the same run again
    assert state.index.worker_block_count(hot) == 6
    assert state.engine_joined(_engine_record(hot, 250.0)) is True  # restarted
    assert state.index.worker_block_count(hot) == 0
    assert (overlay_on(hot), overlay_on(other)) == (0, kept)
    assert state.counters.restart_records_dropped == 6
    assert state.index.worker_epochs() == {hot: 250.0, other: 100.0}
    # A record without a start time (written by hand for a real vLLM) changes nothing.
    assert state.engine_joined(_engine_record(other, 0.0)) is False
    assert state.index.worker_epochs()[other] == 100.0
