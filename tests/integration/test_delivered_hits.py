"""Predicted against delivered hits on a local cluster of sim engines: the gateway
compares every answer's cached tokens with its plan, counts what differs and why, and
the conductor stops claiming blocks an engine turned out to have lost."""

from __future__ import annotations

import json
import urllib.request

import pytest

from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.security.credentials import as_gateway, tenant_context
from tests.support.metrics import scrape, series
from tests.support.services import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MODEL = "sim-model"
DOC = "The quarterly report says revenue grew in every region and margins held. " * 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    lc = LocalCluster(
        tmp_path_factory.mktemp("delivered"), engines=1, stores=0, log=lambda *_: None
    )
    endpoints = lc.start()
    try:
        yield lc, endpoints
    finally:
        lc.stop()


def ask(endpoints, *, stream=True, explain=False, usage=False, question="Summarise."):
    """POST a chat request; returns (headers, raw body bytes)."""
    body = {
        "model": MODEL,
        "max_tokens": 12,
        "stream": stream,
        "messages": [{"role": "system", "content": DOC}, {"role": "user", "content": question}],
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    request = urllib.request.Request(
        endpoints["gateway_url"] + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {endpoints['api_keys']['acme']}",
            **({"x-quillcache-explain": "1"} if explain else {}),
        },
    )
    with urllib.request.urlopen(request, timeout=60, context=tenant_context(endpoints)) as reply:
        assert reply.status == 200
        return dict(reply.headers), reply.read()


def events(raw: bytes) -> list:
    out = []
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {"):
            out.append(json.loads(event[6:]))
    return out


def gateway_metric(endpoints, name: str, **labels: str) -> float:
    return series(scrape(endpoints, endpoints["metrics"]["gateway"]), name, **labels)


def conductor_metric(endpoints, name: str, **labels: str) -> float:
    urls = [u for key, u in endpoints["metrics"].items() if key.startswith("conductor")]
    return sum(series(scrape(endpoints, url), name, **labels) for url in urls)


def engine_call(lc, endpoints, path: str, body: dict) -> dict:
    """POST straight to the engine, as the gateway does (its certificate and credential)."""
    context, auth = as_gateway(lc.certs_dir)
    request = urllib.request.Request(
        endpoints["engines"][0] + path, data=json.dumps(body).encode(), method="POST", headers=auth
    )
    with urllib.request.urlopen(request, timeout=10, context=context) as reply:
        return json.loads(reply.read())


def planned_hits(endpoints) -> int:
    headers, _ = ask(endpoints)
    return int(headers["x-quillcache-hit-blocks"])


def test_a_prompt_an_engine_lost_unheard_is_counted_and_no_longer_claimed(cluster):
    lc, endpoints = cluster
    ask(endpoints)
    # The engine's events reach the conductor: the repeat is planned with hits there.
    hits = wait_until(lambda: planned_hits(endpoints), timeout_s=20, what="a planned hit")
    headers, raw = ask(endpoints, explain=True)
    engine = headers["x-quillcache-engine"]
    held = int(headers["x-quillcache-hit-blocks"])
    assert held >= hits > 10
    report = events(raw)[-1]["quillcache"]
    assert report["predicted"]["engine_hit_tokens"] == report["delivered"]["cached_tokens"]
    assert report["error"]["tokens"] == 0 and report["cause"] is None
    zero = "quillcache_gateway_cached_tokens_error_bucket"
    assert gateway_metric(endpoints, zero, engine=engine, le="0.0") >= 1
    assert gateway_metric(endpoints, zero, engine=engine, le="-1.0") == 0
    evicted = {"engine": engine, "cause": "engine_evicted"}
    assert gateway_metric(endpoints, "quillcache_gateway_mispredictions_total", **evicted) == 0

    # The engine's events are lost from now on, and it resets its prefix cache: the
    # conductor still claims the prompt there.
    engine_call(lc, endpoints, "/sim/events", {"lose": True})
    assert engine_call(lc, endpoints, "/reset_prefix_cache", {})["cleared_blocks"] >= held

    headers, raw = ask(endpoints, explain=True)
    assert int(headers["x-quillcache-hit-blocks"]) == held  # planned from the stale records
    assert b'"usage"' not in raw  # the client did not ask for usage: it sees none
    report = events(raw)[-1]["quillcache"]
    assert report["cause"] == "engine_evicted"
    assert report["predicted"]["cached_tokens"] > 0
    assert report["delivered"]["cached_tokens"] == 0
    assert report["error"]["tokens"] == -report["predicted"]["cached_tokens"]
    assert gateway_metric(endpoints, "quillcache_gateway_mispredictions_total", **evicted) == 1
    wait_until(
        lambda: conductor_metric(
            endpoints, "quillcache_residency_corrections_total", engine=engine
        ),
        timeout_s=15,
        what="the conductor's residency correction",
    )
    headers, raw = ask(endpoints, explain=True)
    assert int(headers["x-quillcache-hit-blocks"]) == 0  # the lost ones are not claimed
    # The engine recomputed them for the request that missed them (its events of that
    # were lost too): this answer's hits say so, and the plan after it claims them again.
    assert events(raw)[-1]["quillcache"]["cause"] == "engine_extra"
    assert planned_hits(endpoints) == held


def test_a_client_that_asks_for_usage_sees_it_as_the_engine_sent_it(cluster):
    _, endpoints = cluster
    _, raw = ask(endpoints, usage=True, question="Usage, please.")
    got = events(raw)
    assert b'"usage"' in raw
    last = got[-1]
    assert last["choices"] == [] and "quillcache" not in last
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    assert last["usage"]["prompt_tokens"] > 0
    # Without usage asked and without explain, the stream ends with the engine's own
    # last event, nothing of the gateway's added.
    _, raw = ask(endpoints, question="Usage, please.")
    assert b'"usage"' not in raw and b'"predicted"' not in raw


def test_a_whole_answer_explains_itself_only_when_asked(cluster):
    _, endpoints = cluster
    _, raw = ask(endpoints, stream=False, question="Whole, please.")
    assert "predicted" not in json.loads(raw).get("quillcache", {})
    _, raw = ask(endpoints, stream=False, explain=True, question="Whole, please.")
    report = json.loads(raw)["quillcache"]
    assert (
        report["delivered"]["cached_tokens"]
        == json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
    )
    assert set(report["predicted"]) >= {"engine_hit_tokens", "pool_loaded_tokens", "ttft_ms"}
