"""The sim engine as a real process: the openai SDK, KV events over ZMQ, offload to and
FETCH from a real store process, etcd registration, fault flags and bad input."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import openai
import pytest
import zmq
import zmq.asyncio

from quillcache_conductor.zmq_sub import EngineSubscriber
from quillcache_core.identity.keys import request_blocks
from quillcache_core.identity.tokenize import BuiltinTokenizer, render_chat
from quillcache_core.index.memory import MemoryIndex
from quillcache_core.kvevents.decode import decode_batch
from quillcache_core.kvevents.events import (
    DecodedBatch,
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
)
from quillcache_core.kvevents.translate import EngineEventTranslator
from quillcache_core.registry import EtcdRegistry
from quillcache_core.wire.engine_plan import EnginePlan, FetchAction
from quillcache_simengine.kvbytes import kv_payload
from tests.support.services import ServiceProcess, wait_until
from tests.support.tls import client_context, engine_auth, gateway_session, tls

pytestmark = pytest.mark.integration

MODEL, TOKENIZER, BS = "sim-model", "builtin-v1", 16


class SimEngineProcess(ServiceProcess):
    """`quillcache sim-engine`: ready once its READY line is out and /health answers."""

    def __init__(self, args: list[str], log_dir: Path, name: str = "sim-engine") -> None:
        super().__init__("sim-engine", args, log_dir, name=name)

    @property
    def http(self) -> str:
        return self.fields["http"]

    def _serving(self) -> bool:
        with urllib.request.urlopen(
            self.http + "/health", timeout=1.0, context=client_context("gateway")
        ) as reply:
            return reply.status == 200

    def stats(self) -> dict:
        request = urllib.request.Request(self.http + "/sim/stats", headers=engine_auth())
        with urllib.request.urlopen(
            request, timeout=2.0, context=client_context("gateway")
        ) as reply:
            return json.loads(reply.read())


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 45.0) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(timeout_s):
            return await coro

    return asyncio.run(bounded())


async def until(predicate: Callable[[], Any], what: str, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def words(seed: int, count: int) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(count))


def chat_tokens(messages: list[dict]) -> list[int]:
    return BuiltinTokenizer().encode(render_chat(messages))


def gateway_keys(tokens: list[int], tenant: str | None) -> list:
    return request_blocks(
        tokens,
        BS,
        model_id=MODEL,
        tokenizer_id=TOKENIZER,
        adapter_id=None,
        tenant_id=tenant or "default",
        cache_salt=tenant,
    )


@pytest.fixture
def engine_factory(tmp_path: Path):
    started: list[SimEngineProcess] = []

    def start(*args: str, name: str = "sim-engine") -> SimEngineProcess:
        proc = SimEngineProcess(["--registry", "", *args], tmp_path, name=name)
        started.append(proc)
        return proc.start(timeout_s=20.0)

    yield start
    for proc in started:
        proc.stop()


# --- the openai SDK -----------------------------------------------------------------------


def test_openai_sdk_streams_and_a_repeated_prompt_hits_with_a_lower_ttft(engine_factory):
    engine = engine_factory("--time-scale", "1.0", "--node-id", "sim-a")
    client = openai.OpenAI(
        base_url=engine.http + "/v1",
        api_key=tls("gateway").engine_key(),
        max_retries=0,
        http_client=httpx2.Client(verify=client_context("gateway")),
    )
    system = "You are a careful assistant. " + words(1, 1500)  # ~3000 tokens: ~135 ms prefill

    def stream(question: str):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        started = time.perf_counter()
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"cache_salt": "acme"},
        )
        ttft, chunks = None, []
        for chunk in raw.parse():
            if ttft is None:
                ttft = time.perf_counter() - started
            chunks.append(chunk)
        return raw.headers, ttft, chunks, messages

    headers1, ttft1, chunks1, messages = stream("What is a KV cache?")
    headers2, ttft2, chunks2, _ = stream("What is a KV cache?")
    text1 = "".join(c.choices[0].delta.content or "" for c in chunks1 if c.choices)
    text2 = "".join(c.choices[0].delta.content or "" for c in chunks2 if c.choices)
    assert text1 and text1 == text2, "reused KV gives the same answer"
    assert len(text1.split()) == 8

    blocks = len(chat_tokens(messages)) // BS
    assert headers1["x-sim-engine"] == "sim-a"
    assert headers1["x-sim-hit-blocks"] == "0" and headers1["x-sim-recomputed-blocks"] == str(
        blocks
    )
    assert int(headers2["x-sim-hit-blocks"]) >= blocks - 1
    assert ttft2 < ttft1, (ttft1, ttft2)
    assert ttft1 > 0.1  # the first prefill really took the cost model's time

    final = [c for c in chunks2 if c.choices and c.choices[0].finish_reason][0]
    assert final.choices[0].finish_reason == "length"
    report = final.model_extra["quillcache"]
    assert report["engine_id"] == "sim-a" and report["hit_blocks"] == int(
        headers2["x-sim-hit-blocks"]
    )
    usage = chunks2[-1].usage
    assert usage.completion_tokens == 8 and usage.prompt_tokens == len(chat_tokens(messages))
    assert usage.prompt_tokens_details.cached_tokens == report["hit_blocks"] * BS

    # Non-stream completions; another salt shares nothing.
    done = client.completions.create(
        model=MODEL, prompt=system, max_tokens=4, extra_body={"cache_salt": "globex"}
    )
    assert done.usage.prompt_tokens_details.cached_tokens == 0
    assert done.model_extra["quillcache"]["hit_blocks"] == 0
    assert len(done.choices[0].text.split()) == 4
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_prefills_queue_so_load_raises_ttft(engine_factory):
    engine = engine_factory("--time-scale", "1.0", "--node-id", "sim-q")
    prefill_s = 2000 * 45e-6  # one prompt's prefill at the cost model's 45 us/token

    async def scenario() -> list[float]:
        async with gateway_session() as session:

            async def ttft(seed: int) -> float:
                body = {"model": MODEL, "prompt": list(range(seed, seed + 2000)), "max_tokens": 2,
                        "stream": True}  # fmt: skip
                started = time.perf_counter()
                async with session.post(engine.http + "/v1/completions", json=body) as reply:
                    await reply.content.readuntil(b"\n\n")
                    first = time.perf_counter() - started
                    await reply.read()
                return first

            async def queue_seen() -> dict:
                await asyncio.sleep(prefill_s / 2)  # the three are booked by now
                return await asyncio.to_thread(engine.stats)

            *firsts, busy = await asyncio.gather(*(ttft(i * 5000) for i in range(3)), queue_seen())
            return sorted(firsts), busy

    ttfts, busy = run(scenario())
    assert ttfts[0] >= prefill_s * 0.9
    assert ttfts[2] >= 3 * prefill_s * 0.9, ttfts  # the last one waited for two prefills
    # /sim/stats: what is queued and how long a prefill booked now would wait.
    assert busy["requests_waiting"] == 3 and busy["queued_prefill_tokens"] >= 3 * 1990
    assert 1.5 * prefill_s * 1000 <= busy["prefill_wait_ms"] <= 3 * prefill_s * 1000, busy
    idle = engine.stats()
    assert (idle["queued_prefill_tokens"], idle["prefill_wait_ms"]) == (0, 0.0)


# --- KV events ----------------------------------------------------------------------------


class EventHarness:
    """Subscriber + the conductor's translator and index, as the conductor wires them."""

    def __init__(self, engine: SimEngineProcess, engine_id: str) -> None:
        self.index = MemoryIndex()
        self.translator = EngineEventTranslator(self.index, engine_id, MODEL, TOKENIZER)
        self.batches: list[DecodedBatch] = []
        self.rejected: list = []
        self.errors: list = []
        self.sub = EngineSubscriber(
            engine_id,
            engine.fields["kv_events"],
            engine.fields["replay"],
            on_batch=self.on_batch,
            on_error=lambda *err: self.errors.append(err),
            on_reset=lambda _id: self.translator.reset(),
        )

    def on_batch(self, _engine_id: str, _seq: int, batch: DecodedBatch) -> None:
        self.batches.append(batch)
        self.rejected.extend(self.translator.apply(batch).rejected)

    def holds(self, keys: list) -> bool:
        return bool(keys) and all(self.index.locate(k) for k in keys)

    def events(self, kind: type) -> list:
        return [e for b in self.batches for e in b.events if isinstance(e, kind)]


async def chat(session: aiohttp.ClientSession, url: str, messages, salt=None, **extra) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, **extra}
    if salt is not None:
        body["cache_salt"] = salt
    async with session.post(url + "/v1/chat/completions", json=body) as reply:
        assert reply.status == 200, await reply.text()
        return await reply.json()


async def replay_from(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Ask a replay socket as vLLM's clients do; vLLM answers (b"", topic, seq, payload)
    per batch, then (b"", b"", -1, b"")."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    out = []
    try:
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            assert await sock.poll(5000), "no replay answer"
            _empty, topic, seq, payload = await sock.recv_multipart()
            seq_no = int.from_bytes(seq, "big", signed=True)
            if seq_no == -1:
                assert (topic, payload) == (b"", b"")
                return out
            out.append((seq_no, payload))
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_kv_events_decode_in_both_encodings_with_the_salt_as_tenant(engine_factory, encoding):
    engine = engine_factory("--event-encoding", encoding, "--hbm-blocks", "8", "--node-id", "e1")
    harness = EventHarness(engine, "e1")

    async def scenario() -> None:
        harness.sub.start()
        try:
            async with gateway_session() as session:
                # ZMQ's slow joiner may lose the first batches: ping until the
                # subscription is live, then start from an empty cache.
                ping = 0
                deadline = time.monotonic() + 10
                while not harness.batches:
                    assert time.monotonic() < deadline, "no KV events arrived"
                    ping += 1
                    ping_messages = [{"role": "user", "content": words(900 + ping, 10)}]
                    await chat(session, engine.http, ping_messages)
                    with contextlib.suppress(AssertionError):
                        await until(lambda: harness.batches, "a first batch", 0.5)
                async with session.post(engine.http + "/reset_prefix_cache") as reply:
                    assert reply.status == 200
                await until(lambda: harness.events(EngineAllCleared), "AllBlocksCleared")

                acme = [{"role": "user", "content": words(2, 40)}]
                acme_keys = gateway_keys(chat_tokens(acme), "acme")
                await chat(session, engine.http, acme, "acme")
                await until(lambda: harness.holds(acme_keys), "acme's blocks")
                assert not harness.holds(gateway_keys(chat_tokens(acme), None))
                assert not harness.holds(gateway_keys(chat_tokens(acme), "globex"))
                salts = {
                    e.cache_salt for e in harness.events(EngineBlockStored) if e.parent is None
                }
                assert "acme" in salts

                # The same prompt under another salt: new blocks, evicting the LRU ones.
                await chat(session, engine.http, acme, "globex")
                globex_keys = gateway_keys(chat_tokens(acme), "globex")
                await until(lambda: harness.holds(globex_keys), "globex's blocks")
                await until(lambda: harness.events(EngineBlockRemoved), "a BlockRemoved")
                assert not harness.holds(acme_keys), "evicted blocks left the index"

                async with session.post(engine.http + "/reset_prefix_cache") as reply:
                    assert reply.status == 200
                await until(lambda: len(harness.events(EngineAllCleared)) == 2, "AllBlocksCleared")
                assert not harness.holds(globex_keys)
                assert len(harness.index.snapshot()) == 0

                # The replay socket answers a start sequence with every batch since.
                replayed = await replay_from(engine.fields["replay"], 0)
                assert [seq for seq, _ in replayed] == list(
                    range(engine.stats()["kv_events_next_seq"])
                )
                assert all(not decode_batch(payload).errors for _seq, payload in replayed)
        finally:
            await harness.sub.stop()
        assert harness.rejected == [] and harness.errors == []
        assert harness.sub.counters.event_errors == 0 and harness.sub.counters.wire_errors == 0

    run(scenario())


# --- offload and FETCH through a real store ---------------------------------------------------


def lone_store_a(tmp_path: Path):
    """A started store "store-a" with an in-memory registry and no peer fetch."""
    store = ServiceProcess(
        "store",
        ["--data-dir", str(tmp_path / "store"), "--registry", "memory", "--node-id", "store-a",
         "--peer-fetch", "false"],
        tmp_path,
    )  # fmt: skip
    return store.start(timeout_s=20.0)


def test_evicted_blocks_land_in_the_store_and_a_fetch_plan_skips_recompute(
    engine_factory, tmp_path: Path
):
    from quillcache_core.storeclient.client import StoreClient

    with lone_store_a(tmp_path) as store:
        address = store.grpc_address
        engine = engine_factory(
            "--hbm-blocks", "8", "--store", address, "--store-node-id", "store-a",
            "--kv-layers", "4", "--node-id", "e2", "--store-writes", "evicted",
        )  # fmt: skip
        shape = (4, 2, BS, 8, 128)  # --kv-layers 4: 256 KiB per block
        a, b, c = ([seed * 1000 + i for i in range(6 * BS + 1)] for seed in (1, 2, 3))
        keys_a = gateway_keys(a, None)

        async def scenario() -> None:
            async with gateway_session() as session:

                async def complete(prompt, plan=None, expect=200):
                    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
                    if plan is not None:
                        body["kv_transfer_params"] = {"quillcache": plan.to_json()}
                    async with session.post(engine.http + "/v1/completions", json=body) as reply:
                        assert reply.status == expect, await reply.text()
                        return reply.headers, await reply.json()

                _h, first = await complete(a)
                await complete(b)
                await complete(c)  # 8 HBM blocks: all of a's 6 are evicted by now
                client = StoreClient(address, timeout_s=5.0, tls=tls("engine"))
                try:
                    await until(lambda: engine.stats()["store"]["offloaded"] >= 6, "offloads", 15.0)
                    assert all(await client.exists(keys_a))
                    data, _tier = await client.get(keys_a[3])
                    assert data == kv_payload(keys_a[3].block_hash, shape), "real, exact bytes"
                finally:
                    await client.close()

                def plan(source_node: str, source_address: str) -> EnginePlan:
                    return EnginePlan(
                        reservation_id="r1", engine_id="e2", model_id=MODEL,
                        tokenizer_id=TOKENIZER, tenant_id="default", block_size=BS,
                        recompute_blocks=0,
                        fetch=tuple(FetchAction(i, k.block_hash, source_node, source_address,
                                                "cpu_dram") for i, k in enumerate(keys_a)),
                    )  # fmt: skip

                # A source that is down: every planned block is recomputed instead.
                headers, _ = await complete(a, plan("store-x", "127.0.0.1:1"))
                assert headers["x-sim-fetched-blocks"] == "0"
                assert headers["x-sim-recomputed-blocks"] == "6"
                await complete(b)
                await complete(c)  # evict a again

                headers, body = await complete(a, plan("store-a", address))
                assert headers["x-sim-hit-blocks"] == "0"
                assert headers["x-sim-fetched-blocks"] == "6"
                assert headers["x-sim-recomputed-blocks"] == "0"
                assert body["quillcache"]["fetched_blocks"] == 6
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BS
                assert body["choices"][0]["text"] == first["choices"][0]["text"]
                stats = engine.stats()
                assert stats["store"]["fetch_mismatches"] == 0
                assert stats["store"]["fetched"] >= 6

        run(scenario())


def test_computed_blocks_are_saved_and_another_engine_fetches_them(engine_factory, tmp_path: Path):
    """The default: as the KV connector does, a prompt's computed blocks go to the store
    node after its prefill, with nothing evicted; a second engine then loads them."""
    from quillcache_core.storeclient.client import StoreClient

    with lone_store_a(tmp_path) as store:
        address = store.grpc_address
        common = ("--store", address, "--store-node-id", "store-a", "--kv-layers", "2")
        first_engine = engine_factory(*common, "--node-id", "e1", "--seed", "11", name="sim-e1")
        second_engine = engine_factory(*common, "--node-id", "e2", "--seed", "22", name="sim-e2")
        shape = (2, 2, BS, 8, 128)
        prompt = [7000 + i for i in range(6 * BS + 3)]
        keys = gateway_keys(prompt, None)

        async def scenario() -> None:
            async with gateway_session() as session:

                async def complete(engine, plan=None):
                    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
                    if plan is not None:
                        body["kv_transfer_params"] = {"quillcache": plan.to_json()}
                    async with session.post(engine.http + "/v1/completions", json=body) as reply:
                        assert reply.status == 200, await reply.text()
                        return reply.headers, await reply.json()

                headers, first = await complete(first_engine)
                assert headers["x-sim-recomputed-blocks"] == "6"
                await until(lambda: first_engine.stats()["store"]["saved"] >= 6, "saves", 15.0)
                stats = first_engine.stats()
                assert stats["store"]["offloaded"] == 0, "nothing was evicted"
                assert stats["store"]["save_dropped"] == 0
                client = StoreClient(address, timeout_s=5.0, tls=tls("engine"))
                try:
                    assert all(await client.exists(keys))
                    data, _tier = await client.get(keys[5])
                    assert data == kv_payload(keys[5].block_hash, shape), "real, exact bytes"
                finally:
                    await client.close()

                plan = EnginePlan(
                    reservation_id="r2", engine_id="e2", model_id=MODEL,
                    tokenizer_id=TOKENIZER, tenant_id="default", block_size=BS,
                    recompute_blocks=0,
                    fetch=tuple(FetchAction(i, k.block_hash, "store-a", address, "cpu_dram")
                                for i, k in enumerate(keys)),
                )  # fmt: skip
                headers, body = await complete(second_engine, plan)
                assert headers["x-sim-fetched-blocks"] == "6"
                assert headers["x-sim-recomputed-blocks"] == "0"
                assert body["choices"][0]["text"] == first["choices"][0]["text"]
                # What the second engine loaded from the pool is not saved again.
                await asyncio.sleep(0.3)
                assert second_engine.stats()["store"]["saved"] == 0

        run(scenario())


# --- registry -------------------------------------------------------------------------------


def test_registers_in_etcd_and_leaves_on_sigterm(etcd_server, tmp_path: Path):
    engine = SimEngineProcess(
        [
            "--registry", etcd_server.client_url, "--node-id", "sim-r", "--locality-domain",
            "rack-1", "--lease-ttl-s", "30", "--store-node-id", "store-r",
        ],
        tmp_path,
    )  # fmt: skip

    async def record():
        registry = EtcdRegistry([etcd_server.endpoint], tls=tls("operator"))
        try:
            return await registry.get("engine", "sim-r")
        finally:
            await registry.close()

    with engine.start(timeout_s=20.0):
        rec = wait_until(lambda: asyncio.run(record()), what="the engine's registry record")
        assert rec.base_url == engine.http
        assert rec.kv_events_endpoint == engine.fields["kv_events"]
        assert rec.kv_replay_endpoint == engine.fields["replay"]
        assert (rec.model, rec.tokenizer, rec.store_node) == (MODEL, TOKENIZER, "store-r")
        assert rec.locality_domain == "rack-1" and rec.address == ""
        assert engine.stop() == 0
    # The lease is 30 s: the key goes at once only because the engine deregistered.
    wait_until(lambda: asyncio.run(record()) is None, timeout_s=5.0, what="deregistration")


# --- faults and bad input -------------------------------------------------------------------


def test_fault_flags_bad_input_and_concurrent_streams(engine_factory):
    engine = engine_factory("--node-id", "e3")
    url = engine.http

    async def scenario() -> None:
        async with gateway_session() as session:
            body = {"model": MODEL, "prompt": words(3, 30), "max_tokens": 10, "stream": True}
            # Aborted after 3 tokens: no [DONE], the transfer breaks.
            seen = b""
            with pytest.raises(aiohttp.ClientError):
                async with session.post(
                    url + "/v1/completions", json=body, headers={"x-sim-fail-after-tokens": "3"}
                ) as reply:
                    assert reply.status == 200
                    async for chunk in reply.content.iter_any():
                        seen += chunk
            assert seen.count(b"data: {") <= 3 and b"[DONE]" not in seen

            async with session.post(
                url + "/v1/completions", json=body, headers={"x-sim-status": "503"}
            ) as reply:
                assert reply.status == 503
                assert (await reply.json())["error"]["code"] == 503

            bad = [
                (b"{not json", 400),
                (b'{"prompt": "\xff\xfe"}', 400),
                (b"[1, 2]", 400),
                (b'{"prompt": "x", "max_tokens": -3}', 400),
                (b'{"model": "nope", "prompt": "x"}', 404),
                (b'{"prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}', 413),
            ]
            for raw, status in bad:
                async with session.post(
                    url + "/v1/completions", data=raw, headers={"Content-Type": "application/json"}
                ) as reply:
                    assert reply.status == status, (raw[:40], await reply.text())
                    error = (await reply.json())["error"]
                    assert set(error) == {"message", "type", "param", "code"}

            async def one(i: int) -> bytes:
                payload = {**body, "prompt": words(100 + i, 20)}
                async with session.post(url + "/v1/completions", json=payload) as reply:
                    assert reply.status == 200
                    return await reply.read()

            batch = {"model": MODEL, "prompt": ["first prompt", "second one"], "max_tokens": 3}
            async with session.post(url + "/v1/completions", json=batch) as reply:
                answer = await reply.json()
                assert [c["index"] for c in answer["choices"]] == [0, 1]
                assert answer["usage"]["completion_tokens"] == 6

            streams = await asyncio.gather(*(one(i) for i in range(100)))
            assert all(
                s.endswith(b"data: [DONE]\n\n") and s.count(b'"text"') == 11 for s in streams
            )

            async with session.get(url + "/metrics") as reply:
                text = await reply.text()
            assert 'quillcache_sim_requests_total{endpoint="completions",status="200"} 101' in text
            assert "vllm:num_requests_running" in text

    run(scenario())
    assert engine.proc.running
