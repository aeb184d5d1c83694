"""How `quillcache up --engine vllm` shares a machine's cores out between vLLM engines, and
picks the ports a vLLM server binds later."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quillcache_core.launch.vllm_engine import engine_cores, niced, serve_env

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("engines", "expected"),
    [
        (1, [[0, 1, 2, 3]]),
        (2, [[0, 1], [2, 3]]),
        (3, [[0], [1], [2]]),  # the fourth core is left to everything else
        (4, [[0], [1], [2], [3]]),
        (6, [[0], [1], [2], [3], [0], [1]]),  # more engines than cores: round the list
    ],
)
def test_each_engine_gets_its_own_run_of_cores(engines, expected):
    assert [engine_cores(i, engines, [0, 1, 2, 3]) for i in range(engines)] == expected


def test_cores_follow_the_machine_s_affinity_not_their_numbers():
    assert engine_cores(1, 2, [4, 7, 2, 9]) == [7, 9]


def test_a_bad_engine_index_is_refused():
    with pytest.raises(ValueError):
        engine_cores(0, 0, [0, 1])


def test_the_binding_goes_to_vllm_s_own_variable():
    env = serve_env(cores=[2, 3])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2,3"
    assert "VLLM_API_KEY" not in env


def test_without_cores_vllm_binds_as_it_likes(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in serve_env()


def test_an_engine_s_command_runs_niced_and_so_does_its_session(tmp_path):
    """The command runs at the niceness with its arguments intact; in a session of its
    own (as `quillcache up` starts it) its autogroup gets the niceness too, where the
    kernel has autogroups (else a group's niceness would outweigh the process's)."""
    script = (
        "import os, sys; from pathlib import Path; g = Path('/proc/self/autogroup'); "
        "print(os.getpriority(os.PRIO_PROCESS, 0)); print(sys.argv[1:]); "
        "print(g.read_text().split()[-1] if g.exists() else 'none')"
    )
    argv = niced([sys.executable, "-c", script, "a b", "$HOME"], 10)
    done = subprocess.run(argv, capture_output=True, text=True, check=True, start_new_session=True)
    nice, args, group = done.stdout.splitlines()
    assert int(nice) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
    assert args == "['a b', '$HOME']"
    if Path("/proc/self/autogroup").exists():
        assert group == "10"
    assert niced(["vllm", "serve"], 0) == ["vllm", "serve"]


def test_ports_picked_for_a_vllm_server_are_never_what_a_bind_to_port_0_returns():
    """vLLM binds the picked ports up to a minute later, while its own processes bind
    port-0 sockets: a picked port must lie outside the range those come from."""
    import socket

    from quillcache_core.launch.vllm_engine import PICKED_PORTS_FROM, _ephemeral_low, free_port

    low = _ephemeral_low()
    picked = {free_port() for _ in range(20)}
    if low > PICKED_PORTS_FROM + 1000:
        assert all(PICKED_PORTS_FROM <= port < low for port in picked), (low, picked)
        with socket.socket() as sock:  # what vLLM's own sockets get
            sock.bind(("127.0.0.1", 0))
            assert sock.getsockname()[1] >= low
    for port in picked:  # free when picked: bindable now
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_child_given_cores_runs_there_with_everything_it_starts(tmp_path):
    """How `quillcache up` keeps a vLLM server on its share of the machine: the child
    and the processes it starts later are on those cores only."""
    from quillcache_core.launch.process import spawn, terminate_group

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: a child runs there anyway")
    cores = sorted(os.sched_getaffinity(0))[-1:]
    script = (
        "import os, subprocess, sys; "
        "inner = subprocess.run([sys.executable, '-c', "
        "'import os; print(sorted(os.sched_getaffinity(0)))'], capture_output=True, text=True); "
        "print(sorted(os.sched_getaffinity(0))); print(inner.stdout.strip())"
    )
    proc, _ = spawn([sys.executable, "-c", script], tmp_path / "probe.log", cores=tuple(cores))
    try:
        assert proc.wait(timeout=30) == 0
    finally:
        terminate_group(proc, 1.0)
    assert (tmp_path / "probe.log").read_text().splitlines() == [str(cores)] * 2
