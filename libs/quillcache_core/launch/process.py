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
- `stopping_on_signals()`: what every command that starts processes runs under: SIGINT
  and SIGTERM raise `Interrupted` in the main thread (so its own `finally` blocks stop
  what it started), and on the way out every group `spawn` started that still runs is
  stopped.

Logs are written mode 0600 in directories made 0700 (`write_private` for other files
of the kind): a process's output may carry what its clients sent.
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
import threading
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


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived under `stopping_on_signals`. A KeyboardInterrupt, so
    asyncio and `except Exception` let it through as they do Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Started:
    """The process groups `spawn` started that may still run, and the signal handler's
    plain flags. Process-wide by nature: a signal reaches the process, not an object.
    `lock` guards `groups` and `closed`; the handler takes no lock."""

    lock = threading.RLock()  # re-entrant: a raise that left it held cannot block the sweep
    groups: dict[int, subprocess.Popen] = {}  # leader pid -> process; reaped ones pruned
    closed = False  # swept: spawn refuses from now on
    stopping = False  # a signal raised Interrupted: later ones change nothing
    deferring = 0  # the main thread is inside spawn: a signal waits until it is done
    pending = 0  # the signal that waited


def _on_signal(signum: int, _frame) -> None:
    """Raise `Interrupted` once; takes no lock, so it cannot deadlock whatever the main
    thread holds."""
    if _Started.stopping:
        return
    if _Started.deferring:
        _Started.pending = signum
        return
    _Started.stopping = True
    raise Interrupted(signum)


def _stop_started(grace_s: float) -> None:
    """SIGTERM every group `spawn` started that still runs, all at once; SIGKILL what is
    left after `grace_s` (stragglers too); reap. Spawn refuses afterwards."""
    _Started.stopping = True
    with _Started.lock:
        _Started.closed = True
        procs = list(_Started.groups.values())
        _Started.groups.clear()
    live = [p for p in procs if p.poll() is None]
    for proc in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)


@contextlib.contextmanager
def stopping_on_signals(grace_s: float = 5.0) -> Iterator[None]:
    """Run a command that starts processes (from the main thread): SIGINT and SIGTERM
    raise `Interrupted` there, once (later ones are ignored while it unwinds); on the
    way out, however it ends, every process group `spawn` started and that still runs
    is stopped (SIGTERM, SIGKILL after `grace_s`)."""
    _Started.closed = _Started.stopping = False
    _Started.pending = 0
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        try:
            _stop_started(grace_s)
        except Interrupted:  # landed before the sweep marked itself: now it cannot
            _stop_started(grace_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(_private_fd(path, os.O_APPEND), "ab") as out:
        offset = out.seek(0, os.SEEK_END)
        proc = _popen_tracked(argv, out, env, cwd)
    if cores:
        # Before the command starts a thread or a process (`sh` execs it): all inherit it.
        with contextlib.suppress(OSError):
            os.sched_setaffinity(proc.pid, cores)
    return proc, offset


def write_private(path: str | os.PathLike[str], text: str) -> None:
    """`text` into `path`, readable and writable by its owner only (also a file that
    was there before with a wider mode)."""
    with open(_private_fd(path, os.O_TRUNC), "w") as out:
        out.write(text)


def _private_fd(path: str | os.PathLike[str], flags: int) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o600)
    os.fchmod(fd, 0o600)  # made before, under a wider umask
    return fd


def _popen_tracked(argv, out, env, cwd) -> subprocess.Popen:
    """Popen, the group remembered for `stopping_on_signals`; a signal that lands in
    between waits until it is remembered (the main thread's) or the sweep waits for it
    (another thread's)."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        _Started.deferring += 1
    try:
        with _Started.lock:
            if _Started.closed:
                raise ProcessFailed(f"stopping: {argv[0]} not started")
            proc = subprocess.Popen(
                [str(a) for a in argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(env) if env is not None else None,
                cwd=cwd,
            )
            for pid in [pid for pid, p in _Started.groups.items() if p.poll() is not None]:
                del _Started.groups[pid]
            _Started.groups[proc.pid] = proc
    finally:
        if main:
            _Started.deferring -= 1
            if _Started.pending and not _Started.stopping:
                _Started.stopping = True
                raise Interrupted(_Started.pending)
    return proc


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
    with _Started.lock:
        if _Started.groups.get(proc.pid) is proc:
            del _Started.groups[proc.pid]
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
