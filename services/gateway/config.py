"""Gateway settings: one frozen object from CLI flags and QC_* variables."""

from __future__ import annotations

import dataclasses
import os
import stat
from dataclasses import dataclass

from quillcache_core.errors import InvalidArgument
from quillcache_core.process.service import event_loop_opt
from quillcache_core.process.settings import opt
from quillcache_core.security.tls import TlsSettings
from quillcache_gateway.limits import TenantLimit, check_limit, parse_tenant_limits
from quillcache_gateway.prewarm import MAX_PREFIXES

MAX_KEYS_FILE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class GatewayConfig(TlsSettings):
    host: str = opt("127.0.0.1", "address to bind the HTTP port on")
    port: int = opt(0, "HTTP port (0 = a free port, printed on the READY line)")
    conductor: str = opt(
        "", "conductor gRPC addresses host:port[,host:port] ('' = every one in the registry)"
    )
    registry: str = opt("memory", "NodeRegistry to find the conductor in: 'memory' or an etcd URL")
    conductor_spread: str = opt(
        "primary",
        "which conductor replica plans: 'primary' (one replica: first the first in an order "
        "every gateway shares, --conductor's, else the registry ids'; when it fails, the next "
        "that answers, from then on; the others are hot standbys) or 'round-robin' (plans "
        "spread over every replica)",
        choices=("primary", "round-robin"),
    )
    api_keys: str = dataclasses.field(
        default="",
        repr=False,
        metadata={
            "help": "API keys as tenant=key[,tenant=key...], best from the environment: a "
            "command line is every local user's to read (ps); empty (and no "
            "--api-keys-file) = no auth, every request is tenant 'default'"
        },
    )
    api_keys_file: str = opt(
        "",
        "a file of API keys, tenant=key a line (or comma-separated), readable by its owner "
        "only (mode 0600 or stricter)",
    )
    cache_salts: str = opt(
        "", "per-tenant cache salt as tenant=salt[,...]; a tenant not listed uses its id"
    )
    admin_tenants: str = opt(
        "",
        "tenants whose API keys also open the status page (/dashboard), as "
        "tenant[,tenant...]; each must have an API key",
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
    header_timeout_s: float = opt(
        10.0,
        "a connection must finish its TLS handshake and each request's line and headers "
        "within this long of opening or of its request's first byte, or it is closed",
    )
    body_timeout_s: float = opt(
        30.0,
        "a request's body must arrive within this long of its headers (4 MiB at 140 KB/s), "
        "or it gets 408 and the connection is closed",
    )
    idle_timeout_s: float = opt(
        75.0, "a keep-alive connection idle this long between requests is closed"
    )
    memo_bytes: int = opt(
        256 * 1024 * 1024,
        "bytes kept of recent prompts' work (token ids, block hashes) for all tenants; "
        "each tenant gets an equal share, at most --tenant-memo-bytes",
    )
    tenant_memo_bytes: int = opt(
        32 * 1024 * 1024,
        "bytes kept of one tenant's recent prompts' work, its own: no tenant's requests "
        "change what another's find there, or how fast they are prepared",
    )
    max_json_depth: int = opt(
        64,
        "request bodies whose arrays and objects nest deeper get 400 (checked before "
        "parsing; at most 512)",
    )
    max_tokens_limit: int = opt(
        1_000_000,
        "largest max_tokens / max_completion_tokens a request may ask for; larger gets 400",
    )
    max_ttft_slo_ms: int = opt(
        3_600_000,
        "largest x-quillcache-ttft-slo-ms header (1 hour); larger, or not a whole number "
        "of ms, gets 400",
    )
    tenant_limits: str = opt(
        "",
        "per-tenant limits as tenant=rps:N,tpm:N,concurrent:N[;tenant=...]: requests a "
        "second (may be fractional; bursts of one second), prompt tokens a minute (bursts "
        "of one minute), requests in flight; a kind left out takes its --default-*, "
        "0 = unlimited; over a limit: 429 with Retry-After",
    )
    default_rps: float = opt(
        0.0, "requests a second of a tenant not in --tenant-limits (0 = unlimited)"
    )
    default_tpm: int = opt(
        0, "prompt tokens a minute of a tenant not in --tenant-limits (0 = unlimited)"
    )
    default_concurrent: int = opt(
        0, "requests in flight of a tenant not in --tenant-limits (0 = unlimited)"
    )
    plan_timeout_s: float = opt(5.0, "deadline of a Plan or Finish call to the conductor")
    use_plan_port: bool = opt(
        True,
        "send Plan and Finish over the conductor's plan port when it has one "
        "(false = always over the gRPC PlanStream)",
    )
    plan_fallback: bool = opt(
        True,
        "while the conductor is unreachable (down, restarting, hung), route each request "
        "to an engine its last Stats listed for the model, by a consistent hash of the "
        "prompt's first block, without a reservation (false = answer 503)",
    )
    plan_fallback_timeout_s: float = opt(
        0.5,
        "with --plan-fallback: the longest a request waits for its Plan before the gateway "
        "routes it itself (what a hung conductor costs a request)",
    )
    plan_fallback_retry_s: float = opt(
        0.5,
        "with --plan-fallback: after the conductor failed, it is asked again at most this "
        "often; requests are routed by the gateway meanwhile",
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
    prewarm_top: int = opt(
        0,
        "a new engine gets each tenant's N hottest recent prompt prefixes (max_tokens 1, "
        "loaded from the pool) before it takes this gateway's traffic (0 = off; prewarm.py)",
    )
    prewarm_timeout_s: float = opt(30.0, "a new engine takes traffic after this long warming")
    prewarm_poll_s: float = opt(0.25, "with --prewarm-top: how often the fleet is looked at")
    event_loop: str = event_loop_opt()
    log_level: str = opt("INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    # tenant -> API key, read once from --api-keys or --api-keys-file (not a flag).
    _keys: dict[str, str] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.conductor and self.registry == "memory":
            raise InvalidArgument("--conductor is required unless --registry names an etcd")
        if self.block_size <= 0 or self.max_body_bytes <= 0:
            raise InvalidArgument("--block-size and --max-body-bytes must be positive")
        if min(self.header_timeout_s, self.body_timeout_s, self.idle_timeout_s) <= 0:
            raise InvalidArgument(
                "--header-timeout-s, --body-timeout-s and --idle-timeout-s must be positive"
            )
        if self.memo_bytes < 0 or self.tenant_memo_bytes < 0:
            raise InvalidArgument("--memo-bytes and --tenant-memo-bytes must be >= 0")
        if self.upstream_timeout_s <= 0 or self.upstream_connect_timeout_s <= 0:
            raise InvalidArgument(
                "--upstream-timeout-s and --upstream-connect-timeout-s must be positive"
            )
        if self.upstream_idle_timeout_s <= 0 or self.finish_hold_ms < 0:
            raise InvalidArgument(
                "--upstream-idle-timeout-s must be positive, --finish-hold-ms >= 0"
            )
        if self.plan_fallback_timeout_s <= 0 or self.plan_fallback_retry_s <= 0:
            raise InvalidArgument(
                "--plan-fallback-timeout-s and --plan-fallback-retry-s must be positive"
            )
        if self.api_keys and self.api_keys_file:
            raise InvalidArgument("give --api-keys or --api-keys-file, not both")
        object.__setattr__(self, "_keys", self._read_keys())  # frozen: set once, here
        parse_pairs(self.cache_salts, "--cache-salts")
        if not 1 <= self.max_json_depth <= 512:
            raise InvalidArgument("--max-json-depth must be from 1 to 512")
        if not 1 <= self.max_tokens_limit < 2**32 or not 1 <= self.max_ttft_slo_ms < 2**32:
            raise InvalidArgument(
                "--max-tokens-limit and --max-ttft-slo-ms must be from 1 to 2**32-1"
            )
        self.limits_by_tenant()
        if not 0 <= self.prewarm_top <= MAX_PREFIXES:
            raise InvalidArgument(f"--prewarm-top must be from 0 to {MAX_PREFIXES}")
        if self.prewarm_timeout_s <= 0 or self.prewarm_poll_s <= 0:
            raise InvalidArgument("--prewarm-timeout-s and --prewarm-poll-s must be positive")
        self.admins()

    def _read_keys(self) -> dict[str, str]:
        """tenant -> key, from --api-keys or the file --api-keys-file names."""
        if not self.api_keys_file:
            return parse_pairs(self.api_keys, "--api-keys")
        path = self.api_keys_file
        try:
            with open(path, encoding="utf-8") as keys:
                mode = os.fstat(keys.fileno()).st_mode
                text = keys.read(MAX_KEYS_FILE_BYTES + 1)
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"--api-keys-file: cannot read {path}: {exc}") from exc
        if mode & 0o077:
            raise InvalidArgument(
                f"--api-keys-file: {path} is open to other users (mode "
                f"{stat.S_IMODE(mode):04o}): chmod 600 it"
            )
        if len(text) > MAX_KEYS_FILE_BYTES:
            raise InvalidArgument(f"--api-keys-file: {path} is over {MAX_KEYS_FILE_BYTES} bytes")
        return parse_pairs(",".join(text.splitlines()), "--api-keys-file")

    def tenants_by_key(self) -> dict[str, str]:
        return {key: tenant for tenant, key in self._keys.items()}

    def salts_by_tenant(self) -> dict[str, str]:
        """Configured cache salts; a tenant not listed uses its own id."""
        return parse_pairs(self.cache_salts, "--cache-salts")

    def admins(self) -> frozenset[str]:
        """--admin-tenants: tenants with an API key whose key also opens /dashboard."""
        names = frozenset(filter(None, (t.strip() for t in self.admin_tenants.split(","))))
        unknown = sorted(names - set(self._keys))
        if unknown:
            raise InvalidArgument(
                f"--admin-tenants names tenants without an API key: {', '.join(unknown)}"
            )
        return names

    def default_limit(self) -> TenantLimit:
        check_limit(self.default_rps, "--default-rps")
        check_limit(self.default_tpm, "--default-tpm")
        check_limit(self.default_concurrent, "--default-concurrent")
        return TenantLimit(self.default_rps, self.default_tpm, self.default_concurrent)

    def limits_by_tenant(self) -> dict[str, TenantLimit]:
        """--tenant-limits, each tenant one with an API key ('default' without keys)."""
        limits = parse_tenant_limits(self.tenant_limits, self.default_limit())
        known = set(self._keys) or {"default"}
        unknown = sorted(set(limits) - known)
        if unknown:
            raise InvalidArgument(
                f"--tenant-limits names tenants without an API key: {', '.join(unknown)}"
            )
        return limits


def parse_pairs(spec: str, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name or not value:
            raise InvalidArgument(f"{flag}: {part!r} is not name=value")
        out[name] = value
    return out
