"""What an attacker on the store's host tries against a real store process: a key too
large for the SSD tier, connections to the block-data port that never authenticate,
and peers that go silent mid-exchange. A bad key is refused (INVALID_ARGUMENT) and
stores nothing, so the store goes on demoting; unauthenticated connections keep no
allowed peer out and are closed after the handshake deadline; every read on the data
path has a deadline, on the store's side and on its clients'."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from quillcache_core.errors import InvalidArgument
from quillcache_core.storeclient.blockcodec import MAX_KEY_FIELD_BYTES
from quillcache_core.storeclient.client import StoreClient
from quillcache_core.storeclient.datapath import protocol as dataproto
from quillcache_core.storeclient.datapath.batch import BlockBatches
from tests.support import stores
from tests.support.services import wait_until
from tests.support.stores import SHAPES, block_key, kv_payload, run
from tests.support.tls import tls

pytestmark = pytest.mark.integration

IO_TIMEOUT_S = 2.0  # the store's --rpc-timeout-s: its deadline of one data-port read
HANDSHAKE_TIMEOUT_S = 1.0


@pytest.fixture
def store(tmp_path):
    with stores.lone_store(tmp_path, "--rpc-timeout-s", str(IO_TIMEOUT_S)) as proc:
        yield proc


@pytest.fixture
def impatient_store(tmp_path):
    """A store that gives a new data-port connection 1 s to finish its TLS handshake."""
    with stores.lone_store(
        tmp_path, "--data-handshake-timeout-s", str(HANDSHAKE_TIMEOUT_S)
    ) as proc:
        yield proc


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _closed_within(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the peer closes `sock` (end of stream or a reset) within `timeout_s`."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def test_a_key_too_large_for_the_ssd_tier_is_refused_and_the_store_keeps_demoting(store):
    """A 1 MiB model id is refused at every door (gRPC Put, Get, Exists, Delete, Pull;
    a put on the data port), nothing is stored, and 50 MiB of ordinary puts into 32 MiB
    of DRAM all land, the oldest demoted to SSD."""
    payload = kv_payload(1, SHAPES["0.5MiB"])
    huge = block_key(0, chain="huge")._replace(model_id="m" * (1 << 20))
    long_tenant = block_key(0, chain="long")._replace(tenant_id="t" * (MAX_KEY_FIELD_BYTES + 1))
    data = store.fields["data"]

    async def scenario():
        async with (
            StoreClient(store.grpc_address, tls=tls("engine")) as engine,
            StoreClient(store.grpc_address, data_address=data, tls=tls("engine")) as pusher,
            StoreClient(store.grpc_address, tls=tls("transfer")) as transfer,
        ):
            for attempt in (
                engine.put(huge, payload),
                engine.put(long_tenant, payload),
                pusher.put(long_tenant, payload),
                engine.get(huge),
                engine.exists([huge]),
                engine.delete([huge]),
            ):
                with pytest.raises(InvalidArgument, match="longer than the limit"):
                    await attempt
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in transfer.open_pull("peer", "127.0.0.1:1", [huge]):
                    pass
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert (await engine.stats())["dram_blocks"] == 0
            keys = [block_key(i, chain="after") for i in range(100)]
            for key in keys:
                await engine.put(key, payload)
            stats = await engine.stats()
            assert stats["demotions"] > 0 and stats["ssd_blocks"] > 0
            assert (await engine.get(keys[0]))[0] == payload  # demoted, still served
            assert (await engine.get(keys[-1]))[0] == payload

    run(scenario())


def test_idle_plain_connections_do_not_keep_an_allowed_peer_off_the_data_port(store):
    """80 plain TCP connections that never start TLS (more than the port's 64 slots)
    sit open, within the store's 5 s handshake deadline, while an engine loads a block
    over the data port on a new connection, five times over."""
    payload = kv_payload(2, SHAPES["0.5MiB"])
    key = block_key(0, chain="slots")

    async def put():
        async with StoreClient(store.grpc_address, tls=tls("engine")) as client:
            await client.put(key, payload)

    run(put())
    address = store.fields["data"]
    with contextlib.ExitStack() as idle:
        for _ in range(80):
            idle.enter_context(socket.create_connection(_host_port(address), timeout=5))
        for _ in range(5):
            batches = BlockBatches(io_timeout_s=5.0, tls=tls("engine"))
            try:
                assert batches.get_many(address, [key]) == [payload]
            finally:
                batches.close()


def test_a_connection_that_does_not_finish_its_handshake_is_closed_and_counted(
    impatient_store,
):
    host, port = _host_port(impatient_store.fields["data"])
    refused = "quillcache_store_data_connections_refused_total"
    before = impatient_store.metric(refused)
    with socket.create_connection((host, port), timeout=5) as sock:
        started = time.monotonic()
        assert _closed_within(sock, 10.0), "an idle connection was kept past its deadline"
        assert time.monotonic() - started < HANDSHAKE_TIMEOUT_S + 3.0
    wait_until(
        lambda: impatient_store.metric(refused) == before + 1,
        what="the timed-out handshake counted as refused",
    )


def test_the_data_port_closes_an_engine_that_stops_inside_a_request(store):
    """An authenticated engine that sends part of a request header and then nothing
    is dropped after the store's read deadline, freeing its slot."""
    raw = socket.create_connection(_host_port(store.fields["data"]), timeout=5)
    with tls("engine").client_context().wrap_socket(raw) as sock:
        sock.sendall(dataproto.encode_request([block_key(0)])[:4])
        started = time.monotonic()
        assert _closed_within(sock, 15.0), "the store kept waiting for the rest"
        assert time.monotonic() - started < IO_TIMEOUT_S + 5.0


@contextlib.contextmanager
def silent_peer() -> Iterator[str]:
    """A data port, with a store's certificate, that completes the TLS handshake of
    every connection and then neither reads nor writes; its address."""
    context = tls("store").server_context()
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                conn.settimeout(5)
                held.append(context.wrap_socket(conn, server_side=True))
            except (OSError, ssl.SSLError):
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()
        for conn in held:  # ends a read still waiting on them
            conn.close()


def _within(fn, timeout_s: float):
    """fn()'s result, or AssertionError if it has not returned after `timeout_s`."""
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert outcome, f"still waiting after {timeout_s:g}s"
    return outcome[0]


def test_a_pull_from_a_peer_that_goes_silent_fails_within_its_deadline(store):
    """The store pulls (Store.Pull, for transfer) from a peer that accepted and went
    silent: the block fails as UNAVAILABLE after the store's read deadline, not when
    the caller's gRPC deadline runs out."""
    key = block_key(0, chain="silent")

    async def pull(address: str):
        async with StoreClient(store.grpc_address, tls=tls("transfer")) as client:
            started = time.monotonic()
            results = [
                r
                async for batch in client.open_pull("peer", address, [key], timeout_s=30)
                for r in batch
            ]
            return results, time.monotonic() - started

    with silent_peer() as address:
        results, elapsed = run(pull(address))
    assert [(r.ok, r.code, r.source_failed) for r in results] == [(False, "UNAVAILABLE", True)]
    assert elapsed < IO_TIMEOUT_S + 5.0


def test_an_engine_load_from_a_silent_peer_gives_up_within_its_deadline():
    """An engine's batch load from a data port that goes silent returns "not held"
    after its own deadline (the engine then recomputes), instead of waiting for ever."""
    batches = BlockBatches(io_timeout_s=1.0, tls=tls("engine"))
    try:
        with silent_peer() as address:
            started = time.monotonic()
            assert _within(lambda: batches.get_many(address, [block_key(0)]), 15.0) == [None]
            assert time.monotonic() - started < 5.0
    finally:
        batches.close()
