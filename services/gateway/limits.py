"""Per-tenant limits at the gateway: requests a second, prompt tokens a minute, in flight.

Set per tenant (`--tenant-limits`, tenants are API keys' owners) with defaults for the
others (`--default-rps`, `--default-tpm`, `--default-concurrent`; 0 = unlimited):

    --tenant-limits "acme=rps:10,tpm:100000,concurrent:8;globex=rps:2.5"

A kind left out of a tenant's entry takes its default. Requests a second and tokens a
minute are token buckets refilled continuously (no background task): a tenant may burst
one second's requests (at least one) and one minute's tokens, then goes at the rate.
A request is admitted (`enter`) against its tenant's in-flight and requests-a-second
limits once its body is read and valid (a slow upload holds no place), and charged its
prompt tokens (`charge`) once they are known, before it is planned; `leave` ends it. Over a limit: 429 with Retry-After (whole
seconds, at least 1) and OpenAI's error, type "requests" or "tokens", code
"rate_limit_exceeded". A prompt larger than the tenant's whole minute of tokens can never
pass: 429 with Retry-After 60 and a message that says so. Not thread-safe: one event loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from quillcache_core.errors import InvalidArgument
from quillcache_core.process.metrics import MetricsRegistry
from quillcache_gateway.errors import ApiError

KINDS = ("rps", "tpm", "concurrent")


@dataclass(frozen=True, slots=True)
class TenantLimit:
    """One tenant's limits; 0 = unlimited."""

    rps: float = 0.0
    tpm: int = 0
    concurrent: int = 0


def parse_tenant_limits(spec: str, default: TenantLimit) -> dict[str, TenantLimit]:
    """`tenant=rps:N,tpm:N,concurrent:N[;tenant=...]`; kinds left out take `default`'s."""
    out: dict[str, TenantLimit] = {}
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        tenant, sep, rest = entry.partition("=")
        tenant = tenant.strip()
        if not sep or not tenant or not rest.strip():
            raise InvalidArgument(f"--tenant-limits: {entry!r} is not tenant=kind:N[,kind:N...]")
        if tenant in out:
            raise InvalidArgument(f"--tenant-limits: tenant {tenant!r} is listed twice")
        values = {"rps": default.rps, "tpm": default.tpm, "concurrent": default.concurrent}
        seen: set[str] = set()
        for item in (i.strip() for i in rest.split(",")):
            kind, sep, number = (p.strip() for p in item.partition(":"))
            if not sep or kind not in KINDS or kind in seen:
                raise InvalidArgument(
                    f"--tenant-limits: {item!r} in {tenant}'s entry is not one of "
                    f"{', '.join(k + ':N' for k in KINDS)} (each at most once)"
                )
            seen.add(kind)
            values[kind] = _number(number, kind, f"--tenant-limits {tenant} {kind}")
        out[tenant] = TenantLimit(**values)
    return out


def _number(text: str, kind: str, where: str) -> float | int:
    try:
        value = float(text) if kind == "rps" else int(text)
    except ValueError:
        raise InvalidArgument(f"{where}: {text!r} is not a number") from None
    check_limit(value, where)
    return value


def check_limit(value: float, where: str) -> None:
    if not (math.isfinite(value) and 0 <= value <= 1e9):
        raise InvalidArgument(f"{where}: {value!r} must be from 0 (unlimited) to 1e9")


class _Bucket:
    """A token bucket: `rate` a second, at most `capacity`, full at the start."""

    __slots__ = ("rate", "capacity", "level", "at")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self.at = now

    def take(self, amount: float, now: float) -> float:
        """0.0 when `amount` was taken, else the seconds until it could be."""
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate


class _Tenant:
    __slots__ = ("limit", "requests", "tokens", "in_flight")

    def __init__(self, limit: TenantLimit, now: float) -> None:
        self.limit = limit
        self.requests = _Bucket(limit.rps, max(limit.rps, 1.0), now) if limit.rps else None
        self.tokens = _Bucket(limit.tpm / 60.0, limit.tpm, now) if limit.tpm else None
        self.in_flight = 0


class TenantLimiter:
    """The tenants' buckets and in-flight counts, and their metrics on `metrics`."""

    def __init__(
        self,
        limits: dict[str, TenantLimit],
        default: TenantLimit,
        metrics: MetricsRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limits = limits
        self._default = default
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}
        self.requests = metrics.counter(
            "gateway_tenant_requests_total",
            "completion requests answered, by tenant and HTTP status (499: the client left)",
            ["tenant", "status"],
        )
        self.rejected = metrics.counter(
            "gateway_tenant_rejected_total",
            "requests refused with 429 by a tenant limit, by tenant and limit "
            "(rps, tpm, concurrent)",
            ["tenant", "limit"],
        )
        self.prompt_tokens = metrics.counter(
            "gateway_tenant_prompt_tokens_total",
            "prompt tokens of the requests admitted, by tenant",
            ["tenant"],
        )
        metrics.gauge(
            "gateway_tenant_in_flight",
            "completion requests in flight, by tenant",
            ["tenant"],
            read=lambda: [((name,), float(t.in_flight)) for name, t in self._tenants.items()],
        )

    def _tenant(self, name: str) -> _Tenant:
        found = self._tenants.get(name)
        if found is None:
            limit = self._limits.get(name, self._default)
            found = self._tenants[name] = _Tenant(limit, self._clock())
        return found

    def in_flight(self, name: str) -> int:
        found = self._tenants.get(name)
        return found.in_flight if found is not None else 0

    def enter(self, name: str) -> None:
        """Admit a request of tenant `name` (then `leave` must follow) or raise 429."""
        tenant = self._tenant(name)
        limit = tenant.limit
        if limit.concurrent and tenant.in_flight >= limit.concurrent:
            raise self._refused(
                name,
                "concurrent",
                "requests",
                f"Rate limit reached for tenant {name} on requests in flight: "
                f"Limit {limit.concurrent}. Please try again when one has finished.",
                1.0,
            )
        if tenant.requests is not None:
            wait = tenant.requests.take(1.0, self._clock())
            if wait:
                raise self._refused(
                    name,
                    "rps",
                    "requests",
                    f"Rate limit reached for tenant {name} on requests per second (RPS): "
                    f"Limit {limit.rps:g}. Please try again in {wait:.3g}s.",
                    wait,
                )
        tenant.in_flight += 1

    def leave(self, name: str) -> None:
        tenant = self._tenants.get(name)
        if tenant is not None and tenant.in_flight > 0:
            tenant.in_flight -= 1

    def charge(self, name: str, tokens: int) -> None:
        """Take a request's prompt tokens from its tenant's minute, or raise 429."""
        tenant = self._tenant(name)
        bucket = tenant.tokens
        if bucket is not None:
            tpm = tenant.limit.tpm
            if tokens > tpm:
                raise self._refused(
                    name,
                    "tpm",
                    "tokens",
                    f"Request too large for tenant {name} on tokens per min (TPM): "
                    f"Limit {tpm}, Requested {tokens}. The prompt must be shorter.",
                    60.0,
                )
            wait = bucket.take(tokens, self._clock())
            if wait:
                raise self._refused(
                    name,
                    "tpm",
                    "tokens",
                    f"Rate limit reached for tenant {name} on tokens per min (TPM): "
                    f"Limit {tpm}, Requested {tokens}. Please try again in {wait:.3g}s.",
                    wait,
                )
        self.prompt_tokens.inc(tokens, tenant=name)

    def count(self, name: str, status: str) -> None:
        self.requests.inc(tenant=name, status=status)

    def _refused(self, name: str, limit: str, type_: str, message: str, wait: float) -> ApiError:
        self.rejected.inc(tenant=name, limit=limit)
        return ApiError(
            429,
            message,
            type_=type_,
            code="rate_limit_exceeded",
            headers={"Retry-After": str(max(1, math.ceil(wait)))},
        )
