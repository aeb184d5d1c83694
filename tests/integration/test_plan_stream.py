"""PlanStream and the compact Plan forms against a real conductor process and etcd."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from quillcache.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from quillcache_core.identity.keys import request_blocks
from quillcache_core.rpc.plan_client import PlanClient
from quillcache_core.wire.plan import expand_runs, pack_hashes
from tests.support.etcdctl import put_engine as support_put_engine
from tests.support.services import ServiceProcess, wait_until

pytestmark = pytest.mark.integration

MODEL, TOKENIZER, BS = "m-stream", "tok-stream", 16
HIT = conductor_pb2.BlockAction.LOCAL_HIT
RECOMPUTE = conductor_pb2.BlockAction.RECOMPUTE


def put_engine(etcd, engine_id: str) -> None:
    support_put_engine(etcd, engine_id, model=MODEL, tokenizer=TOKENIZER)


@pytest.fixture
def conductor(etcd_server, tmp_path):
    proc = ServiceProcess(
        "conductor", ["--registry", etcd_server.client_url, "--seed", "3"], tmp_path
    ).start()
    for engine in ("e1", "e2"):
        put_engine(etcd_server, engine)
    client = conductor_pb2_grpc.ConductorStub(proc.channel("gateway"))
    wait_until(
        lambda: len(client.Stats(conductor_pb2.StatsRequest(), timeout=5).engines) == 2,
        what="two engines",
    )
    yield proc
    proc.stop()


def ident(tenant: str = "acme") -> common_pb2.Identity:
    return common_pb2.Identity(model_id=MODEL, tokenizer_id=TOKENIZER, tenant_id=tenant)


def hashes(tokens, tenant: str = "acme") -> list[str]:
    keys = request_blocks(
        tokens,
        BS,
        model_id=MODEL,
        tokenizer_id=TOKENIZER,
        adapter_id=None,
        tenant_id=tenant,
        cache_salt="",
    )
    return [k.block_hash for k in keys]


def packed_request(tokens, **kw) -> conductor_pb2.PlanRequest:
    return conductor_pb2.PlanRequest(
        identity=ident(),
        packed_hashes=pack_hashes(hashes(tokens)),
        block_tokens=BS,
        prompt_tokens=len(tokens),
        expected_decode_tokens=8,
        **kw,
    )


def test_packed_hashes_and_action_runs_plan_like_the_per_block_form(conductor):
    tokens = list(range(40 * BS))

    async def go():
        async with conductor.channel("gateway", aio=True) as channel:
            stub = conductor_pb2_grpc.ConductorStub(channel)
            # The first 24 blocks become resident on e2.
            await stub.Observe(
                conductor_pb2.ObserveRequest(
                    engine_id="e2",
                    identity=ident(),
                    blocks=[
                        common_pb2.BlockRef(block_hash=h, token_count=BS)
                        for h in hashes(tokens[: 24 * BS])
                    ],
                ),
                timeout=5,
            )
            per_block = await stub.Plan(
                conductor_pb2.PlanRequest(
                    identity=ident(),
                    blocks=[
                        common_pb2.BlockRef(block_hash=h, token_count=BS) for h in hashes(tokens)
                    ],
                    prompt_tokens=len(tokens),
                    expected_decode_tokens=8,
                ),
                timeout=5,
            )
            # An ERROR takes back the blocks the plan recorded optimistically on e2.
            await stub.Finish(
                conductor_pb2.FinishRequest(
                    reservation_id=per_block.reservation_id,
                    outcome=conductor_pb2.FinishRequest.ERROR,
                ),
                timeout=5,
            )
            client = PlanClient(channel)
            runs = await client.plan(packed_request(tokens, action_runs=True), timeout=5)
            await client.close()
            return per_block, runs

    per_block, runs = asyncio.run(go())
    assert per_block.engine_id == runs.engine_id == "e2"
    assert (per_block.hit_blocks, per_block.recompute_blocks) == (24, 16)
    assert (runs.hit_blocks, runs.recompute_blocks) == (24, 16)
    assert len(per_block.actions) == 40
    # Two runs cover the same 40 blocks with the same kinds, in order.
    assert [(a.kind, a.block_index, a.block_count) for a in runs.actions] == [
        (HIT, 0, 24),
        (RECOMPUTE, 24, 16),
    ]
    expanded = [(i, a.kind) for i, a in expand_runs(runs.actions)]
    assert expanded == [(a.block_index, a.kind) for a in per_block.actions]
    assert runs.actions[0].block_hash == per_block.actions[0].block_hash


def test_stream_errors_carry_the_unary_status_and_the_stream_survives(conductor):
    async def go():
        async with conductor.channel("gateway", aio=True) as channel:
            client = PlanClient(channel)
            failures = []
            for bad, code in (
                (conductor_pb2.PlanRequest(packed_hashes=b"\x01" * 16), "INVALID_ARGUMENT"),
                (
                    conductor_pb2.PlanRequest(identity=ident(), packed_hashes=b"\x01" * 15),
                    "INVALID_ARGUMENT",
                ),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.plan(bad, timeout=5)
                failures.append((err.value.code().name, code, err.value.details()))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.finish(
                    conductor_pb2.FinishRequest(
                        reservation_id="nope", outcome=conductor_pb2.FinishRequest.SUCCESS
                    ),
                    timeout=5,
                )
            failures.append((err.value.code().name, "NOT_FOUND", err.value.details()))
            good = await client.plan(packed_request(list(range(4 * BS))), timeout=5)
            opened = client.streams_opened
            await client.close()
            return failures, good, opened

    failures, good, opened = asyncio.run(go())
    for got, want, details in failures:
        assert got == want, details
    assert "model_id is required" in failures[0][2]
    assert "multiple of 16" in failures[1][2]
    assert "nope" in failures[2][2]
    assert good.engine_id in {"e1", "e2"} and good.recompute_blocks == 4
    assert opened == 1, "errors are per call; the stream stayed open"


def test_many_concurrent_calls_share_one_stream_and_all_finish(conductor):
    async def go():
        async with conductor.channel("gateway", aio=True) as channel:
            stub = conductor_pb2_grpc.ConductorStub(channel)
            client = PlanClient(channel)
            replies = await asyncio.gather(
                *(
                    client.plan(packed_request(list(range(n, n + 8 * BS))), timeout=10)
                    for n in range(300)
                )
            )
            open_after_plans = (
                await stub.Stats(conductor_pb2.StatsRequest(), timeout=5)
            ).reservations_open
            await asyncio.gather(
                *(
                    client.finish(
                        conductor_pb2.FinishRequest(
                            reservation_id=r.reservation_id,
                            outcome=conductor_pb2.FinishRequest.CANCELLED,
                        ),
                        timeout=10,
                    )
                    for r in replies
                )
            )
            open_after_finish = (
                await stub.Stats(conductor_pb2.StatsRequest(), timeout=5)
            ).reservations_open
            opened = client.streams_opened
            await client.close()
            return replies, open_after_plans, open_after_finish, opened

    replies, open_after_plans, open_after_finish, opened = asyncio.run(go())
    assert len({r.reservation_id for r in replies}) == 300
    assert {r.engine_id for r in replies} == {"e1", "e2"}, "load spreads over both"
    assert (open_after_plans, open_after_finish) == (300, 0)
    assert opened == 1
    # Calls queued together went as one message: fewer messages than calls.
    assert conductor.metric("quillcache_plan_stream_calls_total") == 600
    assert conductor.metric("quillcache_plan_stream_messages_total") < 600


def test_a_dead_conductor_fails_calls_with_unavailable_instead_of_hanging(conductor):
    async def go():
        async with conductor.channel("gateway", aio=True) as channel:
            client = PlanClient(channel)
            await client.plan(packed_request(list(range(2 * BS))), timeout=5)
            conductor.kill()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.plan(packed_request(list(range(2 * BS))), timeout=5)
            await client.close()
            return err.value.code()

    code = asyncio.run(go())
    assert code == grpc.StatusCode.UNAVAILABLE


def _serve(handlers: dict):
    """An in-process gRPC server speaking only the given Conductor methods."""

    async def start():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("quillcache.v1.Conductor", handlers),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, f"127.0.0.1:{port}"

    return start()


def test_a_silent_conductor_times_calls_out_and_an_old_one_is_called_unary():
    async def silent_stream(request_iterator, context):
        async for _ in request_iterator:
            pass  # reads every call, answers none
        yield conductor_pb2.PlanStreamResponse()

    async def unary_plan(request, context):
        return conductor_pb2.PlanResponse(engine_id="old-conductor")

    async def go():
        server, address = await _serve(
            {
                "PlanStream": grpc.stream_stream_rpc_method_handler(
                    silent_stream,
                    request_deserializer=conductor_pb2.PlanStreamRequest.FromString,
                    response_serializer=conductor_pb2.PlanStreamResponse.SerializeToString,
                )
            }
        )
        old, old_address = await _serve(
            {
                "Plan": grpc.unary_unary_rpc_method_handler(
                    unary_plan,
                    request_deserializer=conductor_pb2.PlanRequest.FromString,
                    response_serializer=conductor_pb2.PlanResponse.SerializeToString,
                )
            }
        )
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                client = PlanClient(channel)
                started = asyncio.get_running_loop().time()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.plan(packed_request(list(range(BS))), timeout=0.3)
                waited = asyncio.get_running_loop().time() - started
                await client.close()
            async with grpc.aio.insecure_channel(old_address) as channel:
                client = PlanClient(channel)
                first = await client.plan(packed_request(list(range(BS))), timeout=5)
                second = await client.plan(packed_request(list(range(BS))), timeout=5)
                await client.close()
        finally:
            await server.stop(0)
            await old.stop(0)
        return err.value.code(), waited, first, second

    code, waited, first, second = asyncio.run(go())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0.25 <= waited < 2.0
    assert first.engine_id == second.engine_id == "old-conductor"
