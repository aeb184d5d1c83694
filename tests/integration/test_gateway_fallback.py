"""Degraded mode: with the conductor gone (stopped, hung) the gateway routes requests
itself, by a consistent hash of the prompt's first block over the engines the
conductor's Stats last listed, and plans by the conductor again as soon as it answers.

In-process, between a fake conductor that is stopped and started again on the same
port and two fake engines (tests/support/gateway_fakes.py).
"""

from __future__ import annotations

import asyncio
import collections
import re
import time

import grpc
import pytest

from quillcache_gateway.fallback import CALL, PROBE, SKIP, CircuitBreaker, rendezvous
from tests.support.gateway_fakes import MODEL, PROMPT, chat, completion, gateway_setup, until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PLAN = "x-quillcache-plan"


def prompt(n: int) -> str:
    return f"conversation {n}: " + PROMPT


async def send(s, body: dict, path: str = "/v1/completions"):
    """(status, headers, the engine that answered or None, the error code or None)."""
    async with s.session.post(s.url + path, json=body) as reply:
        data = await reply.read()
        engine = None
        code = None
        if reply.status == 200 and body.get("stream"):
            found = re.findall(rb'"engine": "(e\d)"', data)
            assert data.endswith(b"data: [DONE]\n\n") and len(set(found)) == 1, data
            engine = found[0].decode()
        elif reply.status == 200:
            engine = (await reply.json())["engine"]
        else:
            code = (await reply.json())["error"]["code"]
        return reply.status, reply.headers, engine, code


def metric(text: str, name: str) -> dict[str, float]:
    """A metric's samples by their labels' text ("" without labels)."""
    found = {}
    for line in text.splitlines():
        m = re.fullmatch(rf"quillcache_{name}(?:\{{(.*)\}})? (\S+)", line)
        if m:
            found[m.group(1) or ""] = float(m.group(2))
    return found


async def warm_up(s) -> None:
    """One planned request: the gateway learns the model's engines from Stats."""
    status, headers, _, _ = await send(s, completion())
    assert status == 200 and PLAN not in headers
    await until(lambda: not s.conductor.open_reservations())
    assert s.gateway.catalog.engines_for(MODEL) == s.conductor.engines


def test_rendezvous_is_stable_spreads_and_moves_only_the_keys_of_an_engine_that_left():
    engines = [(f"e{i}", f"http://e{i}") for i in range(4)]
    keys = [f"block-{n}".encode() for n in range(2000)]
    chosen = {key: rendezvous(key, engines) for key in keys}
    assert chosen == {key: rendezvous(key, list(reversed(engines))) for key in keys}
    spread = collections.Counter(engine for engine, _ in chosen.values())
    assert set(spread) == {"e0", "e1", "e2", "e3"} and min(spread.values()) > 400, spread
    for key in keys:  # e2 excluded: only its keys move
        again = rendezvous(key, engines, ["e2"])
        assert again == chosen[key] if chosen[key][0] != "e2" else again[0] != "e2"
    assert rendezvous(b"k", engines, [e for e, _ in engines]) is None
    assert rendezvous(b"k", []) is None


def test_the_breaker_asks_one_probe_at_a_time_once_its_retry_time_has_passed():
    breaker = CircuitBreaker(retry_s=0.05)
    assert breaker.turn() == CALL and breaker.failed(CALL) and breaker.is_open
    assert breaker.turn() == SKIP
    time.sleep(0.06)
    assert breaker.turn() == PROBE
    assert breaker.turn() == SKIP  # the probe is in flight
    breaker.abandoned(PROBE)  # its client left: the next one probes
    assert breaker.turn() == PROBE
    assert not breaker.failed(PROBE) and breaker.turn() == SKIP
    time.sleep(0.06)
    assert breaker.turn() == PROBE and breaker.answered(PROBE)
    assert not breaker.is_open and breaker.turn() == CALL


def test_with_the_conductor_down_requests_are_routed_by_prompt_and_planned_again_once_back():
    async def main():
        async with gateway_setup(2) as s:
            await warm_up(s)
            plans, finishes = len(s.conductor.plans), len(s.conductor.finishes)
            await s.stop_conductor()
            started = time.monotonic()
            # 50 requests, 10 prompts x 5, streamed and not, five at a time.
            bodies = [
                completion(prompt=prompt(n % 10), stream=bool(i % 2))
                for i, n in enumerate(range(50))
            ]
            results = []
            for i in range(0, 50, 5):
                results += await asyncio.gather(*(send(s, b) for b in bodies[i : i + 5]))
            down_for = time.monotonic() - started
            by_prompt = collections.defaultdict(set)
            for body, (status, headers, engine, _) in zip(bodies, results, strict=True):
                assert status == 200
                assert headers[PLAN] == "fallback"
                assert headers["x-quillcache-engine"] == engine
                assert "x-quillcache-hit-blocks" not in headers
                by_prompt[body["prompt"]].add(engine)
            assert all(len(engines) == 1 for engines in by_prompt.values()), by_prompt
            assert set().union(*by_prompt.values()) == {"e1", "e2"}, by_prompt
            # What the engines were sent: the tenant's salt, a plan without a reservation.
            sent = s.engines[0].bodies[-1]
            assert sent["cache_salt"] == "acme"
            assert sent["kv_transfer_params"]["quillcache"]["reservation_id"] == ""
            text = await s.metrics()
            fallbacks = metric(text, "gateway_plan_fallbacks_total")
            assert sum(fallbacks.values()) == 50, fallbacks
            assert fallbacks['reason="unavailable"'] >= 1, fallbacks
            assert fallbacks['reason="circuit_open"'] >= 40, fallbacks  # not asked each time
            assert metric(text, "gateway_plan_fallback_active") == {"": 1.0}
            assert metric(text, "gateway_reservations_open") == {"": 0.0}

            await s.start_conductor()
            back = time.monotonic()
            while True:
                status, headers, engine, _ = await send(s, completion(prompt=prompt(1)))
                assert status == 200
                if PLAN not in headers:
                    break
                assert time.monotonic() - back < 2.0, "not planned again within 2 s"
                await asyncio.sleep(0.05)
            replanned_in = time.monotonic() - back
            assert headers["x-quillcache-plan-us"] == "42" and engine == "e1"
            await until(lambda: not s.conductor.open_reservations())
            # Nothing was planned or finished for the requests routed meanwhile.
            assert len(s.conductor.plans) == plans + 1
            assert len(s.conductor.finishes) == finishes + 1
            text = await s.metrics()
            assert metric(text, "gateway_plan_fallback_active") == {"": 0.0}
            print(f"50 fallbacks in {down_for:.2f} s; planned again {replanned_in:.2f} s after")

    asyncio.run(main())


def test_with_the_conductor_down_an_engine_that_fails_is_skipped_for_the_next_by_hash():
    async def main():
        async with gateway_setup(2) as s:
            await warm_up(s)
            await s.stop_conductor()
            s.engines[0].fault = "drop"
            for n in range(10):
                status, headers, engine, _ = await send(
                    s, chat(stream=True), "/v1/chat/completions"
                )
                assert (status, headers[PLAN], engine) == (200, "fallback", "e2")
                status, _, engine, _ = await send(s, completion(prompt=prompt(n)))
                assert (status, engine) == (200, "e2")
            s.engines[1].fault = "drop"
            status, headers, _, code = await send(s, completion())
            assert (status, code) == (503, "no_engine_available")
            assert "x-quillcache-request-id" in headers

    asyncio.run(main())


def test_with_the_conductor_down_a_prefill_engine_gets_no_request_while_another_serves():
    async def main():
        async with gateway_setup(2) as s:
            s.conductor.roles = {"e1": "prefill", "e2": "decode"}
            await warm_up(s)
            await s.stop_conductor()
            engines = {(await send(s, completion(prompt=prompt(n))))[2] for n in range(10)}
            assert engines == {"e2"}  # 10 prompts, none routed to the prefill engine
            s.engines[1].fault = "drop"  # the decode engine fails: the prefill one serves
            status, headers, engine, _ = await send(s, completion(prompt=prompt(0)))
            assert (status, headers[PLAN], engine) == (200, "fallback", "e1")

    asyncio.run(main())


def test_client_mistakes_keep_their_answers_with_the_conductor_down_or_refusing():
    async def main():
        async with gateway_setup(2, max_body_bytes=4096) as s:
            await warm_up(s)
            await s.stop_conductor()
            cases = [
                ({"model": MODEL}, {}, 400),
                (completion(max_tokens=-1), {}, 400),
                (completion(prompt="x" * 8000), {}, 413),
                (completion(), {"Authorization": "Bearer nope"}, 401),
                (completion(), {"x-quillcache-ttft-slo-ms": "soon"}, 400),
            ]
            for body, headers, status in cases:
                async with s.session.post(
                    s.url + "/v1/completions", json=body, headers=headers
                ) as reply:
                    assert reply.status == status, (body, await reply.text())
            await s.start_conductor()
            # A conductor that answers is not routed around, whatever it answers.
            refusals = [
                (grpc.StatusCode.INVALID_ARGUMENT, "bad hashes", 400),
                (grpc.StatusCode.NOT_FOUND, "no such thing", 404),
                (grpc.StatusCode.RESOURCE_EXHAUSTED, "too busy", 429),
                (grpc.StatusCode.UNAVAILABLE, f"no engine available for model {MODEL!r}", 503),
            ]
            for code, message, status in refusals:
                s.conductor.refuse = (code, message)
                deadline = time.monotonic() + 5
                while True:  # until the gateway is back on the restarted conductor
                    answer = await send(s, completion())
                    if PLAN not in answer[1] or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.05)
                assert answer[0] == status, (code, answer)
            assert not s.gateway.fallback.breaker.is_open
            fallbacks = metric(await s.metrics(), "gateway_plan_fallbacks_total")
            assert 'reason="deadline_exceeded"' not in fallbacks

    asyncio.run(main())


def test_with_plan_fallback_off_a_conductor_down_gets_the_old_503():
    async def main():
        async with gateway_setup(2, plan_fallback=False) as s:
            await warm_up(s)
            await s.stop_conductor()
            for _ in range(3):
                status, headers, _, code = await send(s, completion())
                assert (status, code) == (503, "no_engine_available")
                assert PLAN not in headers
            assert metric(await s.metrics(), "gateway_plan_fallbacks_total") == {}

    asyncio.run(main())


def test_a_hung_conductor_costs_a_request_the_fallback_timeout_and_its_late_plan_is_cancelled():
    hang = {"s": 0.0}

    async def main():
        async with gateway_setup(
            2,
            conductor_delay=lambda: hang["s"],
            plan_stream=False,
            plan_fallback_timeout_s=0.3,
            plan_fallback_retry_s=0.5,
        ) as s:
            await warm_up(s)
            hang["s"] = 1.5
            started = time.monotonic()
            status, headers, _, _ = await send(s, completion())
            waited = time.monotonic() - started
            assert (status, headers[PLAN]) == (200, "fallback")
            assert 0.25 < waited < 1.0, waited
            # Meanwhile the conductor is not asked: no request waits for it.
            started = time.monotonic()
            for n in range(5):
                status, headers, _, _ = await send(s, completion(prompt=prompt(n)))
                assert (status, headers[PLAN]) == (200, "fallback")
            assert time.monotonic() - started < 0.3
            # The plan that came late had its reservation cancelled at once.
            late = s.conductor.reservations[-1]
            await until(lambda: not s.conductor.open_reservations(), timeout_s=5)
            cancelled = [f for f in s.conductor.finishes if f.reservation_id == late]
            assert [f.outcome for f in cancelled] == [3]  # CANCELLED
            fallbacks = metric(await s.metrics(), "gateway_plan_fallbacks_total")
            assert fallbacks['reason="deadline_exceeded"'] >= 1, fallbacks
            hang["s"] = 0.0
            await asyncio.sleep(0.5)
            status, headers, _, _ = await send(s, completion())
            assert status == 200 and PLAN not in headers

    asyncio.run(main())
