"""The block data path between real store processes: bytes move store to store over
the sources' raw TCP data ports, are verified against the source's checksum, and a
source that fails mid-block leaves nothing half-written at the destination."""

from __future__ import annotations

import socket
import threading

import pytest

from quillcache.v1 import store_pb2, store_pb2_grpc, transfer_pb2, transfer_pb2_grpc
from quillcache_core.model import CacheTier
from quillcache_core.storeclient import wire
from quillcache_core.storeclient.blockcodec import payload_checksum
from quillcache_core.storeclient.client import StoreClient
from quillcache_core.storeclient.datapath import protocol as dataproto
from quillcache_core.storeclient.datapath.sockets import recv_exactly
from quillcache_core.wire.tiers import tier_to_proto
from tests.support.stores import SHAPES, block_key, kv_payload, run
from tests.support.tls import tls

pytestmark = pytest.mark.integration


async def _pull(address: str, source: str, keys):
    async with StoreClient(address, tls=tls("transfer")) as client:  # only transfer pulls
        return sorted(
            [r async for batch in client.open_pull("fake-source", source, keys) for r in batch],
            key=lambda r: r.index,
        )


async def _read_back(address: str, keys):
    async with StoreClient(address, tls=tls("engine")) as client:
        tiers = await client.exists(keys)
        data = {
            k.block_hash: (await client.get(k))[0] for k, t in zip(keys, tiers, strict=True) if t
        }
        return tiers, data, await client.stats()


def test_copy_moves_real_bytes_store_to_store_and_verifies_them(fleet):
    a = fleet.store("store-a", dram=128 * 1024 * 1024)
    b = fleet.store("store-b", dram=128 * 1024 * 1024)
    xfer = fleet.transfer()
    assert a.fields["data"] and b.fields["data"]
    keys = [block_key(i, chain="d") for i in range(20)]
    payloads = [kv_payload(500 + i, SHAPES["4MiB" if i % 3 else "0.5MiB"]) for i in range(20)]

    async def put_all():
        async with StoreClient(a.grpc_address, tls=tls("engine")) as client:
            for key, payload in zip(keys, payloads, strict=True):
                await client.put(key, payload)

    run(put_all())
    with xfer.channel("operator") as channel:
        request = transfer_pb2.TransferRequest(
            source_node="store-a",
            destination_node="store-b",
            keys=[wire.key_to_proto(k) for k in keys],
        )
        final = list(transfer_pb2_grpc.TransferStub(channel).Copy(request, timeout=60))[-1]
    assert final.finished and final.blocks_failed == 0
    total = sum(len(p) for p in payloads)
    assert final.bytes_done == total
    tiers, data, _ = run(_read_back(b.grpc_address, keys))
    assert tiers == [CacheTier.CPU_DRAM] * len(keys)
    assert [data[k.block_hash] for k in keys] == payloads  # byte-identical
    # The bytes went A -> B over the data port (not through the transfer service).
    assert a.metric("quillcache_store_data_sent_bytes_total") == total
    assert b.metric("quillcache_store_data_pulled_bytes_total") == total
    assert b.metric("quillcache_store_data_pull_failures_total") == 0


def test_pull_batches_results_when_asked_and_old_clients_get_one_per_message(fleet):
    """A Pull asking for batches gets several results per message (at most as many as
    asked), a Pull that does not (an old client) one per message; both store the same
    verified bytes and account for every block exactly once."""
    a = fleet.store("store-a", dram=128 * 1024 * 1024)
    b = fleet.store("store-b", dram=128 * 1024 * 1024)
    keys = [block_key(i, chain="batch") for i in range(24)] + [block_key(99, chain="absent")]
    payloads = [kv_payload(900 + i, SHAPES["0.5MiB"]) for i in range(24)]

    async def put_all():
        async with StoreClient(a.grpc_address, tls=tls("engine")) as client:
            for key, payload in zip(keys[:24], payloads, strict=True):
                await client.put(key, payload)

    async def delete_at_b():
        async with StoreClient(b.grpc_address, tls=tls("engine")) as client:
            await client.delete(keys)

    run(put_all())
    with b.channel("transfer") as channel:
        pull = store_pb2_grpc.StoreStub(channel).Pull
        shapes = {}
        for asked in (5, 0):
            request = store_pb2.PullRequest(
                source_node="store-a",
                source_data_address=a.fields["data"],
                keys=[wire.key_to_proto(k) for k in keys],
                max_batch_results=asked,
            )
            messages = list(pull(request, timeout=60))
            if asked:
                results = [r for m in messages for r in m.results]
                # A batch message carries its results only.
                assert all(not m.ok and not m.code and m.results for m in messages)
            else:
                results = messages
                assert all(not m.results for m in messages)
            shapes[asked] = [len(m.results) for m in messages]
            by_index = {r.index: r for r in results}
            assert sorted(r.index for r in results) == list(range(len(keys)))
            assert all(by_index[i].ok for i in range(24))
            assert by_index[24].code == "NOT_FOUND" and by_index[24].source_failed
            assert [by_index[i].checksum for i in range(24)] == [
                payload_checksum(p) for p in payloads
            ]
            _, data, _ = run(_read_back(b.grpc_address, keys[:24]))
            assert [data[k.block_hash] for k in keys[:24]] == payloads
            run(delete_at_b())
    assert max(shapes[5]) <= 5 and len(shapes[5]) < len(keys)  # several per message
    assert len(shapes[0]) == len(keys)  # one per message


class FakeSource:
    """A data port answering one request by a script of per-block misbehaviour (over
    TLS, as a store: the puller accepts no other)."""

    def __init__(self, script) -> None:
        self.script = script
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        raw, _ = self.server.accept()
        with tls("store").server_context().wrap_socket(raw, server_side=True) as conn:
            head = memoryview(bytearray(dataproto.REQUEST_HEADER.size))
            recv_exactly(conn, head)
            body = memoryview(bytearray(dataproto.decode_request_header(head)))
            recv_exactly(conn, body)
            keys = dataproto.decode_request_body(body)
            assert len(keys) == len(self.script)
            for action, payload in self.script:
                if action == "ok":
                    header = dataproto.encode_block_header(
                        CacheTier.CPU_DRAM, len(payload), payload_checksum(payload)
                    )
                    conn.sendall(header + payload)
                elif action == "flipped":  # a bit flipped on the way
                    header = dataproto.encode_block_header(
                        CacheTier.CPU_DRAM, len(payload), payload_checksum(payload)
                    )
                    bad = bytearray(payload)
                    bad[len(bad) // 2] ^= 0x10
                    conn.sendall(header + bytes(bad))
                elif action == "missing":
                    conn.sendall(dataproto.encode_block_error(dataproto.STATUS_NOT_FOUND, "gone"))
                elif action == "dies":  # half the payload, then the source is gone
                    header = dataproto.encode_block_header(
                        CacheTier.CPU_DRAM, len(payload), payload_checksum(payload)
                    )
                    conn.sendall(header + payload[: len(payload) // 2])
                    return

    def close(self) -> None:
        self.server.close()
        self.thread.join(timeout=5)


def test_a_pull_stores_only_whole_verified_blocks(fleet):
    """Block by block: a good one is stored; a flipped bit is DATA_LOSS; a missing one
    NOT_FOUND; a source dying mid-block loses that block and the rest (UNAVAILABLE)
    and leaves an older copy under that key as it was."""
    b = fleet.store("store-b", "--pull-streams", "1")
    keys = [block_key(i, chain="f") for i in range(5)]
    payloads = [kv_payload(700 + i) for i in range(5)]
    older = kv_payload(799)

    async def put_older():
        async with StoreClient(b.grpc_address, tls=tls("engine")) as client:
            await client.put(keys[3], older)

    run(put_older())
    source = FakeSource(
        [
            ("ok", payloads[0]),
            ("flipped", payloads[1]),
            ("missing", b""),
            ("dies", payloads[3]),
            ("ok", payloads[4]),  # never sent
        ]
    )
    try:
        results = run(_pull(b.grpc_address, source.address, keys))
    finally:
        source.close()
    assert [r.index for r in results] == list(range(5))
    assert results[0].ok and results[0].checksum == payload_checksum(payloads[0])
    assert results[0].tier == tier_to_proto(CacheTier.CPU_DRAM)
    assert (results[1].code, results[1].source_failed) == ("DATA_LOSS", True)
    assert "checksum" in results[1].error
    assert results[2].code == "NOT_FOUND" and results[2].error == "gone"
    half = len(payloads[3]) // 2
    assert results[3].code == "UNAVAILABLE" and results[3].source_failed
    assert f"after {half} of {len(payloads[3])} bytes" in results[3].error
    assert results[4].code == "UNAVAILABLE"

    tiers, data, stats = run(_read_back(b.grpc_address, keys))
    assert [t is not None for t in tiers] == [True, False, False, True, False]
    assert data[keys[0].block_hash] == payloads[0]
    assert data[keys[3].block_hash] == older  # never half-replaced
    assert stats["dram_blocks"] == 2
    assert b.metric("quillcache_store_data_pull_failures_total") == 4
