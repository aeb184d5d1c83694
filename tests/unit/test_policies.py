import random

import pytest

from quillcache_core.errors import InvalidArgument
from quillcache_core.model import CacheTier, CostModel
from quillcache_core.routing.actions import ActionKind
from quillcache_core.routing.policy import Fleet
from quillcache_core.routing.references import POLICY_NAMES, make_policy
from tests.unit.factories import engine, make_request, resident, usable_from

pytestmark = pytest.mark.unit


def run(name, req, usable, engines, stores=None, seed=0):
    policy = make_policy(name, CostModel())
    return policy.plan(req, usable, Fleet(engines, stores or {}), random.Random(seed))


@pytest.mark.parametrize("name", ["quillcache", "dynamo", "llm-d", "sglang"])
def test_cache_aware_policies_pick_the_idle_hot_engine(name):
    req = make_request(8)
    usable = usable_from(req, resident(req, "e1", CacheTier.HBM))
    decision = run(name, req, usable, [engine("e0"), engine("e1"), engine("e2")])
    assert decision.engine.id == "e1"
    assert decision.count(ActionKind.LOCAL_HIT) == 8
    assert decision.policy == name


def test_dynamo_cost_is_prefill_blocks_less_tiered_credit_plus_decode_blocks():
    req = make_request(8)  # ISL = 128 tokens = 8 blocks
    usable = usable_from(
        req,
        resident(req, "e0", CacheTier.HBM, blocks=[0, 1]),
        resident(req, "s0", CacheTier.CPU_DRAM, blocks=[2, 3]),
        resident(req, "s0", CacheTier.LOCAL_SSD, blocks=[4]),
    )
    engines = [engine("e0", store="s0", queued_prefill_tokens=16, inflight_blocks=1), engine("e1")]
    decision = run("dynamo", req, usable, engines, {"s0": "rack-a"})
    credit = 2 * 1.0 + 2 * 0.75 + 1 * 0.25
    e0_cost = (16 + 128) / 16 - credit + 1  # 6.25 < 8 for the cold engine
    costs = {decision.chosen.engine_id: decision.chosen.score}
    costs.update({o.engine_id: o.score for o in decision.others})
    assert costs == pytest.approx({"e0": e0_cost, "e1": 8.0})
    assert decision.engine.id == "e0"
    # Local-only reuse: the own store node's copies are fetched, nothing from peers.
    kinds = [a.kind for a in decision.actions]
    assert kinds == [ActionKind.LOCAL_HIT] * 2 + [ActionKind.FETCH] * 3 + [ActionKind.RECOMPUTE] * 3


def test_reference_policies_never_fetch_from_a_peer_but_ours_does():
    req = make_request(6)
    usable = usable_from(req, resident(req, "s9", CacheTier.CPU_DRAM))
    stores = {"s9": "rack-a"}
    engines = [engine("e0", store="s0"), engine("e1", store="s1")]
    for name in ("dynamo", "llm-d", "sglang", "round-robin", "least-loaded"):
        assert run(name, req, usable, engines, stores).count(ActionKind.FETCH) == 0, name
    assert run("quillcache", req, usable, engines, stores).count(ActionKind.FETCH) == 6


def test_llmd_score_weights_queue_kv_and_prefix():
    req = make_request(4)
    usable = usable_from(req, resident(req, "e0", CacheTier.HBM, blocks=[0, 1]))
    busy = engine("e0", inflight_requests=4, hbm_used_bytes=0)
    idle = engine("e1", inflight_requests=0)
    decision = run("llm-d", req, usable, [busy, idle])
    scores = {decision.chosen.engine_id: -decision.chosen.score}
    scores.update({o.engine_id: -o.score for o in decision.others})
    # e0: queue 0, kv 1, prefix 2/4 -> 0 + 2 + 1.5; e1: queue 1, kv 1, prefix 0 -> 2 + 2.
    assert scores == pytest.approx({"e0": 3.5, "e1": 4.0})
    assert decision.engine.id == "e1"


def test_sglang_switches_to_least_loaded_only_past_both_thresholds():
    req = make_request(4)
    usable = usable_from(req, resident(req, "e0", CacheTier.HBM))
    hot = engine("e0", inflight_requests=100)
    assert run("sglang", req, usable, [hot, engine("e1", inflight_requests=40)]).engine.id == "e0"
    assert run("sglang", req, usable, [hot, engine("e1", inflight_requests=30)]).engine.id == "e1"


def test_sglang_below_match_threshold_picks_smallest_tree():
    req = make_request(10)
    usable = usable_from(req, resident(req, "e0", CacheTier.HBM, blocks=[0, 1]))  # 20% match
    engines = [engine("e0", resident_blocks=50), engine("e1", resident_blocks=10)]
    assert run("sglang", req, usable, engines).engine.id == "e1"


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
