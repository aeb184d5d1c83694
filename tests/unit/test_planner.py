import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache_core.errors import InvalidArgument, NodeUnavailable
from quillcache_core.model import MIB, CacheResidency, CacheTier, CostModel
from quillcache_core.routing.actions import ActionKind
from quillcache_core.routing.cost import source_cost
from quillcache_core.routing.planner import CostPlanner
from quillcache_core.routing.policy import Fleet
from tests.unit.factories import engine, make_request, resident, usable_from

pytestmark = pytest.mark.unit

CM = CostModel()


def plan(request, usable, engines, stores=None, seed=0, **kw):
    planner = CostPlanner(CM, **kw)
    return planner.plan(request, usable, Fleet(engines, stores or {}), random.Random(seed))


def test_idle_cache_hot_engine_wins_with_local_hits_and_breakdown():
    req = make_request(8, extra_tokens=5, decode_tokens=10)
    usable = usable_from(req, resident(req, "e0", CacheTier.HBM))
    decision = plan(req, usable, [engine("e0"), engine("e1")])
    assert decision.engine.id == "e0"
    assert [a.kind for a in decision.actions] == [ActionKind.LOCAL_HIT] * 8
    chosen = decision.chosen
    assert chosen.hit_blocks == 8 and chosen.fetch_blocks == 0 and chosen.prefix_blocks == 8
    assert chosen.fetch_us == 8 * CM.hbm_hit_us
    assert chosen.prefill_us == 5 * CM.prefill_us_per_token
    assert chosen.decode_us == 10 * CM.decode_us_per_token
    assert chosen.est_ttft_us == chosen.queue_us + chosen.fetch_us + chosen.prefill_us
    (other,) = decision.others
    assert other.engine_id == "e1"
    assert other.prefill_us == (8 * 16 + 5) * CM.prefill_us_per_token
    assert other.cost_us > chosen.cost_us


@pytest.mark.parametrize(("running", "expected"), [(3, "e0"), (4, "e1")])
def test_hot_engine_loses_once_its_reserved_load_makes_it_slower(running, expected):
    # 8 hot blocks save 8*16*45 - 8*5 = 5,720 us of prefill; each running decode costs 1,500 us.
    req = make_request(8, decode_tokens=0)
    usable = usable_from(req, resident(req, "e0", CacheTier.HBM))
    decision = plan(req, usable, [engine("e0", running_decodes=running), engine("e1")])
    assert decision.engine.id == expected
    costs = {
        decision.chosen.engine_id: decision.chosen,
        **{o.engine_id: o for o in decision.others},
    }
    assert costs["e0"].cost_us == 8 * CM.hbm_hit_us + running * CM.running_decode_penalty_us
    assert costs["e1"].cost_us == 8 * 16 * CM.prefill_us_per_token


def test_queued_prefill_tokens_count_as_queue_cost():
    req = make_request(4, decode_tokens=0)
    usable = usable_from(req, resident(req, "e0", CacheTier.HBM))
    decision = plan(req, usable, [engine("e0", queued_prefill_tokens=1000), engine("e1")])
    assert decision.engine.id == "e1"
    hot = decision.others[0]
    assert hot.queue_us == 4000


def test_peer_fetch_beats_recompute_and_names_the_source():
    req = make_request(4)
    usable = usable_from(req, resident(req, "s1", CacheTier.CPU_DRAM, nbytes=2 * MIB))
    decision = plan(req, usable, [engine("e0", store="s0")], {"s0": "rack-a", "s1": "rack-a"})
    assert [a.kind for a in decision.actions] == [ActionKind.FETCH] * 4
    assert {(a.source_node, a.source_tier) for a in decision.actions} == {
        ("s1", CacheTier.CPU_DRAM)
    }
    assert decision.chosen.fetch_us == 4 * 2 * CM.cpu_dram_us_per_mb


def test_cross_domain_fetch_pays_the_penalty_and_nearest_copy_wins():
    req = make_request(2)
    usable = usable_from(
        req,
        resident(req, "s-far", CacheTier.CPU_DRAM, nbytes=MIB),
        resident(req, "s-near", CacheTier.LOCAL_SSD, blocks=[1], nbytes=MIB),
    )
    stores = {"s-far": "rack-b", "s-near": "rack-a"}
    decision = plan(req, usable, [engine("e0")], stores)
    a0, a1 = decision.actions
    assert (a0.source_node, a0.cost_us) == (
        "s-far",
        CM.cpu_dram_us_per_mb + CM.cross_domain_penalty_us,
    )
    # SSD nearby (280) beats DRAM far away (55 + 350).
    assert (a1.source_node, a1.cost_us) == ("s-near", CM.local_ssd_us_per_mb)


def test_fetch_is_not_chosen_when_it_costs_more_than_recompute():
    req = make_request(3)
    usable = usable_from(req, resident(req, "s1", CacheTier.OBJECT_STORE, nbytes=64 * MIB))
    decision = plan(req, usable, [engine("e0")], {"s1": "rack-a"})
    assert [a.kind for a in decision.actions] == [ActionKind.RECOMPUTE] * 3
    assert decision.chosen.fetch_us == 0


def test_reuse_is_a_contiguous_prefix():
    req = make_request(4)
    usable = usable_from(req, resident(req, "e0", CacheTier.HBM, blocks=[1, 2, 3]))
    decision = plan(req, usable, [engine("e0"), engine("e1")])
    assert decision.count(ActionKind.LOCAL_HIT) == 0
    usable = usable_from(req, resident(req, "e0", CacheTier.HBM, blocks=[0, 1, 3]))
    decision = plan(req, usable, [engine("e0"), engine("e1")])
    assert [a.kind for a in decision.actions] == [ActionKind.LOCAL_HIT] * 2 + [
        ActionKind.RECOMPUTE
    ] * 2


def test_residency_on_a_dead_node_or_another_engine_is_no_source():
    req = make_request(2)
    usable = usable_from(
        req,
        resident(req, "s-dead", CacheTier.CPU_DRAM),
        resident(req, "e9", CacheTier.HBM),
    )
    decision = plan(req, usable, [engine("e0")], {"s-live": "rack-a"})
    assert decision.count(ActionKind.RECOMPUTE) == 2


def test_exact_ties_break_at_random_with_the_injected_rng():
    req = make_request(2)
    usable = usable_from(req)
    engines = [engine("e0"), engine("e1"), engine("e2")]
    picks = [plan(req, usable, engines, seed=s).engine.id for s in range(60)]
    assert set(picks) == {"e0", "e1", "e2"}
    again = [plan(req, usable, engines, seed=s).engine.id for s in range(60)]
    assert picks == again, "same seed, same choices"


def test_temperature_sometimes_takes_a_costlier_engine():
    req = make_request(4)
    usable = usable_from(req, resident(req, "e0", CacheTier.HBM))
    engines = [engine("e0"), engine("e1")]
    greedy = {plan(req, usable, engines, seed=s).engine.id for s in range(100)}
    warm = {plan(req, usable, engines, seed=s, temperature=2.0).engine.id for s in range(100)}
    assert greedy == {"e0"}
    assert warm == {"e0", "e1"}


def test_empty_fleet_and_bad_temperature_are_errors():
    req = make_request(1)
    with pytest.raises(NodeUnavailable):
        plan(req, usable_from(req), [])
    with pytest.raises(InvalidArgument):
        CostPlanner(CM, temperature=-1)


def _brute_force_costs(req, usable, engines, stores):
    """Per engine, min over every contiguous prefix k, computed the slow obvious way."""
    out = {}
    for w in engines:
        best = math.inf
        fetch = 0.0
        reused = 0
        for k in range(len(req.blocks) + 1):
            est = fetch + CM.prefill_cost_us(req.input_tokens() - reused)
            best = min(best, est)
            if k == len(req.blocks):
                break
            prices = [p[0] for r in usable[k] if (p := source_cost(CM, w, r, stores)) is not None]
            if not prices:
                break
            fetch += min(prices)
            reused += req.blocks[k].token_count
        out[w.id] = (
            CM.queue_cost_us(w)
            + best
            + CM.decode_cost_us(req.estimated_decode_tokens, w.running_decodes)
        )
    return out


WORKERS = ["e0", "e1", "e2", "s0", "s1", "s2", "dead"]
TIERS = list(CacheTier)


@settings(max_examples=150, deadline=None)
@given(
    n_blocks=st.integers(0, 6),
    placements=st.lists(
        st.tuples(
            st.integers(0, 5),
            st.sampled_from(WORKERS),
            st.sampled_from(TIERS),
            st.sampled_from([1, MIB, 3 * MIB, 40 * MIB]),
        ),
        max_size=25,
    ),
    loads=st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 5)), min_size=3, max_size=3),
    seed=st.integers(0, 1000),
)
def test_vectorised_costs_equal_the_brute_force_definition(n_blocks, placements, loads, seed):
    req = make_request(n_blocks, extra_tokens=3)
    usable = [[] for _ in req.blocks]
    for index, worker, tier, nbytes in placements:
        if index < n_blocks:
            usable[index].append(CacheResidency(req.blocks[index], worker, tier, nbytes))
    engines = [
        engine(
            "e0",
            "rack-a",
            store="s0",
            queued_prefill_tokens=loads[0][0],
            running_decodes=loads[0][1],
        ),
        engine(
            "e1",
            "rack-a",
            store="s1",
            queued_prefill_tokens=loads[1][0],
            running_decodes=loads[1][1],
        ),
        engine(
            "e2",
            "rack-b",
            store="s2",
            queued_prefill_tokens=loads[2][0],
            running_decodes=loads[2][1],
        ),
    ]
    stores = {"s0": "rack-a", "s1": "rack-a", "s2": "rack-b"}
    decision = plan(req, usable, engines, stores, seed=seed)
    expected = _brute_force_costs(req, usable, engines, stores)
    got = {decision.chosen.engine_id: decision.chosen.cost_us}
    got.update({o.engine_id: o.cost_us for o in decision.others})
    assert got == pytest.approx(expected)
    assert got[decision.engine.id] == min(expected.values())
    # The chosen engine's actions realise exactly its cost.
    assert decision.chosen.est_ttft_us + decision.chosen.decode_us == pytest.approx(
        expected[decision.engine.id]
    )


# --- with a clock: the queue drains with time, duplicated work weighs more under load --


class _Clock:
    def __init__(self) -> None:
        self.now_us = 0.0

    def __call__(self) -> float:
        return self.now_us


def test_with_a_clock_the_queue_drains_at_prefill_speed_and_never_exceeds_the_observed():
    clock = _Clock()
    planner = CostPlanner(CM.queue_at_prefill_speed(), clock=clock)
    req = make_request(4, decode_tokens=0)
    usable = usable_from(req, resident(req, "e0", CacheTier.HBM))
    hot = engine("e0", queued_prefill_tokens=1000)  # 45 ms of prefill ahead
    cold = engine("e1")
    fleet = Fleet([hot, cold], {})
    first = planner.plan(req, usable, fleet, random.Random(0))
    assert first.engine.id == "e1"  # 45 ms of queue against 2.9 ms of recompute
    clock.now_us = 44_000.0  # the engine has worked 44 ms through it: 1 ms is left
    again = planner.plan(req, usable, fleet, random.Random(0))
    assert again.engine.id == "e0"
    assert again.chosen.queue_us == pytest.approx(1000 * 45 - 44_000)
    hot.queued_prefill_tokens = 0  # its first token came: nothing is left
    assert planner.plan(req, usable, fleet, random.Random(0)).chosen.queue_us == 0
    hot.queued_prefill_tokens = 100  # a new reservation counts in full at once
    clock.now_us = 45_000.0
    decision = planner.plan(req, usable, fleet, random.Random(0))
    assert {c.engine_id: c.queue_us for c in [decision.chosen, *decision.others]}["e0"] == 4500


def test_with_a_clock_a_plans_own_work_counts_though_a_release_hides_the_rise():
    # Between two plans one request's reservation is released (its first token) and
    # the first plan's added: the observed queue falls, yet the new work is there.
    clock = _Clock()
    planner = CostPlanner(CM.queue_at_prefill_speed(), clock=clock)
    req = make_request(4, decode_tokens=0)
    e0 = engine("e0", queued_prefill_tokens=100)  # 4.5 ms ahead
    e1 = engine("e1", queued_prefill_tokens=2000)
    fleet = Fleet([e0, e1], {})
    first = planner.plan(req, [], fleet, random.Random(0))
    assert first.engine.id == "e0"
    tokens = first.recompute_tokens(req)
    e0.queued_prefill_tokens += tokens  # the caller reserves what the plan computes
    clock.now_us = 4_500.0  # the earlier request's prefill is done: released
    e0.queued_prefill_tokens -= 100
    second = planner.plan(req, [], fleet, random.Random(0))
    queue = {c.engine_id: c.queue_us for c in [second.chosen, *second.others]}
    assert queue["e0"] == pytest.approx(tokens * 45)


def test_with_a_clock_a_busy_fleet_keeps_a_prefix_on_its_only_holder():
    req = make_request(40, decode_tokens=0)  # 640 tokens: 28.8 ms to recompute
    usable = usable_from(req, resident(req, "e0", CacheTier.HBM))
    cm = CM.queue_at_prefill_speed()

    def choose(busy_others: int) -> str:
        # e0 holds the prefix behind 40 ms of queue; e1 is idle; of 6 more, some are busy.
        engines = [engine("e0", queued_prefill_tokens=889), engine("e1")]
        engines += [engine(f"b{i}", queued_prefill_tokens=5000) for i in range(busy_others)]
        engines += [engine(f"i{i}") for i in range(6 - busy_others)]
        planner = CostPlanner(cm, clock=_Clock())
        return planner.plan(req, usable, Fleet(engines, {}), random.Random(0)).engine.id

    assert choose(0) != "e0"  # 1 of 8 busy: own TTFT decides (any idle engine)
    assert choose(6) == "e0"  # 7 of 8 busy: recomputing elsewhere costs the queue more
    # Without a clock the planner is the plain cost function: it takes e1.
    engines = [engine("e0", queued_prefill_tokens=889), engine("e1")]
    engines += [engine(f"b{i}", queued_prefill_tokens=5000) for i in range(6)]
    assert CostPlanner(cm).plan(req, usable, Fleet(engines, {}), random.Random(0)).engine.id == "e1"


def test_with_a_clock_exact_ties_go_to_the_emptiest_cache():
    req = make_request(4)
    engines = [engine("e0", resident_blocks=900), engine("e1", resident_blocks=10)]
    engines.append(engine("e2", resident_blocks=500))
    planner = CostPlanner(CM, clock=_Clock())
    for seed in range(5):
        fleet = Fleet(engines, {})
        assert planner.plan(req, usable_from(req), fleet, random.Random(seed)).engine.id == "e1"
