"""End to end on the local cluster: real etcd, conductor, stores, transfer, sim engines, gateway."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest

from quillcache.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from quillcache_core.identity.keys import request_blocks
from quillcache_core.identity.tokenize import BuiltinTokenizer, render_chat
from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.security.credentials import as_gateway, tenant_context
from tests.support.cluster import conductor_channel, https, openai_client, salt_of
from tests.support.services import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "sim-model"
SYSTEM = (
    "You are the support assistant of the Acme Rocket Company. Answer questions about "
    "rockets, orders and deliveries politely and precisely. "
) * 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # A real time scale, so prefill time is measurable from the client.
    lc = LocalCluster(tmp_path_factory.mktemp("cluster"), time_scale=1.0, log=lambda *_: None)
    endpoints = lc.start()
    try:
        yield lc, endpoints
    finally:
        lc.stop()


def client_for(endpoints, tenant="acme") -> openai.OpenAI:
    return openai_client(endpoints, tenant, max_retries=0)


def chat(client, user: str, *, system: str = SYSTEM, max_tokens: int = 8):
    """Stream a chat completion; returns (headers, seconds to first content chunk, text)."""
    started = time.perf_counter()
    with client.chat.completions.with_streaming_response.create(
        model=MODEL,
        stream=True,
        max_tokens=max_tokens,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
    ) as response:
        headers = dict(response.headers)
        headers_at = time.perf_counter() - started
        first = None
        text = []
        for chunk in response.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter() - started
                text.append(chunk.choices[0].delta.content)
    assert first is not None, "no content streamed"
    assert headers_at <= first
    return headers, first, "".join(text)


def test_openai_sdk_streams_with_decision_headers_and_the_second_turn_hits(cluster):
    _, endpoints = cluster
    client = client_for(endpoints)
    h1, ttft1, text1 = chat(client, "Where is my order 1234?")
    for name in (
        "request-id",
        "engine",
        "hit-blocks",
        "fetch-blocks",
        "recompute-blocks",
        "est-ttft-ms",
        "plan-us",
    ):
        assert f"x-quillcache-{name}" in h1, name
    assert text1
    h2, ttft2, _ = chat(client, "And what about order 5678?")
    assert h2["x-quillcache-engine"] == h1["x-quillcache-engine"]
    assert int(h2["x-quillcache-hit-blocks"]) >= 20, h2  # the shared system prompt
    assert ttft2 < ttft1, (ttft1, ttft2)


def test_same_prompt_from_another_tenant_gets_no_hit(cluster):
    _, endpoints = cluster
    chat(client_for(endpoints, "acme"), "Tell me about tenant isolation.")
    headers, _, _ = chat(client_for(endpoints, "globex"), "Tell me about tenant isolation.")
    assert headers["x-quillcache-hit-blocks"] == "0"
    assert headers["x-quillcache-fetch-blocks"] == "0"


def test_bad_inputs_get_openai_shaped_4xx(cluster):
    _, endpoints = cluster
    url = endpoints["gateway_url"] + "/v1/chat/completions"
    key = endpoints["api_keys"]["acme"]
    good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

    def post(body: bytes, auth: str | None = key, path: str = url):
        request = urllib.request.Request(path, data=body, method="POST")
        request.add_header("Content-Type", "application/json")
        if auth:
            request.add_header("Authorization", f"Bearer {auth}")
        try:
            with urllib.request.urlopen(
                request, timeout=10, context=tenant_context(endpoints)
            ) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    cases = [
        (b"{not json", key, 400),
        (json.dumps({**good, "messages": "hi"}).encode(), key, 400),
        (json.dumps({"model": MODEL}).encode(), key, 400),
        (json.dumps({**good, "max_tokens": -5}).encode(), key, 400),
        (json.dumps({**good, "stream": "yes"}).encode(), key, 400),
        (json.dumps({**good, "model": "no-such-model"}).encode(), key, 404),
        (
            b'{"model": "sim-model", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
            key,
            400,
        ),
        (json.dumps(good).encode(), "wrong-key", 401),
        (json.dumps(good).encode(), None, 401),
        (b"[" + b"1," * (3 * 1024 * 1024) + b"1]", key, 413),
    ]
    for body, auth, status in cases:
        got, reply = post(body, auth)
        assert got == status, (body[:60], reply)
        assert set(reply["error"]) >= {"message", "type", "param", "code"}
        assert reply["error"]["message"]
    got, reply = post(
        json.dumps({"model": MODEL, "prompt": [1, 2, -3]}).encode(),
        path=endpoints["gateway_url"] + "/v1/completions",
    )
    assert got == 400 and "token id" in reply["error"]["message"]
    # And the gateway still serves.
    assert post(json.dumps({**good, "max_tokens": 2}).encode())[0] == 200


def test_models_lists_what_the_engines_serve(cluster):
    _, endpoints = cluster
    models = client_for(endpoints).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completions_with_token_ids_and_strings(cluster):
    _, endpoints = cluster
    client = client_for(endpoints)
    ids = list(range(100, 100 + 64))
    first = client.completions.with_raw_response.create(model=MODEL, prompt=ids, max_tokens=4)
    again = client.completions.with_raw_response.create(model=MODEL, prompt=ids, max_tokens=4)
    assert int(again.headers["x-quillcache-hit-blocks"]) == 4
    assert again.parse().choices[0].text == first.parse().choices[0].text
    text = client.completions.create(model=MODEL, prompt="A string prompt", max_tokens=3)
    assert text.choices[0].text


def test_500_concurrent_streams_complete_without_errors(cluster):
    _, endpoints = cluster
    url = endpoints["gateway_url"] + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {endpoints['api_keys']['globex']}"}

    async def one(session, n):
        body = {
            "model": MODEL,
            "stream": True,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": f"short question number {n % 50}"}],
        }
        async with session.post(url, json=body, headers=headers) as reply:
            assert reply.status == 200, await reply.text()
            data = await reply.read()
        assert data.endswith(b"data: [DONE]\n\n"), data[-200:]
        assert b'"error"' not in data

    async def main():
        timeout = aiohttp.ClientTimeout(total=240)
        async with aiohttp.ClientSession(
            timeout=timeout,
            connector=aiohttp.TCPConnector(limit=0, ssl=tenant_context(endpoints)),
        ) as session:
            results = await asyncio.gather(
                *(one(session, n) for n in range(500)), return_exceptions=True
            )
        return [r for r in results if isinstance(r, BaseException)]

    errors = asyncio.run(main())
    assert errors == [], errors[:3]


def test_killing_an_engine_mid_run_sends_new_requests_to_the_other(tmp_path):
    lc = LocalCluster(tmp_path, time_scale=0.02, lease_ttl_s=2.0, log=lambda *_: None)
    endpoints = lc.start()
    try:
        client = client_for(endpoints)
        victim = next(c for c in lc.children if c.name == "engine-0")
        survivor_url = endpoints["engines"][1]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=5)
        started = time.monotonic()
        engines = set()
        for n in range(20):
            headers, _, text = chat(client, f"after the kill {n}", system="short system prompt")
            engines.add(headers["x-quillcache-engine"])
            assert text
        assert engines == {"engine-1"}, engines
        assert time.monotonic() - started < 30, "nothing hangs"
        assert survivor_url
    finally:
        lc.stop()


def test_small_hbm_offloads_to_the_store_and_a_later_request_fetches(tmp_path):
    lc = LocalCluster(
        tmp_path, engines=1, stores=1, hbm_blocks=48, time_scale=0.02, log=lambda *_: None
    )
    endpoints = lc.start()
    try:
        client = client_for(endpoints)
        doc = "The quarterly report says revenue grew in every region. " * 20
        first, _, text1 = chat(client, "Summarise.", system=doc)
        engine_url = endpoints["engines"][0]
        gateway_ssl, engine_auth = as_gateway(lc.certs_dir)
        # Fill the engine's 48-block HBM with other work, straight at the engine.
        for n in range(3):
            body = json.dumps(
                {
                    "model": MODEL,
                    "prompt": list(range(1000 * n, 1000 * n + 60 * 16)),
                    "max_tokens": 1,
                }
            ).encode()
            request = urllib.request.Request(
                engine_url + "/v1/completions",
                data=body,
                method="POST",
                headers={"Content-Type": "application/json", **engine_auth},
            )
            with urllib.request.urlopen(request, timeout=30, context=gateway_ssl) as reply:
                assert reply.status == 200

        def offload_done():
            with urllib.request.urlopen(
                engine_url + "/sim/stats", timeout=5, context=https(endpoints)
            ) as reply:
                return json.loads(reply.read())["offload_pending"] == 0

        wait_until(offload_done, timeout_s=20, what="evicted blocks offloaded to the store")

        def planned_fetch():
            reply = client.chat.completions.with_raw_response.create(
                model=MODEL,
                max_tokens=8,
                messages=[
                    {"role": "system", "content": doc},
                    {"role": "user", "content": "Summarise."},
                ],
            )
            return reply if int(reply.headers["x-quillcache-fetch-blocks"]) > 0 else None

        # The store reports the offloaded blocks to the conductor asynchronously: wait
        # until the conductor locates the prompt's first block on the store node.
        tokens = BuiltinTokenizer().encode(
            render_chat(
                [{"role": "system", "content": doc}, {"role": "user", "content": "Summarise."}]
            )
        )
        keys = request_blocks(
            tokens,
            16,
            model_id=MODEL,
            tokenizer_id="builtin-v1",
            adapter_id=None,
            tenant_id=salt_of(lc.certs_dir, "acme"),
            cache_salt=salt_of(lc.certs_dir, "acme"),
        )
        with conductor_channel(endpoints) as channel:
            stub = conductor_pb2_grpc.ConductorStub(channel)
            identity = common_pb2.Identity(
                model_id=MODEL, tokenizer_id="builtin-v1", tenant_id=keys[0].tenant_id
            )

            def on_store():
                found = stub.Locate(
                    conductor_pb2.LocateRequest(
                        identity=identity, block_hashes=[keys[0].block_hash]
                    ),
                    timeout=5,
                )
                return any(loc.kind == "store" for loc in found.blocks[0].locations)

            wait_until(
                on_store, timeout_s=20, what="the conductor to locate the block on the store"
            )
        reply = wait_until(planned_fetch, timeout_s=20, what="a plan with FETCH blocks")
        body = reply.parse()
        usage = json.loads(reply.text)["usage"]
        assert usage["quillcache"]["fetched_blocks"] == int(
            reply.headers["x-quillcache-fetch-blocks"]
        )
        assert usage["quillcache"]["recomputed_blocks"] < int(
            first["x-quillcache-recompute-blocks"]
        )
        assert body.choices[0].message.content == text1, "fetched KV gives the same answer"
    finally:
        lc.stop()


def test_quillcache_up_writes_endpoints_and_stops_cleanly_on_sigterm(tmp_path):
    endpoints_file = tmp_path / "endpoints.json"
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "quillcache_core.launch.cli",
            "up",
            "--endpoints-file",
            str(endpoints_file),
            "--data-dir",
            str(tmp_path / "data"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_until(
            lambda: endpoints_file.exists() and endpoints_file.stat().st_size > 0,
            timeout_s=90,
            what="endpoints file",
        )
        endpoints = json.loads(endpoints_file.read_text())
        assert set(endpoints) == {
            "gateway_url",
            "conductor",
            "conductors",
            "stores",
            "transfer",
            "etcd",
            "engines",
            "metrics",
            "api_keys",
            "tls",
        }
        assert set(endpoints["tls"]) == {"ca", "cert", "key"}
        # Two replicas by default; "conductor" (for old clients) is the first.
        assert len(endpoints["conductors"]) == 2
        assert endpoints["conductor"] == endpoints["conductors"][0]
        assert len(endpoints["stores"]) == 2 and len(endpoints["engines"]) == 2
        assert set(endpoints["api_keys"]) == {"acme", "globex"}
        headers, _, text = chat(client_for(endpoints), "hello")
        assert text and headers["x-quillcache-engine"]
        with urllib.request.urlopen(
            endpoints["metrics"]["gateway"], timeout=5, context=https(endpoints)
        ) as reply:
            assert b"quillcache_gateway_goodput" in reply.read()
        pids = _cluster_pids(tmp_path / "data")
        assert pids, "child processes found"
        # The README's first request, run as written from where `make run` writes the
        # endpoints file.
        (tmp_path / ".quillcache-endpoints.json").write_text(endpoints_file.read_text())
        readme_block = _readme_block_with("curl ")
        shown = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", readme_block],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, shown.stderr
        head, _, body = shown.stdout.partition("\n\n")  # text=True reads CRLF as \n
        assert head.startswith("HTTP/1.1 200"), head
        assert "x-quillcache-engine:" in head.lower()
        assert '"predicted"' in body and '"delivered"' in body, shown.stdout
        assert body.rstrip().endswith("data: [DONE]")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=60)
        log.close()
    assert code == 0, (tmp_path / "up.log").read_text()[-2000:]
    assert "stopped." in (tmp_path / "up.log").read_text()
    wait_until(lambda: not any(_alive(p) for p in pids), timeout_s=10, what="children gone")


def _readme_block_with(text: str) -> str:
    """The README's shell block that contains `text`."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = readme.split("```sh\n")[1:]
    found = [b.split("```", 1)[0] for b in blocks if text in b.split("```", 1)[0]]
    assert len(found) == 1, f"one README block with {text!r}, found {len(found)}"
    return found[0]


def _cluster_pids(data_dir: Path) -> list[int]:
    """Processes whose command line names this cluster's data dir (etcd, stores, conductor)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if str(data_dir).encode() in cmdline:
                pids.append(int(entry.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def _metric(endpoints, url: str, name: str) -> float:
    """The sum of a metric's samples over their labels."""
    total = 0.0
    with urllib.request.urlopen(url, timeout=5, context=https(endpoints)) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith((name + " ", name + "{")):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_ttft_budget_header_drives_the_goodput_metric(cluster):
    _, endpoints = cluster
    metrics = endpoints["metrics"]["gateway"]
    client = client_for(endpoints)

    def ask(slo_ms: str, n: int):
        return client.chat.completions.with_raw_response.create(
            model=MODEL,
            max_tokens=2,
            extra_headers={"x-quillcache-ttft-slo-ms": slo_ms},
            messages=[{"role": "user", "content": f"budget question {n} " + "word " * 300}],
        )

    timed, met = (
        _metric(endpoints, metrics, "quillcache_gateway_ttft_seconds_count"),
        _metric(endpoints, metrics, "quillcache_gateway_ttft_slo_met_total"),
    )
    ask("1", 1)  # a 1 ms budget cannot be met by a 300-word prefill at real time scale
    assert _metric(endpoints, metrics, "quillcache_gateway_ttft_seconds_count") == timed + 1
    assert _metric(endpoints, metrics, "quillcache_gateway_ttft_slo_met_total") == met
    ask("60000", 2)
    assert _metric(endpoints, metrics, "quillcache_gateway_ttft_slo_met_total") == met + 1
    goodput = _metric(endpoints, metrics, "quillcache_gateway_goodput")
    assert 0 < goodput < 1
    with pytest.raises(openai.BadRequestError):
        ask("soon", 3)


def test_a_tokenizer_json_trained_here_is_used_by_gateway_and_engine(tmp_path):
    from tests.unit.test_tokenize import train_tokenizer

    tok = train_tokenizer(tmp_path / "tok.json")
    lc = LocalCluster(
        tmp_path / "cluster",
        engines=1,
        stores=1,
        time_scale=0.02,
        log=lambda *_: None,
        extra_args={
            "gateway": ["--tokenizers", f"{MODEL}={tok}"],
            "sim-engine": ["--tokenizer", tok],
        },
    )
    endpoints = lc.start()
    try:
        client = client_for(endpoints)
        system = "QuillCache routes requests to the engine that holds their prefix. " * 10
        chat(client, "First question.", system=system)
        headers, _, _ = chat(client, "Second question.", system=system)
        # Hits need the gateway's and the engine's token ids (hence hashes) to agree.
        assert int(headers["x-quillcache-hit-blocks"]) >= 3, headers
    finally:
        lc.stop()


def test_an_engine_dying_mid_stream_ends_the_stream_with_an_error_and_frees_the_reservation(
    tmp_path,
):
    lc = LocalCluster(tmp_path, engines=1, stores=1, time_scale=1.0, log=lambda *_: None)
    endpoints = lc.start()
    try:
        engine = next(c for c in lc.children if c.service == "sim-engine")
        url = endpoints["gateway_url"] + "/v1/chat/completions"
        body = json.dumps(
            {
                "model": MODEL,
                "stream": True,
                "max_tokens": 20000,
                "messages": [{"role": "user", "content": "tell me a very long story"}],
            }
        ).encode()
        request = urllib.request.Request(
            url,
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {endpoints['api_keys']['acme']}",
            },
        )
        with urllib.request.urlopen(
            request, timeout=60, context=tenant_context(endpoints)
        ) as reply:
            first = reply.readline()
            assert first.startswith(b"data: {")
            engine.proc.send_signal(signal.SIGKILL)
            rest = reply.read()
        events = [line for line in rest.split(b"\n") if line.startswith(b"data: ")]
        assert events and b'"error"' in events[-1], rest[-300:]
        assert b"[DONE]" not in rest
        with conductor_channel(endpoints) as channel:
            stub = conductor_pb2_grpc.ConductorStub(channel)
            wait_until(
                lambda: stub.Stats(conductor_pb2.StatsRequest(), timeout=5).reservations_open == 0,
                timeout_s=10,
                what="the reservation released",
            )
            stats = stub.Stats(conductor_pb2.StatsRequest(), timeout=5)
            assert stats.reservations_expired == 0, "released by Finish, not by expiry"
    finally:
        lc.stop()


def test_an_engine_registered_with_its_own_tokenizer_id_gets_hits_from_its_events(tmp_path):
    """The engine's record names a tokenizer id the gateway's local tokenizer is not called
    (the builtin one is "builtin-v1"); the gateway must hash under the record's identity,
    as the conductor does with the engine's KV events, or no event ever becomes a hit."""
    lc = LocalCluster(
        tmp_path / "cluster",
        engines=1,
        stores=1,
        time_scale=0.02,
        log=lambda *_: None,
        extra_args={"sim-engine": ["--tokenizer-id", "org/llama-tok-v2"]},
    )
    endpoints = lc.start()
    try:
        messages = [
            {"role": "system", "content": "You route requests by their cached prefix. " * 12},
            {"role": "user", "content": "Which engine holds my prompt?"},
        ]
        full_blocks = len(BuiltinTokenizer().encode(render_chat(messages))) // 16
        # Straight to the engine (with the gateway's credentials and acme's salt): only
        # its KV events tell the conductor, nothing passes through the gateway.
        salt = salt_of(lc.certs_dir, "acme")
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "cache_salt": salt}
        gateway_ssl, engine_auth = as_gateway(lc.certs_dir)
        request = urllib.request.Request(
            endpoints["engines"][0] + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **engine_auth},
        )
        with urllib.request.urlopen(request, timeout=30, context=gateway_ssl) as reply:
            assert reply.status == 200

        async def resident_blocks() -> int:
            async with conductor_channel(endpoints, aio=True) as channel:
                stats = await conductor_pb2_grpc.ConductorStub(channel).Stats(
                    conductor_pb2.StatsRequest(), timeout=5
                )
            assert [e.tokenizer for e in stats.engines] == ["org/llama-tok-v2"]
            return stats.engines[0].resident_blocks

        wait_until(lambda: asyncio.run(resident_blocks()) >= full_blocks - 1, timeout_s=20)
        client = client_for(endpoints)
        first = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=4
        )
        assert first.parse().choices[0].message.content
        hits = int(first.headers["x-quillcache-hit-blocks"])
        assert full_blocks - 1 <= hits <= full_blocks, (hits, full_blocks)
    finally:
        lc.stop()


def test_engines_with_32_and_16_token_blocks_in_one_fleet_both_get_their_hits(tmp_path):
    """The conductor's index keeps 16-token blocks; an engine with 32-token blocks (vLLM on
    CPU) reports them split, and is planned only whole blocks of its own size."""
    lc = LocalCluster(
        tmp_path / "cluster",
        engines=2,
        stores=1,
        time_scale=0.02,
        log=lambda *_: None,
        engine_options={0: {"sim_args": ["--block-size", "32"]}},
    )
    endpoints = lc.start()
    try:
        tokenizer = BuiltinTokenizer()
        gateway_ssl, engine_auth = as_gateway(lc.certs_dir)
        for engine, (url, size) in enumerate(zip(endpoints["engines"], (32, 16), strict=True)):
            messages = [
                {"role": "system", "content": f"Engine {engine} keeps {size}-token blocks. " * 9},
                {"role": "user", "content": "Which blocks are mine?"},
            ]
            tokens = len(tokenizer.encode(render_chat(messages)))
            body = {
                "model": MODEL,
                "messages": messages,
                "max_tokens": 2,
                "cache_salt": salt_of(lc.certs_dir, "acme"),  # acme's, as the gateway sends
            }
            request = urllib.request.Request(
                url + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", **engine_auth},
            )
            with urllib.request.urlopen(request, timeout=30, context=gateway_ssl) as reply:
                assert reply.status == 200
            expected = tokens // size * size // 16  # whole engine blocks, in 16-token blocks

            async def resident(engine_id: str = f"engine-{engine}") -> int:
                async with conductor_channel(endpoints, aio=True) as channel:
                    stats = await conductor_pb2_grpc.ConductorStub(channel).Stats(
                        conductor_pb2.StatsRequest(), timeout=5
                    )
                return next(e.resident_blocks for e in stats.engines if e.engine_id == engine_id)

            wait_until(lambda n=expected: asyncio.run(resident()) >= n, timeout_s=20)
            first = client_for(endpoints).chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=2
            )
            assert first.headers["x-quillcache-engine"] == f"engine-{engine}"
            assert int(first.headers["x-quillcache-hit-blocks"]) == expected, (size, tokens)
    finally:
        lc.stop()


def test_with_the_conductor_killed_the_gateway_routes_every_request_itself(tmp_path):
    """kill -9 of the conductor: the gateway routes by a consistent hash of each prompt's
    first block over the engines it last learnt from Stats; no request fails."""
    lc = LocalCluster(tmp_path, time_scale=0.02, log=lambda *_: None)
    endpoints = lc.start()
    try:
        client = client_for(endpoints)
        headers, _, _ = chat(client, "before the kill", system="short system prompt")
        assert "x-quillcache-plan" not in headers and "x-quillcache-hit-blocks" in headers
        conductor = next(c for c in lc.children if c.name == "conductor")
        conductor.proc.send_signal(signal.SIGKILL)
        conductor.proc.wait(timeout=5)
        started = time.monotonic()
        failures, engines = [], {}
        for n in range(20):
            system = f"system prompt number {n % 5} of the conductor-less hour"
            try:
                headers, _, text = chat(client, f"question {n}", system=system)
            except Exception as exc:  # noqa: BLE001 - counted and shown below
                failures.append(exc)
                continue
            assert headers["x-quillcache-plan"] == "fallback" and text, headers
            engines.setdefault(system, set()).add(headers["x-quillcache-engine"])
        assert failures == [], failures[:3]
        assert all(len(chosen) == 1 for chosen in engines.values()), engines  # same prefix
        assert set().union(*engines.values()) <= {"engine-0", "engine-1"}
        assert time.monotonic() - started < 30, "nothing hangs"
    finally:
        lc.stop()
