"""Wires the sim engine: aiohttp OpenAI API, KV event sockets, store mover, registry.

HTTP routes (one port):

- POST /v1/completions, POST /v1/chat/completions: see `completions`. They accept
  `cache_salt` and `kv_transfer_params.quillcache` (an EnginePlan) and answer with
  `x-sim-engine`, `x-sim-hit-blocks`, `x-sim-fetched-blocks`, `x-sim-recomputed-blocks`.
- GET /v1/models, GET /health, GET /metrics (Prometheus text), GET /sim/stats (JSON),
  POST /reset_prefix_cache (AllBlocksCleared).
- POST /sim/events (tests; the credential): `{"lose": true}` numbers and keeps the
  KV event batches for replay but sends none, as if each were lost on the way, until
  `{"lose": false}`.
- POST /sim/settings (benchmarks; the credential or the plain listener): change the
  engine's role, timing and KV block shape in place (`SETTABLE`), re-registered; the
  answer lists them all. Lets one set of engines serve a benchmark's runs of several
  shapes (colocated, then split) without a restart.
- POST /sim/drain (the operator's certificate, or the credential): take the engine out
  of service without losing its cache (see `drain`). `{"phase": "save", "save_blocks":
  N}` saves its N hottest blocks the pool lacks (default all it holds) and names them;
  `{"phase": "stop", "timeout_s": T}` answers once it is drained (T default 60).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
import time
from dataclasses import asdict, replace
from typing import Any

from aiohttp import web

from quillcache_core.errors import QuillCacheError
from quillcache_core.identity.tokenize import BuiltinTokenizer, Tokenizer, load_tokenizers
from quillcache_core.process.metrics import MetricsRegistry
from quillcache_core.registry import NodeRecord, NodeRegistry, open_registry
from quillcache_core.registry.records import record_data_address
from quillcache_core.security.tls import role_of_cert
from quillcache_core.storeclient.datapath.batch import BlockBatches
from quillcache_simengine.completions import CompletionRoutes, json_error
from quillcache_simengine.config import STORE_WRITES, SimEngineConfig
from quillcache_simengine.drain import Drainer
from quillcache_simengine.engine import SimEngine
from quillcache_simengine.events import KvEventPublisher
from quillcache_simengine.kvcache import PrefixCache
from quillcache_simengine.offload import BlockMover, StoreFactory, default_store_factory
from quillcache_simengine.openai_api import ApiError
from quillcache_simengine.scheduler import Scheduler

# Counters only, no request content: any cluster certificate may read them.
OPEN_PATHS = frozenset({"/health", "/metrics", "/sim/stats"})

# What POST /sim/settings may change, with each value's type.
SETTABLE = {
    "role": str,
    "prefill_stalls_decodes": bool,
    "prefill_us_per_token": int,
    "decode_us_per_token": int,
    "kv_layers": int,
    "kv_heads": int,
    "head_dim": int,
    "store_writes": str,
}

__all__ = ["SETTABLE", "SimEngineServer", "load_tokenizer"]

logger = logging.getLogger(__name__)

VERSION = "quillcache-sim-engine/0.1.0"


def load_tokenizer(config: SimEngineConfig) -> Tokenizer:
    """The gateway's tokenizer for this model: the same spec gives the same name."""
    if config.tokenizer:
        return load_tokenizers(f"{config.model}={config.tokenizer}")[config.model]
    return BuiltinTokenizer()


def _reader(read):
    return lambda: [((), read())]


def _seed(config: SimEngineConfig) -> bytes | None:
    if not config.seed:
        return None  # random per start, like vLLM's hash seed
    return hashlib.sha256(b"quillcache/sim-engine/seed" + str(config.seed).encode()).digest()


class SimEngineServer:
    def __init__(
        self, config: SimEngineConfig, *, store_factory: StoreFactory | None = None
    ) -> None:
        self.config = config
        self.tls = config.tls("engine")
        # Only callers with the gateway's engine credential (and a cluster certificate).
        self._auth = f"Bearer {self.tls.engine_key()}" if self.tls else ""
        if store_factory is None:
            store_factory = functools.partial(default_store_factory, tls=self.tls)
        self.tokenizer = load_tokenizer(config)
        self.tokenizer_id = config.tokenizer_id or self.tokenizer.name
        self.publisher = KvEventPublisher(
            config.host,
            pub_port=config.kv_events_port,
            replay_port=config.kv_replay_port,
            encoding=config.event_encoding,
            buffer_batches=config.kv_events_buffer,
            ipc_dir=config.kv_events_dir,
            ipc_name=config.node_id,
        )
        self.mover = BlockMover(
            own_address=config.store,
            own_node_id=config.store_node_id,
            kv_shape=config.kv_shape,
            timeout_s=config.store_timeout_s,
            queue_blocks=config.offload_queue_blocks,
            store_writes=config.store_writes,
            save_queue_blocks=config.save_queue_blocks,
            concurrency=config.offload_concurrency,
            store_factory=store_factory,
            batches=functools.partial(
                BlockBatches, io_timeout_s=config.store_timeout_s, tls=self.tls
            ),
            data_address=self._store_data_address,
        )
        self.scheduler = Scheduler(
            prefill_us_per_token=config.prefill_us_per_token,
            decode_us_per_token=config.decode_us_per_token,
            time_scale=config.time_scale,
            prefill_stalls_decodes=config.prefill_stalls_decodes,
        )
        self.engine = SimEngine(
            engine_id=config.node_id,
            model_id=config.model,
            tokenizer_id=self.tokenizer_id,
            block_size=config.block_size,
            cache=PrefixCache(config.hbm_blocks),
            scheduler=self.scheduler,
            publisher=self.publisher,
            mover=self.mover,
            seed=_seed(config),
            role=config.role,
        )
        self.drainer = Drainer(self.engine.cache, self.mover, self.scheduler, self._set_state)
        self.metrics = MetricsRegistry(prefix="quillcache_sim_", process=True)
        self.vllm_metrics = MetricsRegistry(prefix="vllm:")
        self._requests = self.metrics.counter(
            "requests_total", "HTTP requests by endpoint and status", ["endpoint", "status"]
        )
        self._register_metrics()
        self.routes = CompletionRoutes(config, self.engine, self.tokenizer, self._requests)
        self.registry: NodeRegistry | None = (
            open_registry(config.registry, self.tls) if config.registry else None
        )
        self._registered = False
        self._register_task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.plain_port = 0  # the --plain-http-port listener's port, 0 = none
        self.started_at = time.time()

    # --- lifecycle ----------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.config.public_host}:{self.port}"

    def record(self) -> NodeRecord:
        events, replay = self.publisher.endpoints(self.config.public_host)
        c = self.config
        return NodeRecord(
            kind="engine",
            id=c.node_id,
            address="",
            locality_domain=c.locality_domain,
            base_url=self.base_url,
            kv_events_endpoint=events,
            kv_replay_endpoint=replay,
            model=c.model,
            tokenizer=self.tokenizer_id,
            store_node=c.store_node_id,
            capacity_bytes=c.hbm_blocks * c.block_bytes,
            version=VERSION,
            start_time_s=self.started_at,
            block_size=c.block_size,
            role=c.role,
            state=self.drainer.report.state,
            extra={
                "engine_kind": "mock",
                "hbm_blocks": c.hbm_blocks,
                "block_bytes": c.block_bytes,
                "event_encoding": c.event_encoding,
            },
        )

    async def start(self) -> None:
        self.publisher.start()
        self.mover.start()
        app = web.Application(
            client_max_size=self.config.max_body_bytes, middlewares=[self._errors, self._authorize]
        )
        app.add_routes(
            [
                web.post("/v1/completions", self.routes.completions),
                web.post("/v1/chat/completions", self.routes.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", self.render_metrics),
                web.get("/sim/stats", self.sim_stats),
                web.post("/reset_prefix_cache", self.reset_prefix_cache),
                web.post("/sim/events", self.events),
                web.get("/sim/settings", self.settings),
                web.post("/sim/settings", self.settings),
                web.post("/tokenize", self.routes.tokenize),
                web.post("/sim/drain", self.drain),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self.config.host,
            self.config.port,
            shutdown_timeout=1.0,
            ssl_context=self.tls.server_context() if self.tls else None,
        )
        await site.start()
        self.port = self._runner.addresses[-1][1]
        if self.config.plain_http_port >= 0:
            plain = web.TCPSite(
                self._runner, self.config.host, self.config.plain_http_port, shutdown_timeout=1.0
            )
            await plain.start()
            self.plain_port = self._runner.addresses[-1][1]
        if self.registry is not None:
            self._register_task = asyncio.get_running_loop().create_task(
                self._register_until_done(self.registry), name="register"
            )
            # Serve at once; registration is retried in the background if etcd is down.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._register_task), 5.0)
        logger.info(
            "sim engine %s serving %s on %s (%d HBM blocks, time scale %g, store %s)",
            self.config.node_id,
            self.config.model,
            self.base_url,
            self.config.hbm_blocks,
            self.config.time_scale,
            self.config.store or "none",
        )

    async def _register_until_done(self, registry: NodeRegistry) -> None:
        delay = 0.1
        while True:
            try:
                await registry.register(self.record(), self.config.lease_ttl_s)
                self._registered = True
                return
            except QuillCacheError as exc:
                logger.warning("registration failed (retry in %.1fs): %s", delay, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _store_data_address(self, node_id: str) -> str:
        """A store node's block-data address, from its registry record."""
        if self.registry is None or not node_id:
            return ""
        for record in await self.registry.list("store"):
            if record.id == node_id:
                return record_data_address(record)
        return ""

    @property
    def plain_url(self) -> str:
        """The benchmarks' plain-HTTP listener ('' when there is none)."""
        return f"http://{self.config.public_host}:{self.plain_port}" if self.plain_port else ""

    def ready_line(self) -> str:
        events, replay = self.publisher.endpoints(self.config.public_host)
        plain = f" plain_http={self.plain_url}" if self.plain_port else ""
        return (
            f"READY sim-engine http={self.base_url} kv_events={events} replay={replay} "
            f"metrics={self.base_url}{plain}"
        )

    async def stop(self) -> None:
        task, self._register_task = self._register_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.registry is not None:
            if self._registered:
                try:
                    async with asyncio.timeout(3.0):
                        await self.registry.deregister("engine", self.config.node_id)
                except (QuillCacheError, TimeoutError) as exc:
                    logger.warning("deregistration failed: %s", exc)
            await self.registry.close()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        await self.mover.close()
        await self.publisher.close()
        logger.info("sim engine %s stopped", self.config.node_id)

    # --- metrics ------------------------------------------------------------------------

    def _register_metrics(self) -> None:
        stats, mover, sched, cache = (
            self.engine.stats,
            self.mover.stats,
            self.scheduler,
            self.engine.cache,
        )
        counters = [
            ("prompt_tokens_total", "prompt tokens received", lambda: stats.prompt_tokens),
            ("computed_tokens_total", "prompt tokens prefilled", lambda: stats.computed_tokens),
            ("generation_tokens_total", "output tokens generated", lambda: stats.generation_tokens),
            ("hit_blocks_total", "blocks served from the prefix cache", lambda: stats.hit_blocks),
            ("fetched_blocks_total", "blocks loaded from a store", lambda: stats.fetched_blocks),
            ("recomputed_blocks_total", "full blocks prefilled", lambda: stats.recomputed_blocks),
            ("fetch_fallback_blocks_total", "planned fetches recomputed instead",
             lambda: stats.fetch_fallback_blocks),
            ("evicted_blocks_total", "blocks evicted (LRU)", lambda: stats.evicted_blocks),
            ("offloaded_blocks_total", "evicted blocks stored", lambda: mover.offloaded),
            ("offloaded_bytes_total", "bytes of offloaded blocks", lambda: mover.offloaded_bytes),
            ("saved_blocks_total", "computed blocks saved to the store node", lambda: mover.saved),
            ("save_dropped_blocks_total", "computed blocks not saved (queue full)",
             lambda: mover.save_dropped),
            ("offload_failures_total", "failed offload and save puts",
             lambda: mover.offload_failures),
            ("offload_dropped_total", "evictions not offloaded (queue full)",
             lambda: mover.offload_dropped),
            ("fetch_failures_total", "failed or wrong block fetches", lambda: mover.fetch_failures),
            ("kv_event_batches_total", "KV event batches published", lambda: stats.event_batches),
        ]  # fmt: skip
        gauges = [
            ("offload_pending", "blocks waiting for offload or save", lambda: self.mover.pending),
            ("cache_blocks", "blocks in the prefix cache", lambda: len(cache)),
            ("cache_capacity_blocks", "prefix cache capacity", lambda: cache.capacity_blocks),
            ("requests_waiting", "requests waiting for prefill", lambda: sched.waiting),
            ("requests_running", "requests decoding", lambda: sched.running),
            ("queued_prefill_tokens", "prefill tokens queued or running",
             lambda: sched.queued_prefill_tokens),
        ]  # fmt: skip
        for kind, table in (("counter", counters), ("gauge", gauges)):
            for name, help_text, read in table:
                metric = self.metrics.gauge(name, help_text, read=_reader(read))
                metric.kind = kind  # read at scrape time, but a counter to Prometheus
        # vLLM's names, for tools that scrape engines for load.
        model = (self.config.model,)
        for name, help_text, read in (
            ("num_requests_running", "running requests", lambda: sched.running),
            ("num_requests_waiting", "waiting requests", lambda: sched.waiting),
            ("kv_cache_usage_perc", "KV cache usage (1 = full)",
             lambda: len(cache) / cache.capacity_blocks),
        ):  # fmt: skip
            self.vllm_metrics.gauge(
                name, help_text, ["model_name"], read=lambda read=read: [(model, read())]
            )

    def stats_json(self) -> dict[str, Any]:
        return {
            "engine_id": self.config.node_id,
            "engine": asdict(self.engine.stats),
            "store": asdict(self.mover.stats),
            "offload_pending": self.mover.pending,
            "cache_blocks": len(self.engine.cache),
            "cache_capacity_blocks": self.engine.cache.capacity_blocks,
            "pinned_blocks": self.engine.cache.pinned_blocks,
            "requests_waiting": self.scheduler.waiting,
            "queued_prefill_tokens": self.scheduler.queued_prefill_tokens,
            # How long a prefill booked now would wait for its turn (0 when idle).
            "prefill_wait_ms": round(self.scheduler.booked_ahead_s() * 1000, 3),
            "requests_running": self.scheduler.running,
            "kv_events_next_seq": self.publisher.next_seq,
            "registered": self._registered,
        }

    # --- plain routes -------------------------------------------------------------------

    @web.middleware
    async def _authorize(self, request: web.Request, handler) -> web.StreamResponse:
        """With TLS, everything but OPEN_PATHS wants the engine credential (not on the
        benchmarks' --plain-http-port listener, which asks for nothing)."""
        if (
            self._auth
            and request.path not in OPEN_PATHS
            and not self._on_plain_listener(request)
            and not (request.path == "/sim/drain" and self._peer_role(request) == "operator")
            and not hmac.compare_digest(
                request.headers.get("Authorization", "").encode(), self._auth.encode()
            )
        ):
            raise ApiError(401, "this engine serves only the gateway: bad or no credential")
        return await handler(request)

    @staticmethod
    def _peer_role(request: web.Request) -> str | None:
        transport = request.transport
        return role_of_cert(transport.get_extra_info("peercert") if transport else None)

    def _on_plain_listener(self, request: web.Request) -> bool:
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        return bool(self.plain_port) and bool(sockname) and sockname[1] == self.plain_port

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return json_error(ApiError(exc.status, exc.reason or str(exc)))
        except ApiError as exc:
            return json_error(exc)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            logger.exception("%s %s failed", request.method, request.path)
            return json_error(ApiError(500, "internal error in the sim engine"))

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "engine_id": self.config.node_id})

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.model,
                        "object": "model",
                        "created": int(self.started_at),
                        "owned_by": "quillcache-sim",
                        "root": self.config.model,
                        "parent": None,
                        "max_model_len": self.config.max_model_len,
                    }
                ],
            }
        )

    async def render_metrics(self, _request: web.Request) -> web.Response:
        text = self.metrics.render() + self.vllm_metrics.render()
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def sim_stats(self, _request: web.Request) -> web.Response:
        return web.json_response(self.stats_json())

    async def reset_prefix_cache(self, _request: web.Request) -> web.Response:
        cleared = self.engine.reset_prefix_cache()
        return web.json_response({"status": "ok", "cleared_blocks": cleared})

    async def events(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the body must be a JSON object") from None
        if not isinstance(body, dict) or set(body) != {"lose"} or type(body["lose"]) is not bool:
            raise ApiError(400, 'the body must be {"lose": true} or {"lose": false}')
        self.publisher.losing = body["lose"]
        logger.info("sim engine %s its KV events", "loses" if body["lose"] else "sends")
        return web.json_response({"lose": self.publisher.losing})

    async def settings(self, request: web.Request) -> web.Response:
        """GET: the settable settings; POST a JSON object of some: applied at once (the
        running requests keep their booked times), re-registered when the record changes."""
        if request.method == "POST":
            try:
                body = await request.json()
            except ValueError:
                raise ApiError(400, "the body must be a JSON object") from None
            if not isinstance(body, dict):
                raise ApiError(400, "the body must be a JSON object")
            unknown = sorted(set(body) - set(SETTABLE))
            if unknown:
                raise ApiError(400, f"not settable: {unknown}; settable: {sorted(SETTABLE)}")
            for name, value in body.items():
                if type(value) is not SETTABLE[name]:
                    raise ApiError(400, f"{name} must be {SETTABLE[name].__name__}")
            if body.get("role", "both") not in ("prefill", "decode", "both"):
                raise ApiError(400, "role must be prefill, decode or both")
            if body.get("store_writes", "computed") not in STORE_WRITES:
                raise ApiError(400, f"store_writes must be one of {', '.join(STORE_WRITES)}")
            try:
                config = replace(self.config, **body)
            except QuillCacheError as exc:  # the config's own checks
                raise ApiError(400, str(exc)) from None
            await self.apply(config)
        return web.json_response({name: getattr(self.config, name) for name in SETTABLE})

    async def drain(self, request: web.Request) -> web.Response:
        """A drain's phase (see `drain`): "save" names the blocks saved, "stop" answers
        with the drain's report once drained."""
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the body must be a JSON object") from None
        if not isinstance(body, dict) or set(body) - {"phase", "save_blocks", "timeout_s"}:
            raise ApiError(400, "the body may hold only phase, save_blocks and timeout_s")
        phase = body.get("phase")
        save_blocks = body.get("save_blocks", self.config.hbm_blocks)
        timeout_s = body.get("timeout_s", 60.0)
        if phase not in ("save", "stop"):
            raise ApiError(400, "phase must be save or stop")
        if type(save_blocks) is not int or save_blocks < 0:
            raise ApiError(400, "save_blocks must be a non-negative integer")
        if type(timeout_s) not in (int, float) or not 0 <= timeout_s <= 3600:
            raise ApiError(400, "timeout_s must be a number of seconds in [0, 3600]")
        if phase == "stop":
            report = await self.drainer.stop(float(timeout_s))
            return web.json_response({"engine_id": self.config.node_id, **asdict(report)})
        saved = await self.drainer.save(save_blocks)
        groups: dict[tuple, dict[str, Any]] = {}  # per identity: the hashes saved
        for key in saved:
            scope = key.scope()
            group = groups.setdefault(scope, {**asdict(scope), "block_hashes": []})
            group["block_hashes"].append(key.block_hash)
        return web.json_response(
            {
                "engine_id": self.config.node_id,
                **asdict(self.drainer.report),
                "saved": list(groups.values()),
            }
        )

    async def _set_state(self, state: str) -> None:
        """Rewrite the registry record with the drain's state (the record names it)."""
        if self.registry is not None:
            await self.registry.register(self.record(), self.config.lease_ttl_s)
            self._registered = True
        logger.info("engine %s now %s", self.config.node_id, state)

    async def apply(self, config: SimEngineConfig) -> None:
        """Run under `config` from now on (only SETTABLE fields may differ)."""
        old, self.config = self.config, config
        self.engine.role = config.role
        sched = self.scheduler
        sched.prefill_stalls_decodes = config.prefill_stalls_decodes
        sched.queue.us_per_token = config.prefill_us_per_token
        sched.decode_interval_s = config.decode_us_per_token * config.time_scale / 1e6
        self.mover.kv_shape = config.kv_shape
        self.mover.store_writes = config.store_writes
        self.routes.config = config
        if self.registry is not None and (old.role, old.kv_shape) != (config.role, config.kv_shape):
            await self.registry.register(self.record(), config.lease_ttl_s)
            self._registered = True
        logger.info("settings now %s", {n: getattr(config, n) for n in SETTABLE})
