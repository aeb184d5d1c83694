"""etcd's peer port and its leases, attacked from the same host (the `etcd_server`
fixture, secure as `quillcache up` runs it).

The peer port carries raft and the lease renewals followers forward; etcd's RBAC does
not reach it, so it takes only an etcd member's certificate. And since etcd lets any
client keep any lease alive, a node stays in the registry only while its owner rewrites
its record: a foreign keepalive buys nothing.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from etcd3aio import _protobuf as pb

from quillcache_core.launch.etcd_server import PEER_ROLE, EtcdServer
from quillcache_core.registry import EtcdRegistry, NodeEvent, NodeRecord, node_key
from quillcache_core.registry.renewals import STALE_AFTER_TTLS
from quillcache_core.security.certs import make_certs
from tests.support.aio import run
from tests.support.etcdctl import etcdctl
from tests.support.tls import certs_dir, channel, tls

pytestmark = pytest.mark.integration

TTL_S = 2
STORE_0 = NodeRecord("store", "store-0", "127.0.0.1:1", "rack-a", start_time_s=1.0)
STORE_1 = NodeRecord("store", "store-1", "127.0.0.1:2", "rack-a", start_time_s=1.0)


def registry(server: EtcdServer, role: str) -> EtcdRegistry:
    return EtcdRegistry([server.endpoint], tls=tls(role))


def lease_of(server: EtcdServer, key: str) -> int:
    """The lease `key` is on, as etcd's root sees it."""
    out = etcdctl(server, "get", key, "-w", "json")
    (kv,) = json.loads(out)["kvs"]
    return int(kv["lease"])


def has_key(server: EtcdServer, key: str) -> bool:
    return etcdctl(server, "get", key, "--keys-only").strip() != ""


def raft_status(server: EtcdServer) -> dict[str, Any]:
    (status,) = json.loads(etcdctl(server, "endpoint", "status", "-w", "json"))
    return status["Status"]


def until(cond, timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not cond():
        assert time.monotonic() - started < timeout_s, f"{what} not within {timeout_s}s"
        time.sleep(0.05)
    return time.monotonic() - started


# ------------------------------------------------------------------ the peer port


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def peer_attacks(server: EtcdServer, lease: int) -> dict[str, tuple[str, bytes, dict[str, str]]]:
    """What a local process sends etcd's peer port: renew a lease, read a lease's keys
    past RBAC, and a raft heartbeat of a far higher term (the leader steps down)."""
    header = raft_status(server)["header"]
    ttl = pb.LeaseTimeToLiveRequest(ID=lease, keys=True).SerializeToString()
    heartbeat = b"".join(  # raftpb.Message: type MsgHeartbeat, to, from, term
        _varint(field << 3) + _varint(value)
        for field, value in ((1, 8), (2, header["member_id"]), (3, 0x1234), (4, 10**6))
    )
    protobuf = {"Content-Type": "application/protobuf"}
    raft = {
        **protobuf,
        "X-Etcd-Cluster-ID": format(header["cluster_id"], "x"),
        "X-Server-From": "1234",
        "X-Server-Version": "3.5.1",
        "X-Min-Cluster-Version": "3.0.0",
    }
    return {
        "renew": ("/leases", pb.LeaseKeepAliveRequest(ID=lease).SerializeToString(), protobuf),
        "lease keys": ("/leases/internal", b"\x0a" + _varint(len(ttl)) + ttl, protobuf),
        "raft": ("/raft", heartbeat, raft),
    }


def tls_context(cert_dir: Path | None, role: str | None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the attacker trusts anything
    if cert_dir is not None and role is not None:
        context.load_cert_chain(cert_dir / f"{role}.pem", cert_dir / f"{role}-key.pem")
    return context


def post(port: int, context: ssl.SSLContext | None, path: str, body: bytes, headers) -> int:
    """The HTTP status the peer port answers, or 0 when it gives no session at all."""
    if context is None:
        conn: http.client.HTTPConnection = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=3, context=context)
    try:
        conn.request("POST" if body else "GET", path, body=body or None, headers=headers)
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):  # ssl.SSLError, reset, closed
        return 0
    finally:
        conn.close()


def test_etcd_peer_port_refuses_a_client_without_the_etcd_members_certificate(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    key = node_key("store", "store-0")
    foreign_ca = make_certs(tmp_path / "foreign")  # its `etcd` pair: the right name, wrong CA
    clients = {
        "plaintext": None,
        "TLS without a certificate": tls_context(None, None),
        "a certificate of another CA": tls_context(foreign_ca, PEER_ROLE),
        "an engine certificate of the cluster's CA": tls_context(certs_dir(), "engine"),
    }

    async def register_and_hang() -> None:
        owner = registry(etcd_server, "store")
        await owner.register(STORE_0, ttl_s=TTL_S)
        await owner.stop_keepalive("store", "store-0")  # store-0 hangs; its lease runs on
        await owner.close()  # revokes nothing: store-0 is no longer its registration

    run(register_and_hang())
    stopped = time.monotonic()
    term = raft_status(etcd_server)["raftTerm"]
    attacks = peer_attacks(etcd_server, lease_of(etcd_server, key))

    answered: dict[tuple[str, str], int] = {}
    while has_key(etcd_server, key) and time.monotonic() - stopped < TTL_S + 4:
        for who, context in clients.items():
            for what, (path, body, headers) in attacks.items():
                status = post(etcd_server.peer_port, context, path, body, headers)
                if 200 <= status < 300:
                    answered[(who, what)] = status
        time.sleep(0.2)

    assert answered == {}, f"the peer port served {answered}"
    assert not has_key(etcd_server, key), "store-0's lease was kept alive through the peer port"
    assert time.monotonic() - stopped < TTL_S + 2  # etcd checks expiry every 0.5 s
    assert raft_status(etcd_server)["raftTerm"] == term, "a foreign raft message moved the term"

    # The member itself, with etcd's certificate, is served; the cluster still works.
    member = tls_context(certs_dir(), PEER_ROLE)
    assert post(etcd_server.peer_port, member, "/version", b"", {}) == 200

    async def still_works() -> None:
        async with registry(etcd_server, "store") as owner:
            started = time.monotonic()
            await owner.register(STORE_1, ttl_s=TTL_S)
            assert await owner.get("store", "store-1") == STORE_1
            assert time.monotonic() - started < 2.0

    run(still_works())


# ---------------------------------------------------------------------- leases


class Watcher:
    def __init__(self, registry: EtcdRegistry) -> None:
        self.events: list[NodeEvent] = []
        self._task = asyncio.create_task(self._run(registry))

    async def _run(self, registry: EtcdRegistry) -> None:
        async for event in registry.watch("store"):
            self.events.append(event)

    def of(self, type_: str, id_: str) -> list[NodeEvent]:
        return [e for e in self.events if e.type == type_ and e.id == id_]

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def wait_for(cond, timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not await cond():
        assert time.monotonic() - started < timeout_s, f"{what} not within {timeout_s}s"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def test_a_foreign_keepalive_does_not_keep_a_stopped_store_in_the_registry(
    etcd_server: EtcdServer,
) -> None:
    key = node_key("store", "store-0")

    async def main() -> None:
        store_0, store_1 = registry(etcd_server, "store"), registry(etcd_server, "store")
        reader = registry(etcd_server, "conductor")
        engine = channel(etcd_server.endpoint, "engine", aio=True)
        leases = pb.LeaseStub(engine)
        keepalives: list[int] = []

        async def keep_alive(lease: int) -> None:  # as the engine, every 0.3 s
            while True:
                call = leases.LeaseKeepAlive()
                await call.write(pb.LeaseKeepAliveRequest(ID=lease))
                keepalives.append((await call.read()).TTL)
                call.cancel()
                await asyncio.sleep(0.3)

        try:
            await store_0.register(STORE_0, ttl_s=TTL_S)
            await store_1.register(STORE_1, ttl_s=TTL_S)
            watcher = Watcher(reader)

            async def both_joined() -> bool:
                return {e.id for e in watcher.events} == {"store-0", "store-1"}

            await wait_for(both_joined, 5, "both stores joined")

            # What an engine certificate reaches of store-0's lease: etcd 3.5 checks no
            # permission on listing leases, their keys or keepalives (the keys it sees
            # are node records, which its role reads anyway); revoking it is refused.
            listed = (await leases.LeaseLeases(pb.LeaseLeasesRequest(), timeout=5)).leases
            found = {}
            for lease in listed:
                reply = await leases.LeaseTimeToLive(
                    pb.LeaseTimeToLiveRequest(ID=lease.ID, keys=True), timeout=5
                )
                found.update({k.decode(): lease.ID for k in reply.keys})
            assert all(k.startswith("/quillcache/v1/nodes/") for k in found)
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await leases.LeaseRevoke(pb.LeaseRevokeRequest(ID=found[key]), timeout=5)
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED

            attack = asyncio.create_task(keep_alive(found[key]))
            await store_0.stop_keepalive("store", "store-0")  # store-0 hangs
            stopped = time.monotonic()

            async def store_0_left() -> bool:
                return bool(watcher.of("leave", "store-0"))

            await wait_for(store_0_left, STALE_AFTER_TTLS * TTL_S + 2, "store-0's leave")
            assert [r.id for r in await reader.list("store")] == ["store-1"]
            assert await reader.get("store", "store-0") is None
            # The lease itself lives on: only the owner's renewals count.
            assert await asyncio.to_thread(has_key, etcd_server, key)
            assert keepalives and all(ttl > 0 for ttl in keepalives)
            assert time.monotonic() - stopped > TTL_S
            # store-1, renewing itself, stayed throughout.
            assert watcher.of("leave", "store-1") == []

            # store-0 back (a new run registers): in the fleet again.
            async with registry(etcd_server, "store") as back:
                await back.register(STORE_0, ttl_s=TTL_S)

                async def store_0_back() -> bool:
                    return len(watcher.of("join", "store-0")) == 2

                await wait_for(store_0_back, 5, "store-0's join")
                assert await reader.get("store", "store-0") == STORE_0
            attack.cancel()
            await asyncio.gather(attack, return_exceptions=True)
            await watcher.stop()
        finally:
            await engine.close()
            for reg in (store_0, store_1, reader):
                await reg.close()

    run(main(), timeout_s=60)
