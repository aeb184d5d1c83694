"""The latency histograms on a live local cluster (sim engines, two store nodes, the
transfer service, TLS): traffic through each process shows up in its histograms, by the
labels an operator filters on, and every process's /metrics passes promtool."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.error
import urllib.request

import pytest

from quillcache.v1 import transfer_pb2, transfer_pb2_grpc
from quillcache_core.errors import NotFound
from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.security.credentials import operator_tls, role_tls, tenant_context
from quillcache_core.security.tls import grpc_channel
from quillcache_core.storeclient import wire
from quillcache_core.storeclient.client import StoreClient
from tests.support.metrics import scrape as scrape_url
from tests.support.metrics import series
from tests.support.services import wait_until
from tests.support.stores import block_key, kv_payload

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODEL = "sim-model"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    lc = LocalCluster(
        tmp_path_factory.mktemp("histograms"), engines=1, stores=2, log=lambda *_: None
    )
    endpoints = lc.start()
    try:
        yield lc, endpoints
    finally:
        lc.stop()


def scrape(endpoints, process: str) -> str:
    return scrape_url(endpoints, endpoints["metrics"][process])


def count(text: str, name: str, **labels: str) -> float:
    """A histogram's observations (its _count samples whose labels include `labels`)."""
    return series(text, f"{name}_count", **labels)


def ask(endpoints, body: dict) -> int:
    request = urllib.request.Request(
        endpoints["gateway_url"] + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {endpoints['api_keys']['acme']}",
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=60, context=tenant_context(endpoints)) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def chat(stream: bool, question: str) -> dict:
    return {
        "model": MODEL,
        "max_tokens": 4,
        "stream": stream,
        "messages": [{"role": "user", "content": "the metrics page " * 40 + question}],
    }


def test_a_request_is_timed_by_the_gateway_and_planned_by_the_conductor(cluster):
    _, endpoints = cluster
    engine = "engine-0"
    before = scrape(endpoints, "gateway")
    planned = count(scrape(endpoints, "conductor"), "quillcache_conductor_plan_seconds")
    assert ask(endpoints, chat(True, "streamed?")) == 200
    assert ask(endpoints, chat(False, "whole?")) == 200
    assert ask(endpoints, {"model": MODEL, "messages": "not a list"}) == 400
    after = scrape(endpoints, "gateway")

    def grew(name: str, **labels: str) -> float:
        return count(after, name, **labels) - count(before, name, **labels)

    assert grew("quillcache_gateway_ttft_seconds", engine=engine) == 2
    assert grew("quillcache_gateway_request_duration_seconds", engine=engine, status="200") == 2
    assert grew("quillcache_gateway_request_duration_seconds", engine="none", status="400") == 1
    assert grew("quillcache_gateway_plan_seconds") == 2
    # The old sum/count counters are the histogram's own series now, and agree with it.
    assert "# TYPE quillcache_gateway_plan_seconds histogram" in after
    assert "quillcache_gateway_plan_seconds_sum " in after
    assert count(scrape(endpoints, "conductor"), "quillcache_conductor_plan_seconds") >= (
        planned + 2
    )
    # The sim engine publishes its KV events with their batch's time: each batch's lag.
    wait_until(
        lambda: count(
            scrape(endpoints, "conductor"), "quillcache_kv_event_lag_seconds", source="engine"
        ),
        timeout_s=10,
        what="the engine's KV event lag observed",
    )


def test_store_gets_and_puts_are_timed_by_tier_and_a_copy_by_the_transfer_service(cluster):
    lc, endpoints = cluster
    key, missing, payload = (
        block_key(1, chain="metrics"),
        block_key(2, chain="nowhere"),
        kv_payload(3),
    )
    store = endpoints["stores"][1]  # the one no engine saves to: only this test's calls

    async def traffic():
        async with StoreClient(store, tls=role_tls(lc.certs_dir, "engine")) as client:
            await client.put(key, payload)
            data, _ = await client.get(key)
            with pytest.raises(NotFound):
                await client.get(missing)
            return data

    before = scrape(endpoints, "store-1")
    assert asyncio.run(traffic()) == payload
    after = scrape(endpoints, "store-1")
    for name, tier in (
        ("quillcache_store_put_seconds", "dram"),
        ("quillcache_store_get_seconds", "dram"),
        ("quillcache_store_get_seconds", "miss"),
    ):
        assert count(after, name, tier=tier) - count(before, name, tier=tier) == 1, (name, tier)

    # The store's residency events reach the conductor with their batch's time.
    wait_until(
        lambda: count(
            scrape(endpoints, "conductor"), "quillcache_kv_event_lag_seconds", source="store"
        ),
        timeout_s=10,
        what="the store's KV event lag observed",
    )
    copied = count(scrape(endpoints, "transfer"), "quillcache_transfer_seconds", mode="copy")
    with grpc_channel(endpoints["transfer"], operator_tls(endpoints), aio=False) as channel:
        request = transfer_pb2.TransferRequest(
            source_node="store-1", destination_node="store-0", keys=[wire.key_to_proto(key)]
        )
        progress = list(transfer_pb2_grpc.TransferStub(channel).Copy(request, timeout=30))
    assert progress[-1].blocks_done == 1
    text = scrape(endpoints, "transfer")
    assert count(text, "quillcache_transfer_seconds", mode="copy") == copied + 1
    assert "# TYPE quillcache_transfer_bytes_total counter" in text
    moved = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('quillcache_transfer_bytes_total{mode="copy"}')
    )
    assert moved >= len(payload)


def test_every_process_s_live_metrics_pass_promtool(cluster):
    _, endpoints = cluster
    for process in endpoints["metrics"]:
        text = scrape(endpoints, process)
        done = subprocess.run(
            ["promtool", "check", "metrics"], input=text.encode(), capture_output=True, timeout=30
        )
        problems = [
            p
            for p in (done.stdout + done.stderr).decode().splitlines()
            # The sim engines copy vLLM's own gauge names, colon and all.
            if p.strip() and not (p.startswith("vllm:") and "':'" in p)
        ]
        assert done.returncode in (0, 3) and problems == [], (process, problems)
