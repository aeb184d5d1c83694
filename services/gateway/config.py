"""Gateway settings: one frozen object from CLI flags and QC_* variables."""

from __future__ import annotations

from dataclasses import dataclass

from quillcache_core.errors import InvalidArgument
from quillcache_core.process.settings import opt


@dataclass(frozen=True)
class GatewayConfig:
    host: str = opt("127.0.0.1", "address to bind the HTTP port on")
    port: int = opt(0, "HTTP port (0 = a free port, printed on the READY line)")
    conductor: str = opt("", "conductor gRPC address host:port ('' = find it in the registry)")
    registry: str = opt("memory", "NodeRegistry to find the conductor in: 'memory' or an etcd URL")
    api_keys: str = opt(
        "",
        "API keys as tenant=key[,tenant=key...]; empty = no auth, every request is tenant 'default'",
    )
    cache_salts: str = opt(
        "", "per-tenant cache salt as tenant=salt[,...]; a tenant not listed uses its id"
    )
    tokenizers: str = opt(
        "", "per-model tokenizer.json as model=path[,...]; others use the built-in one"
    )
    block_size: int = opt(
        16, "tokens a block until the conductor's Stats name its index block size"
    )
    block_bytes: int = opt(2 * 1024 * 1024, "KV bytes per block, sent to the conductor")
    default_ttft_slo_ms: int = opt(
        800, "TTFT budget when the request has no x-quillcache-ttft-slo-ms header"
    )
    default_max_tokens: int = opt(
        256, "max_tokens when the request sets none (expected decode length)"
    )
    max_body_bytes: int = opt(4 * 1024 * 1024, "larger request bodies get 413")
    plan_timeout_s: float = opt(5.0, "deadline of a Plan or Finish call to the conductor")
    use_plan_port: bool = opt(
        True,
        "send Plan and Finish over the conductor's plan port when it has one "
        "(false = always over the gRPC PlanStream)",
    )
    finish_hold_ms: float = opt(
        20.0,
        "a Finish waits up to this long while other requests wait for their first byte "
        "(0 = send at once)",
    )
    upstream_timeout_s: float = opt(300.0, "total deadline of one upstream engine call")
    upstream_connect_timeout_s: float = opt(2.0, "deadline of opening a connection to an engine")
    upstream_idle_timeout_s: float = opt(
        30.0, "an idle keep-alive connection to an engine is reused for this long"
    )
    upstream_retries: int = opt(
        1, "re-plans on another engine when one fails before its first byte"
    )
    event_loop: str = opt(
        "uvloop",
        "asyncio event loop: uvloop (faster) or Python's own",
        choices=("uvloop", "asyncio"),
    )
    log_level: str = opt("INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    def __post_init__(self) -> None:
        if not self.conductor and self.registry == "memory":
            raise InvalidArgument("--conductor is required unless --registry names an etcd")
        if self.block_size <= 0 or self.max_body_bytes <= 0:
            raise InvalidArgument("--block-size and --max-body-bytes must be positive")
        if self.upstream_timeout_s <= 0 or self.upstream_connect_timeout_s <= 0:
            raise InvalidArgument(
                "--upstream-timeout-s and --upstream-connect-timeout-s must be positive"
            )
        if self.upstream_idle_timeout_s <= 0 or self.finish_hold_ms < 0:
            raise InvalidArgument(
                "--upstream-idle-timeout-s must be positive, --finish-hold-ms >= 0"
            )
        parse_pairs(self.api_keys, "--api-keys")
        parse_pairs(self.cache_salts, "--cache-salts")

    def tenants_by_key(self) -> dict[str, str]:
        return {key: tenant for tenant, key in parse_pairs(self.api_keys, "--api-keys").items()}

    def salts_by_tenant(self) -> dict[str, str]:
        """Configured cache salts; a tenant not listed uses its own id."""
        return parse_pairs(self.cache_salts, "--cache-salts")


def parse_pairs(spec: str, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name or not value:
            raise InvalidArgument(f"{flag}: {part!r} is not name=value")
        out[name] = value
    return out
