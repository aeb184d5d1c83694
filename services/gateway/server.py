"""The OpenAI-compatible gateway: hash, plan, proxy the engine's stream, finish, observe."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass

import aiohttp
import grpc
from aiohttp import web

from quillcache.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from quillcache_core.engine_plan import FIELD as PLAN_FIELD
from quillcache_core.engine_plan import EnginePlan, FetchAction
from quillcache_core.errors import InvalidArgument, NodeUnavailable
from quillcache_core.hashing import request_blocks
from quillcache_core.metrics import MetricsRegistry
from quillcache_core.model import CacheTier
from quillcache_core.registry import open_registry
from quillcache_core.rpc import error_from_status
from quillcache_core.tokenize import (
    BuiltinTokenizer,
    Tokenizer,
    load_tokenizers,
    prompt_tokens,
    render_chat,
)
from quillcache_gateway.config import GatewayConfig
from quillcache_gateway.errors import ApiError, from_domain, response

logger = logging.getLogger(__name__)

SLO_HEADER = "x-quillcache-ttft-slo-ms"
TIER_NAMES = {
    common_pb2.TIER_HBM: CacheTier.HBM,
    common_pb2.TIER_REMOTE_HBM: CacheTier.REMOTE_HBM,
    common_pb2.TIER_CPU_DRAM: CacheTier.CPU_DRAM,
    common_pb2.TIER_LOCAL_SSD: CacheTier.LOCAL_SSD,
    common_pb2.TIER_OBJECT_STORE: CacheTier.OBJECT_STORE,
}
SUCCESS = conductor_pb2.FinishRequest.SUCCESS
ERROR = conductor_pb2.FinishRequest.ERROR
CANCELLED = conductor_pb2.FinishRequest.CANCELLED
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


@dataclass(frozen=True, slots=True)
class _Completion:
    """A validated completion request: its body, model, tokenizer and prompt tokens."""

    payload: dict
    model: str
    tokenizer: Tokenizer
    tokens: list[int]
    max_tokens: int
    stream: bool


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.tenants = config.tenants_by_key()
        self.salts = config.salts_by_tenant()
        self.tokenizers: dict[str, Tokenizer] = load_tokenizers(config.tokenizers)
        self.builtin = BuiltinTokenizer()
        self.metrics = MetricsRegistry()
        m = self.metrics
        self.requests = m.counter(
            "gateway_requests_total", "requests answered, by route and status", ["route", "status"]
        )
        self.ttft_sum = m.counter(
            "gateway_ttft_seconds_sum", "sum of time to first byte of the answer"
        )
        self.ttft_count = m.counter(
            "gateway_ttft_seconds_count", "answers whose first byte was timed"
        )
        self.slo_met = m.counter(
            "gateway_ttft_slo_met_total", "answers whose first byte met the TTFT budget"
        )
        m.gauge(
            "gateway_goodput",
            "share of timed answers that met their TTFT budget",
            read=self._goodput,
        )
        self.plan_sum = m.counter("gateway_plan_seconds_sum", "time spent in Plan calls")
        self.plan_count = m.counter("gateway_plan_seconds_count", "Plan calls")
        self.upstream_failures = m.counter(
            "gateway_upstream_failures_total", "engine calls that failed, by phase", ["phase"]
        )
        self.conductor: conductor_pb2_grpc.ConductorStub | None = None
        self._channel: grpc.aio.Channel | None = None
        self._http: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._models: tuple[float, dict[str, bool]] = (0.0, {})
        self._background: set[asyncio.Task] = set()

    def _goodput(self):
        timed = self.ttft_count.get()
        return [((), (self.slo_met.get() / timed) if timed else 1.0)]

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        address = cfg.conductor or await self._find_conductor()
        self._channel = grpc.aio.insecure_channel(address)
        self.conductor = conductor_pb2_grpc.ConductorStub(self._channel)
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=cfg.upstream_timeout_s, sock_connect=2.0),
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            auto_decompress=False,
        )
        app = web.Application(client_max_size=cfg.max_body_bytes)
        app.add_routes(
            [
                web.post("/v1/chat/completions", self.chat_completions),
                web.post("/v1/completions", self.completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", self.render_metrics),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.host, cfg.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001
        logger.info("gateway on %s:%d, conductor %s", cfg.host, self.port, address)

    async def _find_conductor(self, timeout_s: float = 15.0) -> str:
        registry = open_registry(self.config.registry)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                found = await registry.list("conductor")
                if found and found[0].address:
                    return found[0].address
                if time.monotonic() > deadline:
                    raise NodeUnavailable(f"no conductor registered in {self.config.registry}")
                await asyncio.sleep(0.2)
        finally:
            await registry.close()

    def ready_line(self) -> str:
        return f"READY gateway http=http://{self.config.host}:{self.port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)
        if self._http is not None:
            await self._http.close()
        if self._channel is not None:
            await self._channel.close()

    # --- small routes ---------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def render_metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(), content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        try:
            self._tenant(request)
            served = await self._served_models()
        except ApiError as err:
            return response(err)
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "quillcache"}
            for m in sorted(served)
            if m
        ]
        return web.json_response({"object": "list", "data": data})

    async def _served_models(self) -> dict[str, bool]:
        """Models the live engines serve ("" present = some engine serves any model)."""
        fetched_at, models = self._models
        if time.monotonic() - fetched_at < 1.0:
            return models
        try:
            stats = await self.conductor.Stats(
                conductor_pb2.StatsRequest(), timeout=self.config.plan_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise ApiError(
                503, f"conductor unavailable: {exc.details()}", type_="service_unavailable"
            ) from None
        models = {e.model: True for e in stats.engines}
        self._models = (time.monotonic(), models)
        return models

    # --- completions ------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        arrived = time.perf_counter()
        request_id = f"qc-{uuid.uuid4().hex[:24]}"
        route = request.path
        try:
            tenant = self._tenant(request)
            payload = await self._read_json(request)
            job = await self._parse(payload, kind)
            slo_ms = self._slo_ms(request)
            result = await self._proxy(request, request_id, arrived, tenant, job, slo_ms)
        except ApiError as err:
            self.requests.inc(route=route, status=str(err.status))
            return response(err, {"x-quillcache-request-id": request_id})
        self.requests.inc(route=route, status=str(result.status))
        return result

    def _tenant(self, request: web.Request) -> str:
        if not self.tenants:
            return "default"
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        tenant = self.tenants.get(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return tenant

    async def _read_json(self, request: web.Request) -> dict:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(
                413, f"request body exceeds {self.config.max_body_bytes} bytes"
            ) from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiError(
                400, f"request body is not valid UTF-8 ({exc.reason} at byte {exc.start})"
            ) from None
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ApiError(
                400,
                f"request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})",
            ) from None
        if not isinstance(payload, dict):
            raise ApiError(400, "request body must be a JSON object")
        return payload

    async def _parse(self, payload: dict, kind: str) -> _Completion:
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' must be a non-empty string", param="model")
        served = await self._served_models()
        if model not in served and "" not in served:
            raise ApiError(
                404,
                f"The model '{model}' does not exist or no engine serves it.",
                code="model_not_found",
                param="model",
            )
        tokenizer = self.tokenizers.get(model, self.builtin)
        try:
            if kind == "chat":
                if "messages" not in payload:
                    raise ApiError(400, "'messages' is required", param="messages")
                tokens = tokenizer.encode(render_chat(payload["messages"]))
            else:
                if "prompt" not in payload:
                    raise ApiError(400, "'prompt' is required", param="prompt")
                # A batch of prompts is planned by its first prompt.
                tokens = prompt_tokens(payload["prompt"], tokenizer)[0]
        except InvalidArgument as exc:
            raise ApiError(
                400, str(exc), param="messages" if kind == "chat" else "prompt"
            ) from None
        max_tokens = payload.get("max_completion_tokens", payload.get("max_tokens"))
        if max_tokens is not None and (
            not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
        ):
            raise ApiError(400, "'max_tokens' must be a positive integer", param="max_tokens")
        stream = payload.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", param="stream")
        return _Completion(
            payload, model, tokenizer, tokens, max_tokens or self.config.default_max_tokens, stream
        )

    def _slo_ms(self, request: web.Request) -> int:
        value = request.headers.get(SLO_HEADER)
        if value is None:
            return self.config.default_ttft_slo_ms
        try:
            slo = int(value)
        except ValueError:
            slo = 0
        if slo <= 0:
            raise ApiError(400, f"{SLO_HEADER} must be a positive integer of milliseconds")
        return slo

    async def _plan(self, request_id, identity, keys, tokens, max_tokens, slo_ms, excluded):
        refs = [
            common_pb2.BlockRef(
                block_hash=k.block_hash, token_count=k.token_count, bytes=self.config.block_bytes
            )
            for k in keys
        ]
        started = time.perf_counter()
        try:
            return await self.conductor.Plan(
                conductor_pb2.PlanRequest(
                    request_id=request_id,
                    identity=identity,
                    blocks=refs,
                    prompt_tokens=len(tokens),
                    expected_decode_tokens=max_tokens,
                    slo=common_pb2.Slo(ttft_ms=slo_ms),
                    exclude_engines=excluded,
                ),
                timeout=self.config.plan_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            raise from_domain(error_from_status(exc.code(), exc.details() or "")) from None
        finally:
            self.plan_sum.inc(time.perf_counter() - started)
            self.plan_count.inc()

    async def _proxy(self, request, request_id, arrived, tenant, job: _Completion, slo_ms):
        cfg = self.config
        salt = self.salts.get(tenant, tenant)
        payload, model, tokenizer, tokens = job.payload, job.model, job.tokenizer, job.tokens
        keys = request_blocks(
            tokens,
            cfg.block_size,
            model_id=model,
            tokenizer_id=tokenizer.name,
            adapter_id=None,
            tenant_id=tenant,
            cache_salt=salt,
        )
        identity = common_pb2.Identity(
            model_id=model, tokenizer_id=tokenizer.name, tenant_id=tenant, cache_salt=salt
        )
        excluded: list[str] = []
        for _attempt in range(cfg.upstream_retries + 1):
            plan = await self._plan(
                request_id, identity, keys, tokens, job.max_tokens, slo_ms, excluded
            )
            body = dict(payload)
            body["cache_salt"] = salt
            params = body.get("kv_transfer_params")
            body["kv_transfer_params"] = {
                **(params if isinstance(params, dict) else {}),
                PLAN_FIELD: self._engine_plan(plan, model, tokenizer.name, tenant, salt).to_json(),
            }
            url = plan.engine_base_url.rstrip("/") + request.path
            try:
                upstream = await self._http.post(
                    url, json=body, headers={"x-quillcache-request-id": request_id}
                )
            except UPSTREAM_ERRORS as exc:
                logger.warning(
                    "engine %s failed before answering %s: %r", plan.engine_id, request_id, exc
                )
                self.upstream_failures.inc(phase="connect")
                self._finish_later(plan, ERROR, 0.0, keys, success=False)
                excluded.append(plan.engine_id)
                continue
            break
        else:
            raise ApiError(
                503,
                f"no engine could serve the request (tried {', '.join(excluded)})",
                type_="service_unavailable",
                code="no_engine_available",
            )

        headers = {
            "x-quillcache-request-id": request_id,
            "x-quillcache-engine": plan.engine_id,
            "x-quillcache-hit-blocks": str(plan.hit_blocks),
            "x-quillcache-fetch-blocks": str(plan.fetch_blocks),
            "x-quillcache-recompute-blocks": str(plan.recompute_blocks),
            "x-quillcache-est-ttft-ms": f"{plan.est_ttft_ms:.3f}",
            "x-quillcache-plan-us": str(plan.plan_us),
        }
        try:
            if upstream.status != 200 or not job.stream:
                data = await upstream.read()
                ttft_s = time.perf_counter() - arrived
                ok = upstream.status == 200
                if not ok:
                    self.upstream_failures.inc(phase="status")
                self._timed(ttft_s, slo_ms)
                self._finish_later(plan, SUCCESS if ok else ERROR, ttft_s, keys, success=ok)
                ctype = upstream.headers.get("Content-Type", "application/json")
                return web.Response(
                    status=upstream.status, body=data, headers={**headers, "Content-Type": ctype}
                )
            return await self._stream(request, upstream, plan, headers, arrived, slo_ms, keys)
        finally:
            upstream.release()

    async def _stream(
        self, request, upstream, plan, headers, arrived, slo_ms, keys
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200,
            headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
        )
        await resp.prepare(request)  # the decision headers go out before the first token
        outcome = SUCCESS
        ttft_s = 0.0
        tail = b"\n\n"
        try:
            while True:
                try:
                    chunk = await upstream.content.readany()
                except UPSTREAM_ERRORS as exc:
                    logger.warning("engine %s failed mid-stream: %r", plan.engine_id, exc)
                    chunk = None
                if not chunk:
                    if not tail.endswith(b"data: [DONE]\n\n"):
                        # The engine failed or closed early: end with an error event.
                        outcome = ERROR
                        self.upstream_failures.inc(phase="stream")
                        await resp.write(_error_event(tail, plan.engine_id))
                    break
                if not ttft_s:
                    ttft_s = time.perf_counter() - arrived
                    self._timed(ttft_s, slo_ms)
                tail = (tail + chunk)[-16:]
                await resp.write(chunk)
            with contextlib.suppress(ConnectionError):
                await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            outcome = CANCELLED  # the client went away
            self._finish_later(plan, outcome, ttft_s, keys, success=False)
            raise
        self._finish_later(plan, outcome, ttft_s, keys, success=outcome == SUCCESS)
        return resp

    def _engine_plan(self, plan, model, tokenizer_id, tenant, salt) -> EnginePlan:
        fetch = tuple(
            FetchAction(
                block_index=a.block_index,
                block_hash=a.block_hash,
                source_node=a.source_node,
                source_address=a.source_address,
                tier=TIER_NAMES.get(a.source_tier, CacheTier.CPU_DRAM).value,
            )
            for a in plan.actions
            if a.kind == conductor_pb2.BlockAction.FETCH
        )
        return EnginePlan(
            reservation_id=plan.reservation_id,
            engine_id=plan.engine_id,
            model_id=model,
            tokenizer_id=tokenizer_id,
            tenant_id=tenant,
            cache_salt=salt,
            block_size=self.config.block_size,
            hit_blocks=plan.hit_blocks,
            recompute_blocks=plan.recompute_blocks,
            fetch=fetch,
        )

    def _timed(self, ttft_s: float, slo_ms: int) -> None:
        self.ttft_sum.inc(ttft_s)
        self.ttft_count.inc()
        if ttft_s * 1000 <= slo_ms:
            self.slo_met.inc()

    def _finish_later(self, plan, outcome, ttft_s: float, keys, *, success: bool) -> None:
        """Finish (and Observe on success) without holding up the client's answer."""
        task = asyncio.get_running_loop().create_task(
            self._finish(plan, outcome, ttft_s, keys, success)
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _finish(self, plan, outcome, ttft_s, keys, success) -> None:
        request = conductor_pb2.FinishRequest(
            reservation_id=plan.reservation_id, outcome=outcome, ttft_ms=ttft_s * 1000
        )
        if success and keys:
            first = keys[0]
            request.identity.CopyFrom(
                common_pb2.Identity(
                    model_id=first.model_id,
                    tokenizer_id=first.tokenizer_id,
                    tenant_id=first.tenant_id,
                )
            )
            request.observe_blocks.extend(
                common_pb2.BlockRef(block_hash=k.block_hash, token_count=k.token_count)
                for k in keys
            )
        try:
            await self.conductor.Finish(request, timeout=self.config.plan_timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.warning(
                "finish of %s failed: %s %s", plan.reservation_id, exc.code().name, exc.details()
            )


def _error_event(tail: bytes, engine_id: str) -> bytes:
    """An SSE error event, after closing any event the engine left half-written."""
    event = {
        "error": {
            "message": f"engine {engine_id} failed before the stream completed",
            "type": "upstream_error",
            "param": None,
            "code": "engine_failed",
        }
    }
    sep = b"" if tail.endswith(b"\n\n") else b"\n\n"
    return sep + b"data: " + json.dumps(event).encode() + b"\n\n"
