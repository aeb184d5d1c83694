"""Supervision of `quillcache up`'s processes: a process that dies is started again, on
the same address, with backoff, and every restart is logged.

Same address: once a child has printed its READY line, the ports it bound (its gRPC,
HTTP, metrics, plan and data ports, or its KV event sockets) are pinned on its command
line as flags (`pinned_ports`), so every later start binds them again and no client,
endpoints file or registry record has to learn a new one. etcd is restarted on its
ports and data dir (`EtcdServer.restart`).

Backoff: the first restart of a process waits `initial_backoff_s` (0.5 s), each further
one twice the last, up to `max_backoff_s` (10 s); a process that stays up
`stable_s` (30 s) starts from 0.5 s again. A restarted process that prints no READY
line or is not healthy within `start_timeout_s` is killed, which counts as another
exit. Log lines:

    supervisor: conductor exited with -9, restarting in 0.5s (restart 1)
    supervisor: conductor is back on 127.0.0.1:41231 (pid 4242), 1.46s after it exited

`Supervisor.poll()` does one pass; `start()` runs passes on a thread every
`interval_s` until `stop()`. `LocalCluster(supervise=True)` (what `quillcache up` uses)
starts one once the cluster is up and stops it before stopping the processes.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from quillcache_core.launch.process import Child, signal_group

if TYPE_CHECKING:
    from quillcache_core.launch.etcd_server import EtcdServer


class Supervised(Protocol):
    """What the supervisor needs of a cluster (`LocalCluster` is one)."""

    lock: threading.Lock
    children: list[Child]
    etcd: EtcdServer | None

    def respawn(self, child: Child) -> None: ...

    def ready(self, child: Child) -> bool: ...

    def log(self, line: str) -> None: ...


# READY line field -> the flag that binds the same port again, per service.
PORT_FLAGS: dict[str, dict[str, str]] = {
    "conductor": {"grpc": "--port", "metrics": "--metrics-port", "plan": "--plan-port"},
    "store": {"grpc": "--port", "metrics": "--metrics-port", "data": "--data-port"},
    "transfer": {"grpc": "--port", "metrics": "--metrics-port"},
    "sim-engine": {"http": "--port", "kv_events": "--kv-events-port", "replay": "--kv-replay-port"},
    "gateway": {"http": "--port"},
}


def pinned_ports(service: str, fields: dict[str, str]) -> list[str]:
    """The flags that make `service` bind the ports its READY line reported again."""
    flags: list[str] = []
    for name, flag in PORT_FLAGS.get(service, {}).items():
        port = fields.get(name, "").rstrip("/").rpartition(":")[2]
        if port.isdigit() and int(port) > 0:
            flags += [flag, port]
    return flags


@dataclass
class Restart:
    """One restart: who, its exit code, the backoff waited, when it was back."""

    name: str
    code: int | None
    restart: int  # the process's restart count, this one included
    delay_s: float
    exited_at: float  # monotonic, when the exit was seen
    back_at: float | None = None  # monotonic, when it was healthy again

    @property
    def downtime_s(self) -> float | None:
        return None if self.back_at is None else self.back_at - self.exited_at


@dataclass
class _Watch:
    backoff_s: float
    restarts: int = 0
    restart_at: float | None = None  # exited: start again then
    starting_since: float | None = None  # started again, not yet healthy
    up_since: float | None = None
    last: Restart | None = None


class Supervisor:
    def __init__(
        self,
        cluster: Supervised,
        *,
        initial_backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        stable_s: float = 30.0,
        start_timeout_s: float = 120.0,
        interval_s: float = 0.1,
    ) -> None:
        self.cluster = cluster
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_s = stable_s
        self.start_timeout_s = start_timeout_s
        self.interval_s = interval_s
        self.restarts: list[Restart] = []
        self._watches: dict[str, _Watch] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- thread ----------------------------------------------------------------------

    def start(self) -> Supervisor:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - supervision must outlive any one pass
                self._log(f"supervisor: pass failed: {exc!r}")

    def forget(self, name: str) -> None:
        """Start over with `name` (it was restarted by hand): no backoff, up from now."""
        self._watches.pop(name, None)

    # --- one pass --------------------------------------------------------------------

    def poll(self) -> None:
        """Notice exits, start due restarts, see restarted processes healthy again."""
        cluster = self.cluster
        self._poll_etcd()
        with cluster.lock:
            children = [c for c in cluster.children if not c.paused and c.proc is not None]
        for child in children:
            if self._stop.is_set():
                return
            with cluster.lock:
                if not child.paused and child in cluster.children:
                    self._poll_child(child)

    def _poll_child(self, child: Child) -> None:
        now = time.monotonic()
        watch = self._watches.setdefault(child.name, _Watch(self.initial_backoff_s))
        if watch.restart_at is not None:
            if now >= watch.restart_at:
                watch.restart_at = None
                watch.starting_since = now
                self.cluster.respawn(child)
            return
        assert child.proc is not None
        code = child.proc.poll()
        if code is not None:
            self._exited(child.name, watch, code, now)
            return
        if watch.starting_since is not None:
            if self.cluster.ready(child):
                watch.starting_since = None
                watch.up_since = now
                self._back(child.name, watch, _address(child), child.proc.pid, now)
            elif now - watch.starting_since > self.start_timeout_s:
                self._log(
                    f"supervisor: {child.name} not healthy {self.start_timeout_s:.0f}s after "
                    "its restart: killing it"
                )
                signal_group(child.proc, signal.SIGKILL)
            return
        self._maybe_stable(watch, now)

    def _poll_etcd(self) -> None:
        etcd = self.cluster.etcd
        if etcd is None:
            return
        now = time.monotonic()
        watch = self._watches.setdefault("etcd", _Watch(self.initial_backoff_s))
        if watch.restart_at is not None:
            if now >= watch.restart_at:
                watch.restart_at = None
                try:
                    etcd.restart()  # the same ports and data; waits until healthy
                except Exception as exc:  # noqa: BLE001 - counts as another exit
                    self._log(f"supervisor: etcd did not start again: {exc}")
                    self._exited("etcd", watch, None, time.monotonic())
                    return
                pid = etcd.pid or 0
                self._back("etcd", watch, etcd.client_url, pid, time.monotonic())
                watch.up_since = time.monotonic()
            return
        if etcd.running:
            self._maybe_stable(watch, now)
            return
        self._exited("etcd", watch, etcd.returncode, now)

    # --- bookkeeping -----------------------------------------------------------------

    def _exited(self, name: str, watch: _Watch, code: int | None, now: float) -> None:
        delay = watch.backoff_s
        watch.backoff_s = min(watch.backoff_s * 2, self.max_backoff_s)
        watch.restarts += 1
        watch.restart_at = now + delay
        watch.starting_since = watch.up_since = None
        watch.last = Restart(name, code, watch.restarts, delay, now)
        self.restarts.append(watch.last)
        self._log(
            f"supervisor: {name} exited with {code}, restarting in {delay:g}s "
            f"(restart {watch.restarts})"
        )

    def _back(self, name: str, watch: _Watch, address: str, pid: int, now: float) -> None:
        last = watch.last
        after = ""
        if last is not None and last.back_at is None:
            last.back_at = now
            after = f", {now - last.exited_at:.2f}s after it exited"
        self._log(f"supervisor: {name} is back on {address} (pid {pid}){after}")

    def _maybe_stable(self, watch: _Watch, now: float) -> None:
        if watch.up_since is None:
            watch.up_since = now
        elif now - watch.up_since >= self.stable_s and watch.backoff_s != self.initial_backoff_s:
            watch.backoff_s = self.initial_backoff_s  # up long enough: a fresh start

    def _log(self, line: str) -> None:
        self.cluster.log(line)


def _address(child: Child) -> str:
    fields = child.fields
    return (
        fields.get("grpc") or fields.get("http") or " ".join(f"{k}={v}" for k, v in fields.items())
    )
