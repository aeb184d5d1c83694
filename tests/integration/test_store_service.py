"""The store node as a real process: gRPC data path, bad input, demotion, corruption,
node death and durability, with a real etcd and a real conductor where they matter."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from quillcache.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc, store_pb2
from quillcache_core.errors import CapacityExceeded, Corrupt, InvalidArgument, NotFound
from quillcache_core.model import CacheTier
from quillcache_core.storeclient import wire
from quillcache_core.storeclient.blockcodec import payload_checksum
from quillcache_core.storeclient.client import StoreClient
from tests.support import stores
from tests.support.etcdctl import put_engine
from tests.support.services import wait_until
from tests.support.stores import (
    MIB,
    MODEL,
    SHAPES,
    TENANT,
    TOKENIZER,
    block_key,
    kv_payload,
    locate,
    run,
)
from tests.support.tls import channel, client_context, grpcurl_args, tls

pytestmark = pytest.mark.integration


@pytest.fixture
def lone_store(tmp_path):
    """A store with an in-memory registry: no etcd, no conductor."""
    with stores.lone_store(tmp_path) as store:
        yield store


async def _client_call(address: str, fn):
    async with StoreClient(address, tls=tls("engine")) as client:
        return await fn(client)


def call(proc, fn):
    return run(_client_call(proc.grpc_address, fn))


def stats(proc) -> dict:
    return call(proc, lambda c: c.stats())


# --- data path --------------------------------------------------------------------------


def test_put_get_is_byte_identical_in_dram_and_on_ssd(lone_store):
    cases = []
    for shape in SHAPES.values():
        for tier, durable in (
            (CacheTier.CPU_DRAM, False),
            (CacheTier.LOCAL_SSD, False),
            (CacheTier.CPU_DRAM, True),
        ):
            cases.append((block_key(len(cases)), kv_payload(len(cases), shape), tier, durable))

    async def scenario(client: StoreClient):
        landed = [await client.put(k, p, tier=t, durable=d) for k, p, t, d in cases]
        present = await client.exists([k for k, *_ in cases] + [block_key(999)])
        got = [await client.get(k) for k, *_ in cases]
        return landed, got, present

    landed, got, present = call(lone_store, scenario)
    for (key, payload, tier, _durable), tier_landed, (data, served) in zip(
        cases, landed, got, strict=True
    ):
        assert tier_landed is tier
        assert data == payload, key
        assert served is tier
    assert present[:-1] == [t for *_, t, _d in cases] and present[-1] is None
    s = stats(lone_store)
    # Durable puts are on both tiers; reading an SSD-only block promoted it to DRAM.
    assert s["ssd_blocks"] == 6 and s["dram_blocks"] == 9, s
    assert s["hits"] == len(cases) and s["misses"] == 0


def _raw_put(address: str, chunks: list[bytes], timeout: float = 10.0):
    """Send pre-framed PutChunks; returns (status code, details)."""
    with channel(address, "engine", options=[("grpc.max_send_message_length", 64 * MIB)]) as chan:
        put = chan.stream_unary(
            "/quillcache.v1.Store/Put",
            request_serializer=None,
            response_deserializer=store_pb2.PutResponse.FromString,
        )
        try:
            put(iter(chunks), timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def _header(key, total, **kw) -> store_pb2.PutChunk:
    return store_pb2.PutChunk(key=wire.key_to_proto(key), total_bytes=total, **kw)


def test_bad_puts_get_clear_errors_and_store_nothing(lone_store):
    addr = lone_store.grpc_address
    data = kv_payload(1)  # 2 MiB
    key = block_key(0)
    no_block = block_key(0)
    empty_hash = wire.key_to_proto(key)
    empty_hash.block_hash = ""
    cases = {
        "oversized chunk": (
            [wire.encode_put_chunk(_header(key, 9 * MIB), b"\0" * (9 * MIB))],
            grpc.StatusCode.INVALID_ARGUMENT,
            "exceeds the maximum",
        ),
        "short of total": (
            [wire.encode_put_chunk(_header(key, len(data)), data[:MIB])],
            grpc.StatusCode.INVALID_ARGUMENT,
            "ended after",
        ),
        "beyond total": (
            [
                wire.encode_put_chunk(_header(key, MIB), data[:MIB]),
                wire.encode_put_chunk(None, data[MIB : MIB + 10]),
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "more than total_bytes",
        ),
        "empty block hash": (
            [wire.encode_put_chunk(store_pb2.PutChunk(key=empty_hash, total_bytes=4), b"abcd")],
            grpc.StatusCode.INVALID_ARGUMENT,
            "block_hash is empty",
        ),
        "no key": (
            [wire.encode_put_chunk(store_pb2.PutChunk(total_bytes=4), b"abcd")],
            grpc.StatusCode.INVALID_ARGUMENT,
            "must carry the key",
        ),
        "no chunk at all": ([], grpc.StatusCode.INVALID_ARGUMENT, "empty Put stream"),
        "checksum mismatch": (
            [wire.encode_put_chunk(_header(key, len(data), checksum=12345), data)],
            grpc.StatusCode.DATA_LOSS,
            "checksum",
        ),
        "larger than every tier": (
            [wire.encode_put_chunk(_header(key, 100 * MIB), data[:MIB])],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "exceeds",
        ),
        "malformed chunk": ([b"\x7a\x05ab"], grpc.StatusCode.INVALID_ARGUMENT, "past the end"),
    }
    for name, (chunks, code, text) in cases.items():
        got, details = _raw_put(addr, chunks)
        assert got == code, (name, got, details)
        assert text in details, (name, details)

    async def check(client: StoreClient):
        assert await client.exists([no_block]) == [None]
        with pytest.raises(NotFound):
            await client.get(no_block)
        return await client.stats()

    client_chunks = StoreClient(addr, chunk_bytes=8 * MIB, tls=tls("engine"))

    async def oversize_via_client():
        # chunk_bytes is bounded by the client itself.
        with pytest.raises(InvalidArgument):
            StoreClient(addr, chunk_bytes=9 * MIB, tls=tls("engine"))
        with pytest.raises(CapacityExceeded):
            await client_chunks.put(block_key(6), b"y" * (65 * MIB), tier=CacheTier.LOCAL_SSD)
        await client_chunks.close()

    run(oversize_via_client())
    s = call(lone_store, check)
    assert s["dram_blocks"] == 0 and s["ssd_blocks"] == 0, s


def test_put_cancelled_midway_stores_nothing(lone_store):
    key = block_key(3)
    data = kv_payload(3, SHAPES["4MiB"])

    async def scenario(client: StoreClient):
        call_ = client.open_put()
        await call_.write(wire.encode_put_chunk(_header(key, len(data)), data[:MIB]))
        await call_.write(wire.encode_put_chunk(None, data[MIB : 2 * MIB]))
        call_.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call_
        # A later Put of the same key is unaffected, and before it nothing is there.
        before = await client.exists([key])
        await client.put(key, data)
        return before, await client.get(key)

    before, (got, _tier) = call(lone_store, scenario)
    assert before == [None]
    assert got == data


def test_identity_is_part_of_the_key(lone_store):
    mine = block_key(0, tenant="acme")
    theirs = block_key(0, tenant="globex")  # same block hash, another tenant
    assert mine.block_hash == theirs.block_hash

    async def scenario(client: StoreClient):
        await client.put(mine, kv_payload(7))
        with pytest.raises(NotFound):
            await client.get(theirs)
        return await client.exists([mine, theirs])

    assert call(lone_store, scenario) == [CacheTier.CPU_DRAM, None]


def test_grpcurl_lists_the_store_and_calls_it(lone_store):
    grpcurl = os.path.join(os.path.dirname(sys.executable), "grpcurl")
    addr = lone_store.grpc_address
    listed = subprocess.run(
        [grpcurl, *grpcurl_args("engine"), addr, "list"], capture_output=True, text=True, timeout=20
    )
    assert "quillcache.v1.Store" in listed.stdout.split(), listed.stderr
    key = block_key(42)
    data = kv_payload(42, SHAPES["0.5MiB"])
    call(lone_store, lambda c: c.put(key, data))
    out = subprocess.run(
        [grpcurl, *grpcurl_args("engine"), "-d", "{}", addr, "quillcache.v1.Store/Stats"],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    reply = json.loads(out.stdout)
    assert reply["node_id"] == "solo" and int(reply["dram_blocks"]) == 1
    # Get streams hand-framed chunks: grpcurl reads them as ordinary GetChunk messages.
    request = json.dumps({"key": json.loads(_key_json(key)), "chunkBytes": 131072})
    out = subprocess.run(
        [
            grpcurl,
            *grpcurl_args("engine"),
            "-max-msg-sz",
            str(64 * MIB),
            "-d",
            request,
            addr,
            "quillcache.v1.Store/Get",
        ],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    decoder = json.JSONDecoder()
    chunks, text = [], out.stdout.strip()
    while text:
        obj, end = decoder.raw_decode(text)
        chunks.append(obj)
        text = text[end:].strip()
    assert len(chunks) == len(data) // 131072
    assert int(chunks[0]["total_bytes"]) == len(data)
    assert b"".join(base64.b64decode(c["data"]) for c in chunks) == data


def _key_json(key) -> str:
    from google.protobuf import json_format

    return json_format.MessageToJson(wire.key_to_proto(key))


# --- with etcd and the conductor -----------------------------------------------------------


def test_demotion_moves_the_coldest_blocks_to_ssd_and_the_index_follows(fleet):
    conductor = fleet.conductor()
    store = fleet.store("store-d", dram=8 * MIB, ssd=64 * MIB)
    keys = [block_key(i, chain="d") for i in range(8)]
    payloads = [kv_payload(100 + i) for i in range(8)]

    async def fill(client: StoreClient):
        return [await client.put(k, p) for k, p in zip(keys, payloads, strict=True)]

    assert call(store, fill) == [CacheTier.CPU_DRAM] * 8  # demotion makes room
    s = stats(store)
    assert s["demotions"] >= 4 and s["dram_bytes"] <= 8 * MIB, s
    assert s["ssd_blocks"] == s["demotions"]
    # The coldest went to SSD, the newest stayed in DRAM; the conductor's index agrees.
    wait_until(
        lambda: locate(conductor, keys[0]) == [("store-d", CacheTier.LOCAL_SSD)],
        timeout_s=10,
        what="block 0 indexed on local_ssd only",
    )
    wait_until(
        lambda: locate(conductor, keys[-1]) == [("store-d", CacheTier.CPU_DRAM)],
        timeout_s=10,
        what="block 7 indexed in cpu_dram",
    )
    tiers = call(store, lambda c: c.exists(keys))
    demoted = [k for k, t in zip(keys, tiers, strict=True) if t is CacheTier.LOCAL_SSD]
    assert demoted == keys[: len(demoted)] and len(demoted) == s["demotions"]
    for key in demoted:
        assert locate(conductor, key) == [("store-d", CacheTier.LOCAL_SSD)]

    async def read_back(client: StoreClient):
        return [await client.get(k) for k in keys]

    for (data, _tier), payload in zip(call(store, read_back), payloads, strict=True):
        assert data == payload


def _flip_payload_byte(data_mdb, payload: bytes) -> None:
    raw = bytearray(data_mdb.read_bytes())
    probe = payload[1000:1064]
    at = raw.find(probe)
    assert at > 0 and raw.find(probe, at + 1) < 0, "payload not found once in data.mdb"
    raw[at + 10] ^= 0xFF
    data_mdb.write_bytes(bytes(raw))


def test_a_block_corrupted_on_disk_is_never_served_and_reported_removed(fleet, tmp_path):
    conductor = fleet.conductor()
    store = fleet.store("store-c", ttl_s=2.0)
    key = block_key(0, chain="x")
    payload = kv_payload(5)
    assert call(store, lambda c: c.put(key, payload, tier=CacheTier.LOCAL_SSD)) is (
        CacheTier.LOCAL_SSD
    )
    store.stop()  # clean shutdown: the SSD tier is closed, the node deregistered
    _flip_payload_byte(tmp_path / "store-c" / "ssd" / "data.mdb", payload)
    store.start()
    # On restart the node announces what its SSD tier holds (it does not read payloads).
    wait_until(
        lambda: locate(conductor, key) == [("store-c", CacheTier.LOCAL_SSD)],
        timeout_s=10,
        what="restarted node announcing its SSD block",
    )

    async def read(client: StoreClient):
        with pytest.raises(NotFound, match="corrupt"):
            await client.get(key)
        with pytest.raises(NotFound, match="not stored"):  # dropped, not served later
            await client.get(key)
        return await client.exists([key]), await client.stats()

    present, s = call(store, read)
    assert present == [None]
    assert s["corrupt_blocks"] == 1 and s["ssd_blocks"] == 0 and s["hits"] == 0, s
    wait_until(lambda: locate(conductor, key) == [], timeout_s=10, what="removal indexed")
    with urllib.request.urlopen(
        store.metrics_url + "/metrics", timeout=5, context=client_context()
    ) as reply:
        assert "quillcache_store_corrupt_blocks_total 1" in reply.read().decode()


def _put_engine(etcd, engine_id: str) -> None:
    put_engine(etcd, engine_id, model=MODEL, tokenizer=TOKENIZER)


def _fetch_sources(conductor, keys) -> set[str]:
    with conductor.channel("gateway") as channel:
        reply = conductor_pb2_grpc.ConductorStub(channel).Plan(
            conductor_pb2.PlanRequest(
                request_id="t",
                identity=common_pb2.Identity(
                    model_id=MODEL, tokenizer_id=TOKENIZER, tenant_id=TENANT
                ),
                blocks=[common_pb2.BlockRef(block_hash=k.block_hash, token_count=16) for k in keys],
                expected_decode_tokens=4,
            ),
            timeout=5,
        )
        conductor_pb2_grpc.ConductorStub(channel).Finish(
            conductor_pb2.FinishRequest(
                reservation_id=reply.reservation_id, outcome=conductor_pb2.FinishRequest.SUCCESS
            ),
            timeout=5,
        )
    return {a.source_node for a in reply.actions if a.kind == conductor_pb2.BlockAction.FETCH}


def test_a_killed_store_leaves_the_index_within_its_lease(fleet, etcd_server):
    conductor = fleet.conductor()
    ttl_s = 2.0
    store = fleet.store("store-k", "--locality-domain", "rack-a", ttl_s=ttl_s)
    _put_engine(etcd_server, "e1")
    keys = [block_key(i, chain="k") for i in range(4)]

    async def fill(client: StoreClient):
        for i, key in enumerate(keys):
            await client.put(key, kv_payload(i))

    call(store, fill)
    wait_until(
        lambda: all(locate(conductor, k) == [("store-k", CacheTier.CPU_DRAM)] for k in keys),
        timeout_s=10,
        what="blocks indexed",
    )
    wait_until(
        lambda: _fetch_sources(conductor, keys) == {"store-k"},
        timeout_s=10,
        what="a plan fetching from store-k",
    )
    store.kill()
    killed_at = time.monotonic()
    wait_until(
        lambda: all(locate(conductor, k) == [] for k in keys),
        timeout_s=ttl_s + 1.0,
        interval_s=0.05,
        what="the dead store's blocks leaving the index",
    )
    assert time.monotonic() - killed_at <= ttl_s + 1.0
    assert "store-k" not in _fetch_sources(conductor, keys)


# --- durability --------------------------------------------------------------------------


def test_acknowledged_durable_puts_survive_sigkill(lone_store):
    rng = random.Random(611)
    acked: set[int] = set()
    attempted: set[int] = set()
    next_index = 0
    for _round in range(3):
        target = len(acked) + rng.randint(5, 30)

        async def writer(start: int, target: int) -> int:
            counter = iter(range(start, start + 10_000))
            killed = False
            async with StoreClient(
                lone_store.grpc_address, timeout_s=5, tls=tls("engine")
            ) as client:

                async def worker():
                    nonlocal killed
                    while not killed:
                        i = next(counter)
                        attempted.add(i)
                        try:
                            await client.put(
                                block_key(i, chain="w"),
                                kv_payload(i, SHAPES["0.5MiB"]),
                                durable=True,
                            )
                        except Exception:
                            return
                        acked.add(i)
                        if len(acked) >= target and not killed:
                            killed = True
                            lone_store.kill()  # SIGKILL with puts in flight

                await asyncio.gather(*(worker() for _ in range(4)))
            return max(attempted) + 1

        next_index = run(writer(next_index, target))
        lone_store.start()

        async def verify(client: StoreClient):
            for i in sorted(attempted):
                key = block_key(i, chain="w")
                try:
                    data, _tier = await client.get(key)
                except NotFound:
                    assert i not in acked, f"acknowledged block {i} lost"
                    continue
                except Corrupt as exc:  # the client verifies the checksum
                    raise AssertionError(f"block {i} served corrupt: {exc}") from None
                assert data == kv_payload(i, SHAPES["0.5MiB"]), i
                assert payload_checksum(data) == payload_checksum(kv_payload(i, SHAPES["0.5MiB"]))

        call(lone_store, verify)
    assert len(acked) >= 15
