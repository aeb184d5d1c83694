"""Puts through a real store process's block-data port (raw TCP): the bytes land
byte-identical in the tier asked for, a durable put survives SIGKILL once
acknowledged, bad bytes are refused with the stream kept in step, a malformed put
closes the connection, and the store registers its data port as a record field."""

from __future__ import annotations

import asyncio
import socket
import ssl

import pytest

from quillcache_core.errors import Corrupt, InvalidArgument, NotFound
from quillcache_core.model import CacheTier
from quillcache_core.registry import EtcdRegistry
from quillcache_core.storeclient.blockcodec import payload_checksum
from quillcache_core.storeclient.client import StoreClient
from quillcache_core.storeclient.datapath import protocol as dataproto
from quillcache_core.storeclient.datapath.sockets import recv_exactly
from tests.support import stores
from tests.support.services import wait_until
from tests.support.stores import MIB, SHAPES, block_key, kv_payload, run
from tests.support.tls import client_context, tls

pytestmark = pytest.mark.integration


@pytest.fixture
def lone_store(tmp_path):
    """A store with an in-memory registry: no etcd, no conductor."""
    with stores.lone_store(tmp_path, "--max-block-bytes", str(4 * MIB)) as store:
        yield store


def _data_address(proc) -> str:
    async def ask():
        async with StoreClient(proc.grpc_address, tls=tls("engine")) as client:
            return (await client.stats())["data_address"]

    address = run(ask())
    assert address == proc.fields["data"]
    return address


def closed(sock) -> bool:
    """Whether the peer closed the (TLS) connection: end of stream or a reset."""
    try:
        return sock.recv(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True


def _ack(sock: socket.socket) -> tuple[dataproto.BlockHeader, str]:
    head = memoryview(bytearray(dataproto.BLOCK_HEADER.size))
    assert recv_exactly(sock, head) == head.nbytes
    ack = dataproto.decode_ack(head)
    text = memoryview(bytearray(ack.message_len))
    assert recv_exactly(sock, text) == ack.message_len
    return ack, bytes(text).decode()


def test_data_port_puts_land_byte_identical_in_the_tier_asked_for(lone_store):
    data = _data_address(lone_store)
    payloads = [kv_payload(900 + i, SHAPES["0.5MiB"]) for i in range(6)]
    keys = [block_key(i, chain="push") for i in range(6)]

    async def scenario():
        async with (
            StoreClient(lone_store.grpc_address, data_address=data, tls=tls("engine")) as pusher,
            StoreClient(lone_store.grpc_address, tls=tls("engine")) as reader,
        ):
            landed = [
                await pusher.put(keys[0], payloads[0]),
                await pusher.put(keys[1], payloads[1], durable=True),
                await pusher.put(keys[2], payloads[2], tier=CacheTier.LOCAL_SSD),
            ]
            # Concurrent durable puts, one connection each, share SSD commits.
            landed += await asyncio.gather(
                *(pusher.put(keys[i], payloads[i], durable=True) for i in range(3, 6))
            )
            tiers = await reader.exists(keys)
            back = [(await reader.get(k))[0] for k in keys]
            with pytest.raises(InvalidArgument):  # over --max-block-bytes: refused
                await pusher.put(block_key(99, chain="push"), bytes(5 * MIB))
            again = await pusher.put(keys[0], payloads[0])  # a fresh connection
            return landed, tiers, back, again, await reader.stats()

    landed, tiers, back, again, stats = run(scenario())
    assert landed[2] is CacheTier.LOCAL_SSD and tiers[2] is CacheTier.LOCAL_SSD
    assert all(t is CacheTier.CPU_DRAM for i, t in enumerate(landed) if i != 2)
    assert back == payloads
    assert again is CacheTier.CPU_DRAM
    assert stats["ssd_blocks"] == 5  # the durable ones and the SSD one
    assert lone_store.metric("quillcache_store_data_put_blocks_total") == 7
    assert lone_store.metric("quillcache_store_data_put_bytes_total") == 7 * len(payloads[0])
    assert lone_store.metric("quillcache_store_data_puts_refused_total") == 1


def test_acknowledged_data_port_durable_puts_survive_sigkill(lone_store):
    data = _data_address(lone_store)
    keys = [block_key(i, chain="pushdur") for i in range(12)]
    payloads = [kv_payload(300 + i, SHAPES["0.5MiB"]) for i in range(12)]

    async def write():
        async with StoreClient(
            lone_store.grpc_address, data_address=data, tls=tls("engine")
        ) as client:
            await asyncio.gather(
                *(client.put(k, p, durable=True) for k, p in zip(keys, payloads, strict=True))
            )

    run(write())
    lone_store.kill()  # SIGKILL: nothing flushed on the way out
    lone_store.start()

    async def read():
        async with StoreClient(lone_store.grpc_address, tls=tls("engine")) as client:
            return [(await client.get(k))[0] for k in keys]

    assert run(read()) == payloads


def test_bad_bytes_are_refused_and_a_malformed_put_closes_the_connection(lone_store):
    host, _, port = _data_address(lone_store).rpartition(":")
    good, bad = kv_payload(41, SHAPES["0.5MiB"]), kv_payload(42, SHAPES["0.5MiB"])
    k_bad, k_good = block_key(1, chain="raw"), block_key(2, chain="raw")
    raw = socket.create_connection((host, int(port)), timeout=10)
    with client_context("engine").wrap_socket(raw) as sock:
        # Bytes that do not match the checksum sent: DATA_LOSS, nothing stored...
        wrong = payload_checksum(bad) ^ 1
        sock.sendall(
            dataproto.encode_put(k_bad, len(bad), wrong, tier=CacheTier.CPU_DRAM, durable=True)
            + bad
        )
        ack, message = _ack(sock)
        assert ack.status == dataproto.STATUS_DATA_LOSS and "checksum" in message
        # ...and the connection goes on with the next put.
        checksum = payload_checksum(good)
        sock.sendall(
            dataproto.encode_put(
                k_good, len(good), checksum, tier=CacheTier.CPU_DRAM, durable=False
            )
            + good
        )
        ack, _ = _ack(sock)
        assert ack.status == dataproto.STATUS_OK and ack.tier is CacheTier.CPU_DRAM
        assert (ack.payload_len, ack.checksum) == (len(good), checksum)
        # An unknown tier code: answered, then the connection is closed.
        header = bytearray(
            dataproto.encode_put(
                k_good, len(good), checksum, tier=CacheTier.CPU_DRAM, durable=False
            )
        )
        header[dataproto.REQUEST_HEADER.size] = 9
        sock.sendall(bytes(header))
        ack, message = _ack(sock)
        assert ack.status == dataproto.STATUS_INVALID_ARGUMENT and "tier" in message
        assert closed(sock)

    async def read():
        async with StoreClient(lone_store.grpc_address, tls=tls("engine")) as client:
            with pytest.raises(NotFound):
                await client.get(k_bad)
            return (await client.get(k_good))[0]

    assert run(read()) == good
    assert lone_store.metric("quillcache_store_data_puts_refused_total") == 2
    assert lone_store.metric("quillcache_store_data_put_blocks_total") == 1


def test_a_batch_of_puts_gets_its_acks_in_order_in_a_few_writes(lone_store):
    """100 puts sent back to back on one connection, one with bytes that do not match
    its checksum, then a get: every put is answered in its place (the bad one
    DATA_LOSS), the get after them, and the acks went out in a few writes, not one a
    put."""
    host, _, port = _data_address(lone_store).rpartition(":")
    payloads = [bytes([i]) * 1024 for i in range(100)]
    keys = [block_key(i, chain="acks") for i in range(100)]
    frames = []
    for i, (key, payload) in enumerate(zip(keys, payloads, strict=True)):
        checksum = payload_checksum(payload) ^ (1 if i == 57 else 0)
        frames.append(
            dataproto.encode_put(
                key, len(payload), checksum, tier=CacheTier.CPU_DRAM, durable=False
            )
            + payload
        )
    before = lone_store.metric("quillcache_store_data_put_ack_writes_total")
    raw = socket.create_connection((host, int(port)), timeout=10)
    with client_context("engine").wrap_socket(raw) as sock:
        sock.sendall(b"".join(frames) + dataproto.encode_request([keys[3]]))
        acks = [_ack(sock)[0] for _ in keys]
        head = memoryview(bytearray(dataproto.BLOCK_HEADER.size))
        assert recv_exactly(sock, head) == head.nbytes
        block = dataproto.decode_block_header(head, 4 * MIB)
        got = memoryview(bytearray(block.payload_len))
        assert recv_exactly(sock, got) == block.payload_len
    assert [a.status for a in acks] == [
        dataproto.STATUS_DATA_LOSS if i == 57 else dataproto.STATUS_OK for i in range(100)
    ]
    ok = [(a, p) for a, p in zip(acks, payloads, strict=True) if a.status == dataproto.STATUS_OK]
    assert all(a.checksum == payload_checksum(p) for a, p in ok)
    assert bytes(got) == payloads[3]
    writes = lone_store.metric("quillcache_store_data_put_ack_writes_total") - before
    assert 2 <= writes <= 10, writes  # at most ACKS_PER_WRITE (64) acks a write


def test_a_changed_payload_is_refused_through_the_client(lone_store):
    """The client's checksum travels with the put: a payload that differs from it (here
    a buffer changed between checksum and send, as a racing writer would) is refused."""
    data = _data_address(lone_store)
    from quillcache_core.storeclient.datapath.put import BlockPusher

    payload = bytearray(kv_payload(7, SHAPES["0.5MiB"]))
    checksum = payload_checksum(payload)
    payload[100] ^= 0xFF
    pusher = BlockPusher(io_timeout_s=10, tls=tls("engine"))
    try:
        with pytest.raises(Corrupt):
            pusher.put(data, block_key(7, chain="chg"), payload, checksum=checksum)
        # The connection stayed usable and was kept.
        assert pusher.put(data, block_key(8, chain="chg"), payload) is CacheTier.CPU_DRAM
    finally:
        pusher.close()


def test_the_store_registers_its_data_port_as_a_record_field(fleet):
    store = fleet.store("store-r")

    async def record():
        async with EtcdRegistry(
            [fleet.etcd.endpoint], timeout_s=3, tls=tls("operator")
        ) as registry:
            return await registry.get("store", "store-r")

    rec = run(record())
    assert rec is not None
    assert rec.data_address == store.fields["data"]
    assert "data_address" not in rec.extra


def test_the_data_port_serves_only_stores_transfer_and_engines(lone_store):
    """Plaintext, TLS without a client certificate, and a certificate of a role that
    moves no blocks (gateway, operator) get nothing, and each is counted."""
    host, _, port = _data_address(lone_store).rpartition(":")
    put = (
        dataproto.encode_put(
            block_key(9, chain="who"), 4, 0, tier=CacheTier.CPU_DRAM, durable=False
        )
        + b"abcd"
    )
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(put)
        assert closed(sock), "a plaintext client got an answer"
    bare = ssl.create_default_context(cafile=str(tls("engine").ca))
    bare.check_hostname = False
    for role in (None, "gateway", "operator"):
        raw = socket.create_connection((host, int(port)), timeout=10)
        context = bare if role is None else client_context(role)
        try:
            with context.wrap_socket(raw) as sock:
                sock.sendall(put)
                assert closed(sock), f"{role} got an answer"
        except (ssl.SSLError, ConnectionError):
            pass  # refused in the handshake
    wait_until(
        lambda: lone_store.metric("quillcache_store_data_connections_refused_total") == 4,
        what="four refused connections",
    )
    assert lone_store.metric("quillcache_store_data_put_blocks_total") == 0


def test_a_store_started_with_dram_prefault_takes_its_memory_and_stores_into_it(tmp_path):
    """`--dram-prefault`: the node's DRAM capacity (32 MiB here) is touched after it
    starts, and blocks put on the data port are stored in that memory, intact."""
    with stores.lone_store(tmp_path, "--dram-prefault") as store:
        touched = 'quillcache_store_dram_prefault_bytes{state="touched"}'
        carved = 'quillcache_store_dram_prefault_bytes{state="carved"}'
        wait_until(lambda: store.metric(touched) == 32 * MIB, what="32 MiB touched")
        assert store.metric(carved) == 0
        data = _data_address(store)
        payloads = [kv_payload(700 + i, SHAPES["0.5MiB"]) for i in range(4)]
        keys = [block_key(i, chain="prefault") for i in range(4)]

        async def scenario():
            async with StoreClient(store.grpc_address, data_address=data, tls=tls("engine")) as c:
                for k, p in zip(keys, payloads, strict=True):
                    await c.put(k, p)
                return [(await c.get(k))[0] for k in keys]

        assert run(scenario()) == payloads
        assert store.metric(carved) == sum(len(p) for p in payloads)  # 0.5 MiB: its own class
