"""Starting a process, reading its READY line, stopping its group: the one way, used by
the local cluster, its supervisor, etcd, the benchmarks and the tests.

- `spawn(argv, log_path)` starts a command in a process group of its own (so stopping
  it takes its children too), stdin closed, stdout and stderr appended to its log; it
  returns the process and where this run's output starts in the log.
- `read_ready(log_path, offset)` / `ready_fields(text)`: a service prints
  `READY <service> key=value ...` once it serves; the fields (its bound ports) are how
  its callers find it.
- `terminate_group(proc, grace_s)`: SIGTERM the group, SIGKILL what is left after the
  grace (stragglers too), and reap the leader.
- `ManagedProcess`: those three around one command, with waits that fail fast when the
  process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

READY = re.compile(r"^READY (\S+) (.*)$", re.MULTILINE)

Predicate = Callable[[], bool | Awaitable[bool]]


@dataclass
class Child:
    """One process of a cluster: its command line and log, the run now going (`proc`,
    where its output starts in the log), what its READY line said, and whether it is
    being restarted by hand (not supervised meanwhile)."""

    name: str
    service: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    fields: dict[str, str] = field(default_factory=dict)
    log_offset: int = 0  # where the current run's output starts in the log
    paused: bool = False  # being restarted by hand: not supervised meanwhile
    cores: tuple[int, ...] = ()  # the only cores it and its children may run on (() = any)

    def log_tail(self, n: int = 30) -> str:
        return log_tail(self.log_path, n)


class ProcessFailed(RuntimeError):
    """A process exited, or did not become ready in time."""


def spawn(
    argv: Sequence[str],
    log_path: str | os.PathLike[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    cores: tuple[int, ...] = (),
) -> tuple[subprocess.Popen, int]:
    """Start `argv` in its own process group, output appended to `log_path`; returns
    the process and the log's size before it (where this run's lines start). With
    `cores`, it and everything it starts run on those cores only."""
    path = Path(log_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as out:
        offset = out.tell()
        proc = subprocess.Popen(
            [str(a) for a in argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(env) if env is not None else None,
            cwd=cwd,
        )
    if cores:
        # Before the command starts a thread or a process (`sh` execs it): all inherit it.
        with contextlib.suppress(OSError):
            os.sched_setaffinity(proc.pid, cores)
    return proc, offset


def ready_fields(text: str) -> dict[str, str] | None:
    """The key=value fields of the first READY line in `text`; None if there is none."""
    match = READY.search(text)
    if match is None:
        return None
    return dict(part.split("=", 1) for part in match.group(2).split() if "=" in part)


def read_ready(log_path: str | os.PathLike[str], offset: int = 0) -> dict[str, str] | None:
    """`ready_fields` of a log from `offset` on (a run's own lines); None before READY."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    return ready_fields(text)


def log_tail(log_path: str | os.PathLike[str], n: int = 40) -> str:
    try:
        data = Path(log_path).read_bytes()[-64 * 1024 :]
    except OSError:
        return "<no log>"
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-n:])


def signal_group(proc: subprocess.Popen | None, sig: int) -> None:
    """Send `sig` to the process group `proc` leads (e.g. SIGKILL for a crash)."""
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def terminate_group(proc: subprocess.Popen | None, grace_s: float) -> int | None:
    """SIGTERM the process group `proc` leads, SIGKILL it (and any straggler of the
    group) after `grace_s`; returns the leader's exit code."""
    if proc is None:
        return None
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGTERM for %.1fs; sending SIGKILL", proc.pid, grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the group
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)
    return proc.returncode


class ManagedProcess:
    """One command, started and stopped as a group, its output in a log."""

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
        self.proc: subprocess.Popen | None = None
        self.log_offset = 0  # where the current run's output starts in the log

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
        self.proc, self.log_offset = spawn(self.argv, self.log_path, env=self.env, cwd=self.cwd)
        return self

    def ready_fields(self) -> dict[str, str] | None:
        """This run's READY fields, None until it printed them."""
        return read_ready(self.log_path, self.log_offset)

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)

    def check_alive(self) -> None:
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

    def _polls(self, timeout_s: float) -> Iterator[None]:
        """One step per try until `timeout_s`: fails fast when the process exits, and
        with the log's tail once the time is up."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            yield
            if time.monotonic() >= deadline:
                raise self._timed_out(timeout_s)

    def wait_ready(
        self, predicate: Predicate, *, timeout_s: float = 10.0, interval_s: float = 0.05
    ) -> None:
        """Poll `predicate` until it is true; fail fast if the process exits.

        A coroutine predicate is run with asyncio.run (so do not call this from a
        running event loop; use `wait_ready_async` there). Exceptions from the
        predicate count as "not ready yet"."""
        for _ in self._polls(timeout_s):
            with contextlib.suppress(Exception):  # not ready yet
                result = predicate()
                if inspect.isawaitable(result):
                    result = asyncio.run(_await(result))
                if result:
                    return
            time.sleep(interval_s)

    async def wait_ready_async(
        self, predicate: Predicate, *, timeout_s: float = 10.0, interval_s: float = 0.05
    ) -> None:
        """Like `wait_ready`, from inside an event loop (sync or async predicate)."""
        for _ in self._polls(timeout_s):
            with contextlib.suppress(Exception):  # not ready yet
                result = predicate()
                if inspect.isawaitable(result):
                    result = await result
                if result:
                    return
            await asyncio.sleep(interval_s)

    def signal(self, sig: int) -> None:
        """Send `sig` to the whole process group (e.g. SIGKILL to simulate a crash)."""
        signal_group(self.proc, sig)

    def stop(self) -> int | None:
        """SIGTERM the group, SIGKILL after the grace period. Returns the exit code."""
        proc, self.proc = self.proc, None
        return terminate_group(proc, self.stop_grace_s)

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:  # last resort: never leak a process group
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                os.killpg(self.proc.pid, signal.SIGKILL)


async def _await(awaitable: Awaitable[bool]) -> bool:
    return await awaitable
