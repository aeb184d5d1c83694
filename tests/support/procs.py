"""Start, wait for and stop helper processes in integration tests.

    proc = ManagedProcess([sys.executable, "-m", "something"], log_path=tmp_path / "x.log")
    with proc:                      # start(); stop() on exit, even on failure
        proc.wait_ready(lambda: port_open(1234), timeout_s=10)

Each process gets its own process group (start_new_session=True); stop() sends
SIGTERM to the whole group, then SIGKILL after a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

Predicate = Callable[[], bool | Awaitable[bool]]


class ProcessFailed(RuntimeError):
    """The process exited, or did not become ready in time."""


class ManagedProcess:
    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        name: str | None = None,
        stop_grace_s: float = 5.0,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.name = name or Path(self.argv[0]).name
        self.stop_grace_s = stop_grace_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> ManagedProcess:
        if self.running:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        except BaseException:
            self._close_log()
            raise
        return self

    def log_tail(self, n: int = 40) -> str:
        try:
            data = self.log_path.read_bytes()[-64 * 1024 :]
        except OSError:
            return "<no log>"
        return "\n".join(data.decode("utf-8", "replace").splitlines()[-n:])

    def _check_alive(self) -> None:
        code = self.returncode
        if self.proc is None or code is not None:
            raise ProcessFailed(
                f"{self.name} exited with code {code}; log tail ({self.log_path}):\n"
                f"{self.log_tail()}"
            )

    def _timed_out(self, timeout_s: float) -> ProcessFailed:
        return ProcessFailed(
            f"{self.name} not ready after {timeout_s:.1f}s; log tail ({self.log_path}):\n"
            f"{self.log_tail()}"
        )

    def wait_ready(
        self, predicate: Predicate, *, timeout_s: float = 10.0, interval_s: float = 0.05
    ) -> None:
        """Poll `predicate` until it is true; fail fast if the process exits.

        A coroutine predicate is run with asyncio.run (so do not call this from a
        running event loop; use `wait_ready_async` there). Exceptions from the
        predicate count as "not ready yet"."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            try:
                result = predicate()
                if inspect.isawaitable(result):
                    result = asyncio.run(_await(result))
                if result:
                    return
            except Exception:  # not ready yet
                pass
            if time.monotonic() >= deadline:
                raise self._timed_out(timeout_s)
            time.sleep(interval_s)

    async def wait_ready_async(
        self, predicate: Predicate, *, timeout_s: float = 10.0, interval_s: float = 0.05
    ) -> None:
        """Like `wait_ready`, from inside an event loop (sync or async predicate)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            try:
                result = predicate()
                if inspect.isawaitable(result):
                    result = await result
                if result:
                    return
            except Exception:  # not ready yet
                pass
            if time.monotonic() >= deadline:
                raise self._timed_out(timeout_s)
            await asyncio.sleep(interval_s)

    def signal(self, sig: int) -> None:
        """Send `sig` to the whole process group (e.g. SIGKILL to simulate a crash)."""
        if self.running:
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def stop(self) -> int | None:
        """SIGTERM the group, SIGKILL after the grace period. Returns the exit code."""
        proc, self.proc = self.proc, None
        code = None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=self.stop_grace_s)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the group
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5.0)
            code = proc.returncode
        self._close_log()
        return code

    def _close_log(self) -> None:
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
            self._log = None

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __del__(self) -> None:  # last resort: never leak a process group
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                os.killpg(self.proc.pid, signal.SIGKILL)


async def _await(awaitable: Awaitable[bool]) -> bool:
    return await awaitable
