"""Conductor settings: one frozen object from CLI flags and QC_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from quillcache_conductor.zmq_sub import STALE_LAG_S
from quillcache_core.errors import InvalidArgument
from quillcache_core.index import BACKENDS
from quillcache_core.process.service import event_loop_opt
from quillcache_core.process.settings import opt
from quillcache_core.routing.disagg import DisaggSettings
from quillcache_core.routing.references import POLICY_NAMES
from quillcache_core.security.tls import TlsSettings


@dataclass(frozen=True)
class ConductorConfig(TlsSettings):
    host: str = opt("127.0.0.1", "address to bind the gRPC and metrics ports on")
    port: int = opt(0, "gRPC port (0 = a free port, printed on the READY line)")
    metrics_port: int = opt(0, "HTTP port for /metrics and /health (0 = a free port)")
    plan_port: int = opt(
        0,
        "TCP port serving PlanStream's messages length-prefixed, the gateway's fast path "
        "(0 = a free port, -1 = off)",
    )
    advertise_host: str = opt("", "host other nodes use to reach this conductor ('' = --host)")
    node_id: str = opt("conductor-0", "this conductor's id in the registry")
    registry: str = opt(
        "memory", "NodeRegistry: 'memory' or an etcd URL such as http://127.0.0.1:2379"
    )
    lease_ttl_s: float = opt(3.0, "lease TTL of this conductor's own registry record")
    index_backend: str = opt(
        "memory",
        "residency index backend (the persistent ones are served from an in-memory mirror)",
        choices=BACKENDS,
    )
    index_path: str = opt(
        "", "directory of a persistent index (required with any --index-backend but memory)"
    )
    policy: str = opt("quillcache", "routing policy", choices=POLICY_NAMES)
    seed_queue_cost: bool = opt(
        False,
        "price queued prefill tokens with the seed's 4 us/token instead of the prefill speed",
    )
    calibrate_prefill: bool = opt(
        True,
        "learn the engines' prefill speed per model from the TTFTs Finish reports and price "
        "plans with it (false = the cost model's default, 45 us a prompt token)",
    )
    temperature: float = opt(
        0.0, "softmax temperature of the quillcache/dynamo policies (0 = greedy)"
    )
    reservation_ttl_s: float = opt(300.0, "a reservation not finished within this time is released")
    block_bytes: int = opt(2 * 1024 * 1024, "KV bytes per block when a request or event omits it")
    block_tokens: int = opt(
        16,
        "the index's block size in tokens, told to gateways in Stats: an engine whose blocks "
        "are a multiple of it (vLLM on CPU: 32) has each split into blocks of this size",
    )
    max_blocks_per_request: int = opt(16384, "Plan and Observe reject longer block lists")
    plan_alternatives: int = opt(
        8,
        "a Plan reply lists the costs of up to this many next-best engines "
        "(a request's max_others may ask for fewer)",
    )
    departed_sweep_s: float = opt(
        10.0,
        "this long after start, drop the residency a reopened lmdb index holds for nodes "
        "the registry no longer lists (they left while the conductor was down); "
        "0 = keep it",
    )
    node_leave_grace_s: float = opt(
        -1.0,
        "keep the residency of an engine or store whose registry record went (its lease "
        "ran out) this long, not routing to it, in case it registers again with the same "
        "start time: a lease lost in an etcd stall loses nothing "
        "(-1 = 2 x --lease-ttl-s + 1; 0 = drop it at once)",
    )
    kv_events: bool = opt(
        True, "subscribe to engines' ZMQ KV event publishers found in the registry"
    )
    replica_sync: bool = opt(
        True,
        "share reservations (load and optimistic blocks) with the other conductor replicas "
        "the registry lists, over a direct stream (replica_sync.py)",
    )
    replica_heartbeat_s: float = opt(
        0.5, "a replica's sync stream carries a heartbeat this often when idle"
    )
    replica_standby_flush_s: float = opt(
        0.05,
        "to a replica that planned nothing lately (a standby), reservations are sent at "
        "most this often, coalesced; to one that plans, as they come (0: always as they come)",
    )
    standby_linger_s: float = opt(
        0.2,
        "while a peer replica plans and this one does not (a standby), its engines' KV event "
        "batches are taken this long after the first arrives, and its stores are asked to "
        "hold theirs as long, together; the first plan here ends the wait (0: never wait)",
    )
    replica_silence_s: float = opt(
        2.0,
        "a replica not heard from this long (no delta, no heartbeat) loses all the load it "
        "reserved here, and its stream is opened again",
    )
    disagg: str = opt(
        "auto",
        "prefill/decode disaggregation: auto (split or colocated per request from the cost "
        "model, or as a request asks), off (never split)",
        choices=("auto", "off"),
    )
    disagg_min_decode_tokens: int = opt(
        32, "requests expecting fewer output tokens stay colocated (disagg auto)"
    )
    disagg_margin: float = opt(
        0.1, "a split must be at least this share cheaper than colocated (disagg auto)"
    )
    disagg_bytes_per_s: float = opt(
        500e6, "store-to-store bandwidth assumed until the gateways' transfers measure it"
    )
    seed: int = opt(0, "random seed for tie-breaks (0 = from the OS)")
    event_loop: str = event_loop_opt()
    log_level: str = opt("INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.index_backend != "memory" and not self.index_path:
            raise InvalidArgument(
                f"--index-path is required with --index-backend {self.index_backend}"
            )
        if self.reservation_ttl_s <= 0:
            raise InvalidArgument("--reservation-ttl-s must be positive")
        if self.disagg_min_decode_tokens < 0 or not 0 <= self.disagg_margin < 1:
            raise InvalidArgument(
                "--disagg-min-decode-tokens must be >= 0 and --disagg-margin in [0, 1)"
            )
        if not self.disagg_bytes_per_s > 0:
            raise InvalidArgument("--disagg-bytes-per-s must be positive")
        if self.lease_ttl_s <= 0:
            raise InvalidArgument("--lease-ttl-s must be positive")
        if self.departed_sweep_s < 0:
            raise InvalidArgument("--departed-sweep-s must be >= 0")
        if self.node_leave_grace_s < 0 and self.node_leave_grace_s != -1:
            raise InvalidArgument("--node-leave-grace-s must be >= 0, or -1 for the default")
        if self.replica_heartbeat_s <= 0 or self.replica_silence_s <= self.replica_heartbeat_s:
            raise InvalidArgument(
                "--replica-heartbeat-s must be positive and below --replica-silence-s"
            )
        if not 0 <= self.replica_standby_flush_s < self.replica_heartbeat_s:
            raise InvalidArgument(
                "--replica-standby-flush-s must be >= 0 and below --replica-heartbeat-s"
            )
        if not 0 <= self.standby_linger_s < STALE_LAG_S:
            raise InvalidArgument(
                f"--standby-linger-s must be >= 0 and below {STALE_LAG_S} s "
                "(a view that far behind its engine counts as stale)"
            )
        if self.temperature < 0:
            raise InvalidArgument("--temperature must be >= 0")
        if self.block_bytes <= 0 or self.max_blocks_per_request <= 0 or self.block_tokens <= 0:
            raise InvalidArgument(
                "--block-bytes, --block-tokens and --max-blocks-per-request must be positive"
            )

    def disagg_settings(self) -> DisaggSettings:
        return DisaggSettings(
            enabled=self.disagg == "auto",
            min_decode_tokens=self.disagg_min_decode_tokens,
            margin=self.disagg_margin,
            default_bytes_per_s=self.disagg_bytes_per_s,
        )
