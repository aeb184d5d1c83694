"""Who may tell the conductors what the engines and stores hold, on a default local
cluster (two conductors, as `quillcache up` starts).

The engines' KV events (every tenant's token ids and cache salt) go over unix sockets
in a directory only the cluster's user may open, never over TCP, and still reach the
conductors. Over gRPC a batch is taken only from the node it reports for (its own
certificate) and only for a registered node: a batch under one identity for another
engine, from a store for an engine, or for an id the registry does not list is
refused whole, counted, and changes no plan. Each process holds only its own key.
"""

from __future__ import annotations

import asyncio
import os
import stat
import urllib.request
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from prometheus_client.parser import text_string_to_metric_families

from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.registry import open_registry
from quillcache_core.security.certs import ROLE_SECRETS, make_instance_credentials
from quillcache_core.security.credentials import SERVICE_ROLES, operator_tls
from quillcache_core.security.tls import Tls, grpc_channel
from tests.support.cluster import https, openai_client
from tests.support.services import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "sim-model"
PROMPT = list(range(300, 300 + 160))  # 10 blocks of 16 tokens


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    lc = LocalCluster(tmp_path_factory.mktemp("ev"), conductors=2, log=lambda *_: None)
    endpoints = lc.start(timeout_s=120)
    try:
        yield lc, endpoints
    finally:
        lc.stop()


def own_tls(lc: LocalCluster, name: str) -> Tls:
    """The credentials `quillcache up` gave process `name`."""
    child = next(c for c in lc.children if c.name == name)
    return Tls.from_dir(child.argv[child.argv.index("--tls-dir") + 1], SERVICE_ROLES[child.service])


def repeat_prompt(endpoints) -> tuple[str, int]:
    """Send the prompt until a repeat hits; returns (engine, hit blocks)."""
    client = openai_client(endpoints, max_retries=0)

    def hits():
        reply = client.completions.with_raw_response.create(
            model=MODEL, prompt=PROMPT, max_tokens=2
        )
        engine, hit = (
            reply.headers["x-quillcache-engine"],
            int(reply.headers["x-quillcache-hit-blocks"]),
        )
        return (engine, hit) if hit >= 10 else None

    return wait_until(hits, timeout_s=30, interval_s=0.2, what="a repeated prompt to hit")


def resident(endpoints, engine: str) -> list[int]:
    """The engine's resident blocks on each conductor."""
    out = []
    for address in endpoints["conductors"]:
        stats = conductor_stats(endpoints, address)
        out.append(next(e.resident_blocks for e in stats.engines if e.engine_id == engine))
    return out


def conductor_stats(endpoints, address: str) -> conductor_pb2.StatsResponse:
    with grpc_channel(address, operator_tls(endpoints), aio=False) as channel:
        return conductor_pb2_grpc.ConductorStub(channel).Stats(conductor_pb2.StatsRequest())


async def engine_records(endpoints) -> list:
    registry = open_registry(endpoints["etcd"], operator_tls(endpoints))
    try:
        return await registry.list("engine")
    finally:
        await registry.close()


def clear(node: str, source: str = "engine") -> conductor_pb2.KvEventBatch:
    batch = conductor_pb2.KvEventBatch(engine_id=node, source_kind=source)
    batch.events.add().cleared.CopyFrom(conductor_pb2.AllBlocksCleared())
    return batch


def ingest(endpoints, tls: Tls, batch) -> list[grpc.StatusCode]:
    """The batch sent to every conductor under `tls`; each call's status."""
    codes = []
    for address in endpoints["conductors"]:
        with grpc_channel(address, tls, aio=False) as channel:
            try:
                conductor_pb2_grpc.ConductorStub(channel).IngestKvEvents(batch, timeout=10)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
    return codes


def refused(endpoints, source: str, reason: str) -> float:
    """kv_event_batches_refused_total{source,reason} summed over the conductors."""
    total = 0.0
    for name in ("conductor", "conductor-1"):
        url = endpoints["metrics"][name]
        with urllib.request.urlopen(url, timeout=5, context=https(endpoints)) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "quillcache_kv_event_batches_refused_total" and sample.labels == {
                    "source": source,
                    "reason": reason,
                }:
                    total += sample.value
    return total


def listening_tcp_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (/proc/net/tcp{,6} by socket inode)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_engine_event_sockets_are_unix_sockets_in_a_private_directory(cluster):
    lc, endpoints = cluster
    records = asyncio.run(engine_records(endpoints))
    assert len(records) == 2
    sockets = lc.data_dir / "ipc"
    for record in records:
        for endpoint in (record.kv_events_endpoint, record.kv_replay_endpoint):
            assert endpoint.startswith(f"ipc://{sockets}/"), endpoint
            assert stat.S_ISSOCK(Path(endpoint.removeprefix("ipc://")).stat().st_mode)
    assert stat.S_IMODE(sockets.stat().st_mode) == 0o700
    for child in (c for c in lc.children if c.service == "sim-engine"):
        http_port = int(child.fields["http"].rsplit(":", 1)[1])
        assert listening_tcp_ports(child.proc.pid) == {http_port}, child.name


def test_a_repeated_prompt_hits_with_events_over_unix_sockets(cluster):
    _, endpoints = cluster
    engine, hit = repeat_prompt(endpoints)
    assert hit == 10
    wait_until(lambda: min(resident(endpoints, engine)) >= 10, what="both conductors indexing")


def test_an_engine_cannot_report_for_another_engine(cluster):
    lc, endpoints = cluster
    engine, _ = repeat_prompt(endpoints)
    other = "engine-1" if engine == "engine-0" else "engine-0"
    before = resident(endpoints, engine)
    codes = ingest(endpoints, own_tls(lc, other), clear(engine))
    assert codes == [grpc.StatusCode.PERMISSION_DENIED] * 2
    assert resident(endpoints, engine) == before
    assert repeat_prompt(endpoints) == (engine, 10)


def test_a_store_cannot_erase_engine_records(cluster):
    lc, endpoints = cluster
    engine, _ = repeat_prompt(endpoints)
    before = resident(endpoints, engine)
    denied, missing = [grpc.StatusCode.PERMISSION_DENIED] * 2, [grpc.StatusCode.NOT_FOUND] * 2
    store_0 = own_tls(lc, "store-0")
    role_wide = Tls.from_dir(lc.certs_dir, "store")  # `quillcache certs`' one per role
    for tls in (store_0, role_wide):
        assert ingest(endpoints, tls, clear(engine)) == denied
    # As a store's residency: store-0 speaks for itself only, and no store has that id.
    assert ingest(endpoints, store_0, clear(engine, "store")) == denied
    assert ingest(endpoints, store_0, clear("store-1", "store")) == denied
    assert ingest(endpoints, role_wide, clear(engine, "store")) == missing
    assert refused(endpoints, "engine", "role") >= 4
    assert resident(endpoints, engine) == before
    assert repeat_prompt(endpoints) == (engine, 10)


def test_a_batch_for_an_unregistered_engine_is_refused_and_counted(cluster, tmp_path):
    lc, endpoints = cluster
    engine, _ = repeat_prompt(endpoints)
    before = refused(endpoints, "engine", "unregistered")
    # Even a certificate of the cluster's CA naming the ghost itself.
    ghost = make_instance_credentials(lc.certs_dir, tmp_path / "ghost", "engine", "ghost-7")
    batch = clear("ghost-7")
    batch.identity.model_id = MODEL
    stored = batch.events.add().stored
    stored.block_hashes[:] = ["1"]
    stored.token_ids[:] = list(range(16))
    stored.block_size = 16
    assert (
        ingest(endpoints, Tls.from_dir(ghost, "engine"), batch) == [grpc.StatusCode.NOT_FOUND] * 2
    )
    assert refused(endpoints, "engine", "unregistered") == before + 2
    for address in endpoints["conductors"]:
        engines = conductor_stats(endpoints, address).engines
        assert sorted(e.engine_id for e in engines) == ["engine-0", "engine-1"]
    assert repeat_prompt(endpoints) == (engine, 10)


def test_each_process_holds_only_its_own_key_and_the_ca_certificate(cluster):
    lc, _ = cluster
    children = [c for c in lc.children if c.service in SERVICE_ROLES]
    assert len(children) == 8  # 2 conductors, 2 stores, transfer, 2 engines, gateway
    for child in children:
        role = SERVICE_ROLES[child.service]
        tls = own_tls(lc, child.name)
        assert stat.S_IMODE(tls.directory.stat().st_mode) == 0o700
        assert tls.directory != lc.certs_dir
        files = sorted(p.name for p in tls.directory.iterdir())
        assert files == sorted(
            ["ca.pem", f"{role}.pem", f"{role}-key.pem", *ROLE_SECRETS.get(role, ())]
        )
        cert = x509.load_pem_x509_certificate(tls.cert.read_bytes())
        assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == role
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        named = "--node-id" in child.argv
        instance = child.argv[child.argv.index("--node-id") + 1] if named else child.name
        assert uris.get_values_for_type(x509.UniformResourceIdentifier) == [
            f"quillcache://{role}/{instance}"
        ]
