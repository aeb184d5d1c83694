"""Clients that hang up at any moment leave no reservation open at the conductor.

Two hundred clients hang up at random moments: while the conductor plans, after the
plan and before the engine's first byte, mid-stream, or not at all; the conductor and
the engine are slow at random so that every phase is hit. Half of them with aiohttp
cancelling the handler when its client leaves, half without (then a write fails).
Within a few seconds every reservation handed out has had exactly one Finish.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random

import pytest

from quillcache.v1 import conductor_pb2
from tests.support.gateway_fakes import chat, completion, gateway_setup, until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

CLIENTS_PER_ROUND = 100
CANCELLED = conductor_pb2.FinishRequest.CANCELLED
SUCCESS = conductor_pb2.FinishRequest.SUCCESS


def http_request(port: int, route: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer k-acme\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + data


async def client(port: int, n: int, rng: random.Random, left: dict) -> None:
    """Client `n`: sends a request, then hangs up: at a random moment (half of them),
    at the answer's first byte, after its first event, or never."""
    user = f"client-{n}"
    stream = n % 3 != 0
    if n % 2:
        route, body = "/v1/completions", completion(stream=stream, user=user)
    else:
        route, body = "/v1/chat/completions", chat(stream=stream, user=user)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(http_request(port, route, body))
    received = b""
    kind = rng.choices(range(4), weights=(50, 15, 20, 15))[0]
    try:
        if kind == 0:  # at a random moment
            await asyncio.sleep(rng.uniform(0.0, 0.35))
        elif kind == 1:  # at the answer's first byte
            received = await reader.read(1)
        elif kind == 2:  # after the first event of a stream, or the whole plain answer
            while b"data:" not in received and not reader.at_eof():
                received += await reader.read(4096)
        else:  # never: the whole answer
            received = await reader.read()
    finally:
        left[user] = (asyncio.get_running_loop().time(), received, stream)
        writer.transport.abort()


def test_clients_hanging_up_at_random_moments_leave_every_reservation_finished():
    rng = random.Random(20240617)

    def conductor_delay() -> float:
        return rng.choice([0.0, rng.uniform(0.0, 0.15)])

    def engine_delay() -> float:
        return rng.choice([0.0, rng.uniform(0.05, 0.2)])

    async def main():
        async with gateway_setup(
            conductor_delay=conductor_delay, engine_delay=engine_delay, plan_stream=False
        ) as s:
            server = s.gateway.http_server
            port = s.gateway.port
            left: dict[str, tuple[float, bytes, bool]] = {}
            unreached = {}
            seen: set[str] = set()
            for cancelling in (True, False):
                server.handler_cancellation = cancelling
                offset = 0 if cancelling else CLIENTS_PER_ROUND
                await asyncio.gather(
                    *(client(port, offset + n, rng, left) for n in range(CLIENTS_PER_ROUND))
                )
                await until(lambda: not s.conductor.open_reservations(), timeout_s=5)
                reached = {e["request_id"] for e in s.engines[0].log}
                unreached[cancelling] = set(s.conductor.planned_at) - reached - seen
                seen = set(s.conductor.planned_at)
            conductor = s.conductor
            finished = collections.Counter(f.reservation_id for f in conductor.finishes)
            assert set(finished) == set(conductor.reservations)
            assert set(finished.values()) == {1}, "a reservation was finished twice"
            assert len(s.gateway.open_plans) == 0
            # A request routed by the gateway itself (the fake conductor slow to answer
            # under load: fallback) has no reservation to wait for above: its handler
            # may still be finishing. Every tenant slot comes back.
            await until(lambda: s.gateway.limits.in_flight("acme") == 0, timeout_s=5)
            # Nor is an engine connection left open but the pool's idle ones.
            engine_server = s.engines[0].runner.server

            def engine_connections() -> int:
                return sum(c.transport is not None for c in engine_server.connections)

            await until(lambda: engine_connections() == s.gateway.upstream.idle_connections(), 3)
            metrics = await s.metrics()
            assert "quillcache_gateway_reservations_open 0" in metrics
            assert 'quillcache_gateway_tenant_in_flight{tenant="acme"} 0' in metrics

            # Every phase was hit, in both rounds.
            outcomes = collections.Counter(f.outcome for f in conductor.finishes)
            assert outcomes[CANCELLED] >= 20 and outcomes[SUCCESS] >= 20, outcomes
            by_user = {e["user"]: e for e in s.engines[0].log}
            phases = collections.Counter()
            for user, (at, received, stream) in left.items():
                round_ = "cancelling" if int(user.split("-")[1]) < CLIENTS_PER_ROUND else "not"
                entry = by_user.get(user)
                # A request the gateway routed itself (fallback, above) was never planned.
                planned = conductor.planned_at.get(entry["request_id"]) if entry else None
                if planned is not None and at < planned:
                    phases[round_, "while planning"] += 1
                elif entry is not None and at < entry.get("head", float("inf")):
                    phases[round_, "before the engine's first byte"] += 1
                elif stream and b" 200 " in received and b"[DONE]" not in received:
                    phases[round_, "mid-stream"] += 1
            # With cancelling handlers, a client gone while planning stops the request
            # before the engine: its plan never reached one.
            phases["cancelling", "while planning"] += len(unreached[True])
            for round_ in ("cancelling", "not"):
                for phase in ("while planning", "before the engine's first byte", "mid-stream"):
                    assert phases[round_, phase] >= 1, phases

    asyncio.run(main())
