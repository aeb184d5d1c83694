"""EtcdRegistry against a real etcd (the `etcd_server` fixture: TLS + RBAC) and the
real etcdctl. Each registry speaks as the role whose records it writes (engines
register engines) or reads (a conductor watches the fleet)."""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from quillcache_core.errors import NodeUnavailable
from quillcache_core.launch.etcd_server import EtcdServer, free_port
from quillcache_core.launch.process import ManagedProcess
from quillcache_core.registry import EtcdRegistry, NodeEvent, NodeRecord, node_key, open_registry
from tests.support.aio import run
from tests.support.etcdctl import etcdctl
from tests.support.tls import certs_dir, tls

pytestmark = pytest.mark.integration


def registry(server: EtcdServer, role: str = "engine", **kw: Any) -> EtcdRegistry:
    """A registry client of `server` as `role` (TLS with that role's certificate)."""
    return EtcdRegistry([server.endpoint], tls=tls(role), **kw)


async def aetcdctl(server: EtcdServer, *args: str, role: str = "root") -> str:
    return await asyncio.to_thread(etcdctl, server, *args, role=role)


async def has_key(server: EtcdServer, id_: str) -> bool:
    return (await aetcdctl(server, "get", node_key("engine", id_), "--keys-only")).strip() != ""


async def until(
    cond: Callable[[], bool | Awaitable[bool]], timeout_s: float = 5.0, what: str = "condition"
) -> float:
    """Poll `cond` until true; returns the seconds it took."""
    started = time.monotonic()
    while True:
        result = cond()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(0.02)


class Watcher:
    """Consumes `registry.watch(kind)` in a task; keeps every event and the view."""

    def __init__(self, registry: EtcdRegistry, kind: str | None = None) -> None:
        self.events: list[NodeEvent] = []
        self.view: dict[tuple[str, str], NodeRecord] = {}
        self._task = asyncio.create_task(self._run(registry, kind))

    async def _run(self, registry: EtcdRegistry, kind: str | None) -> None:
        async for event in registry.watch(kind):
            self.events.append(event)
            key = (event.kind, event.id)
            if event.type == "leave":
                assert key in self.view, f"leave for a node never reported: {event}"
                del self.view[key]
            else:
                assert (event.type == "join") == (key not in self.view), f"bad {event}"
                self.view[key] = event.record

    def ids(self) -> set[str]:
        return {id_ for _, id_ in self.view}

    def of(self, type_: str, id_: str) -> list[NodeEvent]:
        return [e for e in self.events if e.type == type_ and e.id == id_]

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        if not self._task.cancelled() and self._task.exception() is not None:
            raise self._task.exception()  # type: ignore[misc]


def rec(id_: str, kind: str = "engine", **kw: Any) -> NodeRecord:
    return NodeRecord(kind=kind, id=id_, address="127.0.0.1:50051", locality_domain="rack-a", **kw)


# --------------------------------------------------------------------------- tests


def test_register_visible_to_list_get_and_etcdctl(etcd_server: EtcdServer) -> None:
    async def main() -> None:
        async with (
            open_registry(etcd_server.client_url, tls("engine")) as reg,
            open_registry(etcd_server.client_url, tls("store")) as store_reg,
        ):
            assert isinstance(reg, EtcdRegistry) and reg.tls == tls("engine")
            record = rec("e1", model="llama", capacity_bytes=1 << 30)
            await reg.register(record, ttl_s=5)
            await store_reg.register(rec("s1", kind="store"), ttl_s=5)
            assert await reg.list("engine") == [record]
            assert [r.id for r in await reg.list()] == ["e1", "s1"]
            assert await reg.get("engine", "e1") == record
            assert await reg.get("engine", "missing") is None

            value = await aetcdctl(
                etcd_server, "get", node_key("engine", "e1"), "--print-value-only"
            )
            assert NodeRecord.from_json("engine", "e1", value.strip()) == record
            leases = await aetcdctl(etcd_server, "lease", "list")
            assert "found 2 leases" in leases

        # close() revokes the leases: the keys are gone at once.
        assert (
            etcdctl(etcd_server, "get", "--prefix", "/quillcache/v1/nodes/", "--keys-only").strip()
            == ""
        )

    run(main())


def test_unreachable_etcd_fails_fast_with_node_unavailable() -> None:
    async def main() -> None:
        async with EtcdRegistry(
            [f"127.0.0.1:{free_port()}"], tls=tls("engine"), timeout_s=1
        ) as reg:
            started = time.monotonic()
            with pytest.raises(NodeUnavailable):
                await reg.register(rec("e1"), ttl_s=5)
            with pytest.raises(NodeUnavailable):
                await reg.list()
            with pytest.raises(NodeUnavailable):
                await reg.get("engine", "e1")
            assert time.monotonic() - started < 3 * 1 + 1

    run(main())


def test_operator_written_record_shows_in_list_and_watch(etcd_server: EtcdServer) -> None:
    async def main() -> None:
        async with registry(etcd_server, "conductor") as reg:
            watcher = Watcher(reg, "engine")
            body = {"address": "10.0.0.9:50051", "locality_domain": "rack-b", "gpu": "L4"}
            put = [etcd_server, "put"]
            await aetcdctl(*put, node_key("engine", "e9"), json.dumps(body), role="engine")
            await aetcdctl(*put, node_key("engine", "bad"), "{not json", role="engine")
            await aetcdctl(*put, node_key("store", "s9"), "{}", role="store")  # other kind
            await until(lambda: watcher.ids() == {"e9"}, what="join of e9")
            (join,) = watcher.events
            assert join.type == "join" and join.record.extra == {"gpu": "L4"}
            assert join.record.address == "10.0.0.9:50051"
            assert [r.id for r in await reg.list("engine")] == ["e9"]  # "bad" is skipped
            assert await reg.get("engine", "e9") == join.record

            await aetcdctl(etcd_server, "del", node_key("engine", "e9"), role="engine")
            await until(lambda: watcher.of("leave", "e9") != [], what="leave of e9")
            assert watcher.of("leave", "e9")[0].record == join.record
            await watcher.stop()

    run(main())


def test_lost_keepalive_expires_within_ttl(etcd_server: EtcdServer) -> None:
    async def main() -> None:
        owner = registry(etcd_server)
        observer = registry(etcd_server, "conductor")
        try:
            await owner.register(rec("e1"), ttl_s=1)
            await owner.register(rec("e2"), ttl_s=1)
            watcher = Watcher(observer, "engine")
            await until(lambda: watcher.ids() == {"e1", "e2"}, what="joins")
            # An absence check, not synchronization: with the keepalive running the
            # nodes stay through several TTLs.
            await asyncio.sleep(2.5)
            assert watcher.ids() == {"e1", "e2"} and watcher.events == watcher.events[:2]

            await owner.stop_keepalive("engine", "e1")  # as if the owner hung
            took = await until(lambda: watcher.of("leave", "e1") != [], timeout_s=2.0 + 1.0)
            assert took <= 1 + 1.0, f"leave after {took:.2f}s"
            assert await observer.get("engine", "e1") is None
            assert watcher.ids() == {"e2"}
            await watcher.stop()
        finally:
            await owner.close()
            await observer.close()

    run(main())


CHILD = """
import asyncio, sys
from quillcache_core.registry import NodeRecord, open_registry
from quillcache_core.security.tls import Tls

async def main():
    reg = open_registry(sys.argv[1], Tls.from_dir(sys.argv[2], "engine"))
    await reg.register(NodeRecord("engine", "child", "127.0.0.1:1", "rack-a"), ttl_s=1)
    print("registered", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_sigkilled_owner_process_expires(etcd_server: EtcdServer, tmp_path: Any) -> None:
    child = ManagedProcess(
        [sys.executable, "-c", CHILD, etcd_server.client_url, str(certs_dir())],
        log_path=tmp_path / "child.log",
    )

    async def main() -> None:
        async with registry(etcd_server, "conductor") as reg:
            watcher = Watcher(reg)
            await child.wait_ready_async(lambda: watcher.ids() == {"child"}, timeout_s=15)
            child.signal(9)  # SIGKILL the whole group: no deregister, no revoke
            took = await until(lambda: watcher.of("leave", "child") != [], timeout_s=3.0)
            assert took <= 1 + 1.0, f"leave after {took:.2f}s"
            await watcher.stop()

    with child:
        run(main())


def test_deregister_removes_at_once(etcd_server: EtcdServer) -> None:
    async def main() -> None:
        async with registry(etcd_server) as reg:
            watcher = Watcher(reg)
            await reg.register(rec("e1"), ttl_s=30)
            await until(lambda: watcher.ids() == {"e1"})
            started = time.monotonic()
            await reg.deregister("engine", "e1")
            assert await reg.get("engine", "e1") is None
            assert not await has_key(etcd_server, "e1")
            await until(lambda: watcher.of("leave", "e1") != [], timeout_s=2)
            assert time.monotonic() - started < 2  # not the 30 s TTL
            await reg.deregister("engine", "e1")  # no-op
            await watcher.stop()

    run(main())


def test_watch_snapshot_then_live_has_no_gaps_or_duplicates(etcd_server: EtcdServer) -> None:
    async def main() -> None:
        async with registry(etcd_server) as reg:
            before = [f"a{i:02d}" for i in range(20)]
            during = [f"b{i:02d}" for i in range(20)]
            await asyncio.gather(*(reg.register(rec(i), ttl_s=10) for i in before))

            # Registrations race with the watch's snapshot: each node must be
            # reported exactly once, whether via the snapshot or the live stream.
            watcher = Watcher(reg, "engine")
            await asyncio.gather(*(reg.register(rec(i), ttl_s=10) for i in during))
            await reg.register(rec("zz-last"), ttl_s=10)
            await until(lambda: "zz-last" in watcher.ids(), what="last join")

            joins = [e.id for e in watcher.events if e.type == "join"]
            assert sorted(joins) == sorted([*before, *during, "zz-last"])
            assert [e for e in watcher.events if e.type != "join"] == []

            # Live updates and leaves after the snapshot.
            await reg.register(rec("a00", model="m2"), ttl_s=10)
            await reg.deregister("engine", "a01")
            await until(lambda: watcher.of("leave", "a01") != [], what="leave a01")
            (update,) = watcher.of("update", "a00")
            assert update.record.model == "m2"
            assert watcher.view[("engine", "a00")].model == "m2"
            assert len(watcher.ids()) == 40
            await watcher.stop()

    run(main())


def test_watch_and_registration_survive_etcd_restart(etcd_server: EtcdServer) -> None:
    async def main() -> None:
        owner = registry(etcd_server, timeout_s=2)
        observer = registry(etcd_server, "conductor", timeout_s=2)
        try:
            await owner.register(rec("e1"), ttl_s=1)
            watcher = Watcher(observer, "engine")
            await until(lambda: watcher.ids() == {"e1"})

            await asyncio.to_thread(etcd_server.restart)  # same ports, same data dir

            late = registry(etcd_server)
            try:
                await late.register(rec("e2"), ttl_s=5)
                await until(lambda: watcher.ids() == {"e1", "e2"}, timeout_s=8, what="join e2")
                assert len(watcher.of("join", "e2")) == 1
                # e1 is (still, or again) registered; its keepalive carried on.
                await until(lambda: has_key(etcd_server, "e1"), timeout_s=5)
                assert await observer.get("engine", "e1") == rec("e1")
            finally:
                await late.close()
            await until(lambda: watcher.ids() == {"e1"}, what="leave e2")
            await watcher.stop()
        finally:
            await owner.close()
            await observer.close()

    run(main())


def test_registration_and_watch_recover_after_etcd_loses_its_data(etcd_server: EtcdServer) -> None:
    async def main() -> None:
        owner = registry(etcd_server, timeout_s=2)
        observer = registry(etcd_server, "conductor", timeout_s=2)
        try:
            await owner.register(rec("e1"), ttl_s=1)
            await aetcdctl(etcd_server, "put", node_key("engine", "op"), "{}", role="engine")
            watcher = Watcher(observer, "engine")
            await until(lambda: watcher.ids() == {"e1", "op"})

            # Same address, empty etcd: leases and keys are gone, revisions restart.
            await asyncio.to_thread(etcd_server.restart, wipe_data=True)

            # The owner notices the lease is gone and registers again.
            took = await until(lambda: has_key(etcd_server, "e1"), timeout_s=5)
            assert took < 5
            # The watcher re-lists: "op" vanished while it was disconnected.
            await until(lambda: watcher.ids() == {"e1"}, timeout_s=8, what="re-listed view")
            assert len(watcher.of("leave", "op")) == 1
            assert await observer.list() == [rec("e1")]

            # And live events flow again on the new etcd.
            await owner.register(rec("e3"), ttl_s=1)
            await until(lambda: watcher.ids() == {"e1", "e3"}, what="join e3")
            await watcher.stop()
        finally:
            await owner.close()
            await observer.close()

    run(main())


def test_plaintext_etcd_without_tls_still_works(plain_etcd_server: EtcdServer) -> None:
    """`--insecure` setups: an etcd without TLS or auth, reached over http://."""
    assert plain_etcd_server.client_url.startswith("http://")

    async def main() -> None:
        async with (
            open_registry(plain_etcd_server.client_url) as reg,
            open_registry(f"etcd://{plain_etcd_server.endpoint}") as observer,
        ):
            watcher = Watcher(observer)
            await reg.register(rec("e1"), ttl_s=5)
            await reg.register(rec("s1", kind="store"), ttl_s=5)  # no roles here
            await until(lambda: watcher.ids() == {"e1", "s1"}, what="joins")
            assert (await aetcdctl(plain_etcd_server, "get", node_key("engine", "e1"))) != ""
            await watcher.stop()

    run(main())
