"""Every plan stays as it was: a recorded run of the conductor (plans as the gateway asks
them, engines' KV events with their token ids, store residency, first tokens, Finishes
with observed blocks, splits onto a prefill engine, expiries) yields the decisions kept
in `plans_replay.json`, request by request; so do the fleet simulator's runs of every
policy on its workloads (engine, planned hits and fetches, estimated TTFT).

A change that moves code and should decide nothing differently must leave this test
green. A change meant to plan differently re-records the file on purpose:
`QUILLCACHE_RECORD_PLANS=1 pytest tests/unit/test_plans_replay.py` (and says why in its
commit)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from quillcache.v1 import common_pb2, conductor_pb2
from quillcache_bench.fleetsim.command import policy_fleet
from quillcache_bench.fleetsim.sim import FleetConfig, FleetSim
from quillcache_bench.fleetsim.workloads import WORKLOAD_NAMES, make_workload
from quillcache_conductor.events import EventRouter
from quillcache_conductor.servicer import ConductorServicer
from quillcache_conductor.state import ConductorState
from quillcache_core.identity.keys import block_identity
from quillcache_core.index import MemoryIndex
from quillcache_core.model import CostModel
from quillcache_core.process.metrics import MetricsRegistry
from quillcache_core.registry import NodeRecord
from quillcache_core.routing.planner import CostPlanner
from quillcache_core.routing.references import POLICY_NAMES, make_policy

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).with_name("plans_replay.json")
MODEL, TOKENIZER = "replay-model", "replay-tok"
BLOCK = 16
F = conductor_pb2.FinishRequest


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def engine(node: str, *, events: bool, role: str = "both", store: str = "") -> NodeRecord:
    return NodeRecord(
        kind="engine",
        id=node,
        address="",
        locality_domain="rack-a" if node in ("e0", "e1") else "rack-b",
        base_url=f"http://{node}",
        model=MODEL,
        tokenizer=TOKENIZER,
        start_time_s=100.0,
        kv_events_endpoint=f"tcp://{node}:5557" if events else "",
        role=role,
        store_node=store,
    )


def store(node: str, domain: str) -> NodeRecord:
    return NodeRecord(kind="store", id=node, address=f"{node}:1", locality_domain=domain)


def cluster():
    clock = Clock()
    state = ConductorState(
        MemoryIndex(), CostPlanner(CostModel()), clock=clock, rng=random.Random(11)
    )
    for record in (store("s0", "rack-a"), store("s1", "rack-b")):
        state.store_joined(record)
    for record in (
        engine("e0", events=True, store="s0"),
        engine("e1", events=True, store="s0"),
        engine("e2", events=False, store="s1"),
        engine("p0", events=True, role="prefill", store="s1"),
    ):
        state.engine_joined(record)
    router = EventRouter(state, MetricsRegistry(), subscribe_zmq=False)
    for record in state.engines.values():
        router.engine_joined(record.record)
    servicer = ConductorServicer(state, router, max_blocks=4096)
    return state, router, servicer, clock


def plan_request(
    rid: str, identity, tokens: list[int], *, disagg: str = ""
) -> conductor_pb2.PlanRequest:
    hashes = identity.hashes(tokens, BLOCK)
    return conductor_pb2.PlanRequest(
        request_id=rid,
        identity=common_pb2.Identity(
            model_id=identity.model_id,
            tokenizer_id=identity.tokenizer_id,
            tenant_id=identity.tenant_id,
            cache_salt=identity.cache_salt or "",
        ),
        packed_hashes=b"".join(bytes.fromhex(h) for h in hashes),
        block_tokens=BLOCK,
        block_bytes=2 << 20,
        action_runs=True,
        max_others=0,
        prompt_tokens=len(tokens),
        expected_decode_tokens=64,
        slo=common_pb2.Slo(ttft_ms=2000),
        disagg=disagg,
        reports_first_token=True,
    )


def engine_stored(engine_id: str, identity, tokens: list[int]) -> conductor_pb2.KvEventBatch:
    """What vLLM reports of a prompt it computed: its own block hashes (opaque) and the
    blocks' token ids, under the request's salt."""
    full = len(tokens) // BLOCK * BLOCK
    return conductor_pb2.KvEventBatch(
        engine_id=engine_id,
        identity=common_pb2.Identity(model_id=MODEL, tokenizer_id=TOKENIZER),
        events=[
            conductor_pb2.KvEvent(
                stored=conductor_pb2.BlockStored(
                    block_hashes=[f"vllm-{engine_id}-{hash(tuple(tokens[:i + BLOCK])) & 0xFFFFFFFF:x}"
                                  for i in range(0, full, BLOCK)],
                    token_ids=tokens[:full],
                    block_size=BLOCK,
                    cache_salt=identity.cache_salt or "",
                )
            )
        ],
    )  # fmt: skip


def store_stored(node: str, identity, tokens: list[int]) -> conductor_pb2.KvEventBatch:
    hashes = identity.hashes(tokens, BLOCK)
    ident = common_pb2.Identity(
        model_id=identity.model_id, tokenizer_id=identity.tokenizer_id, tenant_id=identity.tenant_id
    )
    return conductor_pb2.KvEventBatch(
        engine_id=node,
        source_kind="store",
        events=[
            conductor_pb2.KvEvent(
                stored=conductor_pb2.BlockStored(
                    block_hashes=hashes, block_size=BLOCK, identity=ident, bytes_per_block=2 << 20
                )
            )
        ],
    )


def decision(reply: conductor_pb2.PlanResponse) -> dict:
    return {
        "engine": reply.engine_id,
        "hit": reply.hit_blocks,
        "fetch": reply.fetch_blocks,
        "recompute": reply.recompute_blocks,
        "actions": [
            [a.kind, a.block_index, a.block_count, a.source_node, a.source_tier]
            for a in reply.actions
        ],
        "est_ttft_ms": round(reply.est_ttft_ms, 3),
        "disagg": reply.disagg,
        "prefill_engine": reply.prefill_engine_id,
    }


def replay() -> list[dict]:
    """The scripted run: 240 requests over 12 documents and 3 tenants (a first visit,
    then questions in random order), with the events, Finishes and time between."""
    state, router, servicer, clock = cluster()
    rng = random.Random(2024)
    tenants = [block_identity(MODEL, TOKENIZER, cache_salt=f"salt-{t}") for t in "abc"]
    documents = [[rng.randrange(32000) for _ in range(rng.randrange(64, 700))] for _ in range(12)]
    open_plans: list[tuple[str, str, object, list[int], float]] = []
    out = []
    for n in range(240):
        clock.now += rng.expovariate(4.0)
        identity = tenants[rng.randrange(3)]
        doc = documents[rng.randrange(12)]
        tokens = doc + [rng.randrange(32000) for _ in range(rng.randrange(8, 80))]
        disagg = "split" if n % 17 == 0 else ""
        reply = servicer.plan(plan_request(f"r{n}", identity, tokens, disagg=disagg))
        out.append(decision(reply))
        open_plans.append((reply.reservation_id, reply.engine_id, identity, tokens, clock.now))
        if reply.prefill_reservation_id:
            servicer.finish(F(reservation_id=reply.prefill_reservation_id, outcome=F.SUCCESS,
                              ttft_ms=300.0))  # fmt: skip
        # The oldest requests get their first token and finish, in order.
        while open_plans and clock.now - open_plans[0][4] > rng.uniform(0.2, 1.5):
            rid, engine_id, ident, toks, started = open_plans.pop(0)
            fate = rng.random()
            if fate < 0.08:
                continue  # never finished: its reservation expires
            servicer.finish(F(reservation_id=rid, outcome=F.PREFILLED,
                              ttft_ms=(clock.now - started) * 500))  # fmt: skip
            if fate < 0.15:
                servicer.finish(F(reservation_id=rid, outcome=F.CANCELLED))
                continue
            if state.engines[engine_id].record.kv_events_endpoint:
                router.ingest_proto(engine_stored(engine_id, ident, toks))
            hashes = ident.hashes(toks, BLOCK)
            servicer.finish(
                F(
                    reservation_id=rid,
                    outcome=F.SUCCESS,
                    ttft_ms=(clock.now - started) * 1000,
                    identity=common_pb2.Identity(model_id=MODEL, tokenizer_id=TOKENIZER,
                                                 tenant_id=ident.tenant_id),
                    observe_packed_hashes=b"".join(bytes.fromhex(h) for h in hashes),
                    observe_block_tokens=BLOCK,
                )
            )  # fmt: skip
            if rng.random() < 0.5:  # its engine's store node saved the prompt
                node = state.engines[engine_id].record.store_node or "s0"
                router.ingest_proto(store_stored(node, ident, toks))
        if n % 40 == 39:  # an engine's cache is emptied now and then
            router.ingest_proto(conductor_pb2.KvEventBatch(
                engine_id="e1", identity=common_pb2.Identity(model_id=MODEL, tokenizer_id=TOKENIZER),
                events=[conductor_pb2.KvEvent(cleared=conductor_pb2.AllBlocksCleared())]))  # fmt: skip
        state.tick()
    return out


def fleet_runs() -> dict[str, dict]:
    """Each policy of the fleet simulator on each workload: per request, the engine and
    what the plan said (hits, fetches, estimated TTFT)."""
    config = FleetConfig(engines=4, stores=2, domains=2, hbm_blocks=512,
                         dram_bytes=256 << 21, ssd_bytes=512 << 21)  # fmt: skip
    out = {}
    for workload in WORKLOAD_NAMES:
        for policy in POLICY_NAMES:
            wl = make_workload(workload, 80, 5)
            fleet = policy_fleet(config, policy, frozenset({"quillcache"}))
            rate = 0.7 * wl.saturation_rate(fleet.engines, fleet.cost_model)
            sim = FleetSim(fleet, make_policy(policy, CostModel()), wl.requests,
                           wl.arrivals_us(rate, 5), seed=5)  # fmt: skip
            run = sim.run()
            out[f"{workload}/{policy}"] = {
                "engine": run.engine_of.tolist(),
                "hit": run.planned_hit_blocks.tolist(),
                "fetch": run.planned_fetch_blocks.tolist(),
                "est_ttft_us": [round(float(x), 1) for x in run.est_ttft_us],
            }
    return out


@pytest.fixture(scope="module")
def golden() -> tuple[dict, dict]:
    got = {"conductor": replay(), "fleetsim": fleet_runs()}
    if os.environ.get("QUILLCACHE_RECORD_PLANS"):
        GOLDEN.write_text(json.dumps(got, indent=None, separators=(",", ":")) + "\n")
    return got, json.loads(GOLDEN.read_text())


def test_the_fleet_simulators_runs_plan_as_before(golden):
    got, want = golden
    assert got["fleetsim"].keys() == want["fleetsim"].keys()
    for name, runs in got["fleetsim"].items():
        assert runs == want["fleetsim"][name], f"{name} planned differently"


def test_the_recorded_run_plans_as_before(golden):
    got, want = golden
    got, want = got["conductor"], want["conductor"]
    assert len(got) == len(want)
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"request {n} planned differently"
    # The run exercises what it should: hits, fetches, recomputes and splits all occur.
    assert sum(d["hit"] > 0 for d in got) > 20
    assert sum(d["fetch"] > 0 for d in got) > 5
    assert sum(d["disagg"].startswith("split") for d in got) > 0
