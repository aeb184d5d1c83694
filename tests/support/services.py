"""Start QuillCache service processes for integration tests and talk to them."""

from __future__ import annotations

import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from quillcache_core.launch.process import ManagedProcess, ProcessFailed
from tests.support.tls import certs_dir, channel, client_context


class ServiceProcess:
    """A `quillcache <service>` process; `fields` holds its READY line's key=value pairs."""

    def __init__(
        self,
        service: str,
        args: list[str],
        log_dir: Path,
        name: str | None = None,
        *,
        wait_serving: bool = True,
    ) -> None:
        """`wait_serving`: `start` waits for gRPC health SERVING after READY (False: for
        a test whose subject is that check)."""
        self.service = service
        self.wait_serving = wait_serving
        # Every process runs with the session's certificates unless a test asks otherwise.
        if "--insecure" not in args and "--tls-dir" not in args:
            args = [*args, "--tls-dir", str(certs_dir())]
        self.insecure = "--insecure" in args
        self.args = args
        self.name = name or service
        self.log_path = Path(log_dir) / f"{self.name}.log"
        self.proc = ManagedProcess(
            [sys.executable, "-m", "quillcache_core.launch.cli", service, *args],
            log_path=self.log_path,
            name=self.name,
        )
        self.fields: dict[str, str] = {}

    def start(self, timeout_s: float = 15.0) -> ServiceProcess:
        self.proc.start()  # only this run's READY line counts (the log is appended to)
        self.proc.wait_ready(self._read_ready, timeout_s=timeout_s)
        if self.wait_serving:
            self.proc.wait_ready(self._serving, timeout_s=timeout_s)
        return self

    def _read_ready(self) -> bool:
        fields = self.proc.ready_fields()
        if fields is None:
            return False
        self.fields = fields
        return True

    @property
    def grpc_address(self) -> str:
        return self.fields["grpc"]

    @property
    def metrics_url(self) -> str:
        return self.fields["metrics"]

    def metric(self, name: str) -> float:
        """The value of an unlabelled series on the process's /metrics."""
        context = None if self.insecure else client_context("operator")
        url = self.metrics_url + "/metrics"
        with urllib.request.urlopen(url, timeout=5, context=context) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise AssertionError(f"{name} not on /metrics")

    def _serving(self) -> bool:
        with self.channel("operator") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1.0
            )
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def channel(self, role: str = "operator", *, aio: bool = False, options=()):
        """A gRPC channel to this process as `role` (plaintext if it runs --insecure)."""
        if self.insecure:
            maker = grpc.aio.insecure_channel if aio else grpc.insecure_channel
            return maker(self.grpc_address, options=list(options))
        return channel(self.grpc_address, role, aio=aio, options=options)

    def stop(self) -> int | None:
        return self.proc.stop()

    def kill(self) -> None:
        import signal

        self.proc.signal(signal.SIGKILL)
        deadline = time.monotonic() + 5
        while self.proc.running and time.monotonic() < deadline:
            time.sleep(0.02)

    def log_tail(self, n: int = 60) -> str:
        return self.proc.log_tail(n)

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_until(
    predicate, timeout_s: float = 10.0, interval_s: float = 0.05, what: str = "condition"
):
    """Poll `predicate` until it returns a truthy value; return it or fail with `what`."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - "not yet" until the deadline
            last_error = exc
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout_s}s waiting for {what}; last error: {last_error!r}"
            )
        time.sleep(interval_s)


__all__ = ["ProcessFailed", "ServiceProcess", "wait_until"]
