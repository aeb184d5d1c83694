"""Prefill/decode disaggregation: when the conductor splits a request across two engines
(routing/disagg.py), and the reservations a split plan opens (quillcache_conductor.split)."""

from __future__ import annotations

import asyncio
import random

import pytest

from quillcache_conductor.split import plan_split
from quillcache_conductor.state import ConductorState
from quillcache_core.errors import InvalidArgument
from quillcache_core.index import MemoryIndex
from quillcache_core.model import CacheResidency, CacheTier, CostModel, WorkerState
from quillcache_core.registry.records import NodeRecord
from quillcache_core.routing import disagg
from quillcache_core.routing.planner import CostPlanner
from quillcache_simengine.scheduler import Scheduler
from tests.unit.factories import MODEL, TOKENIZER, make_request

pytestmark = pytest.mark.unit


COST = CostModel()
SETTINGS = disagg.DisaggSettings()


def engine(id: str, running: int = 0, store: str | None = None) -> WorkerState:
    return WorkerState(id=id, locality_domain="a", running_decodes=running, store_node_id=store)


def choose(request, d, d_role, others, *, usable=(), bps=1e9, mode="auto", settings=SETTINGS):
    ttft = float(COST.prefill_cost_us(request.input_tokens()))
    bandwidth = disagg.Bandwidth(bps)
    return disagg.choose(COST, settings, request, d, d_role, ttft, others, usable, bandwidth, mode)


@pytest.mark.parametrize(
    ("blocks", "out", "running", "bps", "mode", "split", "why"),
    [
        # a long prompt onto an engine decoding for 8 others: their streams would stall
        (128, 512, 8, 1e9, "auto", True, "split; cheaper"),
        # the same on an idle engine: nothing to stall, the second call only costs
        (128, 512, 0, 1e9, "auto", False, "colocated; cheaper"),
        # a short answer gains nothing from a second engine
        (128, 4, 8, 1e9, "auto", False, "colocated; short output"),
        # a network slow enough that moving the KV costs more than the stall
        (128, 512, 1, 20e6, "auto", False, "colocated; cheaper"),
        # the client's header wins either way
        (128, 512, 0, 1e9, "split", True, "split; asked for"),
        (128, 512, 8, 1e9, "colocated", False, "colocated; asked for"),
    ],
)
def test_split_or_colocated_follows_the_cost_model(blocks, out, running, bps, mode, split, why):
    request = make_request(blocks, decode_tokens=out)
    choice = choose(
        request, engine("d", running), "both", [(engine("p"), "prefill")], bps=bps, mode=mode
    )
    assert choice.split is split
    assert choice.reason.startswith(why)
    assert (choice.prefill.id if choice.prefill else None) == ("p" if split else None)


def test_a_decode_only_engine_is_split_whenever_someone_can_prefill():
    request = make_request(4, decode_tokens=2)
    choice = choose(request, engine("d"), "decode", [(engine("p"), "prefill")])
    assert choice.split and choice.reason.startswith("split; decode-only engine")
    alone = choose(request, engine("d"), "decode", [(engine("x"), "decode")])
    assert not alone.split and "no other engine can prefill" in alone.reason
    off = choose(
        request,
        engine("d"),
        "decode",
        [(engine("p"), "prefill")],
        settings=disagg.DisaggSettings(enabled=False),
    )
    assert not off.split


def test_what_the_engines_hold_is_neither_recomputed_nor_moved():
    request = make_request(16, decode_tokens=256)
    d, p = engine("d", running=8, store="s-d"), engine("p", store="s-p")
    hbm_p = [[CacheResidency(k, "p", CacheTier.HBM, request.block_bytes)] for k in request.blocks]
    choice = choose(request, d, "both", [(p, "prefill")], usable=hbm_p)
    assert choice.split and choice.prefill_tokens == 16  # at least one token: the last block
    # the decode engine's own store node already has every block: nothing to move
    pool_d = [
        [CacheResidency(k, "s-d", CacheTier.CPU_DRAM, request.block_bytes)] for k in request.blocks
    ]
    assert choose(request, d, "both", [(p, "prefill")], usable=pool_d).transfer_blocks == 0
    # the decode engine holds the whole prompt in HBM: nothing to split
    hbm_d = [[CacheResidency(k, "d", CacheTier.HBM, request.block_bytes)] for k in request.blocks]
    held = choose(request, d, "both", [(p, "prefill")], usable=hbm_d)
    assert not held.split and "holds the prompt" in held.reason


def test_a_prefill_engine_on_the_decode_engines_store_node_moves_nothing():
    request = make_request(16, decode_tokens=256)
    d = engine("d", store="s-0")
    far, near = engine("far", store="s-1"), engine("near", store="s-0")
    choice = choose(request, d, "decode", [(far, "prefill"), (near, "prefill")], bps=50e6)
    assert choice.prefill.id == "near" and choice.transfer_blocks == 0
    assert choose(request, d, "decode", [(far, "prefill")], bps=50e6).transfer_blocks > 0


def test_a_blocks_move_costs_what_the_last_transfers_measured():
    bw = disagg.Bandwidth(500e6)
    assert bw.block_us(2 << 20) == pytest.approx((2 << 20) / 500e6 * 1e6)  # assumed
    # 20 blocks of 16 KiB in 20 ms (latency included): 1 ms a block, whatever the
    # configured block size says
    assert bw.observe(20 * 16384, 20 * 16384 / 0.020, 20)
    assert bw.block_us(2 << 20) == pytest.approx(1000.0)
    assert bw.observe(20 * 16384, 20 * 16384 / 0.040, 20)
    assert 1000.0 < bw.block_us(2 << 20) < 2000.0
    assert not bw.observe(0, 1e6, 3)
    assert not bw.observe(4096, float("nan"), 1)
    assert not bw.observe(4096, 1e6, 0)


def record(node: str, role: str) -> NodeRecord:
    return NodeRecord(
        kind="engine",
        id=node,
        address="",
        locality_domain="a",
        base_url=f"http://{node}",
        model=MODEL,
        tokenizer=TOKENIZER,
        store_node=f"store-{node}",
        role=role,
    )


def test_a_split_plan_reserves_the_prompt_on_the_prefill_engine_and_decoding_on_the_other():
    state = ConductorState(
        MemoryIndex(), CostPlanner(COST), clock=lambda: 10.0, rng=random.Random(1)
    )
    state.engine_joined(record("pre", "prefill"))
    state.engine_joined(record("dec", "decode"))
    request = make_request(8, extra_tokens=5)
    for _ in range(3):  # a prefill-only engine is never planned to decode
        outcome = plan_split(state, request)
        assert outcome.decision.engine.id == "dec"
        assert outcome.split.split and outcome.split.prefill.id == "pre"
        state.finish(outcome.reservation_id, "cancelled")
        state.finish(outcome.prefill_reservation_id, "cancelled")
    outcome = plan_split(state, request)
    pre, dec = state.engines["pre"].state, state.engines["dec"].state
    assert pre.queued_prefill_tokens == request.input_tokens()
    assert dec.queued_prefill_tokens == 5  # it loads the 8 blocks, computes the tail
    assert pre.inflight_requests == dec.inflight_requests == 1
    state.finish(outcome.prefill_reservation_id, "success")
    state.finish(outcome.reservation_id, "success")
    assert pre.queued_prefill_tokens == dec.queued_prefill_tokens == 0
    assert pre.inflight_requests == dec.inflight_requests == 0
    colocated = plan_split(state, request, mode="colocated")
    assert not colocated.split.split and colocated.prefill_reservation_id == ""


def test_an_engine_role_is_part_of_its_record():
    rec = record("e", "decode")
    assert NodeRecord.from_json("engine", "e", rec.to_json()).role == "decode"
    assert NodeRecord.from_json("engine", "e", b'{"role": ""}').role == "both"
    assert NodeRecord.from_json("engine", "e", b"{}").role == "both"
    with pytest.raises(InvalidArgument, match="role"):
        NodeRecord.from_json("engine", "e", b'{"role": "encode"}')
    with pytest.raises(InvalidArgument, match="role"):
        NodeRecord.from_json("engine", "e", b'{"role": 3}')


@pytest.mark.parametrize("stalls", [False, True])
def test_a_sim_engines_prefill_stalls_its_running_decodes_when_asked(stalls):
    """The sim engine's step model: with --prefill-stalls-decodes, a prefill that runs
    while a request decodes pushes its later tokens back by the prefill's duration."""

    async def scenario() -> list[float]:
        sched = Scheduler(
            prefill_us_per_token=1000,
            decode_us_per_token=10_000,
            time_scale=1.0,
            prefill_stalls_decodes=stalls,
        )
        loop = asyncio.get_running_loop()
        start = loop.time()
        end = await sched.prefill(1)
        times = []

        async def decode() -> None:
            async for _ in sched.decode(5, end):
                times.append(loop.time() - start)

        async def other_prefill() -> None:
            await asyncio.sleep(0.015)
            await sched.prefill(30)  # 30 ms, done at about 45 ms

        await asyncio.gather(decode(), other_prefill())
        return times

    times = asyncio.run(scenario())
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    if stalls:
        assert max(gaps) >= 0.035  # one gap holds the 30 ms prefill
        assert times[-1] >= 0.06
    else:
        assert max(gaps) < 0.02 and times[-1] < 0.05


def test_a_fleet_of_both_engines_is_split_only_when_asked():
    request = make_request(16, decode_tokens=256)
    d, p = engine("d", running=8), engine("p")
    assert not choose(request, d, "both", [(p, "both")]).split  # auto: no prefill engine
    assert choose(request, d, "both", [(p, "both")], mode="split").split
    # a decode-only engine may have a both engine prefill for it
    assert choose(request, d, "decode", [(p, "both")]).split
