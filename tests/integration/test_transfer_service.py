"""The transfer service as a real process, between real store processes, with etcd:
peer fetch, Copy/Move/Prefetch, a source dying mid-transfer, bad requests.

Where both paths exist, each test runs on both: the block data path (stores pull from
each other's raw TCP data ports, the default) and gRPC (Get streamed into Put through
the transfer service: `--data-path false`, or a source with `--data-port -1`)."""

from __future__ import annotations

import urllib.request

import grpc
import pytest

from quillcache.v1 import common_pb2, transfer_pb2, transfer_pb2_grpc
from quillcache_core.errors import NotFound
from quillcache_core.model import CacheTier
from quillcache_core.storeclient import wire
from quillcache_core.storeclient.client import StoreClient
from tests.support.services import wait_until
from tests.support.stores import SHAPES, block_key, kv_payload, locate, run
from tests.support.tls import client_context, tls

pytestmark = pytest.mark.integration


async def _with(address: str, fn):
    async with StoreClient(address, tls=tls("engine")) as client:
        return await fn(client)


def call(proc, fn):
    return run(_with(proc.grpc_address, fn))


def put_all(proc, keys, payloads) -> None:
    async def go(client):
        for key, payload in zip(keys, payloads, strict=True):
            await client.put(key, payload)

    call(proc, go)


def transfer(proc, method: str, keys, src="store-a", dst="store-b", **kw):
    """All progress messages of one Copy/Move/Prefetch call."""
    with proc.channel("operator") as channel:
        stub = transfer_pb2_grpc.TransferStub(channel)
        request = transfer_pb2.TransferRequest(
            source_node=src,
            destination_node=dst,
            keys=[wire.key_to_proto(k) for k in keys],
            **kw,
        )
        return list(getattr(stub, method)(request, timeout=60))


def metrics(proc) -> str:
    with urllib.request.urlopen(
        proc.metrics_url + "/metrics", timeout=5, context=client_context()
    ) as reply:
        return reply.read().decode()


def sample(text: str, series: str) -> float:
    """The value of one series (name and labels, as exposed) of a /metrics text."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not exposed")


@pytest.mark.parametrize("path", ["data", "grpc"])
def test_a_get_on_node_b_is_served_from_node_a(fleet, path):
    """Over the data path B pulls from A's data port itself; without one (A started
    with --data-port -1) B has the transfer service copy it over gRPC."""
    conductor = fleet.conductor()
    a = fleet.store("store-a", *([] if path == "data" else ["--data-port", "-1"]))
    b = fleet.store("store-b")
    xfer = fleet.transfer()
    key = block_key(0, chain="p")
    payload = kv_payload(11)
    put_all(a, [key], [payload])
    wait_until(
        lambda: locate(conductor, key) == [("store-a", CacheTier.CPU_DRAM)],
        timeout_s=10,
        what="block indexed on store-a",
    )

    async def fetch(client: StoreClient):
        with pytest.raises(NotFound):
            await client.get(key)  # local only: not here
        data, tier = await client.get(key, allow_remote=True)
        again, _ = await client.get(key)  # the copy was kept
        return data, tier, again, await client.exists([key]), await client.stats()

    data, tier, again, present, stats = call(b, fetch)
    assert data == payload and again == payload
    assert tier is CacheTier.CPU_DRAM and present == [CacheTier.CPU_DRAM]
    assert stats["peer_fetches"] == 1
    copied = 'quillcache_transfer_blocks_total{mode="copy",result="ok"} 1'
    if path == "data":
        assert "data" in a.fields and stats["data_address"] == b.fields["data"]
        assert "quillcache_store_data_sent_blocks_total 1" in metrics(a)
        assert sample(metrics(b), "quillcache_store_data_pulled_bytes_total") == len(payload)
        assert copied not in metrics(xfer)
    else:
        assert "data" not in a.fields
        assert copied in metrics(xfer)
    # B reported its new copy: the index now knows both nodes.
    wait_until(
        lambda: (
            locate(conductor, key)
            == [("store-a", CacheTier.CPU_DRAM), ("store-b", CacheTier.CPU_DRAM)]
        ),
        timeout_s=10,
        what="store-b's copy indexed",
    )


def _results(messages):
    final = messages[-1]
    assert final.finished and all(not m.finished for m in messages[:-1])
    return final, {r.key.block_hash: r for r in final.results}


PATH_FLAGS = {"data": [], "grpc": ["--data-path", "false"]}


@pytest.mark.parametrize("path", ["data", "grpc"])
def test_copy_move_and_prefetch_report_progress_and_verify_checksums(fleet, path):
    a = fleet.store("store-a")
    b = fleet.store("store-b")
    xfer = fleet.transfer("--progress-every-blocks", "4", *PATH_FLAGS[path])
    keys = [block_key(i, chain="m") for i in range(24)]
    payloads = [kv_payload(200 + i, SHAPES["2MiB" if i % 2 else "0.5MiB"]) for i in range(24)]
    put_all(a, keys, payloads)
    missing = block_key(99, chain="m")

    # Copy 12 blocks (and one the source lacks) into B's SSD tier.
    messages = transfer(
        xfer, "Copy", keys[:12] + [missing], window=3, destination_tier=common_pb2.TIER_LOCAL_SSD
    )
    final, by_hash = _results(messages)
    assert len(messages) >= 3  # at least every 4 blocks, then the final one
    done = [m.blocks_done for m in messages]
    assert done == sorted(done) and done[-1] == 13
    assert final.blocks_total == 13 and final.blocks_failed == 1 and final.bytes_per_s > 0
    assert final.bytes_done == sum(len(p) for p in payloads[:12])
    assert [r.key.block_hash for r in final.results] == [k.block_hash for k in keys[:12]] + [
        missing.block_hash
    ]
    assert not by_hash[missing.block_hash].ok
    assert by_hash[missing.block_hash].code == "NOT_FOUND"
    assert all(by_hash[k.block_hash].ok for k in keys[:12])

    # Move 6 others: at B afterwards, gone from A.
    final, by_hash = _results(transfer(xfer, "Move", keys[12:18]))
    assert final.blocks_failed == 0 and all(r.ok for r in final.results)

    # Prefetch 12: the first 6 (copied above) are skipped, the rest land in DRAM.
    prefetch_keys = keys[:6] + keys[18:]
    final, by_hash = _results(transfer(xfer, "Prefetch", prefetch_keys))
    assert final.blocks_skipped == 6 and final.blocks_failed == 0
    assert [by_hash[k.block_hash].skipped for k in prefetch_keys] == [True] * 6 + [False] * 6

    async def check_b(client: StoreClient):
        tiers = await client.exists(keys)
        data = [(await client.get(k))[0] for k in keys]
        return tiers, data

    async def check_a(client: StoreClient):
        return await client.exists(keys)

    tiers_b, data_b = call(b, check_b)
    assert tiers_b[:12] == [CacheTier.LOCAL_SSD] * 12
    assert tiers_b[12:] == [CacheTier.CPU_DRAM] * 12
    assert data_b == payloads
    tiers_a = call(a, check_a)
    assert tiers_a[12:18] == [None] * 6
    assert all(t is CacheTier.CPU_DRAM for t in tiers_a[:12] + tiers_a[18:])
    assert f'quillcache_transfer_requests_by_path_total{{path="{path}"}} 3' in metrics(xfer)


@pytest.mark.parametrize("path", ["data", "grpc"])
def test_a_source_killed_mid_transfer_leaves_nothing_half_written(fleet, path):
    a = fleet.store("store-a", dram=256 * 1024 * 1024)
    b = fleet.store("store-b")
    xfer = fleet.transfer("--progress-every-blocks", "1", "--backoff-s", "0.05", *PATH_FLAGS[path])
    # Either path can outrun the kill into DRAM on a busy machine: landing on SSD (a
    # commit per block) keeps the transfer going long enough for the kill to land
    # mid-way.
    tier = common_pb2.TIER_LOCAL_SSD
    keys = [block_key(i, chain="s") for i in range(64)]
    payloads = [kv_payload(300 + i) for i in range(64)]
    put_all(a, keys, payloads)

    messages = []
    with xfer.channel("operator") as channel:
        request = transfer_pb2.TransferRequest(
            source_node="store-a",
            destination_node="store-b",
            keys=[wire.key_to_proto(k) for k in keys],
            window=2,
            chunk_bytes=64 * 1024,  # many chunks per block: the kill lands mid-block
            destination_tier=tier,
        )
        for message in transfer_pb2_grpc.TransferStub(channel).Copy(request, timeout=60):
            messages.append(message)
            if len(messages) == 1:
                a.kill()
    final, by_hash = _results(messages)
    ok = [k for k in keys if by_hash[k.block_hash].ok]
    failed = [k for k in keys if not by_hash[k.block_hash].ok]
    assert ok and failed and final.blocks_failed == len(failed)
    for key in failed:
        result = by_hash[key.block_hash]
        assert result.code == "UNAVAILABLE", result
        assert "source node store-a" in result.error, result.error

    async def check(client: StoreClient):
        tiers = await client.exists(keys)
        data = {k.block_hash: (await client.get(k))[0] for k in ok}
        return tiers, data, await client.stats()

    tiers, data, stats = call(b, check)
    assert [t is not None for t in tiers] == [by_hash[k.block_hash].ok for k in keys]
    for key, payload in zip(keys, payloads, strict=True):
        if key in ok:
            assert data[key.block_hash] == payload
    assert stats["ssd_blocks"] == len(ok)


def test_unknown_nodes_and_bad_requests_get_clear_errors(fleet):
    fleet.store("store-a")
    xfer = fleet.transfer()
    key = block_key(0)
    empty = wire.key_to_proto(key)
    empty.tenant_id = ""
    cases = [
        (
            dict(source_node="nope", destination_node="store-a", keys=[wire.key_to_proto(key)]),
            grpc.StatusCode.NOT_FOUND,
            "nope",
        ),
        (
            dict(source_node="store-a", destination_node="ghost", keys=[wire.key_to_proto(key)]),
            grpc.StatusCode.NOT_FOUND,
            "ghost",
        ),
        (
            dict(source_node="store-a", destination_node="store-b"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "keys is empty",
        ),
        (
            dict(source_node="store-a", destination_node="store-a", keys=[wire.key_to_proto(key)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "same node",
        ),
        (
            dict(source_node="store-a", destination_node="x", keys=[empty]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "tenant_id is empty",
        ),
        (
            dict(destination_node="x", keys=[wire.key_to_proto(key)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "required",
        ),
    ]
    with xfer.channel("operator") as channel:
        stub = transfer_pb2_grpc.TransferStub(channel)
        for method in ("Copy", "Move", "Prefetch"):
            for fields, code, text in cases:
                with pytest.raises(grpc.RpcError) as info:
                    list(getattr(stub, method)(transfer_pb2.TransferRequest(**fields), timeout=10))
                assert info.value.code() == code, (method, fields, info.value.details())
                assert text in info.value.details()
