"""The KV connector's pool client (`quillcache_vllm.pool`, what runs inside vLLM) against
real store processes: a step's saves go to the node's block-data port as one batch and
its loads as one request, byte-identical; a block only a peer node holds is still
loaded (gRPC Get with allow_remote); a node without a data port is used over gRPC."""

from __future__ import annotations

import urllib.request

import pytest

from quillcache_core.launch.vllm_engine import free_port
from quillcache_core.model import CacheTier
from quillcache_core.storeclient.client import StoreClient
from quillcache_vllm.pool import Pool
from tests.support import stores
from tests.support.services import wait_until
from tests.support.stores import SHAPES, block_key, kv_payload, locate, run
from tests.support.tls import client_context, tls

pytestmark = pytest.mark.integration


@pytest.fixture
def lone_store(tmp_path):
    with stores.lone_store(tmp_path) as store:
        yield store


@pytest.mark.parametrize("path", ["socket", "data", "grpc"])
def test_saves_and_loads_of_a_step_are_one_batch_on_the_data_port(fleet, path):
    """`socket`: the node's Unix socket (this host, no TLS); `data`: its TLS data port
    (as from another host); `grpc`: a node without a data port."""
    conductor = fleet.conductor()
    a = fleet.store("store-a", *(["--data-port", "-1"] if path == "grpc" else []))
    b = fleet.store("store-b")
    fleet.transfer()
    keys = [block_key(i, chain="step") for i in range(24)]
    payloads = [kv_payload(300 + i, SHAPES["0.5MiB"]) for i in range(24)]
    peer_key = block_key(0, chain="peer")
    peer_payload = kv_payload(999, SHAPES["0.5MiB"])

    async def put_on_b(client: StoreClient):
        await client.put(peer_key, peer_payload)

    run(_with(b.grpc_address, put_on_b))
    pool = Pool(a.grpc_address, tls=tls("engine"), local_sockets=path == "socket")
    try:
        assert pool.save_later(list(zip(keys, payloads, strict=True))) == 24
        assert pool.flush(20.0)
        assert pool.counters.blocks_saved == 24
        assert pool.counters.blocks_save_dropped == 0
        if path != "grpc":
            assert a.metric("quillcache_store_data_put_blocks_total") == 24
            local = a.metric("quillcache_store_data_local_connections_total")
            assert (local > 0) == (path == "socket")
        else:
            assert _puts(a) == 24  # one gRPC Put each
        # the store holds them, byte for byte, as any other client reads them
        assert run(_with(a.grpc_address, lambda c: _get_all(c, keys))) == payloads
        wait_until(
            lambda: locate(conductor, peer_key) == [("store-b", CacheTier.CPU_DRAM)],
            timeout_s=10,
            what="the peer's block indexed on store-b",
        )
        absent = block_key(0, chain="nowhere")
        found = pool.get_many([*keys, peer_key, absent])
        assert found[:24] == payloads
        assert found[24] == peer_payload  # fetched from store-b through store-a
        assert found[25] is None
        assert pool.counters.blocks_loaded == 25
        assert pool.counters.blocks_load_failed == 1
        assert pool.leading_held_later([*keys[:3], absent, keys[3]]).result(10) == 3
        assert pool.leading_held_later([*keys[:5], absent]).result(10) == 5
        assert pool.counters.lookups == 2 and pool.counters.lookup_seconds > 0
    finally:
        pool.close()
    # one save batch and one load request on the data port, or none without one
    assert pool.counters.data_port_batches == (0 if path == "grpc" else 2)
    assert pool.counters.blocks_loaded_from_peers == 0  # no plan named the peer
    assert a.metric("quillcache_store_peer_fetches_total") == 1


def test_the_blocks_a_plan_names_on_a_peer_come_from_its_data_port(fleet):
    """The plan says which node holds a block: it is read from that node's data port
    in one request, and the engine's own node fetches nothing for it."""
    fleet.conductor()
    a = fleet.store("store-a")
    b = fleet.store("store-b")
    fleet.transfer()
    keys = [block_key(i, chain="doc") for i in range(12)]
    payloads = [kv_payload(500 + i, SHAPES["0.5MiB"]) for i in range(12)]

    async def put_on_b(client: StoreClient):
        for key, payload in zip(keys, payloads, strict=True):
            await client.put(key, payload)

    run(_with(b.grpc_address, put_on_b))
    pool = Pool(a.grpc_address, tls=tls("engine"))
    try:
        sources = {k.block_hash: b.grpc_address for k in keys}
        assert pool.get_many(keys, sources) == payloads
        assert pool.counters.blocks_loaded_from_peers == 12
        assert pool.counters.data_port_batches == 2  # store-a's (nothing), store-b's
        # a plan naming a node that does not answer: the blocks come the other way
        dead = {k.block_hash: f"127.0.0.1:{free_port()}" for k in keys[:2]}
        assert pool.get_many(keys[:2], dead) == payloads[:2]
    finally:
        pool.close()
    # 12 read by the pool itself, then the dead plan's 2 pulled by store-a
    assert b.metric("quillcache_store_data_sent_blocks_total") == 14
    assert a.metric("quillcache_store_peer_fetches_total") == 2


def _puts(store) -> float:
    """Blocks the store took by gRPC Put, every landing tier summed."""
    with urllib.request.urlopen(
        store.metrics_url + "/metrics", timeout=5, context=client_context("operator")
    ) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith("quillcache_store_puts_total{"))


async def _with(address: str, fn):
    async with StoreClient(address, tls=tls("engine")) as client:
        return await fn(client)


async def _get_all(client: StoreClient, keys) -> list[bytes]:
    return [(await client.get(k))[0] for k in keys]


def test_a_data_port_that_fails_loses_no_save_and_no_load(lone_store):
    """The port named but dead (the node's data listener gone): every block of the
    batch goes over gRPC instead, and loads are served over gRPC."""
    keys = [block_key(i, chain="dead") for i in range(6)]
    payloads = [kv_payload(40 + i, SHAPES["0.5MiB"]) for i in range(6)]
    pool = Pool(lone_store.grpc_address, tls=tls("engine"))
    dead = f"127.0.0.1:{free_port()}"
    pool._ports[pool.store_address] = (dead, float("inf"))  # as if the port had closed
    try:
        assert pool.save_later(list(zip(keys, payloads, strict=True))) == 6
        assert pool.flush(20.0)
        assert pool.counters.blocks_saved == 6 and pool.counters.blocks_save_dropped == 0
        assert _puts(lone_store) == 6
        assert pool.get_many(keys) == payloads
        assert pool.counters.blocks_load_failed == 0
    finally:
        pool.close()


def test_a_lookup_at_an_unreachable_store_node_counts_nothing_held(tmp_path):
    """The scheduler's lookup when the node is down: 0 held (the request computes)."""
    pool = Pool(f"127.0.0.1:{free_port()}", timeout_s=2.0, tls=tls("engine"))
    try:
        assert pool.leading_held_later([block_key(0, chain="down")]).result(10) == 0
        assert pool.leading_held_later([block_key(1, chain="down")]).result(10) == 0
        assert pool.counters.lookups == 2
    finally:
        pool.close()


def test_another_user_cannot_use_a_nodes_data_socket(lone_store):
    """The Unix socket carries no TLS: only a process of the store's own user gets in
    (the socket file is the owner's; the node checks the peer's credentials too)."""
    import os
    import socket
    import stat

    path = run(_with(lone_store.grpc_address, lambda c: c.stats()))["data_socket"]
    assert path and stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    if os.getuid() != 0:
        pytest.skip("switching to another user needs root")
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # as nobody: connect and report the outcome
        code = b"?"
        try:
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            try:
                sock.connect(path)
                code = b"connected"
            except PermissionError:
                code = b"denied"
        finally:
            os.write(write, code)
            os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    assert os.read(read, 64) == b"denied"


def test_a_node_without_a_data_socket_is_loaded_over_its_tls_port(tmp_path):
    """`--data-socket off`: Stats names no socket, and the pool uses the TLS data port."""
    with stores.lone_store(tmp_path, "--data-socket", "off") as store:
        assert run(_with(store.grpc_address, lambda c: c.stats()))["data_socket"] == ""
        pool = Pool(store.grpc_address, tls=tls("engine"))
        try:
            keys = [block_key(i, chain="tls") for i in range(4)]
            payloads = [kv_payload(700 + i, SHAPES["0.5MiB"]) for i in range(4)]
            assert pool.save_later(list(zip(keys, payloads, strict=True))) == 4
            assert pool.flush(20.0)
            assert pool.get_many(keys) == payloads
        finally:
            pool.close()
        assert store.metric("quillcache_store_data_local_connections_total") == 0
        assert store.metric("quillcache_store_data_put_blocks_total") == 4
