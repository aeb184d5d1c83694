"""The status page at /dashboard: engines, stores, conductor replicas and the last
requests' plans against what their answers delivered. The page (dashboard.html, no
external resource) asks /dashboard/state for its figures every few seconds.

Who may look (`DashboardAccess`): a client certificate of the cluster's CA with the
operator role, or the API key (`Authorization: Bearer`) of a tenant named in
--admin-tenants. Any other caller gets an OpenAI-shaped 401 (no credential, or an
unknown key) or 403 (a tenant's key, another role's certificate), and no figure. No
credential travels in a URL or a cookie: a browser presents the operator's
certificate, a script the admin's key in its header.

What it costs: the request path appends one row to a bounded deque
(`RecentPlans.record`); the fleet (the conductor's Stats, the registry's engine and
store records, each store's Stats, a health check of each conductor replica) is asked
only while someone has the page open, at most once a second however many do
(`FleetView`). No prompt text is kept: a row holds ids, block counts and times.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from importlib import resources

from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from quillcache.v1 import conductor_pb2, store_pb2, store_pb2_grpc
from quillcache_core.registry import open_registry
from quillcache_core.security.tls import Tls, grpc_channel, role_of_cert
from quillcache_gateway.accounting import DELIVERY_KEY
from quillcache_gateway.delivered import Prediction
from quillcache_gateway.errors import ApiError, response

logger = logging.getLogger(__name__)

KEPT_PLANS = 256  # rows kept: the engines' hit shares are over these
SHOWN_PLANS = 50  # rows the page lists, newest first
FLEET_TTL_S = 1.0  # the fleet is asked at most this often
CALL_TIMEOUT_S = 1.0  # deadline of each call for the page (Stats, registry, health)
REFRESH_MS = 2000  # how often the page asks for its figures
NONCE = "{{nonce}}"  # in dashboard.html: the inline script's and style's CSP nonce


@dataclass(frozen=True, slots=True)
class PlanRow:
    """One answered request: its plan and what the answer delivered. Never its prompt.

    `replica` "" = the gateway's own fallback plan (no conductor; no predicted TTFT);
    `ttft_ms` None = not a stream, or it ended before its first byte; `cached_tokens`
    None = the engine reported none (or the answer was not a success)."""

    at_s: float  # wall-clock time the plan's answer ended
    request_id: str
    tenant: str
    engine_id: str
    prefill_engine_id: str  # a split request's prefill engine ("" = not split)
    replica: str
    status: int  # the engine's HTTP status
    hit_blocks: int
    fetch_blocks: int
    recompute_blocks: int
    predicted_ttft_ms: float | None
    ttft_ms: float | None
    predicted_cached_tokens: int
    cached_tokens: int | None
    cause: str | None  # why delivered and predicted cached tokens differ (delivered.py)
    replica_behind_ms: int | None  # how far the planning replica's view trailed the engine


class RecentPlans:
    """The last `KEPT_PLANS` answered requests. `record` is the request path's only
    cost: one row appended to a bounded deque (single event loop: no lock)."""

    def __init__(self, clock: Callable[[], float] = time.time, kept: int = KEPT_PLANS) -> None:
        self._clock = clock
        self._rows: deque[PlanRow] = deque(maxlen=kept)

    def record(
        self,
        request: web.Request,
        request_id: str,
        tenant: str,
        plan,
        prediction: Prediction,
        status: int,
    ) -> None:
        """Keep a request's plan (a PlanResponse), its engine's HTTP `status` and, when
        its answer was counted (accounting.DeliveryMeter), what it delivered."""
        done = request.get(DELIVERY_KEY)
        fallback = prediction.fallback
        self._rows.append(
            PlanRow(
                at_s=self._clock(),
                request_id=request_id,
                tenant=tenant,
                engine_id=plan.engine_id,
                prefill_engine_id=plan.prefill_engine_id if plan.disagg == "split" else "",
                replica=prediction.replica,
                status=status,
                hit_blocks=plan.hit_blocks,
                fetch_blocks=plan.fetch_blocks,
                recompute_blocks=plan.recompute_blocks,
                predicted_ttft_ms=None if fallback else round(plan.est_ttft_ms, 3),
                ttft_ms=None if done is None or done.ttft_ms is None else round(done.ttft_ms, 3),
                predicted_cached_tokens=prediction.cached_tokens,
                cached_tokens=None if done is None else done.cached_tokens,
                cause=None if done is None else done.cause,
                replica_behind_ms=None if fallback else prediction.replica_behind_ms,
            )
        )

    def rows(self) -> list[PlanRow]:
        """Every kept row, oldest first."""
        return list(self._rows)


def engine_shares(rows: Iterable[PlanRow]) -> dict[str, dict[str, int]]:
    """Per engine, its kept requests' plans summed: requests, engine-hit, pool-load
    and recompute blocks (the gateway's own fallback plans say none)."""
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        found = out.setdefault(
            row.engine_id,
            {"requests": 0, "hit_blocks": 0, "fetch_blocks": 0, "recompute_blocks": 0},
        )
        found["requests"] += 1
        found["hit_blocks"] += row.hit_blocks
        found["fetch_blocks"] += row.fetch_blocks
        found["recompute_blocks"] += row.recompute_blocks
    return out


class DashboardAccess:
    """Who may open the page: the operator's certificate, or an admin tenant's key."""

    def __init__(self, tls_on: bool, tenants_by_key: Mapping[str, str], admins: frozenset[str]):
        self.tls_on = tls_on
        self.tenants_by_key = tenants_by_key
        self.admins = admins

    def viewer(self, request: web.Request) -> str:
        """Who is looking ("operator", "admin <tenant>"), or ApiError 401/403."""
        role = None
        if self.tls_on and request.transport is not None:
            role = role_of_cert(request.transport.get_extra_info("peercert"))
            if role == "operator":
                return "operator"
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() == "bearer" and key:
            tenant = self.tenants_by_key.get(key)
            if tenant is None:
                raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
            if tenant not in self.admins:
                raise ApiError(403, "This API key may not open the status page.", code="forbidden")
            return f"admin {tenant}"
        if role is not None:
            raise ApiError(
                403, f"A {role} certificate may not open the status page.", code="forbidden"
            )
        if not self.tls_on and not self.tenants_by_key:
            return "anyone (--insecure without API keys)"
        raise ApiError(
            401,
            "The status page needs the operator's client certificate or an admin's API key "
            "(Authorization: Bearer KEY).",
            code="missing_credentials",
            headers={"WWW-Authenticate": "Bearer"},
        )


class FleetView:
    """What the fleet looks like, asked of it at most every `ttl_s` (one gathering at a
    time, shared by every page that asks meanwhile). A part that fails is reported
    with its error; the others are still shown."""

    def __init__(
        self,
        replicas,  # replicas.ConductorReplicas: Stats, addresses, primary, spread
        registry_url: str,
        tls: Tls | None,
        *,
        ttl_s: float = FLEET_TTL_S,
        timeout_s: float = CALL_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replicas = replicas
        self.registry_url = registry_url
        self.tls = tls
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._registry = None
        self._channels: dict[str, object] = {}  # address -> channel (stores, replicas)
        self._cached: dict | None = None
        self._cached_at = 0.0
        self._pending: asyncio.Task | None = None

    async def snapshot(self) -> dict:
        if self._cached is not None and self._clock() - self._cached_at < self.ttl_s:
            return self._cached
        if self._pending is None:
            self._pending = asyncio.create_task(self._gather(), name="dashboard-fleet")
        task = self._pending
        try:
            found = await asyncio.shield(task)  # a page that leaves does not cancel others'
        finally:
            if task.done() and self._pending is task:
                self._pending = None
        self._cached, self._cached_at = found, self._clock()
        return found

    async def _gather(self) -> dict:
        stats, records, replicas = await asyncio.gather(
            self._stats(), self._records(), self._replicas()
        )
        engine_records, store_records, registry_error = records
        stores = await self._stores(store_records)
        used = {r["address"] for r in replicas} | {s["address"] for s in stores}
        for address in [a for a in self._channels if a not in used]:
            await self._channels.pop(address).close()
        answer, stats_error = stats
        return {
            "conductor": {
                "error": stats_error,
                "policy": answer.policy if answer else "",
                "index_backend": answer.index_backend if answer else "",
                "plans": answer.plans if answer else 0,
                "reservations_open": answer.reservations_open if answer else 0,
                "block_tokens": answer.block_tokens if answer else 0,
                "resident_blocks": answer.resident_records if answer else 0,
            },
            "engines": _engines(answer, engine_records),
            "stores": stores,
            "registry_error": registry_error,
            "replicas": replicas,
            "spread": self.replicas.spread,
        }

    async def _stats(self) -> tuple[conductor_pb2.StatsResponse | None, str | None]:
        try:
            return await self.replicas.Stats(
                conductor_pb2.StatsRequest(), timeout=self.timeout_s
            ), None
        except Exception as exc:  # noqa: BLE001 - shown on the page
            return None, _describe(exc)

    async def _records(self) -> tuple[list, list, str | None]:
        """The registry's engine and store records (none without a registry)."""
        if not self.registry_url or self.registry_url == "memory":
            return [], [], "no registry (--registry memory): stores and engine states unknown"
        try:
            if self._registry is None:
                self._registry = open_registry(self.registry_url, self.tls)
            engines, stores = await asyncio.wait_for(
                asyncio.gather(self._registry.list("engine"), self._registry.list("store")),
                self.timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - shown on the page
            return [], [], f"registry: {_describe(exc)}"
        return engines, stores, None

    async def _replicas(self) -> list[dict]:
        replicas = self.replicas
        primary = replicas.primary
        addresses = replicas.addresses
        answers = await asyncio.gather(*(self._health(a) for a in addresses))
        return [
            {
                "address": address,
                "healthy": status == "SERVING",
                "status": status,
                "in_use": address == primary if primary else True,
            }
            for address, status in zip(addresses, answers, strict=True)
        ]

    async def _health(self, address: str) -> str:
        stub = health_pb2_grpc.HealthStub(self._channel(address))
        try:
            found = await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - shown on the page
            return _describe(exc)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(found.status)

    async def _stores(self, records) -> list[dict]:
        records = [r for r in records if r.address]
        answers = await asyncio.gather(
            *(
                store_pb2_grpc.StoreStub(self._channel(r.address)).Stats(
                    store_pb2.StoreStatsRequest(), timeout=self.timeout_s
                )
                for r in records
            ),
            return_exceptions=True,
        )
        out = []
        for record, found in zip(records, answers, strict=True):
            row = {
                "id": record.id,
                "address": record.address,
                "locality_domain": record.locality_domain,
                "error": None,
                "dram": None,
                "ssd": None,
            }
            if isinstance(found, BaseException):
                row["error"] = _describe(found)
            else:
                row["dram"] = _tier(found.dram_bytes, found.dram_capacity_bytes, found.dram_blocks)
                row["ssd"] = _tier(found.ssd_bytes, found.ssd_capacity_bytes, found.ssd_blocks)
            out.append(row)
        return out

    def _channel(self, address: str):
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc_channel(address, self.tls)
        return channel

    async def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            with contextlib.suppress(BaseException):
                await self._pending
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            with contextlib.suppress(Exception):
                await channel.close()
        if self._registry is not None:
            with contextlib.suppress(Exception):
                await self._registry.close()
            self._registry = None


def _tier(used: int, capacity: int, blocks: int) -> dict:
    return {"used_bytes": used, "capacity_bytes": capacity, "blocks": blocks}


def _engines(stats: conductor_pb2.StatsResponse | None, records) -> list[dict]:
    """The engines the conductor plans to (its Stats), and those only the registry
    lists; each one's state from its registry record ("" = no record seen)."""
    by_record = {r.id: r for r in records}
    out = {}
    for engine in stats.engines if stats else ():
        record = by_record.get(engine.engine_id)
        out[engine.engine_id] = {
            "id": engine.engine_id,
            "role": engine.role or "both",
            "state": record.state if record else "",
            "model": engine.model,
            "store_node": engine.store_node,
            "inflight": engine.inflight_requests,
            "queued_prefill_tokens": engine.queued_prefill_tokens,
            "resident_blocks": engine.resident_blocks,
            "planned": True,
        }
    for record in records:
        if record.id not in out:
            out[record.id] = {
                "id": record.id,
                "role": record.role,
                "state": record.state,
                "model": record.model,
                "store_node": record.store_node,
                "inflight": None,
                "queued_prefill_tokens": None,
                "resident_blocks": None,
                "planned": False,
            }
    return [out[k] for k in sorted(out)]


def _describe(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if callable(code):
        with contextlib.suppress(Exception):
            return f"{code().name}: {exc.details()}"
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    return type(exc).__name__


def page_state(viewer: str, fleet: dict, rows: list[PlanRow], now_s: float) -> dict:
    """The JSON the page renders: the fleet, each engine's hit shares over the kept
    rows, and the newest `SHOWN_PLANS` rows first."""
    shares = engine_shares(rows)
    engines = [{**e, "recent": shares.get(e["id"])} for e in fleet["engines"]]
    return {
        "generated_at_s": now_s,
        "viewer": viewer,
        "refresh_ms": REFRESH_MS,
        **fleet,
        "engines": engines,
        "requests": [asdict(r) for r in reversed(rows[-SHOWN_PLANS:])],
    }


class Dashboard:
    """The page's routes (`routes`), the request path's hook (`record`), `close`."""

    def __init__(
        self,
        access: DashboardAccess,
        fleet: FleetView,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.access = access
        self.fleet = fleet
        self.plans = RecentPlans(clock)
        self._clock = clock
        self._html = resources.files("quillcache_gateway").joinpath("dashboard.html").read_text()

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/dashboard", self.page), web.get("/dashboard/state", self.state)]

    def record(
        self,
        request: web.Request,
        request_id: str,
        tenant: str,
        plan,
        prediction: Prediction,
        status: int,
    ) -> None:
        """One answered request's plan and delivery (see `RecentPlans.record`)."""
        self.plans.record(request, request_id, tenant, plan, prediction, status)

    async def page(self, request: web.Request) -> web.Response:
        try:
            self.access.viewer(request)
        except ApiError as err:
            return response(err, _PRIVATE)
        nonce = secrets.token_urlsafe(16)
        return web.Response(
            text=self._html.replace(NONCE, nonce),
            content_type="text/html",
            headers={**_PRIVATE, "Content-Security-Policy": _csp(nonce)},
        )

    async def state(self, request: web.Request) -> web.Response:
        try:
            viewer = self.access.viewer(request)
        except ApiError as err:
            return response(err, _PRIVATE)
        fleet = await self.fleet.snapshot()
        state = page_state(viewer, fleet, self.plans.rows(), self._clock())
        return web.json_response(state, headers=_PRIVATE)

    async def close(self, _app: web.Application | None = None) -> None:
        """Close the fleet's channels and registry (an aiohttp on_cleanup hook)."""
        await self.fleet.close()


# Nothing of the page is cached, framed, or sent on as a referrer.
_PRIVATE = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


def _csp(nonce: str) -> str:
    """The page runs only its own inline script and style, and fetches only its origin."""
    return (
        f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
