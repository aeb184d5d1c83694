"""The gateway's fast path builds the same bytes and plans as the plain, slower way."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.v1 import common_pb2, conductor_pb2
from quillcache_core.identity.chain import BlockChain
from quillcache_core.identity.tokenize import BuiltinTokenizer, HfTokenizer, render_chat
from quillcache_core.index.memory import MemoryIndex
from quillcache_core.kvevents.decode import decode_batch
from quillcache_core.kvevents.translate import EngineEventTranslator
from quillcache_core.process.metrics import MetricsRegistry
from quillcache_core.registry import NodeRecord
from quillcache_core.wire import engine_plan
from quillcache_core.wire.engine_plan import EnginePlan, FetchAction
from quillcache_core.wire.plan import pack_hashes
from quillcache_gateway.conductor_calls import FinishQueue
from quillcache_gateway.config import GatewayConfig
from quillcache_gateway.server import Gateway, _Call, _Completion
from quillcache_gateway.wire import upstream_body
from tests.support.vllm_publisher import VllmEventEncoder
from tests.unit.test_tokenize import train_tokenizer

pytestmark = pytest.mark.unit

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)


def gateway() -> Gateway:
    return Gateway(GatewayConfig(conductor="127.0.0.1:1", cache_salts="acme=salty", insecure=True))


def plain_body(payload: dict, salt: str, plan: dict) -> dict:
    """What the gateway used to send: the payload re-encoded with both fields set."""
    body = dict(payload)
    body["cache_salt"] = salt
    params = body.get("kv_transfer_params")
    body["kv_transfer_params"] = {
        **(params if isinstance(params, dict) else {}),
        "quillcache": plan,
    }
    return body


@settings(max_examples=200, deadline=None)
@given(
    payload=st.dictionaries(st.text(max_size=12), json_values, max_size=6),
    indent=st.sampled_from([None, 0, 2]),
    trailing=st.sampled_from(["", " ", "\n", "\r\n\t "]),
)
def test_spliced_body_equals_the_reencoded_one(payload, indent, trailing):
    ident = gateway()._identity("acme", "m", "builtin-v1")
    plan = {"reservation_id": "r1", "fetch": [{"block_index": 3, "tier": "cpu_dram"}]}
    raw = (json.dumps(payload, indent=indent, ensure_ascii=False) + trailing).encode()
    sent = json.loads(upstream_body(raw, payload, ident, plan))
    assert sent == plain_body(payload, "salty", plan)


def test_the_client_cannot_choose_its_cache_salt_or_overwrite_the_plan():
    ident = gateway()._identity("acme", "m", "builtin-v1")
    payload = {
        "model": "m",
        "cache_salt": "globex",
        "kv_transfer_params": {"quillcache": {"reservation_id": "forged"}, "other": 1},
    }
    raw = json.dumps(payload).encode()
    sent = json.loads(upstream_body(raw, payload, ident, {"reservation_id": "r1"}))
    assert sent["cache_salt"] == "salty"
    assert sent["kv_transfer_params"] == {"quillcache": {"reservation_id": "r1"}, "other": 1}
    assert sent["model"] == "m"


def test_empty_and_unicode_bodies_splice():
    ident = gateway()._identity("tenant-é", "m", "builtin-v1")
    for raw, payload in ((b"{}", {}), (b' { "p" : "\xe5\xad\x97}" } ', {"p": "字}"})):
        sent = json.loads(upstream_body(raw, payload, ident, {}))
        assert sent == plain_body(payload, "tenant-é", {})


def engine_record(engine_id: str, tokenizer: str) -> NodeRecord:
    """An engine's registry record serving sim-model under `tokenizer`."""
    return NodeRecord(
        kind="engine",
        id=engine_id,
        address="",
        locality_domain="d0",
        model="sim-model",
        tokenizer=tokenizer,
    )


def served(gw: Gateway, models: dict[str, str]) -> Gateway:
    """The gateway as if the conductor's Stats had just listed these models' tokenizers."""
    gw.catalog.set_served(models)
    return gw


def gateway_hashes(gw: Gateway, tenant: str, payload: dict, kind: str) -> tuple[list[str], object]:
    """The block hashes the gateway's own request path derives (parse, identity, hash)."""
    raw = json.dumps(payload).encode()
    job = asyncio.run(gw._parse(raw, payload, kind, "acme", gw._fields(payload, kind)))
    ident = gw._identity(tenant, job.model, job.tokenizer_id)
    return ident.identity.hashes(job.tokens, 16), ident


def conductor_hashes(record: NodeRecord, tokens: list[int], salt: str) -> tuple[list[str], set]:
    """What the conductor indexes when the engine of `record` reports caching `tokens`."""
    index = MemoryIndex()
    translator = EngineEventTranslator(index, record.id, record.model, record.tokenizer)
    enc = VllmEventEncoder(block_size=16, seed=b"another-deployment")
    result = translator.apply(decode_batch(enc.batch([enc.stored_event(tokens, salt=salt)])))
    assert result.rejected == []
    keys = sorted((r.key for r in index.snapshot()), key=lambda k: k.block_index)
    return [k.block_hash for k in keys], {k.scope() for k in keys}


@pytest.mark.parametrize("tokenizer", ["org/llama-tok-v2", ""])
@pytest.mark.parametrize(
    "kind,payload",
    [
        ("completion", {"model": "sim-model", "prompt": "a shared system prompt " * 20}),
        (
            "chat",
            {
                "model": "sim-model",
                "messages": [
                    {"role": "system", "content": "You answer questions about rockets. " * 8},
                    {"role": "user", "content": "How high?"},
                ],
            },
        ),
    ],
)
def test_gateway_and_conductor_derive_the_same_keys_for_one_engine_record(
    tokenizer, kind, payload, tmp_path
):
    # The engine's record names a tokenizer the gateway's local files are not called
    # (the gateway knows them as sim-model:tok.json): the identity is the record's on
    # both sides, so the keys meet.
    record = engine_record("e1", tokenizer)
    local = train_tokenizer(tmp_path / "tok.json")
    gw = served(with_tokenizer(local), {record.model: record.tokenizer})
    hashes, ident = gateway_hashes(gw, "acme", payload, kind)
    assert len(hashes) >= 5
    engine_tokenizer = HfTokenizer(local)
    tokens = (
        engine_tokenizer.encode(render_chat(payload["messages"]))
        if kind == "chat"
        else engine_tokenizer.encode(payload["prompt"])
    )
    theirs, scopes = conductor_hashes(record, tokens, "salty")  # acme's salt reaches vLLM
    assert hashes == theirs
    assert scopes == {ident.identity.scope()}
    assert ident.plan_identity.cache_salt == "salty"
    assert ident.finish_identity == common_pb2.Identity(
        model_id="sim-model", tokenizer_id=tokenizer or "sim-model", tenant_id="salty"
    )
    assert gw._identity("acme", "sim-model", tokenizer) is ident  # computed once


def with_tokenizer(path: str) -> Gateway:
    return Gateway(
        GatewayConfig(
            conductor="127.0.0.1:1",
            cache_salts="acme=salty",
            tokenizers=f"sim-model={path}",
            insecure=True,
        )
    )


def test_another_tenant_or_tokenizer_never_meets_those_keys():
    payload = {"model": "sim-model", "prompt": "a shared system prompt " * 20}
    gw = served(gateway(), {"sim-model": "builtin-v1"})
    ours, _ = gateway_hashes(gw, "acme", payload, "completion")
    tokens = BuiltinTokenizer().encode(payload["prompt"])
    record = engine_record("e1", "builtin-v1")
    assert conductor_hashes(record, tokens, "salty")[0] == ours
    assert conductor_hashes(record, tokens, "globex")[0][0] != ours[0]
    other = engine_record("e2", "org/tok-v3")
    assert conductor_hashes(other, tokens, "salty")[0][0] != ours[0]


def test_plan_json_is_engine_plan_to_json_with_fetch_runs_expanded():
    """The gateway's plan for the engine, from a conductor's reply (`engine_plan.plan_json`)."""
    gw = gateway()
    ident = gw._identity("acme", "sim-model", "builtin-v1")
    hashes = [f"{i:032x}" for i in range(10)]
    job = _Completion(b"{}", {}, "sim-model", "builtin-v1", list(range(170)), 8, False)
    call = _Call(
        "req",
        0.0,
        800,
        job,
        ident,
        BlockChain(ident.identity.scope(), 16, pack_hashes(hashes)),
        hashes,
    )
    A = conductor_pb2.BlockAction
    plan = conductor_pb2.PlanResponse(
        reservation_id="res-1",
        engine_id="e1",
        hit_blocks=2,
        fetch_blocks=5,
        recompute_blocks=3,
        actions=[
            A(kind=A.LOCAL_HIT, block_index=0, block_count=2),
            A(
                kind=A.FETCH,
                block_index=2,
                block_count=3,
                source_node="s1",
                source_address="h:1",
                source_tier=common_pb2.TIER_CPU_DRAM,
            ),
            A(
                kind=A.FETCH,
                block_index=5,
                source_node="s2",
                source_address="h:2",
                source_tier=common_pb2.TIER_LOCAL_SSD,
            ),
            A(
                kind=A.FETCH,
                block_index=6,
                block_count=1,
                source_node="s2",
                source_address="h:2",
                source_tier=common_pb2.TIER_LOCAL_SSD,
            ),
            A(kind=A.RECOMPUTE, block_index=7, block_count=3),
        ],
    )
    expected = EnginePlan(
        reservation_id="res-1",
        engine_id="e1",
        model_id="sim-model",
        tokenizer_id="builtin-v1",
        tenant_id="salty",  # the identity's tenant is its cache partition
        cache_salt="salty",
        block_size=16,
        hit_blocks=2,
        recompute_blocks=3,
        fetch=tuple(
            FetchAction(i, hashes[i], node, addr, tier)
            for i, node, addr, tier in (
                (2, "s1", "h:1", "cpu_dram"),
                (3, "s1", "h:1", "cpu_dram"),
                (4, "s1", "h:1", "cpu_dram"),
                (5, "s2", "h:2", "local_ssd"),
                (6, "s2", "h:2", "local_ssd"),
            )
        ),
    )
    got = engine_plan.plan_json(plan, ident.identity, call.block_size, call.hashes)
    assert got == expected.to_json()
    assert EnginePlan.from_json(json.loads(json.dumps(got))) == expected


class FakeCalls:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[str] = []
        self.fail = fail

    async def finish(self, request, timeout_s):
        await asyncio.sleep(0)
        self.sent.append(request.reservation_id)
        if self.fail:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down"
            )
        return conductor_pb2.FinishResponse(released=True)


def finish(rid: str) -> conductor_pb2.FinishRequest:
    return conductor_pb2.FinishRequest(reservation_id=rid, outcome=1)


async def until(condition, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


def test_finish_queue_sends_in_the_background_and_drains_on_stop():
    async def main():
        calls = FakeCalls()
        queue = FinishQueue(calls, 1.0, MetricsRegistry().counter("d", "d"))
        queue.start()
        queue.submit(finish("a"))
        assert calls.sent == []  # nothing is sent on the submitter's turn
        await until(lambda: calls.sent == ["a"])
        for rid in "bcd":
            queue.submit(finish(rid))
        await queue.stop()
        assert calls.sent == ["a", "b", "c", "d"]

    asyncio.run(main())


def test_finish_waits_while_a_request_is_held_but_not_past_max_hold():
    async def main():
        calls = FakeCalls()
        queue = FinishQueue(calls, 1.0, MetricsRegistry().counter("d", "d"), max_hold_s=0.2)
        queue.start()
        queue.hold()
        queue.submit(finish("a"))
        await asyncio.sleep(0.05)
        assert calls.sent == []
        queue.unhold()
        await until(lambda: calls.sent == ["a"])
        queue.hold()
        queue.submit(finish("b"))
        await until(lambda: calls.sent == ["a", "b"], timeout_s=2.0)  # max_hold_s passed
        queue.unhold()
        await queue.stop()

    asyncio.run(main())


def test_finish_queue_is_bounded_and_survives_failed_calls():
    async def main():
        calls = FakeCalls(fail=True)
        dropped = MetricsRegistry().counter("dropped", "d")
        queue = FinishQueue(calls, 1.0, dropped, max_pending=2)
        for rid in "abc":
            queue.submit(finish(rid))
        assert dropped.get() == 1
        queue.start()
        await until(lambda: calls.sent == ["a", "b"])
        queue.submit(finish("d"))
        await until(lambda: calls.sent == ["a", "b", "d"])
        await queue.stop()

    asyncio.run(main())
