"""Predicted against delivered hits: the gateway's comparison, its stream tap, the
histogram it is counted in, and the conductor dropping the blocks an engine had lost."""

from __future__ import annotations

import json
import random

import pytest

from quillcache.v1 import common_pb2, conductor_pb2
from quillcache_conductor.events import EventRouter
from quillcache_conductor.servicer import ConductorServicer
from quillcache_conductor.state import ConductorState
from quillcache_core.index import MemoryIndex
from quillcache_core.model import CacheResidency, CostModel
from quillcache_core.process.metrics import MetricsRegistry
from quillcache_core.registry import NodeRecord
from quillcache_core.routing.planner import CostPlanner
from quillcache_core.wire.plan import pack_hashes
from quillcache_gateway.delivered import Delivery, StreamTap, asking_usage, predict, whole_body
from quillcache_gateway.wire import upstream_body
from tests.unit.factories import MODEL, TENANT, TOKENIZER, make_request

pytestmark = pytest.mark.unit

BS = 16


def plan(hit: int, fetch: int, prompt_tokens: int = 10 * BS + 3, fallback: bool = False):
    return predict("e0", "" if fallback else "c0", hit, fetch, 40.0, BS, prompt_tokens, BS)


@pytest.mark.parametrize(
    ("hit", "fetch", "delivered", "error", "cause"),
    [
        (6, 0, 6 * BS, 0, None),
        (6, 0, 2 * BS, -4 * BS, "engine_evicted"),
        (2, 4, 4 * BS, -2 * BS, "pool_load_failed"),
        (2, 4, 1 * BS, -5 * BS, "engine_evicted"),
        (2, 0, 5 * BS, 3 * BS, "engine_extra"),
        (2, 0, None, None, None),
    ],
)
def test_delivered_cached_tokens_are_compared_with_hits_plus_pool_loads(
    hit, fetch, delivered, error, cause
):
    done = Delivery(plan(hit, fetch), delivered, 55.0)
    assert done.token_error == error
    assert done.cause == cause
    assert done.ttft_error_ms == pytest.approx(15.0)


@pytest.mark.parametrize(
    ("hit", "fetch", "delivered", "cause"),
    [
        (6, 0, 6 * BS, None),  # behind, yet as planned: nothing to explain
        (6, 0, 2 * BS, "stale_replica"),  # an eviction the replica had not heard of yet
        (2, 4, 4 * BS, "stale_replica"),
        (2, 0, 5 * BS, "stale_replica"),  # blocks the engine stored unheard
        (2, 0, None, None),
    ],
)
def test_a_plan_from_a_replica_behind_its_engine_is_a_stale_replica_misprediction(
    hit, fetch, delivered, cause
):
    behind = predict("e0", "c0", hit, fetch, 40.0, BS, 10 * BS + 3, BS, behind_ms=750)
    done = Delivery(behind, delivered, 55.0)
    assert done.cause == cause
    assert done.explain()["predicted"]["replica_behind_ms"] == 750
    assert done.explain()["cause"] == cause
    assert (
        Delivery(plan(hit, fetch), delivered, 55.0).explain()["predicted"]["replica_behind_ms"] == 0
    )


def test_a_fallback_plan_comes_before_a_stale_replica():
    behind = predict("e0", "", 2, 0, 40.0, BS, 10 * BS + 3, BS, behind_ms=750)
    done = Delivery(behind, 5 * BS, 55.0)
    assert done.cause == "fallback_plan"
    assert done.explain()["predicted"]["replica_behind_ms"] is None


def test_a_prompt_cached_whole_is_predicted_without_its_last_block():
    # The engine always computes the last prompt token: 4 full blocks, 3 can hit.
    assert plan(4, 0, prompt_tokens=4 * BS).cached_tokens == 3 * BS
    assert plan(2, 2, prompt_tokens=4 * BS).loaded_tokens == BS
    # An engine of 32-token blocks caches 2 of 4 index blocks of 64 tokens, not 3.
    assert predict("e0", "c0", 4, 0, 1.0, BS, 4 * BS, 2 * BS).cached_tokens == 2 * BS


def test_a_fallback_plan_is_its_own_cause_and_has_no_ttft_error():
    done = Delivery(plan(0, 0, fallback=True), 3 * BS, 10.0)
    assert done.cause == "fallback_plan"
    assert done.ttft_error_ms is None


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


USAGE = {"prompt_tokens": 99, "prompt_tokens_details": {"cached_tokens": 32}}
TOKEN = sse({"id": "x", "choices": [{"delta": {"content": "hi"}}]})
USAGE_EVENT = sse({"id": "x", "choices": [], "usage": USAGE})
DONE = b"data: [DONE]\n\n"


def relay(tap: StreamTap, stream: bytes, cut: int) -> bytes:
    out = tap.feed(stream[:cut]) + tap.feed(stream[cut:])
    return out + tap.flush()


@pytest.mark.parametrize("cut", [0, 5, len(TOKEN) + 9, len(TOKEN) + len(USAGE_EVENT) + 2])
def test_a_usage_the_client_did_not_ask_for_is_taken_out_wherever_reads_split(cut):
    tap = StreamTap(keep_usage=False, explain=None)
    assert relay(tap, TOKEN + USAGE_EVENT + DONE, cut) == TOKEN + DONE
    assert tap.cached == 32


def test_events_ending_in_crlf_are_relayed_at_once():
    tap = StreamTap(keep_usage=False, explain=None)
    event = b'data: {"choices": []}\r\n\r\n'
    assert tap.feed(event) == event
    assert tap.feed(b"data: {") == b"" and tap.flush() == b"data: {"


def test_a_usage_the_client_asked_for_arrives_as_the_engine_sent_it():
    tap = StreamTap(keep_usage=True, explain=None)
    assert relay(tap, TOKEN + USAGE_EVENT + DONE, 7) == TOKEN + USAGE_EVENT + DONE
    assert tap.cached == 32


def test_an_explaining_client_gets_the_figures_in_the_last_event_and_no_usage():
    tap = StreamTap(keep_usage=False, explain=plan(2, 0))
    tap.ttft_ms = 50.0
    out = relay(tap, TOKEN + USAGE_EVENT + DONE, 3)
    events = [e for e in out.split(b"\n\n") if e]
    last = json.loads(events[-2][6:])
    assert set(last) == {"id", "choices", "quillcache"} and last["choices"] == []
    assert last["quillcache"]["delivered"] == {"cached_tokens": 32, "ttft_ms": 50.0}
    assert last["quillcache"]["error"] == {"tokens": 0, "ttft_ms": 10.0}
    assert events[-1] == b"data: [DONE]"


def test_a_whole_answer_gets_the_figures_beside_the_engines_own_extras():
    body = json.dumps({"usage": USAGE, "quillcache": {"engine_id": "e0"}}).encode()
    assert whole_body(body, None) == (body, 32)
    shaped, _ = whole_body(body, plan(3, 0))
    report = json.loads(shaped)["quillcache"]
    assert report["engine_id"] == "e0" and report["delivered"]["cached_tokens"] == 32
    assert report["cause"] == "engine_evicted"
    assert whole_body(b"not json", plan(3, 0)) == (b"not json", None)


class _Ident:
    salt_json = b'"s"'


def test_a_stream_without_usage_asks_the_engine_for_it():
    raw = b'{"model":"m","stream":true}'
    spliced = json.loads(upstream_body(raw, json.loads(raw), _Ident, {}, {"include_usage": True}))
    assert spliced["stream_options"] == {"include_usage": True}
    assert spliced["cache_salt"] == "s"
    assert json.loads(upstream_body(raw, json.loads(raw), _Ident, {})).get("stream_options") is None
    asked = {"stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    assert asking_usage(asked) == {"include_usage": True}


def test_a_histogram_renders_cumulative_buckets_sum_and_count():
    m = MetricsRegistry(prefix="")
    h = m.histogram("err", "error", [-10, 0, 10], ["engine"])
    for value in (-20, 0, 0, 5, 50):
        h.observe(value, engine="e0")
    text = m.render()
    assert 'err_bucket{engine="e0",le="-10.0"} 1.0' in text
    assert 'err_bucket{engine="e0",le="0.0"} 3.0' in text
    assert 'err_bucket{engine="e0",le="10.0"} 4.0' in text
    assert 'err_bucket{engine="e0",le="+Inf"} 5.0' in text
    # A histogram with negative buckets has no _sum (prometheus_client's rule: a sum
    # that can fall breaks Prometheus' counter-reset detection).
    assert "err_sum" not in text
    assert 'err_count{engine="e0"} 5.0' in text
    assert h.count(engine="e0") == 5


def conductor():
    state = ConductorState(
        MemoryIndex(), CostPlanner(CostModel()), clock=lambda: 1000.0, rng=random.Random(1)
    )
    state.engine_joined(
        NodeRecord(
            kind="engine",
            id="e0",
            address="",
            locality_domain="rack-a",
            base_url="http://e0",
            model=MODEL,
            tokenizer=TOKENIZER,
            start_time_s=100.0,
            kv_events_endpoint="tcp://e0:5557",
        )
    )
    events = EventRouter(state, MetricsRegistry(), subscribe_zmq=False)
    return state, ConductorServicer(state, events, max_blocks=64)


def plan_and_finish(servicer, request, delivered: int | None) -> int:
    identity = common_pb2.Identity(model_id=MODEL, tokenizer_id=TOKENIZER, tenant_id=TENANT)
    packed = pack_hashes([key.block_hash for key in request.blocks])
    reply = servicer.plan(
        conductor_pb2.PlanRequest(
            request_id="r",
            identity=identity,
            packed_hashes=packed,
            block_tokens=BS,
            prompt_tokens=request.prompt_tokens,
        )
    )
    finish = conductor_pb2.FinishRequest(
        reservation_id=reply.reservation_id,
        outcome=conductor_pb2.FinishRequest.SUCCESS,
        identity=identity,
        observe_packed_hashes=packed,
        observe_block_tokens=BS,
    )
    if delivered is not None:
        finish.delivered_cached_tokens = delivered
    servicer.finish(finish)
    return reply.hit_blocks


def test_an_engine_that_delivered_fewer_hits_loses_the_records_past_them():
    state, servicer = conductor()
    request = make_request(8, extra_tokens=3)
    state.index.put_many(CacheResidency.hbm("e0", k, 2 << 20) for k in request.blocks)
    assert plan_and_finish(servicer, request, 8 * BS) == 8  # as planned: nothing changes
    assert state.counters.residency_corrections == {}
    assert plan_and_finish(servicer, request, 3 * BS) == 8  # had lost 5 of them
    assert state.counters.residency_corrections == {"e0": 1}
    # The next plan claims only 3; the engine delivers 8 (it had recomputed them, and
    # its events of that came before the Finish that dropped them): held, recorded.
    assert plan_and_finish(servicer, request, 8 * BS) == 3
    assert state.counters.residency_corrections == {"e0": 2}
    assert plan_and_finish(servicer, request, None) == 8


def test_a_prompt_cached_whole_delivers_one_block_less_and_loses_nothing():
    state, servicer = conductor()
    request = make_request(8)  # 8 full blocks, no token past them: 7 can be cached
    state.index.put_many(CacheResidency.hbm("e0", k, 2 << 20) for k in request.blocks)
    assert plan_and_finish(servicer, request, 7 * BS) == 8
    assert state.counters.residency_corrections == {}
    assert plan_and_finish(servicer, request, None) == 8
