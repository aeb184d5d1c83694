"""The gateway in-process between a fake conductor (gRPC) and fake engines with faults.

As in the SGLang router's tests: each fake engine has a fault flag and answers with
its own id, so a test sees which engine served and what the conductor was told.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import grpc
import pytest
from aiohttp import web

from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
from quillcache_core.identity.keys import block_identity
from quillcache_core.identity.tokenize import BuiltinTokenizer
from quillcache_core.wire.plan import pack_hashes
from quillcache_gateway.config import GatewayConfig
from quillcache_gateway.server import Gateway

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

MODEL = "sim-model"
TOKENIZER = "builtin-v1"  # what the sim engine's record names
PROMPT = "a prompt long enough for a few full blocks of sixteen tokens " * 4


class FakeConductor(conductor_pb2_grpc.ConductorServicer):
    """Plans onto the first engine not excluded; records every Plan and Finish."""

    def __init__(self, engines: list[tuple[str, str]]) -> None:
        self.engines = engines
        self.plans: list[conductor_pb2.PlanRequest] = []
        self.finishes: list[conductor_pb2.FinishRequest] = []
        self.stream_calls = 0

    def plan(self, request):
        self.plans.append(request)
        engine_id, url = next((e, u) for e, u in self.engines if e not in request.exclude_engines)
        return conductor_pb2.PlanResponse(
            reservation_id=f"res-{len(self.plans)}",
            engine_id=engine_id,
            engine_base_url=url,
            hit_blocks=1,
            recompute_blocks=len(request.packed_hashes) // 16 - 1,
            plan_us=42,
        )

    def finish(self, request):
        self.finishes.append(request)
        return conductor_pb2.FinishResponse(released=True)

    async def Plan(self, request, context):
        return self.plan(request)

    async def Finish(self, request, context):
        return self.finish(request)

    async def Stats(self, request, context):
        return conductor_pb2.StatsResponse(
            engines=[
                conductor_pb2.EngineStats(engine_id=e, model=MODEL, tokenizer=TOKENIZER)
                for e, _ in self.engines
            ]
        )

    async def PlanStream(self, request_iterator, context):
        async for message in request_iterator:
            reply = conductor_pb2.PlanStreamResponse()
            for call in message.calls:
                self.stream_calls += 1
                if call.WhichOneof("call") == "plan":
                    reply.results.add(call_id=call.call_id, plan=self.plan(call.plan))
                else:
                    reply.results.add(call_id=call.call_id, finish=self.finish(call.finish))
            yield reply


class FakeEngine:
    """An OpenAI-ish engine; `fault` is None, "drop" (no answer) or "die" (mid-stream)."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.fault: str | None = None
        self.bodies: list[dict] = []
        self.peers: set = set()
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # noqa: SLF001

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.peers.add(request.transport.get_extra_info("peername"))
        if self.fault == "drop":
            request.transport.abort()
            return web.Response()
        if not body.get("stream"):
            return web.json_response({"engine": self.engine_id, "choices": [{"text": "hi"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for n in range(3):
            await resp.write(f'data: {{"engine": "{self.engine_id}", "n": {n}}}\n\n'.encode())
        if self.fault == "die":
            request.transport.abort()
            return resp
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def stop(self) -> None:
        await self.runner.cleanup()


@contextlib.asynccontextmanager
async def setup(n_engines: int = 2):
    engines = [FakeEngine(f"e{i + 1}") for i in range(n_engines)]
    urls = [await e.start() for e in engines]
    conductor = FakeConductor([(e.engine_id, u) for e, u in zip(engines, urls, strict=True)])
    server = grpc.aio.server()
    conductor_pb2_grpc.add_ConductorServicer_to_server(conductor, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    gateway = Gateway(
        GatewayConfig(
            conductor=f"127.0.0.1:{port}",
            api_keys="acme=k-acme",
            finish_hold_ms=0,
            insecure=True,  # in-process doubles of the conductor and engines speak plaintext
        )
    )
    await gateway.start()
    session = aiohttp.ClientSession(headers={"Authorization": "Bearer k-acme"})
    try:
        yield f"http://127.0.0.1:{gateway.port}", conductor, engines, session
    finally:
        await session.close()
        await gateway.stop()
        await server.stop(None)
        for engine in engines:
            await engine.stop()


async def until(condition, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def expected_packed() -> bytes:
    tokens = BuiltinTokenizer().encode(PROMPT)
    return pack_hashes(block_identity(MODEL, TOKENIZER, cache_salt="acme").hashes(tokens, 16))


def test_a_stream_gets_headers_first_then_the_engines_bytes_then_finish_with_observe():
    async def main():
        async with setup() as (url, conductor, engines, session):
            body = {"model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": 3}
            async with session.post(url + "/v1/completions", json=body) as reply:
                assert reply.status == 200
                assert reply.headers["x-quillcache-engine"] == "e1"
                assert reply.headers["x-quillcache-plan-us"] == "42"
                assert reply.headers["Content-Type"] == "text/event-stream"
                assert reply.headers["x-quillcache-request-id"].startswith("qc-")
                data = await reply.read()
            assert data.endswith(b"data: [DONE]\n\n") and data.count(b'"engine": "e1"') == 3
            plan = conductor.plans[0]
            assert plan.packed_hashes == expected_packed() and plan.action_runs
            assert (plan.block_tokens, plan.identity.tenant_id) == (16, "acme")
            assert plan.identity.cache_salt == "acme"
            assert (plan.identity.model_id, plan.identity.tokenizer_id) == (MODEL, TOKENIZER)
            sent = engines[0].bodies[0]
            assert sent["cache_salt"] == "acme" and sent["prompt"] == PROMPT
            assert sent["kv_transfer_params"]["quillcache"]["reservation_id"] == "res-1"
            await until(lambda: len(conductor.finishes) == 1)
            done = conductor.finishes[0]
            assert (done.reservation_id, done.outcome) == ("res-1", 1)
            assert done.observe_packed_hashes == plan.packed_hashes
            assert done.identity.tenant_id == "acme" and done.ttft_ms > 0
            assert conductor.stream_calls == 2  # Plan and Finish went over PlanStream
            # Plain answers, over the same kept-alive engine connection.
            for _ in range(3):
                plain = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
                async with session.post(url + "/v1/completions", json=plain) as reply:
                    assert reply.status == 200
                    assert (await reply.json())["engine"] == "e1"
            assert len(engines[0].peers) == 1

    asyncio.run(main())


def test_an_engine_failing_before_its_answer_is_replanned_elsewhere():
    async def main():
        async with setup() as (url, conductor, engines, session):
            engines[0].fault = "drop"
            body = {"model": MODEL, "prompt": PROMPT, "stream": True}
            async with session.post(url + "/v1/completions", json=body) as reply:
                assert reply.status == 200
                assert reply.headers["x-quillcache-engine"] == "e2"
                assert (await reply.read()).endswith(b"data: [DONE]\n\n")
            assert [list(p.exclude_engines) for p in conductor.plans] == [[], ["e1"]]
            await until(lambda: len(conductor.finishes) == 2)
            outcomes = {f.reservation_id: f.outcome for f in conductor.finishes}
            assert outcomes == {"res-1": 2, "res-2": 1}  # ERROR, SUCCESS

    asyncio.run(main())


def test_an_engine_dying_mid_stream_ends_it_with_an_error_event():
    async def main():
        async with setup(1) as (url, conductor, engines, session):
            engines[0].fault = "die"
            body = {"model": MODEL, "prompt": PROMPT, "stream": True}
            async with session.post(url + "/v1/completions", json=body) as reply:
                assert reply.status == 200
                data = await reply.read()
            last = data.strip().split(b"\n\n")[-1]
            assert last.startswith(b"data: ") and json.loads(last[6:])["error"]["code"] == (
                "engine_failed"
            )
            await until(lambda: len(conductor.finishes) == 1)
            assert conductor.finishes[0].outcome == 2
            assert not conductor.finishes[0].observe_packed_hashes

    asyncio.run(main())


def test_bad_requests_get_openai_shaped_errors_and_plan_nothing():
    async def main():
        async with setup(1) as (url, conductor, _engines, session):
            cases = [
                (b"{nope", {}, 400),
                (b"[1, 2]", {}, 400),
                (json.dumps({"model": MODEL}).encode(), {}, 400),
                (json.dumps({"model": "other", "prompt": "x"}).encode(), {}, 404),
                (json.dumps({"model": MODEL, "prompt": "x"}).encode(), {"Authorization": "x"}, 401),
            ]
            for raw, headers, status in cases:
                async with session.post(
                    url + "/v1/completions", data=raw, headers=headers
                ) as reply:
                    assert reply.status == status
                    error = (await reply.json())["error"]
                    assert set(error) == {"message", "type", "param", "code"}
            assert conductor.plans == []

    asyncio.run(main())
