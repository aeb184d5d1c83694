"""The gateway in-process between a fake conductor (gRPC) and fake engines with faults
(tests/support/gateway_fakes.py): each fake engine has a fault flag and answers with
its own id, so a test sees which engine served and what the conductor was told.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from quillcache_core.identity.keys import block_identity
from quillcache_core.identity.tokenize import BuiltinTokenizer
from quillcache_core.wire.plan import pack_hashes
from tests.support.gateway_fakes import MODEL, PROMPT, TOKENIZER, gateway_setup, until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def expected_packed() -> bytes:
    tokens = BuiltinTokenizer().encode(PROMPT)
    return pack_hashes(block_identity(MODEL, TOKENIZER, cache_salt="acme").hashes(tokens, 16))


def test_a_stream_gets_headers_first_then_the_engines_bytes_then_finish_with_observe():
    async def main():
        async with gateway_setup(2, hit_blocks=1) as s:
            body = {"model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": 3}
            async with s.session.post(s.url + "/v1/completions", json=body) as reply:
                assert reply.status == 200
                assert reply.headers["x-quillcache-engine"] == "e1"
                assert reply.headers["x-quillcache-plan-us"] == "42"
                assert reply.headers["Content-Type"] == "text/event-stream"
                assert reply.headers["x-quillcache-request-id"].startswith("qc-")
                data = await reply.read()
            assert data.endswith(b"data: [DONE]\n\n") and data.count(b'"engine": "e1"') == 3
            plan = s.conductor.plans[0]
            assert plan.packed_hashes == expected_packed() and plan.action_runs
            assert (plan.block_tokens, plan.identity.tenant_id) == (16, "acme")
            assert plan.identity.cache_salt == "acme"
            assert (plan.identity.model_id, plan.identity.tokenizer_id) == (MODEL, TOKENIZER)
            sent = s.engines[0].bodies[0]
            assert sent["cache_salt"] == "acme" and sent["prompt"] == PROMPT
            assert sent["kv_transfer_params"]["quillcache"]["reservation_id"] == "res-1"
            await until(lambda: len(s.conductor.finishes) == 1)
            done = s.conductor.finishes[0]
            assert (done.reservation_id, done.outcome) == ("res-1", 1)
            assert done.observe_packed_hashes == plan.packed_hashes
            assert done.identity.tenant_id == "acme" and done.ttft_ms > 0
            # The first token was reported as it came, with the same TTFT.
            assert plan.reports_first_token
            assert [(p.reservation_id, p.ttft_ms) for p in s.conductor.prefilled] == [
                ("res-1", done.ttft_ms)
            ]
            assert s.conductor.stream_calls == 3  # Plan, PREFILLED, Finish over PlanStream
            # Plain answers, over the same kept-alive engine connection.
            for _ in range(3):
                plain = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
                async with s.session.post(s.url + "/v1/completions", json=plain) as reply:
                    assert reply.status == 200
                    assert (await reply.json())["engine"] == "e1"
            assert len(s.engines[0].peers) == 1

    asyncio.run(main())


def test_an_engine_failing_before_its_answer_is_replanned_elsewhere():
    async def main():
        async with gateway_setup(2, hit_blocks=1) as s:
            s.engines[0].fault = "drop"
            body = {"model": MODEL, "prompt": PROMPT, "stream": True}
            async with s.session.post(s.url + "/v1/completions", json=body) as reply:
                assert reply.status == 200
                assert reply.headers["x-quillcache-engine"] == "e2"
                assert (await reply.read()).endswith(b"data: [DONE]\n\n")
            assert [list(p.exclude_engines) for p in s.conductor.plans] == [[], ["e1"]]
            await until(lambda: len(s.conductor.finishes) == 2)
            outcomes = {f.reservation_id: f.outcome for f in s.conductor.finishes}
            assert outcomes == {"res-1": 2, "res-2": 1}  # ERROR, SUCCESS

    asyncio.run(main())


def test_an_engine_dying_mid_stream_ends_it_with_an_error_event():
    async def main():
        async with gateway_setup(hit_blocks=1) as s:
            s.engines[0].fault = "die"
            body = {"model": MODEL, "prompt": PROMPT, "stream": True}
            async with s.session.post(s.url + "/v1/completions", json=body) as reply:
                assert reply.status == 200
                data = await reply.read()
            last = data.strip().split(b"\n\n")[-1]
            assert last.startswith(b"data: ") and json.loads(last[6:])["error"]["code"] == (
                "engine_failed"
            )
            await until(lambda: len(s.conductor.finishes) == 1)
            assert s.conductor.finishes[0].outcome == 2
            assert not s.conductor.finishes[0].observe_packed_hashes

    asyncio.run(main())


def test_bad_requests_get_openai_shaped_errors_and_plan_nothing():
    async def main():
        async with gateway_setup(hit_blocks=1) as s:
            cases = [
                (b"{nope", {}, 400),
                (b"[1, 2]", {}, 400),
                (json.dumps({"model": MODEL}).encode(), {}, 400),
                (json.dumps({"model": "other", "prompt": "x"}).encode(), {}, 404),
                (json.dumps({"model": MODEL, "prompt": "x"}).encode(), {"Authorization": "x"}, 401),
            ]
            for raw, headers, status in cases:
                async with s.session.post(
                    s.url + "/v1/completions", data=raw, headers=headers
                ) as reply:
                    assert reply.status == status
                    error = (await reply.json())["error"]
                    assert set(error) == {"message", "type", "param", "code"}
            assert s.conductor.plans == []

    asyncio.run(main())
