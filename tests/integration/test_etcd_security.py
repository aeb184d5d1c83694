"""etcd secure by default: TLS with client certificates and RBAC (the `etcd_server`
fixture, certificates of `tests.support.tls`).

Without a certificate of the cluster's CA nobody gets an answer; with one, etcd takes
its common name as the user, and each component role may write only its own kind's
node records while everyone reads the fleet.
"""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from etcd3aio._protobuf import KVStub, PutRequest, RangeRequest

from quillcache_core.errors import InvalidArgument, NodeUnavailable
from quillcache_core.launch import etcd_server as etcd_module
from quillcache_core.launch.etcd_server import ETCD_ROLES, ETCD_USERS, EtcdServer
from quillcache_core.registry import (
    NODE_KINDS,
    NODES_PREFIX,
    EtcdRegistry,
    NodeEvent,
    NodeRecord,
    RegistryAccessDenied,
    node_key,
    open_registry,
)
from quillcache_core.security.certs import SERVER_NAME
from tests.support.aio import run
from tests.support.etcdctl import etcdctl, put_engine
from tests.support.tls import certs_dir, tls

pytestmark = pytest.mark.integration

ENGINE_KEY = node_key("engine", "x")


def registry(server: EtcdServer, role: str, **kw: Any) -> EtcdRegistry:
    return EtcdRegistry([server.endpoint], tls=tls(role), **kw)


def rec(id_: str, kind: str = "engine") -> NodeRecord:
    return NodeRecord(kind=kind, id=id_, address="127.0.0.1:50051", locality_domain="rack-a")


async def until(cond: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(0.02)


class Watcher:
    """Everything `registry.watch(kind)` reports, as a conductor would follow it."""

    def __init__(self, registry: EtcdRegistry, kind: str | None = None) -> None:
        self.events: list[NodeEvent] = []
        self._task = asyncio.create_task(self._run(registry, kind))

    async def _run(self, registry: EtcdRegistry, kind: str | None) -> None:
        async for event in registry.watch(kind):
            self.events.append(event)

    def ids(self) -> set[str]:
        return {e.id for e in self.events}

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        if not self._task.cancelled() and self._task.exception() is not None:
            raise self._task.exception()  # type: ignore[misc]


def denied(server: EtcdServer, *args: str, role: str) -> str:
    """Run etcdctl as `role`, expecting a refusal; returns its stderr."""
    with pytest.raises(subprocess.CalledProcessError) as info:
        etcdctl(server, *args, role=role)
    return info.value.stderr.decode()


def grpc_range(channel: grpc.Channel, key: str = NODES_PREFIX) -> None:
    KVStub(channel).Range(RangeRequest(key=key.encode()), timeout=3)


# --------------------------------------------------------------------------- tests


def test_rbac_layout_matches_the_registry_keys() -> None:
    """The server's copy of the key layout is the registry's."""
    assert etcd_module.NODES_PREFIX == NODES_PREFIX
    assert etcd_module.NODE_KINDS == NODE_KINDS
    assert set(ETCD_USERS) == {"root", "operator", *NODE_KINDS}
    for kind in NODE_KINDS:
        assert ETCD_ROLES[kind] == [("readwrite", f"{NODES_PREFIX}{kind}/"), ("read", NODES_PREFIX)]
    assert ETCD_ROLES["operator"] == [("read", "/quillcache/")]


def test_secure_server_serves_https_only(etcd_server: EtcdServer) -> None:
    assert etcd_server.client_url == f"https://{etcd_server.endpoint}"
    assert etcd_server.tls_dir == certs_dir()
    assert etcd_server.etcdctl_args("store")[-4:] == [
        "--cert",
        str(certs_dir() / "store.pem"),
        "--key",
        str(certs_dir() / "store-key.pem"),
    ]
    roles = etcdctl(etcd_server, "role", "list").split()
    assert set(roles) == {"root", *ETCD_ROLES}
    assert "root" in etcdctl(etcd_server, "user", "get", "root")
    assert "Authentication Status: true" in etcdctl(etcd_server, "auth", "status")


def test_plaintext_client_gets_no_answer(etcd_server: EtcdServer) -> None:
    # etcdctl over http:// to the TLS port.
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run(
            [
                etcd_module.find_etcd_binary("etcdctl"),
                "--endpoints",
                f"http://{etcd_server.endpoint}",
                "--dial-timeout",
                "1s",
                "--command-timeout",
                "2s",
                "get",
                "/quillcache/",
            ],
            capture_output=True,
            timeout=10,
            check=True,
        )
    # A plaintext gRPC channel.
    with (
        grpc.insecure_channel(etcd_server.endpoint) as channel,
        pytest.raises(grpc.RpcError) as info,
    ):
        grpc_range(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # Plain HTTP.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with pytest.raises((urllib.error.URLError, OSError)):
        opener.open(f"http://{etcd_server.endpoint}/health", timeout=2).read()

    # And the registry in plaintext fails as unavailable, quickly.
    async def main() -> None:
        async with EtcdRegistry([etcd_server.endpoint], timeout_s=1) as reg:
            started = time.monotonic()
            with pytest.raises(NodeUnavailable):
                await reg.list()
            assert time.monotonic() - started < 5

    run(main())


def test_tls_without_client_certificate_is_refused(etcd_server: EtcdServer) -> None:
    ca = (certs_dir() / "ca.pem").read_bytes()
    creds = grpc.ssl_channel_credentials(root_certificates=ca)
    options = [("grpc.ssl_target_name_override", SERVER_NAME)]
    with grpc.secure_channel(etcd_server.endpoint, creds, options) as channel:
        with pytest.raises(grpc.RpcError) as info:
            grpc_range(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    ctx = ssl.create_default_context(cafile=str(certs_dir() / "ca.pem"))
    ctx.check_hostname = False
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx)
    )
    with pytest.raises((urllib.error.URLError, OSError)):
        opener.open(f"{etcd_server.client_url}/health", timeout=2).read()

    # The same with a client certificate works (health needs no role).
    ctx.load_cert_chain(str(certs_dir() / "gateway.pem"), str(certs_dir() / "gateway-key.pem"))
    with opener.open(f"{etcd_server.client_url}/health", timeout=2) as resp:
        assert b'"health":"true"' in resp.read()


def test_only_an_engine_certificate_writes_engine_records(etcd_server: EtcdServer) -> None:
    for role in ("store", "conductor", "transfer", "gateway", "operator", "etcd"):
        err = denied(etcd_server, "put", ENGINE_KEY, "{}", role=role)
        assert "permission denied" in err, (role, err)
    etcdctl(etcd_server, "put", ENGINE_KEY, "{}", role="engine")
    assert etcdctl(etcd_server, "get", ENGINE_KEY, "--print-value-only", role="store") == "{}\n"
    # Not even deleting someone else's record.
    assert "permission denied" in denied(etcd_server, "del", ENGINE_KEY, role="store")
    # A gRPC client with the store's certificate: PERMISSION_DENIED.
    with grpc.secure_channel(
        etcd_server.endpoint,
        tls("store").channel_credentials(),
        [("grpc.ssl_target_name_override", SERVER_NAME)],
    ) as channel:
        stub = KVStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Put(PutRequest(key=ENGINE_KEY.encode(), value=b"{}"), timeout=3)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        stub.Put(PutRequest(key=node_key("store", "s1").encode(), value=b"{}"), timeout=3)
    # Nobody writes outside the node records (but root).
    assert "permission denied" in denied(etcd_server, "put", "/other", "x", role="engine")


def test_every_role_registers_its_own_kind_and_reads_the_fleet(etcd_server: EtcdServer) -> None:
    async def main() -> None:
        regs = {kind: registry(etcd_server, kind, timeout_s=3) for kind in NODE_KINDS}
        try:
            for kind, reg in regs.items():
                await reg.register(rec(f"{kind}-1", kind), ttl_s=5)
            everyone = {(r.kind, r.id) for r in await regs["gateway"].list()}
            assert everyone == {(kind, f"{kind}-1") for kind in NODE_KINDS}
            for reg in regs.values():
                assert len(await reg.list()) == len(NODE_KINDS)
        finally:
            for reg in regs.values():
                await reg.close()
        # close() revoked every lease (RBAC lets each owner revoke its own).
        assert etcdctl(etcd_server, "get", "--prefix", NODES_PREFIX, "--keys-only") == ""

    run(main())


def test_register_of_another_kind_fails_clearly(etcd_server: EtcdServer) -> None:
    async def main() -> None:
        async with registry(etcd_server, "store", timeout_s=3) as reg:
            started = time.monotonic()
            with pytest.raises(RegistryAccessDenied) as info:
                await reg.register(rec("x"), ttl_s=5)
            assert time.monotonic() - started < 3  # an answer, not a hang or retries
            message = str(info.value)
            assert "'store'" in message and ENGINE_KEY in message and "PERMISSION_DENIED" in message
            # Its own kind is fine, and the refused attempt left no lease behind.
            await reg.register(rec("s1", "store"), ttl_s=5)
            leases = await asyncio.to_thread(etcdctl, etcd_server, "lease", "list")
            assert "found 1 leases" in leases

    run(main())


def test_fake_engine_from_wrong_role_never_reaches_a_watcher(etcd_server: EtcdServer) -> None:
    async def main() -> None:
        async with (
            registry(etcd_server, "conductor") as conductor,
            registry(etcd_server, "store") as store,
            registry(etcd_server, "engine") as engine,
        ):
            watcher = Watcher(conductor)
            with pytest.raises(RegistryAccessDenied):
                await store.register(rec("fake"), ttl_s=5)
            with pytest.raises(RegistryAccessDenied):
                await conductor.register(rec("fake"), ttl_s=5)
            for role in ("store", "gateway", "transfer"):
                await asyncio.to_thread(
                    denied, etcd_server, "put", node_key("engine", "fake"), "{}", role=role
                )
            # A real engine registers after the attempts; once the watcher has seen
            # it, it has seen everything before it.
            await engine.register(rec("real"), ttl_s=5)
            await until(lambda: "real" in watcher.ids(), what="join of the real engine")
            assert watcher.ids() == {"real"}
            assert [r.id for r in await conductor.list()] == ["real"]
            assert await conductor.get("engine", "fake") is None
            await watcher.stop()

    run(main())


def test_operator_reads_but_cannot_write(etcd_server: EtcdServer) -> None:
    put_engine(etcd_server, "e1", model="m", tokenizer="t")  # as the engine role
    out = etcdctl(etcd_server, "get", "--prefix", "/quillcache/", "--keys-only", role="operator")
    assert out.split() == [node_key("engine", "e1")]
    assert "permission denied" in denied(etcd_server, "put", ENGINE_KEY, "{}", role="operator")
    assert "permission denied" in denied(
        etcd_server, "del", node_key("engine", "e1"), role="operator"
    )

    async def main() -> None:
        async with registry(etcd_server, "operator") as reg:
            watcher = Watcher(reg, "engine")
            await until(lambda: watcher.ids() == {"e1"}, what="operator's watch")
            assert [r.id for r in await reg.list()] == ["e1"]
            with pytest.raises(RegistryAccessDenied):
                await reg.register(rec("op"), ttl_s=5)
            await watcher.stop()

    run(main())


def test_certificate_without_an_etcd_user_reads_nothing(etcd_server: EtcdServer) -> None:
    """etcd's own server certificate is of the CA but names no etcd user."""
    put_engine(etcd_server, "e1", model="m", tokenizer="t")

    async def main() -> None:
        async with registry(etcd_server, "etcd", timeout_s=3) as reg:
            with pytest.raises(RegistryAccessDenied, match="'etcd'"):
                await reg.list()
            with pytest.raises(RegistryAccessDenied):
                await reg.get("engine", "e1")
            with pytest.raises(RegistryAccessDenied):  # a watch ends with the refusal
                async for _ in reg.watch("engine"):
                    pass

    run(main())


def test_registration_keeps_and_renews_its_lease_under_rbac(etcd_server: EtcdServer) -> None:
    async def main() -> None:
        async with (
            registry(etcd_server, "engine", timeout_s=2) as owner,
            registry(etcd_server, "conductor", timeout_s=2) as observer,
        ):
            await owner.register(rec("e1"), ttl_s=1)
            await owner.register(rec("e1"), ttl_s=1)  # again: new lease, old one revoked
            watcher = Watcher(observer, "engine")
            await until(lambda: watcher.ids() == {"e1"})
            await asyncio.sleep(2.5)  # keepalives carry it through several TTLs
            assert [e.type for e in watcher.events] == ["join"]
            leases = etcdctl(etcd_server, "lease", "list").split()
            assert leases[:3] == ["found", "1", "leases"]

            # The lease is taken away (root revokes it): the owner registers anew.
            await asyncio.to_thread(etcdctl, etcd_server, "lease", "revoke", leases[-1])
            await until(
                lambda: [e.type for e in watcher.events] == ["join", "leave", "join"],
                timeout_s=5,
                what="leave and re-join",
            )
            await owner.deregister("engine", "e1")
            await until(lambda: watcher.events[-1].type == "leave", what="deregister")
            await watcher.stop()

    run(main())


def test_auth_survives_restart_and_is_set_up_again_after_data_loss(
    etcd_server: EtcdServer,
) -> None:
    etcd_server.restart()
    assert "permission denied" in denied(etcd_server, "put", ENGINE_KEY, "{}", role="store")
    etcd_server.restart(wipe_data=True)  # a fresh etcd: users and roles made again
    assert "permission denied" in denied(etcd_server, "put", ENGINE_KEY, "{}", role="store")
    etcdctl(etcd_server, "put", ENGINE_KEY, "{}", role="engine")
    # Another server object on the same data dir (e.g. `quillcache up` run again).
    etcd_server.stop()
    again = EtcdServer(
        etcd_server.data_dir,
        client_port=etcd_server.client_port,
        peer_port=etcd_server.peer_port,
        tls_dir=certs_dir(),
    )
    with again:
        assert etcdctl(again, "get", ENGINE_KEY, "--print-value-only", role="operator") == "{}\n"
        assert "permission denied" in denied(again, "put", ENGINE_KEY, "{}", role="store")


def test_https_registry_needs_certificates(etcd_server: EtcdServer) -> None:
    with pytest.raises(InvalidArgument, match="certificates"):
        open_registry(etcd_server.client_url)
    with pytest.raises(InvalidArgument, match="certificates"):
        EtcdRegistry([etcd_server.client_url])
    reg = open_registry(etcd_server.client_url, tls("engine"))
    assert isinstance(reg, EtcdRegistry) and reg.endpoints == [etcd_server.endpoint]
