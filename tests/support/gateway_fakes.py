"""An in-process gateway between a fake conductor (gRPC) and fake engines, for tests.

As in the SGLang router's tests: each fake engine answers with its own id and may
fail on purpose (`fault`), so a test sees which engine served and what the conductor
was told. Knobs for the hardening tests: the conductor and the engines may be slow at
random (`delay` callables), the conductor may answer unary only (a slow PlanStream
would serve its calls one at a time), and the engines answer both completion routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable

import aiohttp
import grpc
from aiohttp import web

from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
from quillcache_gateway.config import GatewayConfig
from quillcache_gateway.server import Gateway

MODEL = "sim-model"
TOKENIZER = "builtin-v1"  # what the sim engine's record names: the built-in tokenizer
PROMPT = "a prompt long enough for a few full blocks of sixteen tokens " * 4


def no_delay() -> float:
    return 0.0


class FakeConductor(conductor_pb2_grpc.ConductorServicer):
    """Plans onto the first engine not excluded, `hit_blocks` of the prompt's blocks
    cached; records every plan made and Finish, and counts the calls over PlanStream."""

    def __init__(
        self,
        engines: list[tuple[str, str]],
        *,
        stream: bool = True,
        delay: Callable[[], float] = no_delay,
        name: str = "",
    ) -> None:
        self.engines = engines
        self.roles: dict[str, str] = {}  # engine id -> role its Stats names (default both)
        self.name = name  # prefixes its reservation ids: replicas' ids never collide
        self.stream = stream
        self.delay = delay
        self.plans: list[conductor_pb2.PlanRequest] = []
        self.reservations: list[str] = []  # the reservations handed out, in order
        self.finishes: list[conductor_pb2.FinishRequest] = []
        self.prefilled: list[conductor_pb2.FinishRequest] = []  # first tokens reported
        self.planned_at: dict[str, float] = {}  # request id -> loop time its plan went out
        self.stream_calls = 0  # the calls made over PlanStream
        self.hit_blocks = 0  # of every plan: the prompt's blocks the engine has cached
        # When set, every Plan is refused with this (code, message), as the conductor
        # answers a mistake (INVALID_ARGUMENT, ...) or having no engine (UNAVAILABLE).
        self.refuse: tuple[grpc.StatusCode, str] | None = None

    def plan(self, request: conductor_pb2.PlanRequest) -> conductor_pb2.PlanResponse:
        self.plans.append(request)
        self.planned_at[request.request_id] = asyncio.get_running_loop().time()
        reservation_id = f"{self.name}res-{len(self.plans)}"
        self.reservations.append(reservation_id)
        engine_id, url = next((e, u) for e, u in self.engines if e not in request.exclude_engines)
        return conductor_pb2.PlanResponse(
            reservation_id=reservation_id,
            engine_id=engine_id,
            engine_base_url=url,
            hit_blocks=self.hit_blocks,
            recompute_blocks=len(request.packed_hashes) // 16 - self.hit_blocks,
            plan_us=42,
        )

    def finish(self, request: conductor_pb2.FinishRequest) -> conductor_pb2.FinishResponse:
        if request.outcome == conductor_pb2.FinishRequest.PREFILLED:
            self.prefilled.append(request)  # not the end of the request
        else:
            self.finishes.append(request)
        return conductor_pb2.FinishResponse(released=True)

    def open_reservations(self) -> set[str]:
        return set(self.reservations) - {f.reservation_id for f in self.finishes}

    async def Plan(self, request, context):
        # The reservation is made at once; the answer takes `delay()` to arrive (a
        # caller that gives up meanwhile leaves it open, as with a real conductor).
        if self.refuse is not None:
            await context.abort(*self.refuse)
        reply = self.plan(request)
        wait = self.delay()
        if wait:
            await asyncio.sleep(wait)
            self.planned_at[request.request_id] = asyncio.get_running_loop().time()
        return reply

    async def Finish(self, request, context):
        return self.finish(request)

    async def Stats(self, request, context):
        return conductor_pb2.StatsResponse(
            engines=[
                conductor_pb2.EngineStats(
                    engine_id=e,
                    base_url=u,
                    model=MODEL,
                    tokenizer=TOKENIZER,
                    role=self.roles.get(e, "both"),
                )
                for e, u in self.engines
            ]
        )

    async def PlanStream(self, request_iterator, context):
        if not self.stream:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no PlanStream here")
        async for message in request_iterator:
            reply = conductor_pb2.PlanStreamResponse()
            for call in message.calls:
                self.stream_calls += 1
                if call.WhichOneof("call") == "plan" and self.refuse is not None:
                    code, message = self.refuse
                    error = conductor_pb2.CallError(code=code.value[0], message=message)
                    reply.results.add(call_id=call.call_id, error=error)
                elif call.WhichOneof("call") == "plan":
                    reply.results.add(call_id=call.call_id, plan=self.plan(call.plan))
                else:
                    reply.results.add(call_id=call.call_id, finish=self.finish(call.finish))
            yield reply


class FakeEngine:
    """An OpenAI-ish engine on both completion routes, slow by `delay()` if asked:
    before its answer's head and between its three stream events. `fault` is None,
    "drop" (no answer) or "die" (mid-stream, after the three events)."""

    def __init__(self, engine_id: str, delay: Callable[[], float] = no_delay) -> None:
        self.engine_id = engine_id
        self.delay = delay
        self.fault: str | None = None
        self.gate: asyncio.Event | None = None  # when set: every answer waits for it
        self.requests = 0
        self.log: list[dict] = []  # per request: user, request_id, arrived, head (loop times)
        self.bodies: list[dict] = []  # the request bodies, in order
        self.peers: set = set()  # the gateway's connections, by (host, port)
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.answer)
        app.router.add_post("/v1/chat/completions", self.answer)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[-1][1]}"

    async def _pause(self) -> None:
        wait = self.delay()
        if wait:
            await asyncio.sleep(wait)

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        self.bodies.append(body)
        self.peers.add(request.transport.get_extra_info("peername"))
        loop = asyncio.get_running_loop()
        entry = {
            "user": body.get("user"),
            "request_id": request.headers.get("x-quillcache-request-id"),
            "arrived": loop.time(),
        }
        self.log.append(entry)
        if self.fault == "drop":
            request.transport.abort()
            return web.Response()
        if self.gate is not None:
            await self.gate.wait()
        await self._pause()
        entry["head"] = loop.time()
        if not body.get("stream"):
            return web.json_response({"engine": self.engine_id, "choices": [{"text": "hi"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for n in range(3):
            await resp.write(f'data: {{"engine": "{self.engine_id}", "n": {n}}}\n\n'.encode())
            await self._pause()
        if self.fault == "die":
            request.transport.abort()
            return resp
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def stop(self) -> None:
        await self.runner.cleanup()


@dataclasses.dataclass
class Setup:
    url: str
    gateway: Gateway
    conductor: FakeConductor
    engines: list[FakeEngine]
    session: aiohttp.ClientSession
    server: grpc.aio.Server | None = None  # the conductor's; None while it is stopped
    conductor_port: int = 0
    # With `conductors=N`: every replica (the first is `conductor`) and its server.
    replicas: list[FakeConductor] = dataclasses.field(default_factory=list)
    replica_servers: list[grpc.aio.Server | None] = dataclasses.field(default_factory=list)

    async def metrics(self) -> str:
        async with self.session.get(self.url + "/metrics") as reply:
            return await reply.text()

    async def stop_conductor(self) -> None:
        """The conductor goes away (its port refuses connections) until started again."""
        server, self.server = self.server, None
        if server is not None:
            await server.stop(None)

    async def stop_replica(self, i: int) -> None:
        """Replica i (1 or more; 0 is `stop_conductor`) goes away for good."""
        server, self.replica_servers[i] = self.replica_servers[i], None
        if server is not None:
            await server.stop(None)

    async def start_conductor(self) -> None:
        """The same conductor (what it recorded is kept) back on the same port."""
        if self.server is None:
            self.server, _ = await _serve_conductor(self.conductor, self.conductor_port)


async def _serve_conductor(conductor: FakeConductor, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    conductor_pb2_grpc.add_ConductorServicer_to_server(conductor, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    assert bound, f"port {port} could not be bound"
    await server.start()
    return server, bound


@contextlib.asynccontextmanager
async def gateway_setup(
    n_engines: int = 1,
    *,
    conductor_delay: Callable[[], float] = no_delay,
    engine_delay: Callable[[], float] = no_delay,
    plan_stream: bool = True,
    hit_blocks: int = 0,
    api_keys: str = "acme=k-acme",
    key: str = "k-acme",
    conductors: int = 1,
    **config,
):
    engines = [FakeEngine(f"e{i + 1}", engine_delay) for i in range(n_engines)]
    urls = [await e.start() for e in engines]
    conductor = FakeConductor(
        [(e.engine_id, u) for e, u in zip(engines, urls, strict=True)],
        stream=plan_stream,
        delay=conductor_delay,
    )
    conductor.hit_blocks = hit_blocks
    server, port = await _serve_conductor(conductor)
    replicas, servers, addresses = [conductor], [server], [f"127.0.0.1:{port}"]
    for i in range(1, conductors):
        replica = FakeConductor(
            conductor.engines, stream=plan_stream, delay=conductor_delay, name=f"r{i}-"
        )
        replica.hit_blocks = hit_blocks
        replica_server, replica_port = await _serve_conductor(replica)
        replicas.append(replica)
        servers.append(replica_server)
        addresses.append(f"127.0.0.1:{replica_port}")
    settings = {"finish_hold_ms": 0, **config}
    if "insecure" in {f.name for f in dataclasses.fields(GatewayConfig)}:
        settings.setdefault("insecure", True)
    gateway = Gateway(GatewayConfig(conductor=",".join(addresses), api_keys=api_keys, **settings))
    await gateway.start()
    session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"})
    setup = Setup(
        f"http://127.0.0.1:{gateway.port}",
        gateway,
        conductor,
        engines,
        session,
        server,
        port,
        replicas,
        servers,
    )
    try:
        yield setup
    finally:
        await session.close()
        await gateway.stop()
        await setup.stop_conductor()
        for i in range(1, conductors):
            await setup.stop_replica(i)
        for engine in engines:
            await engine.stop()


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    messages = [{"role": "user", "content": PROMPT}]
    return {"model": MODEL, "messages": messages, "max_tokens": 4, **fields}
