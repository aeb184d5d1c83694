"""SIGINT or SIGTERM stops everything a launching command started, at any moment.

`quillcache up` and a benchmark that starts a cluster (`bench-gateway --hold-s`, which
holds it up before measuring) get SIGINT or SIGTERM on their process group, as from a
terminal's Ctrl-C, `timeout` or a service manager, at random moments during start-up
and while serving. Each time the command exits by itself, and every process of its
cluster (each in a session of its own, so nothing but the command stops it) is gone
within STOP_DEADLINE_S, and none was started after the signal (but the one being
started at that instant). The moments come from a seed printed on failure
(QC_TEST_SEED replays one).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.host import processes_naming

pytestmark = pytest.mark.e2e

STOP_DEADLINE_S = 10.0
START_TIMEOUT_S = 120.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _seed() -> int:
    return int(os.environ.get("QC_TEST_SEED") or random.randrange(2**32))


def _launch(args: list[str], log_path: Path, env: dict[str, str] | None = None):
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "quillcache_core.launch.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )


def _wait_for(predicate, proc: subprocess.Popen, what: str, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not predicate():
        assert proc.poll() is None, f"exited before {what}:\n{log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what}:\n{log_path.read_text()[-3000:]}"
        time.sleep(0.1)


def _kill_all(proc: subprocess.Popen, marker: Path) -> None:
    """What a failed stop left: every group by force."""
    for pid in [proc.pid, *processes_naming(marker)]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=10)


def _signal_and_see_all_gone(
    proc: subprocess.Popen, sig: int, marker: Path, log_path: Path, context: str
) -> None:
    """Send `sig` to the command's group: it starts nothing more (but the one process
    it may have been starting at that instant), exits, and no process naming `marker`
    is left within the deadline."""
    before = set(processes_naming(marker).values())
    os.killpg(proc.pid, sig)
    deadline = time.monotonic() + STOP_DEADLINE_S
    started = set()
    while True:
        left = processes_naming(marker)
        started |= set(left.values()) - before
        code = proc.poll()
        if (code is not None and not left) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if code is None or left:
        _kill_all(proc, marker)
    tail = log_path.read_text(errors="replace")[-2500:]
    assert len(started) <= 1, f"{context}: started after it:\n" + "\n".join(started)
    assert code is not None, f"{context}: still running {STOP_DEADLINE_S}s after it:\n{tail}"
    assert not left, f"{context}: left running:\n" + "\n".join(left.values()) + f"\n{tail}"
    # Killed outright (-sig) only before it set its handlers, when it had started nothing.
    assert code in (0, 128 + sig, -sig), f"{context}: exit code {code}\n{tail}"


@pytest.mark.timeout(240)
def test_quillcache_up_stops_every_process_on_sigint_or_sigterm_at_any_moment(tmp_path):
    seed = _seed()
    rng = random.Random(seed)
    # During start-up (etcd, then each service in turn), then while serving.
    rounds = [("start-up", rng.uniform(0.3, 6.0)) for _ in range(6)]
    rounds += [("serving", rng.uniform(0.0, 1.5)) for _ in range(3)]
    for n, (phase, delay_s) in enumerate(rounds):
        data = tmp_path / f"run-{n}"
        endpoints = data / "endpoints.json"
        log_path = tmp_path / f"up-{n}.log"
        args = ["up", "--data-dir", str(data), "--endpoints-file", str(endpoints)]
        proc = _launch(args, log_path)
        try:
            if phase == "serving":
                _wait_for(endpoints.exists, proc, "endpoints file", log_path)
            time.sleep(delay_s)  # the random moment itself
            sig = rng.choice(SIGNALS)
            context = f"seed {seed}, round {n}: {sig.name} {delay_s:.2f}s into {phase}"
            _signal_and_see_all_gone(proc, sig, data, log_path, context)
        finally:
            if proc.poll() is None:
                _kill_all(proc, data)


@pytest.mark.timeout(180)
def test_a_bench_stops_every_process_of_its_cluster_on_sigterm(tmp_path):
    """SIGTERM (what `timeout` sends) while the bench starts its cluster, then while it
    holds it up."""
    seed = _seed()
    rng = random.Random(seed)
    for n, phase in enumerate(("start-up", "serving") * 2):
        # The bench's cluster lives in a temp dir: here (short: it holds unix sockets).
        temp = Path(tempfile.mkdtemp(prefix="qcs-"))
        log_path = tmp_path / f"bench-{n}.log"
        args = ["bench-gateway", "--hold-s", "300", "--requests", "1", "--warmup", "0"]
        args += ["--out-dir", str(tmp_path / "results")]
        proc = _launch(args, log_path, env={**os.environ, "TMPDIR": str(temp)})
        try:
            if phase == "serving":
                holding = lambda log=log_path: "cluster up:" in log.read_text()  # noqa: E731
                _wait_for(holding, proc, "the cluster held up", log_path)
                delay_s = rng.uniform(0.0, 1.5)
            else:
                delay_s = rng.uniform(0.3, 4.0)
            time.sleep(delay_s)
            context = f"seed {seed}: SIGTERM {delay_s:.2f}s into {phase}"
            _signal_and_see_all_gone(proc, signal.SIGTERM, temp, log_path, context)
        finally:
            if proc.poll() is None:
                _kill_all(proc, temp)
            shutil.rmtree(temp, ignore_errors=True)
