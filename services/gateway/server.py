"""The OpenAI-compatible gateway: hash, plan, proxy the engine's stream, finish, observe.

The path of a request is kept short: the tenant's block identity (the engine record's
model and tokenizer, the tenant's cache salt: `identity.keys.block_identity`, the
function the conductor reads engines' KV events with) and its protos are computed once
per (tenant, model, tokenizer); the prompt is hashed straight to block
hashes; the client's body is forwarded as it came with the cache salt and the plan
spliced in (re-encoded only when the client sent either field itself); Plan and
Finish share one PlanStream; engines are called over pooled keep-alive connections
(upstream.py); stream chunks are relayed as they come; Finish (with Observe) is
queued after the answer's last byte and sent in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import ssl
import time
from dataclasses import dataclass, field

import grpc
from aiohttp import HttpVersion11, web

from quillcache.v1 import common_pb2, conductor_pb2
from quillcache_core.errors import InvalidArgument
from quillcache_core.identity.chain import BlockChain
from quillcache_core.identity.keys import BlockIdentity, block_identity
from quillcache_core.identity.tokenize import TokenizerView, request_tokens
from quillcache_core.process.metrics import (
    CONTENT_TYPE,
    DURATION_BUCKETS_S,
    LATENCY_BUCKETS_S,
    MICRO_BUCKETS_S,
    MetricsRegistry,
)
from quillcache_core.rpc.server import error_from_status
from quillcache_core.security.tenants import tenant_salt
from quillcache_core.security.tls import role_of_cert
from quillcache_core.wire import engine_plan
from quillcache_gateway.accounting import DeliveryMeter
from quillcache_gateway.conductor_calls import FinishQueue
from quillcache_gateway.config import GatewayConfig
from quillcache_gateway.connections import (
    ConnectionDeadlines,
    GuardedSite,
    answer_and_close,
    server_logger,
)
from quillcache_gateway.dashboard import Dashboard, DashboardAccess, FleetView
from quillcache_gateway.delivered import (
    EXPLAIN_HEADER,
    Delivery,
    Prediction,
    StreamTap,
    asking_usage,
    predict,
    wants_usage,
    whole_body,
)
from quillcache_gateway.disagg import HEADER as DISAGG_HEADER
from quillcache_gateway.disagg import Disaggregator, SplitContext, answer_headers, requested_mode
from quillcache_gateway.errors import ApiError, from_domain, response
from quillcache_gateway.fallback import PLAN_HEADER, SKIP, PlanFallback, is_fallback
from quillcache_gateway.limits import TenantLimiter
from quillcache_gateway.memos import TenantMemos
from quillcache_gateway.models import ModelCatalog
from quillcache_gateway.prewarm import Prewarmer
from quillcache_gateway.replicas import ConductorReplicas
from quillcache_gateway.reservations import OpenPlans, early_outcome, shielded
from quillcache_gateway.upstream import UPSTREAM_ERRORS, UpstreamPool
from quillcache_gateway.validate import check_fields, parse_slo, read_json
from quillcache_gateway.wire import error_event, upstream_body

logger = logging.getLogger(__name__)

SLO_HEADER = "x-quillcache-ttft-slo-ms"
FETCH = conductor_pb2.BlockAction.FETCH
SUCCESS = conductor_pb2.FinishRequest.SUCCESS
ERROR = conductor_pb2.FinishRequest.ERROR
CANCELLED = conductor_pb2.FinishRequest.CANCELLED
DONE_EVENT = b"data: [DONE]\n\n"
MAX_IDENTITIES = 4096
# The engine that took a request (its plan's), for the request's duration histogram.
ENGINE_KEY = web.RequestKey("quillcache_engine", str)
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)


@dataclass(frozen=True, slots=True)
class _Completion:
    """A validated completion request: its body (raw and parsed), model, tokenizer, tokens.

    `tokenizer_id` is the tokenizer the serving engines' registry record names ("" =
    the model's own): the identity's, whatever local files the tokens came from;
    `tokenizer` the local one that tokenized the prompt (None: an engine did), whose
    `commit` keeps its work in the tenant's memo once an engine took the request.
    """

    raw: bytes
    payload: dict
    model: str
    tokenizer_id: str
    tokens: list[int]
    max_tokens: int
    stream: bool
    tokenizer: TokenizerView | None = None


@dataclass(frozen=True, slots=True)
class _Identity:
    """What one (tenant, model, tokenizer) needs on every request, computed once.

    The proto messages are shared: never mutate them (assigning one to a field copies it).
    """

    identity: BlockIdentity
    plan_identity: common_pb2.Identity
    finish_identity: common_pb2.Identity
    salt_json: bytes


@dataclass(frozen=True, slots=True)
class _Call:
    """One request on its way through: what Plan, the engine body and Finish need."""

    request_id: str
    arrived: float  # time.perf_counter() when the request arrived
    slo_ms: int
    job: _Completion
    ident: _Identity
    chain: BlockChain  # the prompt's full blocks (their digests packed)
    hashes: list[str]  # the same as hex, one per full block

    @property
    def block_size(self) -> int:  # tokens a block: the conductor's index block size
        return self.chain.block_tokens

    @property
    def packed(self) -> bytes:
        return self.chain.packed

    disagg: str = ""  # the client's x-quillcache-disagg ("" = the conductor's choice)
    explain: bool = False  # the client sent x-quillcache-explain: 1
    notes: dict[str, str] = field(default_factory=dict)  # headers added on the way (disagg)


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.tls = config.tls("gateway")
        self.tenants = config.tenants_by_key()
        self.salts = config.salts_by_tenant()
        # Tenants' salts are keyed hashes of their names (see security.tenants).
        self._salt_key = self.tls.secret() if self.tls else b""
        self.catalog = ModelCatalog(
            config.tokenizers,
            config.block_size,
            config.plan_timeout_s,
            stats=lambda: self._stats,
            upstream=lambda: self.upstream,
        )
        self.metrics = MetricsRegistry(process=True)
        m = self.metrics
        self.requests = m.counter(
            "gateway_requests_total", "requests answered, by route and status", ["route", "status"]
        )
        self.ttft = m.histogram(
            "gateway_ttft_seconds",
            "arrival of a request to the first token its client gets (a stream's first "
            "chunk, or a whole answer), by the engine that answered",
            LATENCY_BUCKETS_S,
            ["engine"],
        )
        self.duration = m.histogram(
            "gateway_request_duration_seconds",
            "arrival of a completion request to its answer's last byte, by engine "
            '("none": answered before one took it) and HTTP status',
            DURATION_BUCKETS_S,
            ["engine", "status"],
        )
        self.slo_met = m.counter(
            "gateway_ttft_slo_met_total", "answers whose first byte met the TTFT budget"
        )
        m.gauge(
            "gateway_goodput",
            "share of timed answers that met their TTFT budget",
            read=self._goodput,
        )
        self.plan_seconds = m.histogram(
            "gateway_plan_seconds",
            "Plan calls to the conductor, as the gateway waits for them (each attempt)",
            MICRO_BUCKETS_S,
        )
        self.prepare_seconds = m.histogram(
            "gateway_prepare_seconds",
            "time from a request's arrival to its Plan call (read, validate, tokenize, hash)",
            MICRO_BUCKETS_S,
        )
        self.engine_head_seconds = m.histogram(
            "gateway_engine_head_seconds",
            "time from sending a request to an engine to its answer's head (per engine call)",
            LATENCY_BUCKETS_S,
        )
        self.upstream_failures = m.counter(
            "gateway_upstream_failures_total", "engine calls that failed, by phase", ["phase"]
        )
        self.delivery = DeliveryMeter(m)
        self.finish_dropped = m.counter(
            "gateway_finish_dropped_total", "Finish calls dropped because too many were queued"
        )
        self.limits = TenantLimiter(config.limits_by_tenant(), config.default_limit(), m)
        # Prompts open alike: a shared opening is tokenized and hashed once, per tenant.
        self.memos = TenantMemos(
            set(self.tenants.values()) or {"default"},
            config.memo_bytes,
            config.tenant_memo_bytes,
        )
        self.deadlines = ConnectionDeadlines(config.header_timeout_s, config.idle_timeout_s, m)
        self.fallback = PlanFallback(
            self.catalog,
            m,
            enabled=config.plan_fallback,
            timeout_s=min(config.plan_fallback_timeout_s, config.plan_timeout_s),
            retry_s=config.plan_fallback_retry_s,
        )
        self.open_plans = OpenPlans(m, lambda finish: self._finishes.submit(finish))
        self.disagg = Disaggregator(registry_url=config.registry, tls=self.tls, metrics=m)
        self.prewarm = Prewarmer(
            config.prewarm_top,
            config.prewarm_timeout_s,
            config.prewarm_poll_s,
            config.block_bytes,
            m,
        )
        self.conductor: ConductorReplicas | None = None
        self._stats: ConductorReplicas | None = None
        self._finishes: FinishQueue | None = None
        self.upstream: UpstreamPool | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._identities: dict[tuple[str, str, str], _Identity] = {}

    @property
    def http_server(self) -> web.Server | None:
        """The aiohttp server answering clients (None until started)."""
        return self._runner.server if self._runner is not None else None

    def _goodput(self):
        timed = self.ttft.total_count()
        return [((), (self.slo_met.get() / timed) if timed else 1.0)]

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        # Every conductor replica (replicas.py); channels reconnect soon after one is back
        # (gRPC's backoff grows to 2 minutes). A hung replica leaves time for the next.
        self.conductor = ConductorReplicas(
            cfg.conductor,
            cfg.registry,
            self.tls,
            use_plan_port=cfg.use_plan_port,
            channel_options=RECONNECT_OPTIONS,
            attempt_timeout_s=(self.fallback.timeout_s or cfg.plan_timeout_s) / 2,
            spread=cfg.conductor_spread,
        )
        await self.conductor.start()
        self._stats = self.conductor
        self._finishes = FinishQueue(
            self.conductor,
            cfg.plan_timeout_s,
            self.finish_dropped,
            max_hold_s=cfg.finish_hold_ms / 1000,
        )
        self._finishes.start()
        self.upstream = UpstreamPool(
            connect_timeout_s=cfg.upstream_connect_timeout_s,
            total_timeout_s=cfg.upstream_timeout_s,
            idle_timeout_s=cfg.upstream_idle_timeout_s,
            tls=self.tls,
            engine_key=self.tls.engine_key() if self.tls else "",
        )
        self.disagg.bind(SplitContext(self.upstream.post, self._finishes.submit, self.open_plans))
        self.prewarm.start(self.conductor, self.upstream, self._finishes.submit)
        app = web.Application(
            client_max_size=cfg.max_body_bytes, middlewares=[self.deadlines.middleware]
        )
        self.dashboard = Dashboard(
            DashboardAccess(self.tls is not None, self.tenants, cfg.admins()),
            FleetView(self.conductor, cfg.registry, self.tls),
        )
        app.add_routes(
            [
                web.post("/v1/chat/completions", self.chat_completions),
                web.post("/v1/completions", self.completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", self.render_metrics),
                *self.dashboard.routes(),
            ]
        )
        app.on_cleanup.append(self.dashboard.close)
        self._runner = web.AppRunner(app, access_log=None, logger=server_logger())
        await self._runner.setup()
        site = GuardedSite(self._runner, cfg.host, cfg.port, self._ssl_context(), self.deadlines)
        await site.start()
        self.port = self._runner.addresses[-1][1]
        logger.info(
            "gateway on %s:%d, conductors %s", cfg.host, self.port, self.conductor.addresses
        )

    def _ssl_context(self) -> ssl.SSLContext | None:
        """HTTPS with the gateway's certificate. A client certificate is optional: API
        clients have keys; /metrics wants a certificate of the cluster's CA."""
        if self.tls is None:
            return None
        ctx = self.tls.server_context()
        ctx.verify_mode = ssl.CERT_OPTIONAL
        return ctx

    def ready_line(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"READY gateway http={scheme}://{self.config.host}:{self.port}"

    async def stop(self) -> None:
        await self.prewarm.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._finishes is not None:
            await self._finishes.stop()
        if self.conductor is not None:
            await self.conductor.close()
        if self.upstream is not None:
            await self.upstream.close()
        await self.disagg.close()

    # --- small routes ---------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def render_metrics(self, request: web.Request) -> web.Response:
        if self.tls is not None and not role_of_cert(
            request.transport.get_extra_info("peercert") if request.transport else None
        ):
            return response(
                ApiError(403, "/metrics needs a certificate of the cluster's CA", code="forbidden")
            )
        return web.Response(
            body=self.metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE}
        )

    async def models(self, request: web.Request) -> web.Response:
        try:
            self._tenant(request)
            served = await self.catalog.served_models()
        except ApiError as err:
            return response(err)
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "quillcache"}
            for m in sorted(served)
            if m
        ]
        return web.json_response({"object": "list", "data": data})

    # --- completions ------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        arrived = time.perf_counter()
        request_id = "qc-" + secrets.token_hex(12)  # random: says nothing of other traffic
        tenant = ""
        status = "499"  # unless set below: the client left (the handler was cancelled)
        try:
            tenant = self._tenant(request)
            cfg = self.config
            raw, payload = await read_json(
                request, cfg.max_body_bytes, cfg.max_json_depth, cfg.body_timeout_s
            )
            fields = self._fields(payload, kind)
            slo_ms = self._slo_ms(request)
            mode = requested_mode(request.headers.get(DISAGG_HEADER))  # 400 if not a mode
            # Only a request read and valid holds a place: 429 over its requests a second
            # or in flight.
            self.limits.enter(tenant)
            try:
                job = await self._parse(raw, payload, kind, tenant, fields)
                self.limits.charge(tenant, len(job.tokens))  # 429 over its tokens a minute
                result = await self._proxy(request, request_id, arrived, tenant, job, slo_ms, mode)
            finally:
                self.limits.leave(tenant)
            status = str(result.status)
            return result
        except ApiError as err:
            status = str(err.status)
            reply = response(err, {"x-quillcache-request-id": request_id})
            if (err.headers or {}).get("Connection") == "close":
                await answer_and_close(request, reply)
            return reply
        except Exception as exc:
            status = "499" if isinstance(exc, ConnectionError) else "500"
            raise
        finally:
            self.requests.inc(route=request.path, status=status)
            elapsed_s = time.perf_counter() - arrived
            self.duration.observe(elapsed_s, engine=request.get(ENGINE_KEY, "none"), status=status)
            if tenant:
                self.limits.count(tenant, status)
            self.delivery.log(request, request_id, status, elapsed_s * 1000)

    def _tenant(self, request: web.Request) -> str:
        if not self.tenants:
            return "default"
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        tenant = self.tenants.get(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return tenant

    def _fields(self, payload: dict, kind: str) -> tuple[str, int | None, bool]:
        """The request's model, max_tokens (None: not set) and stream, or 400."""
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' must be a non-empty string", param="model")
        return model, *check_fields(payload, kind, self.config.max_tokens_limit)

    async def _parse(
        self,
        raw: bytes,
        payload: dict,
        kind: str,
        tenant: str,
        fields: tuple[str, int | None, bool],
    ) -> _Completion:
        """The request with its prompt tokenized (`fields`: `_fields`' answer)."""
        model, max_tokens, stream = fields
        tokenizer_id = await self.catalog.served_tokenizer(model)
        if tokenizer_id is None:
            raise ApiError(
                404,
                f"The model '{model}' does not exist or no engine serves it.",
                code="model_not_found",
                param="model",
            )
        field = "messages" if kind == "chat" else "prompt"
        tokenizer = self.catalog.tokenizer_for(model, tokenizer_id, self.memos.of(tenant).tokens)
        try:
            if tokenizer is None:
                tokens = await self.catalog.engine_tokens(model, payload, kind)
            else:
                # A batch of prompts is planned by its first prompt.
                tokens = request_tokens(kind, payload, tokenizer)
        except InvalidArgument as exc:
            raise ApiError(400, str(exc), param=field) from None
        except (TypeError, ValueError, RecursionError) as exc:  # text no tokenizer reads
            logger.info("cannot tokenize a request's %s: %r", field, exc)
            raise ApiError(400, f"the {field} cannot be tokenized: {exc}", param=field) from None
        return _Completion(
            raw,
            payload,
            model,
            tokenizer_id,
            tokens,
            max_tokens or self.config.default_max_tokens,
            stream,
            tokenizer,
        )

    def _slo_ms(self, request: web.Request) -> int:
        cfg = self.config
        slo = request.headers.get(SLO_HEADER)
        return parse_slo(slo, cfg.default_ttft_slo_ms, cfg.max_ttft_slo_ms, SLO_HEADER)

    def _identity(self, tenant: str, model: str, tokenizer_id: str) -> _Identity:
        key = (tenant, model, tokenizer_id)
        found = self._identities.get(key)
        if found is not None:
            return found
        if len(self._identities) >= MAX_IDENTITIES:
            self._identities.clear()  # models are client input when an engine serves any
        salt = self.salts.get(tenant) or (
            tenant_salt(self._salt_key, tenant) if self._salt_key else tenant
        )
        identity = block_identity(model, tokenizer_id, cache_salt=salt)
        proto = {
            "model_id": identity.model_id,
            "tokenizer_id": identity.tokenizer_id,
            "tenant_id": identity.tenant_id,
        }
        found = _Identity(
            identity=identity,
            plan_identity=common_pb2.Identity(**proto, cache_salt=salt),
            finish_identity=common_pb2.Identity(**proto),
            salt_json=json.dumps(salt).encode(),
        )
        self._identities[key] = found
        return found

    async def _plan(self, call: _Call, excluded: list[str]):
        """The conductor's plan; while it is unreachable, the gateway's own (fallback.py)."""
        cfg = self.config
        excluded = self.prewarm.excluding(excluded)  # engines warming up (prewarm.py)
        fallback = self.fallback
        turn = fallback.turn()
        if turn == SKIP:
            return fallback.route(call, excluded, "circuit_open")
        started = time.perf_counter()
        request = conductor_pb2.PlanRequest(
            request_id=call.request_id,
            identity=call.ident.plan_identity,
            packed_hashes=call.packed,
            block_tokens=call.block_size,
            block_bytes=cfg.block_bytes,
            action_runs=True,
            max_others=0,  # the reply's other engines are never read here
            prompt_tokens=len(call.job.tokens),
            expected_decode_tokens=call.job.max_tokens,
            slo=common_pb2.Slo(ttft_ms=call.slo_ms),
            exclude_engines=excluded,
            disagg=call.disagg,
            # A stream's first token is seen here and reported (`_prefilled`).
            reports_first_token=call.job.stream,
        )
        try:
            # In its own task: if the client leaves first, or the gateway stops waiting,
            # the plan's reservation is cancelled when it comes (reservations.py).
            plan = await shielded(
                self.conductor.plan(request, cfg.plan_timeout_s),
                self.open_plans.orphaned,
                fallback.timeout_s,
            )
        except Exception as exc:
            reason = fallback.failed(exc, turn)
            if reason is not None:
                return fallback.route(call, excluded, reason, exc)
            if not isinstance(exc, grpc.aio.AioRpcError):
                raise
            status = (exc.code(), exc.details() or "")
            # The call's error sits in a reference cycle of the RPC's frames: without its
            # traceback it holds none of this request's frames (its prompt, its tokens)
            # until the collector comes by.
            exc.__traceback__ = None
        except BaseException:
            fallback.abandoned(turn)
            raise
        else:
            fallback.answered(turn)
            self.open_plans.add(plan)
            return plan
        finally:
            self.plan_seconds.observe(time.perf_counter() - started)
        # Raised outside the handler, and held by no local: no context, no cycle.
        raise from_domain(error_from_status(*status))

    async def _proxy(self, request, request_id, arrived, tenant, job: _Completion, slo_ms, mode):
        ident = self._identity(tenant, job.model, job.tokenizer_id)
        block_size = self.catalog.block_size
        chains = self.memos.of(tenant).chains.deferred()
        chain, hashes = BlockChain.of_tokens(ident.identity, job.tokens, block_size, chains)
        explain = request.headers.get(EXPLAIN_HEADER) == "1"
        call = _Call(request_id, arrived, slo_ms, job, ident, chain, hashes, mode, explain=explain)
        self.prepare_seconds.observe(time.perf_counter() - arrived)
        self._finishes.hold()  # no Finish competes with this request for its answer
        try:
            plan, upstream = await self._open_upstream(call, request.path)
        finally:
            self._finishes.unhold()
        request[ENGINE_KEY] = plan.engine_id
        if upstream.status == 200:  # planned and taken: its work is kept for the next ones
            if job.tokenizer is not None:
                job.tokenizer.commit()
            chains.commit()
            self.prewarm.served(tenant, call, plan)
        headers = {"x-quillcache-request-id": request_id, "x-quillcache-engine": plan.engine_id}
        if is_fallback(plan):  # the gateway chose the engine: no reservation, no plan's numbers
            headers[PLAN_HEADER] = "fallback"
        else:
            headers["x-quillcache-hit-blocks"] = str(plan.hit_blocks)
            headers["x-quillcache-fetch-blocks"] = str(plan.fetch_blocks)
            headers["x-quillcache-recompute-blocks"] = str(plan.recompute_blocks)
            headers["x-quillcache-est-ttft-ms"] = f"{plan.est_ttft_ms:.3f}"
            headers["x-quillcache-plan-us"] = str(plan.plan_us)
            headers.update(answer_headers(plan, call.notes))  # disagg.py
        replica = "" if is_fallback(plan) else (self.conductor.owner(plan.reservation_id) or "?")
        prediction = predict(
            plan.engine_id,
            replica,
            plan.hit_blocks,
            plan.fetch_blocks,
            plan.est_ttft_ms,
            block_size,
            len(job.tokens),
            self.catalog.engine_block_size(plan.engine_id),
            plan.index_behind_ms,
        )
        try:
            if upstream.status != 200 or not job.stream:
                return await self._whole(request, upstream, plan, headers, call, prediction)
            return await self._stream(request, upstream, plan, headers, call, prediction)
        except BaseException as exc:
            # However the answer ended early (the client hung up: the handler was
            # cancelled or a write failed), its reservation is finished; once.
            self._finish_later(plan, early_outcome(exc), 0.0, call, observe=False)
            raise
        finally:
            upstream.release()
            self.dashboard.record(request, request_id, tenant, plan, prediction, upstream.status)

    async def _open_upstream(self, call: _Call, path: str):
        """Plan, then send the engine the request; on its failure re-plan elsewhere."""
        excluded: list[str] = []
        job = call.job
        for _attempt in range(self.config.upstream_retries + 1):
            plan = await self._plan(call, excluded)
            if self.prewarm.holds(plan, job.model):  # a new engine warms up first
                self._finish_later(plan, CANCELLED, 0.0, call, observe=False)
                plan = await self._plan(call, excluded)
            if plan.disagg == "split" and plan.prefill_engine_id and not is_fallback(plan):
                plan, answer = await self.disagg.split(call, plan, path)  # disagg.py
                if answer is not None:  # under way: its first token was the prefill's
                    return plan, answer
            sent = time.perf_counter()
            try:
                body = upstream_body(
                    job.raw,
                    job.payload,
                    call.ident,
                    engine_plan.plan_json(plan, call.ident.identity, call.block_size, call.hashes),
                    # A stream's usage tells what the engine delivered (delivered.py).
                    None
                    if not job.stream or wants_usage(job.payload)
                    else asking_usage(job.payload),
                )
                upstream = await self.upstream.post(
                    plan.engine_base_url.rstrip("/"),
                    path,
                    body,
                    b"x-quillcache-request-id: " + call.request_id.encode() + b"\r\n",
                )
            except UPSTREAM_ERRORS as exc:
                logger.warning(
                    "engine %s failed before answering %s: %r",
                    plan.engine_id,
                    call.request_id,
                    exc,
                )
                self.upstream_failures.inc(phase="connect")
                self._finish_later(plan, ERROR, 0.0, call, observe=False)
                excluded.append(plan.engine_id)
                continue
            except BaseException as exc:  # the client left while the engine was called
                self._finish_later(plan, early_outcome(exc), 0.0, call, observe=False)
                raise
            self.engine_head_seconds.observe(time.perf_counter() - sent)
            return plan, upstream
        raise ApiError(
            503,
            f"no engine could serve the request (tried {', '.join(excluded)})",
            type_="service_unavailable",
            code="no_engine_available",
        )

    async def _whole(
        self, request, upstream, plan, headers, call: _Call, prediction: Prediction
    ) -> web.Response:
        """A non-streamed answer (or an engine's error): read it, answer, then Finish."""
        try:
            data = await upstream.read_all()
        except UPSTREAM_ERRORS as exc:
            logger.warning("engine %s failed mid-answer: %r", plan.engine_id, exc)
            self.upstream_failures.inc(phase="stream")
            self._finish_later(plan, ERROR, 0.0, call, observe=False)
            raise ApiError(
                502,
                f"engine {plan.engine_id} failed before the answer completed",
                type_="upstream_error",
                code="engine_failed",
            ) from None
        ttft_s = time.perf_counter() - call.arrived
        ok = upstream.status == 200
        if not ok:
            self.upstream_failures.inc(phase="status")
        self._timed(ttft_s, call.slo_ms, plan.engine_id)
        cached = None
        if ok:
            data, cached = whole_body(data, prediction if call.explain else None)
            self.delivery.count(request, Delivery(prediction, cached, None))
        headers["Content-Type"] = upstream.headers.get("content-type", "application/json")
        resp = web.Response(status=upstream.status, body=data, headers=headers)
        try:
            await resp.prepare(request)
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            self._finish_later(plan, CANCELLED, ttft_s, call, observe=False)
            raise
        self._finish_later(plan, SUCCESS if ok else ERROR, ttft_s, call, observe=ok, cached=cached)
        return resp

    async def _stream(
        self, request, upstream, plan, headers, call: _Call, prediction: Prediction
    ) -> web.StreamResponse:
        """A streamed answer, relayed event by event (`upstream.relay`: each piece the
        engine sends goes on to the client from the engine connection's own callback,
        in the response's chunked framing), then Finish."""
        headers["Content-Type"] = "text/event-stream"
        headers["Cache-Control"] = "no-cache"
        resp = web.StreamResponse(status=200, headers=headers)
        framed = request.version >= HttpVersion11  # else the body ends at close
        if framed:
            resp.enable_chunked_encoding()
        await resp.prepare(request)  # the decision headers go out before the first token
        transport = request.transport
        outcome = SUCCESS
        ttft_s = 0.0
        tail = b"\n\n"
        explain = prediction if call.explain else None
        tap = StreamTap(keep_usage=wants_usage(call.job.payload), explain=explain)

        def sink(chunk: bytes) -> bool:
            nonlocal ttft_s, tail
            if transport.is_closing():
                return False  # the client left
            if not ttft_s:
                ttft_s = time.perf_counter() - call.arrived
                self._timed(ttft_s, call.slo_ms, plan.engine_id)
                self._prefilled(plan, ttft_s)
                tap.ttft_ms = ttft_s * 1000
            tail = chunk[-16:] if len(chunk) >= 16 else (tail + chunk)[-16:]
            shaped = tap.feed(chunk)
            if shaped:
                transport.write(b"%x\r\n%s\r\n" % (len(shaped), shaped) if framed else shaped)
            return True

        try:
            if transport is None:
                raise ConnectionResetError("the client left")
            try:
                await upstream.relay(sink, transport.get_write_buffer_size)
            except UPSTREAM_ERRORS as exc:
                logger.warning("engine %s failed mid-stream: %r", plan.engine_id, exc)
            if transport.is_closing():
                raise ConnectionResetError("the client left")
            if not tail.endswith(DONE_EVENT):
                # The engine failed or closed early: end with an error event.
                outcome = ERROR
                self.upstream_failures.inc(phase="stream")
                await resp.write(tap.flush() + error_event(tail, plan.engine_id))
            else:
                await resp.write(tap.flush())
            with contextlib.suppress(ConnectionError):
                await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            self._finish_later(plan, CANCELLED, ttft_s, call, observe=False)  # client left
            raise
        if outcome == SUCCESS:
            self.delivery.count(request, Delivery(prediction, tap.cached, ttft_s * 1000))
        self._finish_later(
            plan, outcome, ttft_s, call, observe=outcome == SUCCESS, cached=tap.cached
        )
        return resp

    def _timed(self, ttft_s: float, slo_ms: int, engine: str) -> None:
        self.ttft.observe(ttft_s, engine=engine)
        if ttft_s * 1000 <= slo_ms:
            self.slo_met.inc()

    def _prefilled(self, plan, ttft_s: float) -> None:
        """Tell the conductor a stream's first token came (queued like a Finish): the
        plan's prefill stops counting on its engine, and its TTFT is learned."""
        if is_fallback(plan) or not plan.reservation_id:
            return
        self._finishes.submit(
            conductor_pb2.FinishRequest(
                reservation_id=plan.reservation_id,
                outcome=conductor_pb2.FinishRequest.PREFILLED,
                ttft_ms=ttft_s * 1000,
            )
        )

    def _finish_later(
        self,
        plan,
        outcome,
        ttft_s: float,
        call: _Call,
        *,
        observe: bool,
        cached: int | None = None,
    ) -> None:
        """Queue Finish; with `observe`, the prompt's blocks are recorded on the engine,
        and `cached` (the tokens the engine reported cached) corrects its residency.

        A plan is finished once: later calls for it (an exit path's catch-all) do nothing.
        """
        if not self.open_plans.take(plan):
            return
        finish = conductor_pb2.FinishRequest(
            reservation_id=plan.reservation_id, outcome=outcome, ttft_ms=ttft_s * 1000
        )
        if observe and call.packed:
            finish.identity.CopyFrom(call.ident.finish_identity)
            finish.observe_packed_hashes = call.packed
            finish.observe_block_tokens = call.block_size
            if cached is not None:
                finish.delivered_cached_tokens = cached
        self._finishes.submit(finish)
