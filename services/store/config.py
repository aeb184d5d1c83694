"""Store node settings: one frozen object from CLI flags and QC_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from quillcache_core.errors import InvalidArgument
from quillcache_core.process.settings import opt
from quillcache_core.security.tls import TlsSettings

MIB = 1024 * 1024
GIB = 1024 * MIB


@dataclass(frozen=True)
class StoreConfig(TlsSettings):
    host: str = opt("127.0.0.1", "address to bind the gRPC and metrics ports on")
    port: int = opt(0, "gRPC port (0 = a free port, printed on the READY line)")
    metrics_port: int = opt(0, "HTTP port for /metrics and /health (0 = a free port)")
    pull_streams: int = opt(2, "connections a Pull uses at once to fetch from a source's data port")
    data_port: int = opt(
        0,
        "raw TCP block-data port other store nodes pull blocks from (0 = a free port, "
        "printed on the READY line and announced in the registry; -1 = off: peers fall "
        "back to gRPC)",
    )
    data_socket: str = opt(
        "auto",
        "Unix socket of the block-data protocol for clients on this host running as this "
        "user (engines loading their own node's blocks, no TLS): a path, 'auto' (a new "
        "private directory under the system's temp dir) or 'off'; announced in Stats",
    )
    data_handshake_timeout_s: float = opt(
        5.0,
        "a connection to the block-data port that has not finished its TLS handshake, "
        "or sent its first request, this long after it connected is closed, seconds",
    )
    data_idle_timeout_s: float = opt(
        300.0, "a block-data connection that sends no new request this long is closed, seconds"
    )
    advertise_host: str = opt(
        "", "host other nodes reach this one at (default: --host, or 127.0.0.1 for 0.0.0.0)"
    )
    node_id: str = opt("store-0", "this store node's id in the registry and in KV events")
    data_dir: str = opt("", "directory of the SSD tier (LMDB); required")
    dram_capacity_bytes: int = opt(1 * GIB, "DRAM tier budget in bytes")
    dram_prefault: bool = opt(
        False,
        "take the DRAM tier's memory when the node starts (mapped and touched in the "
        "background at the lowest CPU priority), so storing a block later costs no page "
        "faults; the node's RSS is then its DRAM capacity",
    )
    ssd_capacity_bytes: int = opt(8 * GIB, "SSD tier budget in bytes (records: header + payload)")
    locality_domain: str = opt("", "locality domain (rack, zone) announced in the registry")
    registry: str = opt(
        "memory", "NodeRegistry: 'memory' or an etcd URL such as http://127.0.0.1:2379"
    )
    lease_ttl_s: float = opt(3.0, "lease TTL of this node's registry record, seconds")
    conductor: str = opt(
        "",
        "conductor gRPC addresses host:port[,host:port] for residency events "
        "(default: every conductor registered in the registry)",
    )
    transfer: str = opt(
        "",
        "transfer service address for peer fetch (default: discover in the registry; "
        "'none' = fetch from peers directly)",
    )
    peer_fetch: bool = opt(True, "serve Get(allow_remote) misses from peer store nodes")
    max_chunk_bytes: int = opt(8 * MIB, "largest data field accepted in one Put chunk")
    max_block_bytes: int = opt(256 * MIB, "largest block accepted by Put")
    max_inflight_put_bytes: int = opt(
        512 * MIB, "bytes of Put payloads being received at once (further Puts wait)"
    )
    default_chunk_bytes: int = opt(1 * MIB, "Get chunk size when the request gives none")
    group_commit_window_s: float = opt(0.002, "SSD group commit window for durable puts")
    lazy_commit_window_s: float = opt(0.05, "SSD commit delay for non-durable writes")
    event_queue_max: int = opt(
        100_000, "residency events held for the conductor; on overflow a full resync follows"
    )
    event_batch_max: int = opt(512, "residency events per KvEventBatch")
    event_linger_s: float = opt(
        0.02, "how long residency events wait for more to share their KvEventBatch, seconds"
    )
    rpc_timeout_s: float = opt(10.0, "deadline of calls to the conductor, peers and transfer")
    worker_threads: int = opt(8, "threads for disk and checksum work")
    log_level: str = opt("INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.data_dir:
            raise InvalidArgument("--data-dir is required (the SSD tier's directory)")
        if self.dram_capacity_bytes <= 0:
            raise InvalidArgument("--dram-capacity-bytes must be positive")
        if self.ssd_capacity_bytes <= 0:
            raise InvalidArgument("--ssd-capacity-bytes must be positive")
        if self.lease_ttl_s <= 0:
            raise InvalidArgument("--lease-ttl-s must be positive")
        if not 4096 <= self.max_chunk_bytes <= 64 * MIB - 4096:
            raise InvalidArgument("--max-chunk-bytes must be in 4096..(64 MiB - 4096)")
        if not 4096 <= self.default_chunk_bytes <= self.max_chunk_bytes:
            raise InvalidArgument("--default-chunk-bytes must be in 4096..--max-chunk-bytes")
        if self.max_block_bytes <= 0 or self.max_inflight_put_bytes < self.max_block_bytes:
            raise InvalidArgument(
                "--max-block-bytes must be positive and <= --max-inflight-put-bytes"
            )
        if self.event_queue_max <= 0 or self.event_batch_max <= 0:
            raise InvalidArgument("--event-queue-max and --event-batch-max must be positive")
        if not 0 <= self.event_linger_s <= 1:
            raise InvalidArgument("--event-linger-s must be in 0..1")
        if self.rpc_timeout_s <= 0 or self.worker_threads <= 0:
            raise InvalidArgument("--rpc-timeout-s and --worker-threads must be positive")
        if self.data_handshake_timeout_s <= 0 or self.data_idle_timeout_s <= 0:
            raise InvalidArgument(
                "--data-handshake-timeout-s and --data-idle-timeout-s must be positive"
            )
        if not 1 <= self.pull_streams <= 16:
            raise InvalidArgument("--pull-streams must be in 1..16")
        if not -1 <= self.data_port <= 65535:
            raise InvalidArgument("--data-port must be -1 (off), 0 (a free port) or a port")
        if "/" in self.node_id or not self.node_id:
            raise InvalidArgument("--node-id must be non-empty and contain no '/'")

    @property
    def advertised_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
