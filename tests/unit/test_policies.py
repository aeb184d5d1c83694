import dataclasses
import random

import pytest

from quillcache_core.errors import InvalidArgument
from quillcache_core.model import CacheTier, CostModel
from quillcache_core.routing.actions import ActionKind
from quillcache_core.routing.policy import Fleet
from quillcache_core.routing.references import POLICY_NAMES, EngineMetrics, make_policy
from tests.unit.factories import engine, make_request, resident, usable_from

pytestmark = pytest.mark.unit


def run(name, req, usable, engines, stores=None, seed=0):
    policy = make_policy(name, CostModel())
    return policy.plan(req, usable, Fleet(engines, stores or {}), random.Random(seed))


@pytest.mark.parametrize("name", ["quillcache", "dynamo", "llm-d"])
def test_cache_aware_policies_pick_the_idle_hot_engine(name):
    req = make_request(8)
    usable = usable_from(req, resident(req, "e1", CacheTier.HBM))
    decision = run(name, req, usable, [engine("e0"), engine("e1"), engine("e2")])
    assert decision.engine.id == "e1"
    assert decision.count(ActionKind.LOCAL_HIT) == 8
    assert decision.policy == name


def test_reference_policies_never_fetch_from_a_peer_but_ours_does():
    req = make_request(6)
    usable = usable_from(req, resident(req, "s9", CacheTier.CPU_DRAM))
    stores = {"s9": "rack-a"}
    engines = [engine("e0", store="s0"), engine("e1", store="s1")]
    for name in ("dynamo", "llm-d", "sglang", "round-robin", "least-loaded"):
        assert run(name, req, usable, engines, stores).count(ActionKind.FETCH) == 0, name
    assert run("quillcache", req, usable, engines, stores).count(ActionKind.FETCH) == 6


# --- Dynamo: its own active-block and prefill tracking --------------------------------


def _tracking(name):
    policy = make_policy(name, CostModel())
    policy.bind_lifecycle()
    return policy


def _costs(decision):
    costs = {decision.chosen.engine_id: decision.chosen.score}
    costs.update({o.engine_id: o.score for o in decision.others})
    return costs


def test_dynamo_counts_a_shared_prefix_once_per_engine_and_frees_it_at_the_end():
    dynamo = _tracking("dynamo")
    engines = [engine("e0"), engine("e1")]
    fleet = Fleet(engines, {})
    first = make_request(8, seed=1)
    second = make_request(8, seed=1, extra_tokens=32)  # same 8 blocks, then 2 more
    second = dataclasses.replace(second, id="req-2")
    hot = dynamo.plan(first, usable_from(first), fleet, random.Random(0)).engine.id
    # The second shares the first's 8 active blocks on `hot`: only its 2 new ones count.
    decision = dynamo.plan(second, usable_from(second), fleet, random.Random(0))
    costs = _costs(decision)
    cold = "e1" if hot == "e0" else "e0"
    # potential prefill blocks + potential active blocks (ISL 160 tokens = 10 blocks)
    assert costs[hot] == pytest.approx((128 + 160) / 16 + (8 + 2))
    assert costs[cold] == pytest.approx(160 / 16 + 10)
    assert decision.engine.id == cold  # 20 < 28: the in-flight prefill outweighs sharing
    dynamo.observe_first_token(first.id, hot)
    assert dynamo.active_prefill_tokens(hot) == 0
    # A third copy on `hot` now adds no block and no queued prefill beyond its own.
    third = dataclasses.replace(first, id="req-3")
    costs = _costs(dynamo.plan(third, usable_from(third), fleet, random.Random(0)))
    assert costs[hot] == pytest.approx(128 / 16 + 8)
    dynamo.observe_finished(first.id, hot)
    dynamo.observe_finished(third.id, hot)
    dynamo.observe_finished(second.id, cold)
    assert dynamo.active_blocks(hot) == dynamo.active_blocks(cold) == 0


def test_dynamo_credits_lower_tiers_partially():
    dynamo = _tracking("dynamo")
    req = make_request(8)  # ISL = 128 tokens = 8 blocks
    usable = usable_from(
        req,
        resident(req, "e0", CacheTier.HBM, blocks=[0, 1]),
        resident(req, "s0", CacheTier.CPU_DRAM, blocks=[2, 3]),
        resident(req, "s0", CacheTier.LOCAL_SSD, blocks=[4]),
    )
    engines = [engine("e0", store="s0"), engine("e1")]
    decision = dynamo.plan(req, usable, Fleet(engines, {"s0": "rack-a"}), random.Random(0))
    credit = 2 * 1.0 + 2 * 0.75 + 1 * 0.25
    assert _costs(decision) == pytest.approx({"e0": 8 - credit + 8, "e1": 8.0 + 8})
    assert decision.engine.id == "e0"
    # Local-only reuse: the own store node's copies are fetched, nothing from peers.
    kinds = [a.kind for a in decision.actions]
    assert kinds == [ActionKind.LOCAL_HIT] * 2 + [ActionKind.FETCH] * 3 + [ActionKind.RECOMPUTE] * 3


# --- llm-d: scraped metrics, min-max prefix scores, speculative entries ----------------


def test_llmd_scores_queue_kv_and_min_max_normalised_prefix():
    llmd = _tracking("llm-d")
    llmd.observe_metrics({"e0": EngineMetrics(4, 0.25), "e1": EngineMetrics(0, 0.0)})
    req = make_request(4)
    usable = usable_from(req, resident(req, "e0", CacheTier.HBM, blocks=[0, 1]))
    decision = llmd.plan(req, usable, Fleet([engine("e0"), engine("e1")], {}), random.Random(0))
    scores = {k: -v for k, v in _costs(decision).items()}
    # e0: queue 0, kv 2*(1-0.25), prefix 2 of 4 blocks is the only match -> 1.0 (x3);
    # e1: queue 2, kv 2, prefix 0. (Matched/total would give e0 3.0 and send it to e1.)
    assert scores == pytest.approx({"e0": 4.5, "e1": 4.0})
    # The scraped metrics, not the live load columns, drive the queue score.
    live = [engine("e0", inflight_requests=0), engine("e1", inflight_requests=9)]
    llmd.observe_metrics({"e0": EngineMetrics(0, 0.0), "e1": EngineMetrics(0, 0.0)})
    assert llmd.plan(req, usable, Fleet(live, {}), random.Random(0)).engine.id == "e0"


def test_llmd_speculative_entries_keep_a_repeat_on_its_engine_before_any_kv_event():
    llmd = _tracking("llm-d")
    engines = [engine(f"e{i}") for i in range(4)]
    fleet = Fleet(engines, {})
    req = make_request(6)
    llmd.observe_time(0.0)
    first = llmd.plan(req, usable_from(req), fleet, random.Random(1)).engine.id
    for seed in range(8):  # no KV event yet: only the speculative entries say where it went
        llmd.observe_time(1e6)
        assert llmd.plan(req, usable_from(req), fleet, random.Random(seed)).engine.id == first
    llmd.observe_time(40e6)  # past the 30 s TTL: nothing speculative is left
    assert not llmd.prefix_scores(req, engines, [[] for _ in engines]).any()


# --- SGLang: its own tree of routed prompts and its own load counts --------------------


def test_sglang_tree_learns_routed_prompts_and_never_hears_evictions():
    sglang = _tracking("sglang")
    engines = [engine(f"e{i}") for i in range(4)]
    fleet = Fleet(engines, {})
    doc = make_request(10, seed=5)
    owner = sglang.plan(doc, usable_from(doc), fleet, random.Random(0)).engine.id
    assert sglang.tree_size(owner) == 160
    question = dataclasses.replace(make_request(10, seed=5, extra_tokens=20), id="q")
    # Another engine holds it by KV events; the router does not listen to them.
    usable = usable_from(
        question, resident(question, "e3" if owner != "e3" else "e2", CacheTier.HBM)
    )
    for seed in range(6):
        assert sglang.plan(question, usable, fleet, random.Random(seed)).engine.id == owner


def test_sglang_switches_to_shortest_queue_only_past_both_thresholds():
    sglang = _tracking("sglang")
    req = make_request(4)
    sglang.plan(req, usable_from(req), Fleet([engine("e0")], {}), random.Random(0))  # tree: e0
    hot = engine("e0", inflight_requests=100)
    fleet = Fleet([hot, engine("e1", inflight_requests=40)], {})
    assert sglang.plan(req, usable_from(req), fleet, random.Random(0)).engine.id == "e0"
    fleet = Fleet([hot, engine("e1", inflight_requests=30)], {})
    assert sglang.plan(req, usable_from(req), fleet, random.Random(0)).engine.id == "e1"
    # In the imbalanced branch the prompt is still inserted, for the engine it went to.
    assert sglang.tree_size("e1") == 64


def test_sglang_below_match_threshold_picks_the_smallest_tree():
    sglang = _tracking("sglang")
    fleet = Fleet([engine("e0"), engine("e1")], {})
    big = make_request(10, seed=1)
    sglang.plan(big, usable_from(big), Fleet([engine("e0")], {}), random.Random(0))
    small = make_request(2, seed=2)
    sglang.plan(small, usable_from(small), Fleet([engine("e1")], {}), random.Random(0))
    # Shares 2 of 10 blocks with `big` (20% <= 30%): the smaller tree (e1) wins.
    partial = dataclasses.replace(
        make_request(10, seed=3),
        id="p",
        blocks=big.blocks[:2] + make_request(10, seed=3).blocks[2:],
    )
    assert sglang.plan(partial, usable_from(partial), fleet, random.Random(0)).engine.id == "e1"


def test_round_robin_cycles_and_least_loaded_follows_load():
    req = make_request(1)
    engines = [engine("b"), engine("a"), engine("c")]
    policy = make_policy("round-robin")
    picks = [
        policy.plan(req, usable_from(req), Fleet(engines, {}), random.Random(0)).engine.id
        for _ in range(6)
    ]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    engines = [engine("a", inflight_requests=3), engine("b", inflight_requests=1)]
    assert run("least-loaded", req, usable_from(req), engines).engine.id == "b"


def test_every_named_policy_builds_and_unknown_is_an_error():
    assert set(POLICY_NAMES) == {
        "quillcache",
        "dynamo",
        "llm-d",
        "sglang",
        "round-robin",
        "least-loaded",
    }
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    with pytest.raises(InvalidArgument, match="unknown policy"):
        make_policy("random-forest")
