"""`quillcache bench-live`'s systems: the reference routers' processes, the engines'
counters, and the CPU time of a process tree.

The routers are the real `sglang-router` 0.3.2 and `vllm-router` 0.1.17 binaries (the
project's dev extra installs them into the virtualenv), and SMG 1.13.0 (`smg`, in a
virtualenv of its own, `live_peers`), each started with its default
settings but for its policy, its ports (free loopback ports) and a quieter log level,
in front of the engines' plain-HTTP listeners (see `quillcache_simengine.config`:
--plain-http-port). Their names in the results: `sglang-router-<policy>` and
`vllm-router-<policy>`; `round-robin` is vllm-router's round_robin policy.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from quillcache_core.launch.process import spawn, terminate_group
from quillcache_core.launch.vllm_engine import free_port

# name in the results -> (binary, policy)
ROUTERS: dict[str, tuple[str, str]] = {
    "sglang-router-cache_aware": ("sglang-router", "cache_aware"),
    "sglang-router-round_robin": ("sglang-router", "round_robin"),
    "vllm-router-cache_aware": ("vllm-router", "cache_aware"),
    "vllm-router-consistent_hash": ("vllm-router", "consistent_hash"),
    "round-robin": ("vllm-router", "round_robin"),
}
# `quillcache-split`: the same gateway, with the engines given prefill/decode roles in
# place (POST /sim/settings) for its runs; only on the timed (decode-heavy) workloads.
# SMG 1.13 (`smg launch --policy cache_aware`, its own virtualenv: `live_peers`).
SMG = "smg-cache_aware"
SYSTEMS = ("quillcache", "quillcache-split", SMG, *ROUTERS)

_CLK_TCK = os.sysconf("SC_CLK_TCK")


class RouterError(RuntimeError):
    """A reference router did not start or answer."""


def router_binary(binary: str) -> str:
    """The router's console script: beside this interpreter (the project's virtualenv),
    else on PATH."""
    here = Path(sys.executable).parent / binary
    if here.exists():
        return str(here)
    found = shutil.which(binary)
    if found is None:
        raise RouterError(f"{binary} is not installed: `.venv/bin/pip install -e '.[dev]'`")
    return found


def router_argv(binary: str, policy: str, workers: list[str], port: int, metrics_port: int):
    """The command line of one router: its defaults but policy, ports and log level."""
    exe = router_binary(binary)
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        "--policy",
        policy,
        "--prometheus-port",
        str(metrics_port),
        "--prometheus-host",
        "127.0.0.1",
    ]
    if binary == "sglang-router":
        return [exe, "launch", *common, "--log-level", "warn"]
    return [exe, *common, "--log-level", "warning"]


@dataclass
class RouterProcess:
    name: str
    argv: list[str]
    url: str
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self, workers: int, timeout_s: float = 60.0) -> None:
        """Start the router; returns once it answers /v1/models and (where it lists
        them on /workers, as sglang-router does) knows every worker as healthy."""
        self.proc, _ = spawn(self.argv, self.log_path)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RouterError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            if self._ready(workers):
                return
            if time.monotonic() > deadline:
                raise RouterError(f"{self.name} not ready after {timeout_s:.0f}s:\n{self.tail()}")
            time.sleep(0.1)

    def _ready(self, workers: int) -> bool:
        try:
            metric_text(f"{self.url}/v1/models")
        except (OSError, ValueError):
            return False
        try:
            listed = _get_json(f"{self.url}/workers").get("workers")
        except (OSError, ValueError, AttributeError):
            return True  # no worker list to check
        if not isinstance(listed, list):
            return True
        healthy = [w for w in listed if isinstance(w, dict) and w.get("is_healthy", True)]
        return len(healthy) >= workers

    def stop(self, grace_s: float = 5.0) -> None:
        terminate_group(self.proc, grace_s)

    def tail(self, n: int = 20) -> str:
        try:
            text = self.log_path.read_bytes()[-16384:].decode("utf-8", "replace")
        except OSError:
            return "<no log>"
        return "\n".join(re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()[-n:])


def start_router(name: str, workers: list[str], log_dir: Path) -> RouterProcess:
    binary, policy = ROUTERS[name]
    return launch(
        RouterProcess,
        name,
        lambda port, metrics_port: router_argv(binary, policy, workers, port, metrics_port),
        len(workers),
        log_dir,
    )


def launch(kind: type[RouterProcess], name: str, argv_for, workers: int, log_dir: Path):
    """A router process of class `kind` on free loopback ports (`argv_for(port,
    metrics_port)` its command line), returned once it is ready for `workers` workers;
    stopped again if it does not get there."""
    port = free_port()
    router = kind(name, argv_for(port, free_port()), f"http://127.0.0.1:{port}",
                  Path(log_dir) / f"{name}.log")  # fmt: skip
    try:
        router.start(workers)
    except BaseException:
        router.stop()
        raise
    return router


# --- CPU time ----------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process, from /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _CLK_TCK


def tree_cpu_s(pids: list[int]) -> float:
    """CPU seconds used so far by `pids` and every live descendant of theirs (threads
    included: /proc/PID/stat counts every thread of a process)."""
    return trees_cpu_s({"": pids})[""]


def _children() -> dict[int, list[int]]:
    """Every live process's children, by parent pid, from one pass over /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found = _stat(int(entry))
            if found is not None:
                children.setdefault(found[0], []).append(int(entry))
    return children


def _walk(children: dict[int, list[int]], pids: list[int]) -> list[int]:
    """`pids` and every process under them in `children`, each once."""
    out, todo, seen = [], list(pids), set()
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            out.append(pid)
            todo.extend(children.get(pid, []))
    return out


def process_tree(root: int) -> list[int]:
    """`root` and every live process under it."""
    return _walk(_children(), [root])


def trees_cpu_s(groups: dict[str, list[int]]) -> dict[str, float]:
    """tree_cpu_s of each group of pids, from one pass over /proc."""
    children = _children()
    return {
        name: sum(found[1] for pid in _walk(children, pids) if (found := _stat(pid)) is not None)
        for name, pids in groups.items()
    }


# --- engines -----------------------------------------------------------------------------


@dataclass
class EngineCounters:
    requests: float = 0.0
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0  # prompt tokens not computed: hits and fetched blocks
    fetched_blocks: float = 0.0  # blocks loaded from a store (sim engines only)
    external_tokens: float = 0.0  # prompt tokens vLLM took from a KV connector (vLLM only)

    def minus(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(
            self.requests - other.requests,
            self.prompt_tokens - other.prompt_tokens,
            self.cached_tokens - other.cached_tokens,
            self.fetched_blocks - other.fetched_blocks,
            self.external_tokens - other.external_tokens,
        )


@dataclass
class Engine:
    """One engine as the bench sees it: `url` is what the routers are given (a sim
    engine's plain listener, or an insecure vLLM's only port)."""

    name: str
    url: str
    kind: str = "sim"  # or "vllm"

    def counters(self) -> EngineCounters:
        if self.kind == "sim":
            stats = _get_json(f"{self.url}/sim/stats")["engine"]
            return EngineCounters(
                stats["requests"],
                stats["prompt_tokens"],
                stats["prompt_tokens"] - stats["computed_tokens"],
                stats["fetched_blocks"],
            )
        text = metric_text(f"{self.url}/metrics")
        return EngineCounters(
            metric_sum(text, "vllm:request_success_total"),
            metric_sum(text, "vllm:prompt_tokens_total"),
            metric_sum(text, "vllm:prefix_cache_hits_total"),
            external_tokens=metric_sum(text, "vllm:external_prefix_cache_hits_total"),
        )

    def kv_tokens(self) -> int | None:
        """A vLLM engine's KV cache in tokens, as it publishes it (`vllm:cache_config_info`:
        num_gpu_blocks of block_size tokens); None for a sim engine or when absent."""
        if self.kind == "sim":
            return None
        for line in metric_text(f"{self.url}/metrics").splitlines():
            if line.startswith("vllm:cache_config_info{"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
                try:
                    return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
                except (KeyError, ValueError):
                    return None
        return None

    def settings(self, changes: dict | None = None) -> dict:
        """A sim engine's settable settings (GET /sim/settings), after applying
        `changes` (POST) if any."""
        data = None if changes is None else json.dumps(changes).encode()
        request = urllib.request.Request(
            f"{self.url}/sim/settings",
            data=data,
            method="GET" if data is None else "POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10.0) as reply:
            return json.loads(reply.read())

    def reset_cache(self) -> bool:
        """Empty the engine's prefix cache (each system starts cold); False if refused
        (vLLM answers it only in its dev mode)."""
        request = urllib.request.Request(f"{self.url}/reset_prefix_cache", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10.0) as reply:
                return reply.status == 200
        except (OSError, ValueError):
            return False


def metric_text(url: str, context: ssl.SSLContext | None = None) -> str:
    """The body of a GET (a metrics page, a JSON answer) as text."""
    with urllib.request.urlopen(url, timeout=10.0, context=context) as reply:
        return reply.read().decode("utf-8", "replace")


def _get_json(url: str) -> dict:
    return json.loads(metric_text(url))


def metric_sum(text: str, name: str) -> float:
    """Sum of every sample of a Prometheus metric (any labels) in an exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            with contextlib.suppress(ValueError):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (or gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return text[text.rindex(")") + 2] in "Tt"


@contextlib.contextmanager
def paused(pids: list[int], settle_s: float):
    """QuillCache's own processes stopped (SIGSTOP) while a reference router runs: behind
    a router a deployment has no gateway, conductors or stores, and ours would otherwise
    take the shared cores from its engines (the conductors ingest every engine's KV
    events). Continued on exit (always), then `settle_s` for their leases and
    connections to come back before QuillCache is measured again."""
    stopped = []
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        # A signal is delivered when its process is next scheduled: wait until each is
        # stopped, so nothing of ours runs once the router's measurement begins.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not all(map(_stopped, stopped)):
            time.sleep(0.005)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if stopped:
            time.sleep(settle_s)
