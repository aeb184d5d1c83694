"""Per-tenant limits at the gateway: 429 with Retry-After in OpenAI's shape, per tenant.

Each limit is reached by one tenant while another goes on unaffected, and the
gateway's /metrics count the refusals by tenant and limit.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

import pytest

from quillcache_core.identity.tokenize import BuiltinTokenizer
from tests.support.gateway_fakes import PROMPT, chat, completion, gateway_setup, until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

KEYS = "acme=k-acme,globex=k-globex,tiny=k-tiny"
PROMPT_TOKENS = len(BuiltinTokenizer().encode(PROMPT))


async def post(s, key: str, body: dict, route: str = "/v1/completions"):
    headers = {"Authorization": f"Bearer {key}"}
    async with s.session.post(s.url + route, json=body, headers=headers) as reply:
        return reply.status, reply.headers.get("Retry-After"), await reply.read()


def refusal(status: int, retry_after: str | None, data: bytes, type_: str) -> dict:
    assert status == 429
    assert retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == (type_, "rate_limit_exceeded")
    return error


async def refused(s, key: str, body: dict, type_: str) -> tuple[dict, str]:
    """`body` posted as `key` is refused (as `refusal` checks): its error and Retry-After."""
    status, retry_after, data = await post(s, key, body)
    return refusal(status, retry_after, data, type_), retry_after


def metric(text: str, name: str, **labels: str) -> float:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # as exposed
    found = re.search(rf"^quillcache_{name}\{{{re.escape(inner)}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_requests_a_second_refuse_one_tenant_with_429_and_spare_the_others():
    async def main():
        async with gateway_setup(api_keys=KEYS, tenant_limits="acme=rps:2") as s:
            started = time.monotonic()
            results = [await post(s, "k-acme", completion()) for _ in range(8)]
            elapsed = time.monotonic() - started
            ok = [r for r in results if r[0] == 200]
            refused = [r for r in results if r[0] != 200]
            # A burst of one second (2), then 2 a second.
            assert 2 <= len(ok) <= 2 + math.ceil(elapsed * 2)
            assert refused
            for status, retry_after, data in refused:
                error = refusal(status, retry_after, data, "requests")
                assert "requests per second" in error["message"]
            assert refused[0][1] == "1"
            for _ in range(5):  # globex has no limits: never refused meanwhile
                assert (await post(s, "k-globex", chat(), "/v1/chat/completions"))[0] == 200
            text = await s.metrics()
            assert metric(text, "gateway_tenant_rejected_total", tenant="acme", limit="rps") == (
                len(refused)
            )
            assert metric(text, "gateway_tenant_requests_total", tenant="acme", status="429") == (
                len(refused)
            )
            assert metric(text, "gateway_tenant_requests_total", tenant="globex", status="200") == 5
            assert metric(text, "gateway_tenant_rejected_total", tenant="globex", limit="rps") == 0
            assert len(s.conductor.plans) == len(ok) + 5  # a refused request plans nothing

    asyncio.run(main())


def test_prompt_tokens_a_minute_refuse_with_the_wait_and_too_large_prompts_outright():
    tpm = PROMPT_TOKENS * 5 // 2  # two prompts, and half of a third
    limits = f"tiny=tpm:{tpm}"

    async def main():
        async with gateway_setup(api_keys=KEYS, tenant_limits=limits) as s:
            assert (await post(s, "k-tiny", completion()))[0] == 200
            assert (await post(s, "k-tiny", completion(stream=True)))[0] == 200
            error, retry_after = await refused(s, "k-tiny", completion(), "tokens")
            assert "tokens per min (TPM)" in error["message"]
            # What is missing of a third prompt, at tpm/60 tokens a second: about 12 s.
            wait = (3 * PROMPT_TOKENS - tpm) * 60 / tpm
            assert int(retry_after) in (math.ceil(wait) - 1, math.ceil(wait))
            # A prompt over the whole minute can never pass.
            huge = completion(prompt=" ".join(["word"] * (tpm + 1)))
            error, retry_after = await refused(s, "k-tiny", huge, "tokens")
            assert retry_after == "60" and "Request too large" in error["message"]
            assert (await post(s, "k-acme", completion(prompt=huge["prompt"])))[0] == 200
            text = await s.metrics()
            assert metric(text, "gateway_tenant_rejected_total", tenant="tiny", limit="tpm") == 2
            assert metric(text, "gateway_tenant_prompt_tokens_total", tenant="tiny") == (
                2 * PROMPT_TOKENS
            )
            assert metric(text, "gateway_tenant_prompt_tokens_total", tenant="acme") > tpm

    asyncio.run(main())


def test_requests_in_flight_are_capped_per_tenant_and_freed_when_answers_end():
    async def main():
        async with gateway_setup(
            api_keys=KEYS, tenant_limits="globex=concurrent:2", default_concurrent=0
        ) as s:
            engine = s.engines[0]
            engine.gate = asyncio.Event()
            held = [
                asyncio.create_task(post(s, "k-globex", completion(stream=True))) for _ in range(2)
            ]
            await until(lambda: engine.requests == 2)
            assert s.gateway.limits.in_flight("globex") == 2
            text = await s.metrics()
            assert metric(text, "gateway_tenant_in_flight", tenant="globex") == 2
            error, retry_after = await refused(s, "k-globex", completion(), "requests")
            assert retry_after == "1" and "in flight" in error["message"]
            other = asyncio.create_task(post(s, "k-acme", completion()))
            await until(lambda: engine.requests == 3)  # acme went through meanwhile
            engine.gate.set()
            assert [r[0] for r in await asyncio.gather(*held, other)] == [200, 200, 200]
            assert (await post(s, "k-globex", completion()))[0] == 200
            text = await s.metrics()
            assert (
                metric(text, "gateway_tenant_rejected_total", tenant="globex", limit="concurrent")
                == 1
            )
            assert metric(text, "gateway_tenant_in_flight", tenant="globex") == 0
            assert metric(text, "gateway_tenant_requests_total", tenant="globex", status="200") == 3

    asyncio.run(main())


def test_defaults_apply_to_tenants_not_listed_and_a_refused_client_may_retry():
    async def main():
        async with gateway_setup(
            api_keys=KEYS, tenant_limits="acme=concurrent:5", default_rps=1.0
        ) as s:
            assert (await post(s, "k-globex", completion()))[0] == 200
            _, retry_after = await refused(s, "k-globex", completion(), "requests")
            # acme is listed without rps: its own entry leaves rps at the default too.
            assert (await post(s, "k-acme", completion()))[0] == 200
            assert (await post(s, "k-acme", completion()))[0] == 429
            await asyncio.sleep(int(retry_after))
            assert (await post(s, "k-globex", completion()))[0] == 200

    asyncio.run(main())


def test_bad_limits_are_refused_at_start():
    from quillcache_core.errors import InvalidArgument
    from quillcache_gateway.config import GatewayConfig

    base = {"conductor": "127.0.0.1:1", "api_keys": KEYS, "insecure": True}
    for bad in (
        {"tenant_limits": "acme"},
        {"tenant_limits": "acme=rps"},
        {"tenant_limits": "acme=rps:fast"},
        {"tenant_limits": "acme=qps:1"},
        {"tenant_limits": "acme=rps:1,rps:2"},
        {"tenant_limits": "acme=rps:-1"},
        {"tenant_limits": "acme=rps:nan"},
        {"tenant_limits": "acme=tpm:1.5"},
        {"tenant_limits": "acme=rps:1;acme=tpm:2"},
        {"tenant_limits": "initech=rps:1"},  # no such tenant
        {"default_rps": -1.0},
        {"default_concurrent": -2},
        {"max_json_depth": 0},
        {"max_json_depth": 5000},
        {"max_tokens_limit": 2**32},
        {"max_ttft_slo_ms": 0},
    ):
        with pytest.raises(InvalidArgument):
            GatewayConfig(**base, **bad)
    config = GatewayConfig(**base, tenant_limits=" acme = rps:2.5 , tpm:600 ; tiny=concurrent:1 ")
    limits = config.limits_by_tenant()
    assert (limits["acme"].rps, limits["acme"].tpm, limits["acme"].concurrent) == (2.5, 600, 0)
    assert (limits["tiny"].rps, limits["tiny"].concurrent) == (0.0, 1)
