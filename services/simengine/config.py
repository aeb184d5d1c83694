"""Sim engine settings: one frozen object from CLI flags and QC_* variables."""

from __future__ import annotations

import os
from dataclasses import dataclass

from quillcache_core.errors import InvalidArgument
from quillcache_core.model import CostModel
from quillcache_core.process.settings import opt
from quillcache_core.security.tls import TlsSettings

_COST = CostModel()
STORE_WRITES = ("computed", "evicted", "none")
# The longest path of a unix socket (sockaddr_un.sun_path, less its terminating NUL).
MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class SimEngineConfig(TlsSettings):
    host: str = opt("127.0.0.1", "address to bind the HTTP and ZMQ sockets on")
    port: int = opt(0, "HTTP port: OpenAI API, /health, /metrics (0 = a free port)")
    plain_http_port: int = opt(
        -1,
        "benchmarks only: an extra plain-HTTP listener on --host with no TLS and no "
        "engine credential, for reference routers that cannot present a client "
        "certificate (-1 = none, 0 = a free port); never advertised in the registry",
    )
    advertise_host: str = opt(
        "", "host other nodes use to reach this engine (default: --host, 0.0.0.0 -> 127.0.0.1)"
    )
    kv_events_port: int = opt(0, "ZMQ PUB port of the KV events (0 = a free port)")
    kv_replay_port: int = opt(0, "ZMQ ROUTER port of the KV event replay (0 = a free port)")
    kv_events_dir: str = opt(
        "",
        "unix sockets DIR/<node-id>-events and -replay for the KV events instead of TCP "
        "ports; DIR is made mode 0700 and must be only this user's ('' = TCP on --host)",
    )
    event_encoding: str = opt(
        "array", "KV event encoding, as vLLM releases differ", choices=("array", "map")
    )
    kv_events_buffer: int = opt(10_000, "KV event batches kept for replay")
    node_id: str = opt("sim-engine-0", "this engine's id (registry, headers, responses)")
    model: str = opt("sim-model", "the served model name")
    tokenizer: str = opt("", "a Hugging Face tokenizer.json for the model ('' = built-in)")
    tokenizer_id: str = opt(
        "", "tokenizer id in block identities and the registry (default: the tokenizer's name)"
    )
    block_size: int = opt(16, "tokens per KV block")
    hbm_blocks: int = opt(4096, "KV blocks the simulated GPU holds (LRU beyond that)")
    time_scale: float = opt(
        0.02, "multiplies every simulated compute time (1.0 = the cost model's real-time)"
    )
    prefill_us_per_token: int = opt(_COST.prefill_us_per_token, "prefill cost per token (µs)")
    decode_us_per_token: int = opt(_COST.decode_us_per_token, "decode cost per output token (µs)")
    prefill_stalls_decodes: bool = opt(
        False,
        "a finished prefill delays every running decode by its duration (one kind of step "
        "at a time, as vLLM without chunked prefill); off: decodes never wait",
    )
    default_max_tokens: int = opt(16, "output tokens when a request names no max_tokens")
    max_model_len: int = opt(32_768, "prompt + output tokens a request may use")
    kv_layers: int = opt(16, "layers of the simulated KV tensor of one block")
    kv_heads: int = opt(8, "KV heads of the simulated KV tensor")
    head_dim: int = opt(128, "head dimension of the simulated KV tensor")
    store: str = opt("", "host:port of this engine's store node ('' = no offload, no FETCH)")
    store_node_id: str = opt("", "the store node's id (registry record, FETCH source matching)")
    store_writes: str = opt(
        "computed",
        "what goes to the store node: every newly computed full block, saved in the "
        "background as the QuillCache vLLM connector does (computed); evicted blocks "
        "(evicted); nothing (none)",
        choices=STORE_WRITES,
    )
    save_queue_blocks: int = opt(8192, "computed blocks waiting to be saved; beyond: dropped")
    offload_queue_blocks: int = opt(256, "evicted blocks waiting for offload; beyond: dropped")
    offload_concurrency: int = opt(4, "concurrent offload puts")
    store_timeout_s: float = opt(10.0, "deadline of one store call (put or get)")
    registry: str = opt(
        "memory", "NodeRegistry: 'memory', '' (none) or an etcd URL like http://127.0.0.1:2379"
    )
    locality_domain: str = opt("local", "locality domain (rack, host) of this engine")
    role: str = opt(
        "both",
        "part in prefill/decode disaggregation: prefill (writes every prompt's blocks to its "
        "store node before answering), decode, or both",
        choices=("prefill", "decode", "both"),
    )
    lease_ttl_s: float = opt(3.0, "lease TTL of this engine's registry record")
    seed: int = opt(0, "seed of the engine's block hashes (0 = random per start, like vLLM)")
    max_body_bytes: int = opt(32 * 1024 * 1024, "largest request body accepted")
    log_level: str = opt("INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    def __post_init__(self) -> None:
        super().__post_init__()
        positive = {
            "--block-size": self.block_size,
            "--hbm-blocks": self.hbm_blocks,
            "--default-max-tokens": self.default_max_tokens,
            "--max-model-len": self.max_model_len,
            "--kv-layers": self.kv_layers,
            "--kv-heads": self.kv_heads,
            "--head-dim": self.head_dim,
            "--offload-queue-blocks": self.offload_queue_blocks,
            "--save-queue-blocks": self.save_queue_blocks,
            "--offload-concurrency": self.offload_concurrency,
            "--kv-events-buffer": self.kv_events_buffer,
            "--max-body-bytes": self.max_body_bytes,
        }
        for flag, value in positive.items():
            if value <= 0:
                raise InvalidArgument(f"{flag} must be positive, got {value}")
        if self.plain_http_port < -1:
            raise InvalidArgument("--plain-http-port must be -1 (none), 0 (free) or a port")
        if self.time_scale < 0:
            raise InvalidArgument("--time-scale must be >= 0")
        if self.prefill_us_per_token < 0 or self.decode_us_per_token < 0:
            raise InvalidArgument("--prefill-us-per-token and --decode-us-per-token must be >= 0")
        if self.lease_ttl_s <= 0 or self.store_timeout_s <= 0:
            raise InvalidArgument("--lease-ttl-s and --store-timeout-s must be positive")
        if self.store and ":" not in self.store:
            raise InvalidArgument(f"--store must be host:port, got {self.store!r}")
        if not self.node_id or "/" in self.node_id:
            raise InvalidArgument("--node-id must be non-empty and contain no '/'")
        if not self.model:
            raise InvalidArgument("--model must be non-empty")
        if self.kv_events_dir:
            if self.kv_events_port or self.kv_replay_port:
                raise InvalidArgument(
                    "--kv-events-dir puts the KV events on unix sockets: "
                    "no --kv-events-port or --kv-replay-port with it"
                )
            longest = os.path.join(os.path.abspath(self.kv_events_dir), f"{self.node_id}-replay")
            if len(longest.encode()) > MAX_SOCKET_PATH:
                raise InvalidArgument(
                    f"--kv-events-dir: the socket {longest} is longer than a unix socket's "
                    f"{MAX_SOCKET_PATH} bytes; pick a shorter directory"
                )

    @property
    def public_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host

    @property
    def kv_shape(self) -> tuple[int, int, int, int, int]:
        """[layers, 2 (K and V), block tokens, kv heads, head dim] of one block."""
        return (self.kv_layers, 2, self.block_size, self.kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        layers, kv, tokens, heads, dim = self.kv_shape
        return layers * kv * tokens * heads * dim * 2  # float16
