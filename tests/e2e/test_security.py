"""`quillcache up` as an attacker on the same network meets it, and as its tenants do.

Every port of the secure cluster refuses a client without a certificate of the
cluster's CA (plaintext, or TLS with no client certificate); a certificate of the
wrong role is refused per call and counted; a tenant's blocks in a store cannot be
read, overwritten or deleted by anyone acting for another tenant, nor found by a key
computed from the tenant's name; a fake engine cannot be registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from quillcache.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc, store_pb2, store_pb2_grpc
from quillcache_core.errors import NotFound
from quillcache_core.identity.keys import request_blocks
from quillcache_core.identity.tokenize import BuiltinTokenizer
from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.launch.etcd_server import find_etcd_binary
from quillcache_core.security.credentials import tenant_context
from quillcache_core.security.tls import Tls, grpc_channel
from quillcache_core.storeclient.client import StoreClient
from tests.support.cluster import https, openai_client, salt_of
from tests.support.services import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "sim-model"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # Small engine caches, so evicted blocks go to the stores.
    lc = LocalCluster(
        tmp_path_factory.mktemp("secure"), hbm_blocks=64, time_scale=0.02, log=lambda *_: None
    )
    endpoints = lc.start()
    try:
        yield lc, endpoints
    finally:
        lc.stop()


def as_role(lc: LocalCluster, role: str) -> Tls:
    return Tls.from_dir(lc.certs_dir, role)


def no_client_cert(lc: LocalCluster) -> ssl.SSLContext:
    """TLS that trusts the cluster's CA but shows no certificate of its own."""
    ctx = ssl.create_default_context(cafile=str(lc.certs_dir / "ca.pem"))
    ctx.check_hostname = False
    return ctx


def grpc_ports(lc: LocalCluster, endpoints: dict) -> dict[str, str]:
    ports = {"conductor": endpoints["conductor"], "transfer": endpoints["transfer"]}
    ports.update({f"store-{i}": a for i, a in enumerate(endpoints["stores"])})
    ports["etcd"] = endpoints["etcd"].removeprefix("https://")
    return ports


def tcp_ports(lc: LocalCluster, endpoints: dict) -> dict[str, str]:
    """The plain-TCP ports under TLS: the plan port and the stores' block-data ports."""
    operator = as_role(lc, "operator")
    with grpc_channel(endpoints["conductor"], operator, aio=False) as channel:
        stats = conductor_pb2_grpc.ConductorStub(channel).Stats(conductor_pb2.StatsRequest())
    ports = {"plan-port": stats.plan_address}
    for i, address in enumerate(endpoints["stores"]):
        with grpc_channel(address, operator, aio=False) as channel:
            reply = store_pb2_grpc.StoreStub(channel).Stats(store_pb2.StoreStatsRequest())
        ports[f"store-{i}-data"] = reply.data_address
    return ports


def http_ports(endpoints: dict) -> dict[str, str]:
    ports = {f"engine-{i}": url + "/health" for i, url in enumerate(endpoints["engines"])}
    ports.update({f"metrics-{name}": url for name, url in endpoints["metrics"].items()})
    return ports


def test_the_endpoints_file_names_tls_everywhere(cluster):
    lc, endpoints = cluster
    assert endpoints["tls"]["cert"].endswith("operator.pem")
    assert endpoints["etcd"].startswith("https://")
    assert endpoints["gateway_url"].startswith("https://")
    assert all(u.startswith("https://") for u in http_ports(endpoints).values())


def test_no_grpc_port_answers_a_plaintext_or_certificateless_client(cluster):
    lc, endpoints = cluster
    request = health_pb2.HealthCheckRequest()
    bare = grpc.ssl_channel_credentials(root_certificates=(lc.certs_dir / "ca.pem").read_bytes())
    options = [("grpc.ssl_target_name_override", "quillcache")]
    for name, address in grpc_ports(lc, endpoints).items():
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as plain:
                health_pb2_grpc.HealthStub(channel).Check(request, timeout=3)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE, name
        with grpc.secure_channel(address, bare, options=options) as channel:
            with pytest.raises(grpc.RpcError) as no_cert:
                health_pb2_grpc.HealthStub(channel).Check(request, timeout=3)
        assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE, name
        # The same call with the operator's certificate is answered (etcd's health
        # service is not the same, so only QuillCache's ports are asked).
        if name != "etcd":
            with grpc_channel(address, as_role(lc, "operator"), aio=False) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=3)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name


def _refused(sock_factory) -> bool:
    """Whether a connection made by `sock_factory` is refused: the handshake fails, or
    the server closes without answering a request."""
    try:
        with sock_factory() as sock:
            sock.sendall(b"\x00\x00\x00\x10" + b"x" * 16)
            return sock.recv(16) == b""
    except (ssl.SSLError, ConnectionError, TimeoutError):
        return True


def test_no_tcp_port_answers_a_plaintext_or_certificateless_client(cluster):
    lc, endpoints = cluster
    for name, address in tcp_ports(lc, endpoints).items():
        host, _, port = address.rpartition(":")

        def plain(host=host, port=port):
            return socket.create_connection((host, int(port)), timeout=5)

        def bare(host=host, port=port):
            raw = socket.create_connection((host, int(port)), timeout=5)
            return no_client_cert(lc).wrap_socket(raw)

        assert _refused(plain), f"{name} answered plaintext"
        assert _refused(bare), f"{name} answered TLS without a client certificate"


def _http_refused(url: str, context: ssl.SSLContext | None) -> bool:
    """Whether an HTTP(S) GET gets no answer at all (an HTTP error status is an answer)."""
    try:
        with urllib.request.urlopen(url, timeout=5, context=context):
            return False
    except urllib.error.HTTPError:
        return False
    except Exception:  # noqa: BLE001 - a failed handshake, a reset, a garbled reply
        return True


def test_no_engine_or_metrics_port_answers_without_a_certificate(cluster):
    lc, endpoints = cluster
    for name, url in http_ports(endpoints).items():
        plain = url.replace("https://", "http://")
        assert _http_refused(plain, None), f"{name} answered plaintext"
        if name == "metrics-gateway":
            continue  # the gateway's port serves tenants: below
        assert _http_refused(url, no_client_cert(lc)), f"{name} answered without a certificate"
        with urllib.request.urlopen(url, timeout=5, context=https(endpoints)) as reply:
            assert reply.status == 200, name  # with a certificate: served
    # The gateway serves tenants over HTTPS with keys; its /metrics wants a certificate.
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(
            endpoints["metrics"]["gateway"], timeout=5, context=no_client_cert(lc)
        )
    assert denied.value.code == 403


def test_an_engine_serves_only_the_gateways_credential(cluster):
    lc, endpoints = cluster
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()
    url = endpoints["engines"][0] + "/v1/completions"
    for auth in (None, "Bearer " + endpoints["api_keys"]["acme"]):
        request = urllib.request.Request(url, data=body, method="POST")
        request.add_header("Content-Type", "application/json")
        if auth:
            request.add_header("Authorization", auth)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5, context=https(endpoints))
        assert refused.value.code == 401


def test_a_wrong_role_is_refused_per_call_and_counted(cluster):
    lc, endpoints = cluster
    identity = common_pb2.Identity(model_id=MODEL, tokenizer_id="builtin-v1", tenant_id="x")
    plan = conductor_pb2.PlanRequest(identity=identity, prompt_tokens=16)
    cases = [
        # (role, address, call)
        ("store", endpoints["conductor"], lambda ch: conductor_pb2_grpc.ConductorStub(ch).Plan(plan, timeout=5)),
        ("operator", endpoints["conductor"], lambda ch: conductor_pb2_grpc.ConductorStub(ch).IngestKvEvents(conductor_pb2.KvEventBatch(), timeout=5)),
        ("gateway", endpoints["stores"][0], lambda ch: store_pb2_grpc.StoreStub(ch).Delete(store_pb2.DeleteRequest(), timeout=5)),
        ("engine", endpoints["stores"][0], lambda ch: list(store_pb2_grpc.StoreStub(ch).Pull(store_pb2.PullRequest(source_data_address="127.0.0.1:1"), timeout=5))),
        ("engine", endpoints["transfer"], lambda ch: list(__import__("quillcache.v1.transfer_pb2_grpc", fromlist=["x"]).TransferStub(ch).Copy(__import__("quillcache.v1.transfer_pb2", fromlist=["x"]).TransferRequest(), timeout=5))),
    ]  # fmt: skip
    for role, address, call in cases:
        with grpc_channel(address, as_role(lc, role), aio=False) as channel:
            with pytest.raises(grpc.RpcError) as denied:
                call(channel)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED, (role, address)
        assert role in denied.value.details()
    conductor = _metric(endpoints, "conductor", "quillcache_rpc_denied_total")
    store = _metric(endpoints, "store-0", "quillcache_rpc_denied_total")
    assert conductor >= 2 and store >= 2, (conductor, store)


def _metric(endpoints, name: str, series: str) -> float:
    with urllib.request.urlopen(
        endpoints["metrics"][name], timeout=5, context=https(endpoints)
    ) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(series + "{"))


def test_a_fake_engine_cannot_register_and_gets_no_prompt(cluster):
    lc, endpoints = cluster
    key = "/quillcache/v1/nodes/engine/fake"
    record = json.dumps(
        {"kind": "engine", "id": "fake", "base_url": "https://127.0.0.1:9", "model": MODEL}
    )
    etcdctl = find_etcd_binary("etcdctl")
    attempts = {
        "plaintext": ["--endpoints", endpoints["etcd"].replace("https://", "http://")],
        "no certificate": ["--endpoints", endpoints["etcd"], "--cacert", str(lc.certs_dir / "ca.pem")],
        "a store's certificate": ["--endpoints", endpoints["etcd"], *lc.etcd.etcdctl_args("store")],
        "the operator's certificate": ["--endpoints", endpoints["etcd"], *lc.etcd.etcdctl_args("operator")],
    }  # fmt: skip
    for what, flags in attempts.items():
        done = subprocess.run(
            [etcdctl, "--command-timeout=3s", "--dial-timeout=2s", *flags, "put", key, record],
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert done.returncode != 0, f"etcd took an engine record with {what}"
    client = openai_client(endpoints, "acme", max_retries=0)
    for n in range(20):
        reply = client.completions.with_raw_response.create(
            model=MODEL, prompt=f"prompt {n} of the probe", max_tokens=1
        )
        assert reply.headers["x-quillcache-engine"] in {"engine-0", "engine-1"}
    with grpc_channel(endpoints["conductor"], as_role(lc, "operator"), aio=False) as channel:
        stats = conductor_pb2_grpc.ConductorStub(channel).Stats(conductor_pb2.StatsRequest())
    assert "fake" not in {e.engine_id for e in stats.engines}


def test_another_tenant_cannot_read_overwrite_delete_or_find_a_tenants_blocks(cluster):
    lc, endpoints = cluster
    client = openai_client(endpoints, "acme", max_retries=0)
    secret_doc = "Acme's confidential launch schedule for the new rocket line. " * 12
    client.completions.create(model=MODEL, prompt=secret_doc, max_tokens=1)
    # Fill the 64-block engine caches so acme's blocks are evicted to the stores.
    for n in range(12):
        client.completions.create(model=MODEL, prompt=f"filler {n} " * 200, max_tokens=1)
    # Globex asking the gateway for acme's document hits nothing (no timing channel).
    other = openai_client(endpoints, "globex", max_retries=0)
    reply = other.completions.with_raw_response.create(model=MODEL, prompt=secret_doc, max_tokens=1)
    assert reply.headers["x-quillcache-hit-blocks"] == "0"
    assert reply.headers["x-quillcache-fetch-blocks"] == "0"
    tokens = BuiltinTokenizer().encode(secret_doc)

    def keys(salt: str):
        return request_blocks(
            tokens, 16, model_id=MODEL, tokenizer_id="builtin-v1", adapter_id=None,
            tenant_id=salt, cache_salt=salt,
        )  # fmt: skip

    # Another tenant (one that sent nothing here, so none of its own blocks can be around).
    acme, other_tenant = keys(salt_of(lc.certs_dir, "acme")), keys(salt_of(lc.certs_dir, "initech"))
    by_name = keys("acme")  # what anyone could compute from the tenant's name
    engine = as_role(lc, "engine")

    async def probe():
        clients = [StoreClient(a, tls=engine) for a in endpoints["stores"]]
        try:
            held = None
            for _ in range(100):  # offloads reach the store asynchronously
                for store in clients:
                    found = await store.exists(acme)
                    if any(found):
                        held = (store, found.index(next(t for t in found if t)))
                        break
                if held:
                    break
                await asyncio.sleep(0.1)
            assert held, "acme's evicted blocks never reached a store"
            store, i = held
            original, _ = await store.get(acme[i])
            # Acting for another tenant (its salt) or from acme's name: nothing is found...
            for other in (other_tenant, by_name):
                assert not any(await store.exists(other))
                with pytest.raises(NotFound):
                    await store.get(other[i])
                assert await store.delete([other[i]]) == 0
                # ...and a put lands under the other identity, never on acme's block.
                await store.put(other[i], b"\x00" * len(original))
            assert (await store.get(acme[i]))[0] == original
            return len(original)
        finally:
            for store in clients:
                await store.close()

    assert asyncio.run(probe()) > 0


def test_clients_that_hang_up_at_random_moments_leave_no_reservation_open(cluster):
    """200 streaming clients of the real gateway leave at random moments (before the
    headers, after them, mid-stream); the conductor's open reservations go back to 0."""
    import random

    import aiohttp

    lc, endpoints = cluster
    rng = random.Random(17)
    url = endpoints["gateway_url"] + "/v1/completions"
    headers = {"Authorization": f"Bearer {endpoints['api_keys']['acme']}"}

    async def one(session: aiohttp.ClientSession, n: int) -> None:
        body = {"model": MODEL, "prompt": f"hang up {n} " * 40, "max_tokens": 64, "stream": True}

        async def call() -> None:
            async with session.post(url, json=body, headers=headers) as reply:
                async for _ in reply.content.iter_any():
                    pass

        task = asyncio.ensure_future(call())
        await asyncio.sleep(rng.uniform(0.0, 0.08))
        task.cancel()
        with contextlib.suppress(BaseException):
            await task

    async def main() -> None:
        connector = aiohttp.TCPConnector(limit=0, ssl=tenant_context(endpoints))
        async with aiohttp.ClientSession(connector=connector) as session:
            await asyncio.gather(*(one(session, n) for n in range(200)))

    asyncio.run(main())
    with grpc_channel(endpoints["conductor"], as_role(lc, "operator"), aio=False) as channel:
        stub = conductor_pb2_grpc.ConductorStub(channel)
        wait_until(
            lambda: stub.Stats(conductor_pb2.StatsRequest(), timeout=5).reservations_open == 0,
            timeout_s=10,
            what="every reservation released",
        )
