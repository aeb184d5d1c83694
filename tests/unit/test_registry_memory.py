"""NodeRecord encoding, key layout, open_registry parsing, and MemoryRegistry."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from quillcache_core.errors import InvalidArgument, NodeUnavailable
from quillcache_core.registry import (
    NODES_PREFIX,
    EtcdRegistry,
    MemoryRegistry,
    NodeEvent,
    NodeRecord,
    kind_prefix,
    node_key,
    open_registry,
    parse_node_key,
)
from tests.support.tls import tls

pytestmark = pytest.mark.unit


def _rec(id: str = "e1", kind: str = "engine", **kw: Any) -> NodeRecord:
    return NodeRecord(kind, id, f"127.0.0.1:{5000 + len(id)}", "rack-a", **kw)


async def _next(it: AsyncIterator[NodeEvent], timeout_s: float = 2.0) -> NodeEvent:
    return await asyncio.wait_for(anext(it), timeout_s)


async def _until(cond: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


# ------------------------------------------------------------------ records, keys


def test_record_json_round_trip() -> None:
    rec = NodeRecord(
        kind="engine",
        id="vllm-0",
        address="10.0.0.5:50051",
        locality_domain="rack-a",
        base_url="http://10.0.0.5:8000",
        kv_events_endpoint="tcp://10.0.0.5:5557",
        kv_replay_endpoint="tcp://10.0.0.5:5558",
        model="llama-3-8b",
        tokenizer="llama-3",
        store_node="store-1",
        capacity_bytes=64 << 30,
        version="0.1.0",
        start_time_s=1700000000.25,
        extra={"gpu": "H100", "labels": {"zone": "a"}},
    )
    data = rec.to_json()
    assert isinstance(data, bytes)
    body = json.loads(data)
    assert body["kind"] == "engine" and body["id"] == "vllm-0" and body["gpu"] == "H100"
    assert NodeRecord.from_json("engine", "vllm-0", data) == rec
    assert hash(rec) == hash(NodeRecord.from_json("engine", "vllm-0", data))


def test_from_json_is_tolerant() -> None:
    data = json.dumps(
        {
            "address": "h:1",
            "model": None,  # null -> default
            "future_field": [1, 2],
            "kind": "store",  # the key wins over the body
            "id": "other",
        }
    )
    rec = NodeRecord.from_json("engine", "e9", data)
    assert (rec.kind, rec.id, rec.address) == ("engine", "e9", "h:1")
    assert rec.locality_domain == "" and rec.model == "" and rec.capacity_bytes == 0
    assert rec.start_time_s == 0.0
    assert rec.extra == {"future_field": [1, 2]}
    assert NodeRecord.from_json("engine", "e9", rec.to_json()) == rec
    assert NodeRecord.from_json("store", "s1", b"{}") == NodeRecord("store", "s1", "", "")
    assert NodeRecord.from_json("store", "s1", '{"start_time_s": 3}').start_time_s == 3.0


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"{",
        b"[]",
        b'"x"',
        b"3",
        b"null",
        b"\xff\xfe",
        b'{"address": 5}',
        b'{"capacity_bytes": "big"}',
        b'{"capacity_bytes": true}',
        b'{"capacity_bytes": -1}',
        b'{"start_time_s": "now"}',
    ],
)
def test_from_json_rejects_bad_values(data: bytes) -> None:
    with pytest.raises(InvalidArgument):
        NodeRecord.from_json("engine", "e1", data)


def test_key_layout() -> None:
    assert node_key("engine", "e1") == "/quillcache/v1/nodes/engine/e1"
    assert _rec("s7", kind="store").key == "/quillcache/v1/nodes/store/s7"
    assert kind_prefix(None) == NODES_PREFIX == "/quillcache/v1/nodes/"
    assert kind_prefix("engine") == "/quillcache/v1/nodes/engine/"
    assert parse_node_key(b"/quillcache/v1/nodes/engine/e1") == ("engine", "e1")
    assert parse_node_key("/quillcache/v1/nodes/engine") is None
    assert parse_node_key("/quillcache/v1/nodes/engine/e1/x") is None
    assert parse_node_key("/other/engine/e1") is None
    for kind, id_ in [("", "e1"), ("engine", ""), ("a/b", "e1"), ("engine", "x/y")]:
        with pytest.raises(InvalidArgument):
            node_key(kind, id_)
        with pytest.raises(InvalidArgument):
            NodeRecord(kind, id_, "", "")


def test_open_registry() -> None:
    assert isinstance(open_registry("memory"), MemoryRegistry)
    reg = open_registry("etcd://127.0.0.1:2379,10.0.0.2:2379")
    assert isinstance(reg, EtcdRegistry) and reg.endpoints == ["127.0.0.1:2379", "10.0.0.2:2379"]
    reg = open_registry("http://127.0.0.1:2379/")
    assert isinstance(reg, EtcdRegistry) and reg.endpoints == ["127.0.0.1:2379"]
    for bad in ["", "redis://x:1", "etcd://", "etcd://host", "etcd://host:http", "https://h:1"]:
        with pytest.raises(InvalidArgument):
            open_registry(bad)
    assert reg.tls is None


def test_open_registry_tls() -> None:
    engine = tls("engine")
    reg = open_registry("https://127.0.0.1:2379,etcd-1:2379/", engine)
    assert isinstance(reg, EtcdRegistry) and reg.tls == engine
    assert reg.endpoints == ["127.0.0.1:2379", "etcd-1:2379"]
    with pytest.raises(InvalidArgument, match="https.*certificates"):
        open_registry("https://127.0.0.1:2379")
    with pytest.raises(InvalidArgument, match="certificates"):
        EtcdRegistry(["https://127.0.0.1:2379"])
    # etcd:// follows the certificates given; http:// is always plaintext.
    assert open_registry("etcd://127.0.0.1:2379", engine).tls == engine  # type: ignore[attr-defined]
    assert open_registry("http://127.0.0.1:2379", engine).tls is None  # type: ignore[attr-defined]
    assert isinstance(open_registry("memory", engine), MemoryRegistry)
    for bad in ["https://", "https://host", "https://h:1/x"]:
        with pytest.raises(InvalidArgument):
            open_registry(bad, engine)


# ---------------------------------------------------------------- MemoryRegistry


def test_memory_register_list_get_deregister() -> None:
    async def main() -> None:
        reg = MemoryRegistry()
        await reg.register(_rec("e2"), ttl_s=5)
        await reg.register(_rec("e1"), ttl_s=5)
        await reg.register(_rec("s1", kind="store"), ttl_s=5)
        assert [r.id for r in await reg.list()] == ["e1", "e2", "s1"]
        assert [r.id for r in await reg.list("engine")] == ["e1", "e2"]
        assert await reg.get("engine", "e1") == _rec("e1")
        assert await reg.get("engine", "nope") is None
        await reg.deregister("engine", "e1")
        await reg.deregister("engine", "e1")  # idempotent
        assert await reg.get("engine", "e1") is None
        with pytest.raises(InvalidArgument):
            await reg.register(_rec("e3"), ttl_s=0)
        await reg.close()
        assert await reg.list() == []
        with pytest.raises(NodeUnavailable):
            await reg.register(_rec("e4"), ttl_s=5)

    asyncio.run(main())


def test_memory_watch_snapshot_then_live() -> None:
    async def main() -> None:
        reg = MemoryRegistry()
        await reg.register(_rec("e1"), ttl_s=5)
        await reg.register(_rec("s1", kind="store"), ttl_s=5)
        events = reg.watch()
        engines = reg.watch("engine")
        assert await _next(events) == NodeEvent("join", _rec("e1"))
        assert await _next(events) == NodeEvent("join", _rec("s1", kind="store"))
        assert await _next(engines) == NodeEvent("join", _rec("e1"))

        await reg.register(_rec("e2"), ttl_s=5)
        await reg.register(_rec("e2", model="m2"), ttl_s=5)
        await reg.deregister("store", "s1")
        await reg.deregister("engine", "e1")
        expected = [
            NodeEvent("join", _rec("e2")),
            NodeEvent("update", _rec("e2", model="m2")),
            NodeEvent("leave", _rec("s1", kind="store")),
            NodeEvent("leave", _rec("e1")),
        ]
        assert [await _next(events) for _ in expected] == expected
        assert [await _next(engines) for _ in range(3)] == [expected[0], expected[1], expected[3]]

        await reg.close()
        assert [e async for e in events] == []  # the watch ends on close
        assert [e async for e in engines] == []

    asyncio.run(main())


def test_memory_ttl_expiry_and_lease_loss() -> None:
    async def main() -> None:
        reg = MemoryRegistry()
        await reg.register(_rec("e1"), ttl_s=0.05)
        await reg.register(_rec("e2"), ttl_s=30)
        events = reg.watch("engine")
        assert {(await _next(events)).id for _ in range(2)} == {"e1", "e2"}

        started = time.monotonic()
        await reg.stop_keepalive("engine", "e1")
        assert await reg.get("engine", "e1") is not None  # still within its TTL
        assert await _next(events) == NodeEvent("leave", _rec("e1"))
        assert time.monotonic() - started >= 0.04
        assert await reg.get("engine", "e1") is None

        assert reg.expire("engine", "e2") is True
        assert await _next(events) == NodeEvent("leave", _rec("e2"))
        assert reg.expire("engine", "e2") is False
        assert await reg.list() == []

        # Re-registering before the timer fires cancels the expiry.
        await reg.register(_rec("e3"), ttl_s=0.05)
        await reg.stop_keepalive("engine", "e3")
        await reg.register(_rec("e3"), ttl_s=30)
        assert (await _next(events)).type == "join"
        assert (await _next(events)).type == "update"
        await asyncio.sleep(0.1)  # longer than the cancelled 0.05 s timer
        assert await reg.get("engine", "e3") == _rec("e3")
        await reg.close()

    asyncio.run(main())


def test_memory_watch_consumer_can_stop_early() -> None:
    async def main() -> None:
        reg = MemoryRegistry()
        await reg.register(_rec("e1"), ttl_s=5)
        async for event in reg.watch():
            assert event.id == "e1"
            break
        await _until(lambda: not reg._watchers)
        await reg.close()

    asyncio.run(main())
