"""Transfer service settings: one frozen object from CLI flags and QC_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from quillcache_core.errors import InvalidArgument
from quillcache_core.process.settings import opt
from quillcache_core.security.tls import TlsSettings

MIB = 1024 * 1024


@dataclass(frozen=True)
class TransferConfig(TlsSettings):
    host: str = opt("127.0.0.1", "address to bind the gRPC and metrics ports on")
    port: int = opt(0, "gRPC port (0 = a free port, printed on the READY line)")
    metrics_port: int = opt(0, "HTTP port for /metrics and /health (0 = a free port)")
    advertise_host: str = opt(
        "", "host other nodes reach this one at (default: --host, or 127.0.0.1 for 0.0.0.0)"
    )
    node_id: str = opt("transfer-0", "this service's id in the registry")
    registry: str = opt(
        "memory",
        "NodeRegistry resolving store node ids: an etcd URL such as http://127.0.0.1:2379",
    )
    lease_ttl_s: float = opt(3.0, "lease TTL of this service's registry record, seconds")
    data_path: bool = opt(
        True,
        "have the destination pull the blocks from the source's raw TCP block-data port "
        "when both stores advertise one (else stream Get into Put over gRPC)",
    )
    default_window: int = opt(
        8, "gRPC path: blocks in flight per request when the request gives none"
    )
    max_window: int = opt(64, "largest window a request may ask for")
    chunk_bytes: int = opt(
        1 * MIB, "gRPC path: chunk size of the streams when the request gives none"
    )
    retries: int = opt(3, "retries of a block after UNAVAILABLE (either side)")
    backoff_s: float = opt(0.1, "first retry delay; doubles per retry, up to 2 s")
    block_timeout_s: float = opt(
        30.0, "deadline of one block's Get and Put calls (data path: per block of a Pull)"
    )
    progress_every_blocks: int = opt(16, "a progress message at least every N finished blocks")
    progress_interval_s: float = opt(0.5, "and at least this often while blocks are in flight")
    log_level: str = opt("INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lease_ttl_s <= 0:
            raise InvalidArgument("--lease-ttl-s must be positive")
        if not 1 <= self.default_window <= self.max_window:
            raise InvalidArgument("--default-window must be in 1..--max-window")
        if not 4096 <= self.chunk_bytes <= 8 * MIB:
            raise InvalidArgument("--chunk-bytes must be in 4096..8 MiB")
        if self.retries < 0 or self.backoff_s < 0:
            raise InvalidArgument("--retries and --backoff-s must be >= 0")
        if self.block_timeout_s <= 0:
            raise InvalidArgument("--block-timeout-s must be positive")
        if self.progress_every_blocks <= 0 or self.progress_interval_s <= 0:
            raise InvalidArgument(
                "--progress-every-blocks and --progress-interval-s must be positive"
            )
        if "/" in self.node_id or not self.node_id:
            raise InvalidArgument("--node-id must be non-empty and contain no '/'")

    @property
    def advertised_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
