"""How `quillcache up --engine vllm` (and the tests) start a real vLLM engine on CPU.

The flags are the plain `vllm serve` ones an operator would use (README, "Real vLLM
engines"): prefix caching, KV events over ZMQ with a replay socket, prompt-token details
in usage (cached tokens), and vLLM's CPU constraints (a block size that is a multiple of
32, eager mode to start faster). The engine then joins the fleet through
`quillcache register-engine`, as an engine started by hand would.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from quillcache_core.security.tls import Tls

# vLLM on CPU refuses a block size that is not a multiple of 32.
VLLM_CPU_BLOCK_SIZE = 32

# GiB of KV cache per engine (VLLM_CPU_KVCACHE_SPACE), more where a cap needs more.
KV_SPACE_GIB = 1
GIB = 1024**3
# The context of a model whose config.json names none (max_position_embeddings).
DEFAULT_MAX_MODEL_LEN = 2048
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB),
    "HF_HUB_OFFLINE": "1",  # the model is a local directory: never ask a hub
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
    "TOKENIZERS_PARALLELISM": "false",
}


# Ports picked for a vLLM server come from here, below the kernel's ephemeral range.
PICKED_PORTS_FROM = 10_000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port() -> int:
    """A TCP port on 127.0.0.1, free now, that no bind to port 0 hands out meanwhile.

    A vLLM server binds the ports picked for it up to a minute later (the KV connector's
    metrics port once the model is loaded), while it and its workers bind port-0 sockets
    of their own, and Linux readily hands a just-released port to the next bind(0): a
    port picked that way was taken by then ("Address already in use", the engine core
    failed to start; twice in one day here). So the port comes from below the ephemeral
    range (`ip_local_port_range`), which bind(0) never returns; where that range starts
    too low, from bind(0) as before.
    """
    low = _ephemeral_low()
    if low > PICKED_PORTS_FROM + 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(PICKED_PORTS_FROM, low)
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class ModelKv:
    """What sizing an engine's KV cache needs from a model's config.json."""

    context_tokens: int  # max_position_embeddings (DEFAULT_MAX_MODEL_LEN if absent)
    bytes_per_token: int  # K and V of every layer; 0 = the config does not say

    @classmethod
    def of(cls, model_dir: Path) -> ModelKv:
        """Read `model_dir/config.json` (a Llama-style config; OSError or ValueError if
        it is missing or not JSON)."""
        config = json.loads((Path(model_dir) / "config.json").read_text())
        context = config.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN
        try:
            heads = config["num_attention_heads"]
            head_dim = config.get("head_dim") or config["hidden_size"] // heads
            kv_heads = config.get("num_key_value_heads") or heads
            dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
            per_token = config["num_hidden_layers"] * 2 * kv_heads * head_dim
            return cls(int(context), int(per_token * _DTYPE_BYTES.get(str(dtype), 2)))
        except (KeyError, TypeError, ZeroDivisionError):
            return cls(int(context), 0)


@dataclass(frozen=True)
class EngineKv:
    """One vLLM engine's KV cache: its size and the longest request it admits."""

    blocks: int | None  # --num-gpu-blocks-override; None: what the KV space holds
    max_model_len: int
    kv_space_gib: int  # VLLM_CPU_KVCACHE_SPACE
    capacity_bytes: int  # the registry record's (0 = not known)


def kv_cache_blocks(kv_tokens: int, block_size: int = VLLM_CPU_BLOCK_SIZE) -> int:
    """The blocks of an engine whose KV cache holds `kv_tokens` tokens (`quillcache up
    --engine-kv-tokens`). ValueError, naming the flag, unless `kv_tokens` is a multiple
    of the block size of at least two blocks (vLLM keeps one back)."""
    if isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int):
        raise ValueError(f"--engine-kv-tokens must be a whole number, got {kv_tokens!r}")
    if kv_tokens < 2 * block_size or kv_tokens % block_size:
        raise ValueError(
            f"--engine-kv-tokens must be a multiple of the engines' block size ({block_size} "
            f"tokens) and at least {2 * block_size}, got {kv_tokens}"
        )
    return kv_tokens // block_size


def engine_kv(
    model: ModelKv, kv_tokens: int | None = None, block_size: int = VLLM_CPU_BLOCK_SIZE
) -> EngineKv:
    """The KV cache of an engine serving `model`, capped at `kv_tokens` tokens (None: the
    KV space's worth, KV_SPACE_GIB).

    vLLM keeps one block of the cache back (its null block) and refuses to start when a
    request of max_model_len tokens would not fit in the rest ("To serve at least one
    request with the model's max seq len ..."), so max_model_len is the model's context
    but at most the cache's tokens less one block. A cap that needs more than the KV
    space raises the space to fit (vLLM allocates the capped blocks either way, but
    checks the space against the machine's free memory)."""
    block_bytes = model.bytes_per_token * block_size
    space = KV_SPACE_GIB
    if kv_tokens is None:
        blocks = space * GIB // block_bytes if block_bytes else None
    else:
        blocks = kv_cache_blocks(kv_tokens, block_size)
        space = max(space, math.ceil(blocks * block_bytes / GIB))
    max_model_len = model.context_tokens
    if blocks is not None:
        max_model_len = min(max_model_len, (blocks - 1) * block_size)
    return EngineKv(
        blocks=None if kv_tokens is None else blocks,
        max_model_len=max_model_len,
        kv_space_gib=space,
        capacity_bytes=(blocks or 0) * block_bytes,
    )


def serve_args(
    model_dir: Path,
    served_model: str,
    *,
    port: int,
    events_port: int,
    replay_port: int,
    block_size: int = VLLM_CPU_BLOCK_SIZE,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    kv_blocks: int | None = None,
    connector: dict | None = None,
    extra: list[str] | None = None,
    tls: Tls | None = None,
    events_endpoint: str = "",
    replay_endpoint: str = "",
) -> list[str]:
    """The server's arguments after `python -m vllm.entrypoints.openai.api_server`.

    vLLM's publisher must bind a wildcard (`tcp://*:P`): bound to 127.0.0.1 it connects
    instead, and a subscriber hears nothing. `connector` is the QuillCache KV connector's
    extra config (`store`, `model`, `tokenizer`, ...; see `connector_config`), None for
    an engine without one. `events_endpoint` / `replay_endpoint` replace the wildcard TCP
    sockets (an `ipc://` path: only processes of this host that may open it subscribe).
    `kv_blocks` caps the KV cache (`--num-gpu-blocks-override`; see `engine_kv` for the
    max_model_len that fits). With `tls` (the engine role's certificates) the server speaks
    HTTPS and demands a client certificate of the cluster's CA; its API key comes from
    the environment (`serve_env`), not the command line.
    """
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events_endpoint or f"tcp://*:{events_port}",
        "replay_endpoint": replay_endpoint or f"tcp://*:{replay_port}",
        "topic": "kv",
    }
    return [
        "--model",
        str(model_dir),
        "--served-model-name",
        served_model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-prefix-caching",
        "--block-size",
        str(block_size),
        "--max-model-len",
        str(max_model_len),
        *(["--num-gpu-blocks-override", str(kv_blocks)] if kv_blocks is not None else []),
        "--enable-prompt-tokens-details",
        "--enforce-eager",
        "--kv-events-config",
        json.dumps(events),
        *(["--kv-transfer-config", json.dumps(connector_config(connector))] if connector else []),
        *(
            [
                "--ssl-keyfile",
                str(tls.key),
                "--ssl-certfile",
                str(tls.cert),
                "--ssl-ca-certs",
                str(tls.ca),
                "--ssl-cert-reqs",
                str(int(ssl.CERT_REQUIRED)),
            ]
            if tls
            else []
        ),
        *(extra or []),
    ]


def connector_extra(
    store: str,
    model: str,
    tokenizer: str,
    *,
    metrics_port: int,
    scheduler_metrics_port: int,
    tls_dir: str | None,
    bypass_file: str = "",
) -> dict:
    """The QuillCache KV connector's extra config (`quillcache_vllm.connector`) for an
    engine on the store node `store`; `tls_dir` None for an --insecure pool."""
    return {
        "store": store,
        "model": model,
        "tokenizer": tokenizer,
        "index_block_tokens": 16,
        "metrics_port": metrics_port,
        "scheduler_metrics_port": scheduler_metrics_port,
        **({"bypass_file": bypass_file} if bypass_file else {}),
        **({"insecure": True} if tls_dir is None else {"tls_dir": tls_dir}),
    }


def connector_config(extra: dict) -> dict:
    """vLLM's --kv-transfer-config loading `quillcache_vllm.connector.QuillCacheConnector`."""
    return {
        "kv_connector": "QuillCacheConnector",
        "kv_connector_module_path": "quillcache_vllm.connector",
        "kv_role": "kv_both",
        # A block the pool cannot deliver is recomputed, never a failed request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


# The niceness `quillcache up` starts vLLM servers at. A fleet's control processes (the
# gateway, the conductors, a router) never share a CPU with its engines; where they must
# (a local cluster on a few cores), they go first, as vLLM itself keeps a core for its
# own frontend when it has cores to spare.
VLLM_NICE = 10

# Linux with autogroup scheduling (`kernel.sched_autogroup_enabled`, on by default on
# desktop and many cloud kernels) shares the CPU between sessions first: a process
# started in a session of its own (every child of `quillcache up` is) is its own group,
# and its niceness only orders it within that group. Measured here (kernel 6.18, 2
# cores): with the engines at niceness 10 but their groups at 0, a Plan call still took
# 7-21 ms instead of 1.6 right after an engine's answer. So the group's niceness is set
# too, from inside the engine's session (`/proc/self/autogroup`; raising one's own
# niceness needs no privilege); where there is no autogroup the write fails quietly.
_NICE_SESSION = 'echo "$0" > /proc/self/autogroup 2>/dev/null; exec nice -n "$0" "$@"'


def niced(argv: Sequence[str], nice: int = VLLM_NICE) -> list[str]:
    """`argv` run at niceness `nice` (coreutils' nice), its session's autogroup too."""
    return ["sh", "-c", _NICE_SESSION, str(nice), *argv] if nice else list(argv)


def engine_cores(index: int, engines: int, cores: Sequence[int] | None = None) -> list[int]:
    """The cores engine `index` of `engines` on this machine computes on: the machine's
    cores (this process's affinity) shared out in equal runs, one core each when there
    are more engines than cores (then engines share cores round the list)."""
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if engines <= 0 or index < 0:
        raise ValueError(f"engine {index} of {engines}")
    share = len(cores) // engines
    if share == 0:
        return [cores[index % len(cores)]]
    return cores[index * share : (index + 1) * share]


def serve_env(
    tls: Tls | None = None, cores: Sequence[int] = (), kv_space_gib: int = KV_SPACE_GIB
) -> dict[str, str]:
    """vLLM's environment, with `kv_space_gib` GiB of KV cache space (`EngineKv`); with
    `tls`, the engine credential as its API key (vLLM then demands it on /v1); with
    `cores`, its compute threads bound to those cores, one a core
    (VLLM_CPU_OMP_THREADS_BIND). Without it vLLM's CPU worker binds a thread to
    every core of the machine, whatever OMP_NUM_THREADS says, and two engines on one
    machine then compute on the same cores against each other."""
    env = {**os.environ, **VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib)}
    if cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores)
    if tls is not None:
        env["VLLM_API_KEY"] = tls.engine_key()
    return env
