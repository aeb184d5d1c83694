"""Prewarm a new engine with the fleet's hot prefixes before it takes traffic.

With `--prewarm-top N` (default 0: off) the gateway keeps, for every tenant, the prompt
prefixes its recent requests were planned to reuse (the engine hits and pool loads of
their plans), counted by how often (`HotPrefixes`). The conductor knows block keys, not
tokens: only the gateway can send an engine a prompt.

The gateway learns engines from the conductor's Stats (as its model catalog does; here
polled every `--prewarm-poll-s`). The engines of the first answer are the fleet as it
was at the start (never prewarmed); an engine that appears later (scale-out, or one
that left and came back) is new. A new engine is also recognised when a plan names it
before a poll has listed it: that plan is given back and the request re-planned. While
a new engine warms up, every plan of this gateway excludes it (`excluding`), as long as
another engine serves its model; to it the gateway sends each tenant's N hottest
prefixes as `max_tokens: 1` completions, each planned by the conductor to that engine
alone (every other engine excluded), so the blocks the pool holds are FETCHed and the
rest computed, then finished with the prefix observed on it. The engine takes traffic
once they are done, or after `--prewarm-timeout-s` whatever remains.

Tokens are kept in memory only, never logged; each tenant's record is its own and
bounded (`MAX_PREFIXES`, `MAX_TOKENS`), like the tenants' memos.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc

from quillcache.v1 import conductor_pb2
from quillcache_core.process.metrics import MetricsRegistry
from quillcache_core.wire import engine_plan
from quillcache_gateway.delivered import cached_tokens
from quillcache_gateway.upstream import UPSTREAM_ERRORS
from quillcache_gateway.wire import upstream_body

logger = logging.getLogger(__name__)

HASH_BYTES = 16  # a block's digest in packed hashes
MAX_PREFIXES = 64  # kept per tenant (the hottest win a place)
MAX_TOKENS = 1 << 19  # token ids kept per tenant (4 MiB)
DECAY_EVERY = 1024  # a tenant's counts halve after this many recorded hits: recent wins
CONCURRENT = 4  # prewarm requests in flight to one engine
RETRY_S = 0.1  # while the conductor cannot plan to the new engine yet


@dataclass
class Prefix:
    """A prompt opening the fleet held: its tokens (whole blocks), their packed hashes,
    the identity it was served under (the gateway's per-tenant identity object: its
    `plan_identity`, `finish_identity`, `identity`, `salt_json`), and its hits."""

    model: str
    ident: object
    tokens: array
    packed: bytes
    block_size: int
    hits: int = 1

    @property
    def blocks(self) -> int:
        return len(self.packed) // HASH_BYTES

    def opens(self, other: Prefix) -> bool:
        """Whether this prefix is an opening of `other` (warming `other` warms it too;
        the digests chain the identity, so equal openings are of one identity)."""
        return self.block_size == other.block_size and other.packed.startswith(self.packed)


class HotPrefixes:
    """Per tenant, the prefixes recent plans reused, by hits. Not thread-safe."""

    def __init__(
        self,
        max_prefixes: int = MAX_PREFIXES,
        max_tokens: int = MAX_TOKENS,
        decay_every: int = DECAY_EVERY,
    ) -> None:
        self.max_prefixes = max_prefixes
        self.max_tokens = max_tokens
        self.decay_every = decay_every
        self._tenants: dict[str, dict[bytes, Prefix]] = {}
        self._tokens: dict[str, int] = {}
        self._recorded: dict[str, int] = {}

    def record(
        self,
        tenant: str,
        model: str,
        ident: object,
        tokens: list[int],
        packed: bytes,
        block_size: int,
        reused_blocks: int,
    ) -> None:
        """A request of `tenant` was planned to reuse its first `reused_blocks` blocks
        (`packed`: the prompt's block digests, `block_size` tokens each)."""
        blocks = min(reused_blocks, len(packed) // HASH_BYTES, len(tokens) // block_size)
        if blocks <= 0 or blocks * block_size > self.max_tokens:
            return
        kept = self._tenants.setdefault(tenant, {})
        # The last block's digest chains every block before it and the identity.
        key = packed[(blocks - 1) * HASH_BYTES : blocks * HASH_BYTES]
        found = kept.get(key)
        if found is not None:
            found.hits += 1
            found.ident = ident  # the same identity (the key chains it), perhaps made anew
        else:
            try:
                ids = array("q", tokens[: blocks * block_size])
            except (OverflowError, TypeError):
                return  # not token ids this record can hold
            kept[key] = Prefix(model, ident, ids, packed[: blocks * HASH_BYTES], block_size)
            self._tokens[tenant] = self._tokens.get(tenant, 0) + len(ids)
            # The coldest others go (the oldest of them first); the newcomer stays, or
            # no new prefix would ever outlast its first hit.
            while len(kept) > self.max_prefixes or self._tokens[tenant] > self.max_tokens:
                others = [k for k in kept if k != key]
                if not others:
                    break
                self._drop(tenant, min(others, key=lambda k: kept[k].hits))
        recorded = self._recorded[tenant] = self._recorded.get(tenant, 0) + 1
        if recorded % self.decay_every == 0:
            for prefix in kept.values():
                prefix.hits = (prefix.hits + 1) // 2

    def _drop(self, tenant: str, key: bytes) -> None:
        prefix = self._tenants[tenant].pop(key)
        self._tokens[tenant] -= len(prefix.tokens)

    def tenants(self) -> list[str]:
        return sorted(self._tenants)

    def hottest(self, tenant: str, n: int, model: str | None = None) -> list[Prefix]:
        """The tenant's `n` hottest prefixes (of `model`; None: any), hottest first; a
        prefix that opens a chosen one is left out (warming the longer warms it), and
        a chosen one that opens a hotter candidate's place is taken by it."""
        chosen: list[Prefix] = []
        kept = self._tenants.get(tenant, {})
        for prefix in sorted(kept.values(), key=lambda p: p.hits, reverse=True):
            if len(chosen) >= n:
                break
            if model is not None and prefix.model != model:
                continue
            if any(prefix.opens(c) for c in chosen):
                continue
            shorter = next((i for i, c in enumerate(chosen) if c.opens(prefix)), None)
            if shorter is not None:
                chosen[shorter] = prefix
            else:
                chosen.append(prefix)
        return chosen


@dataclass(frozen=True)
class _Engine:
    engine_id: str
    base_url: str
    model: str  # "" = serves any model


class Prewarmer:
    """The gateway's side of prewarming (the module's docstring). One event loop."""

    def __init__(
        self,
        top: int,
        timeout_s: float,
        poll_s: float,
        block_bytes: int,
        metrics: MetricsRegistry,
        rpc_timeout_s: float = 5.0,
    ) -> None:
        self.top = top
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.block_bytes = block_bytes
        self.rpc_timeout_s = rpc_timeout_s
        self.prefixes = HotPrefixes()
        self.requests = metrics.counter(
            "gateway_prewarm_requests_total",
            "prefixes sent to a new engine before it took traffic, by outcome",
            ["outcome"],
        )
        self.engines_warmed = metrics.counter(
            "gateway_prewarm_engines_total", "new engines held out of planning to prewarm"
        )
        metrics.gauge(
            "gateway_prewarm_engines_warming",
            "engines held out of planning while they prewarm",
            read=lambda: [((), float(len(self._warming)))],
        )
        self._known: dict[str, _Engine] | None = None  # None until the first Stats
        self._warming: dict[str, asyncio.Task] = {}
        self._poller: asyncio.Task | None = None
        self._conductor = None
        self._upstream = None
        self._submit: Callable[[conductor_pb2.FinishRequest], None] = lambda _: None

    @property
    def enabled(self) -> bool:
        return self.top > 0

    def start(self, conductor, upstream, submit_finish) -> None:
        """Begin watching the fleet (`conductor`: Plan and Stats, `upstream`: the engine
        pool, `submit_finish`: the gateway's Finish queue)."""
        self._conductor, self._upstream, self._submit = conductor, upstream, submit_finish
        if self.enabled:
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def stop(self) -> None:
        tasks = [t for t in (self._poller, *self._warming.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._warming.clear()

    # --- the request path --------------------------------------------------------------

    def served(self, tenant: str, call, plan) -> None:
        """A request was planned (`plan`) and taken: count the prefix its plan reused."""
        if not self.enabled or not plan.reservation_id:
            return
        reused = plan.hit_blocks + plan.fetch_blocks
        if reused > 0:
            self.prefixes.record(
                tenant, call.job.model, call.ident, call.job.tokens, call.packed,
                call.block_size, reused,
            )  # fmt: skip

    def excluding(self, excluded: list[str]) -> list[str]:
        """`excluded` and every engine warming up (a new list when there are any)."""
        if not self._warming:
            return excluded
        return [*excluded, *(e for e in self._warming if e not in excluded)]

    def holds(self, plan, model: str) -> bool:
        """Whether `plan` names an engine that is to warm up first: one no Stats listed
        yet (it is then warmed, if another engine serves `model`) or one warming."""
        if not self.enabled or self._known is None:
            return False
        engine_id = plan.engine_id
        if engine_id in self._warming:
            return True
        if engine_id in self._known or not plan.engine_base_url:
            return False
        return self._begin(_Engine(engine_id, plan.engine_base_url, model))

    # --- the fleet ---------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while True:
            try:
                stats = await self._conductor.Stats(
                    conductor_pb2.StatsRequest(), timeout=self.rpc_timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                logger.debug("prewarm: no Stats (%s)", exc.code().name)
            except Exception:  # noqa: BLE001 - the watch goes on; the next poll may answer
                logger.warning("prewarm: the fleet's Stats failed", exc_info=True)
            else:
                self.saw(
                    _Engine(e.engine_id, e.base_url, e.model)
                    for e in stats.engines
                    if e.engine_id and e.base_url
                )
            await asyncio.sleep(self.poll_s)

    def saw(self, engines: Iterable[_Engine]) -> None:
        """The fleet as a Stats answer lists it: new engines warm up, gone ones are
        forgotten (one that comes back is new again)."""
        listed = {e.engine_id: e for e in engines}
        if self._known is None:
            self._known = listed
            logger.info("prewarm: %d engines at the start", len(listed))
            return
        for engine_id in [e for e in self._known if e not in listed]:
            del self._known[engine_id]
        for engine in listed.values():
            if engine.engine_id not in self._known and engine.engine_id not in self._warming:
                self._begin(engine)

    def _begin(self, engine: _Engine) -> bool:
        """Hold `engine` out of planning and warm it; False (it serves at once) when no
        other known engine serves its model."""
        known = self._known if self._known is not None else {}
        others = [
            e
            for e in known.values()
            if e.engine_id not in self._warming and _serves_same(e.model, engine.model)
        ]
        if not others:
            known[engine.engine_id] = engine
            return False
        self.engines_warmed.inc()
        task = asyncio.get_running_loop().create_task(self._warm(engine, known))
        self._warming[engine.engine_id] = task
        return True

    async def _warm(self, engine: _Engine, known: dict[str, _Engine]) -> None:
        began = time.monotonic()
        prefixes = [
            p
            for tenant in self.prefixes.tenants()
            for p in self.prefixes.hottest(tenant, self.top, engine.model or None)
        ]
        logger.info(
            "prewarm: engine %s held out of planning; %d prefixes to send",
            engine.engine_id,
            len(prefixes),
        )
        outcomes: dict[str, int] = {}
        try:
            async with asyncio.timeout(self.timeout_s):
                slots = asyncio.Semaphore(CONCURRENT)

                async def one(prefix: Prefix) -> None:
                    async with slots:
                        outcome = await self._send(engine, prefix, known)
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
                    self.requests.inc(outcome=outcome)

                await asyncio.gather(*(one(p) for p in prefixes))
        except TimeoutError:
            logger.warning(
                "prewarm: engine %s not warm after %.0fs: it takes traffic now",
                engine.engine_id,
                self.timeout_s,
            )
        finally:
            self._warming.pop(engine.engine_id, None)
            if self._known is not None:
                self._known[engine.engine_id] = engine
        logger.info(
            "prewarm: engine %s takes traffic after %.2fs (%s)",
            engine.engine_id,
            time.monotonic() - began,
            ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) or "nothing to send",
        )

    async def _send(self, engine: _Engine, prefix: Prefix, known: dict[str, _Engine]) -> str:
        """One prefix to the engine: planned to it alone, answered, finished (observed)."""
        ident = prefix.ident
        tokens = prefix.tokens.tolist()
        others = [e for e in (*known, *self._warming) if e != engine.engine_id]
        request = conductor_pb2.PlanRequest(
            request_id="qc-prewarm-" + secrets.token_hex(8),
            identity=ident.plan_identity,
            packed_hashes=prefix.packed,
            block_tokens=prefix.block_size,
            block_bytes=self.block_bytes,
            action_runs=True,
            max_others=0,
            prompt_tokens=len(tokens),
            expected_decode_tokens=1,
            exclude_engines=others,
            disagg="colocated",
        )
        while True:  # until the conductor sees the engine (the poll may be ahead of it)
            try:
                plan = await self._conductor.plan(request, self.rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND):
                    logger.warning("prewarm: plan refused: %s", exc.code().name)
                    return "plan_failed"
                await asyncio.sleep(RETRY_S)
                continue
            break
        if plan.engine_id != engine.engine_id:
            self._finish(plan, conductor_pb2.FinishRequest.CANCELLED, prefix, None)
            return "planned_elsewhere"
        payload = {"model": prefix.model, "prompt": tokens, "max_tokens": 1, "stream": False}
        packed = prefix.packed
        hashes = [packed[i : i + HASH_BYTES].hex() for i in range(0, len(packed), HASH_BYTES)]
        body = upstream_body(
            json.dumps(payload).encode(),
            payload,
            ident,
            engine_plan.plan_json(plan, ident.identity, prefix.block_size, hashes),
        )
        started = time.perf_counter()
        try:
            reply = await self._upstream.post(
                plan.engine_base_url.rstrip("/"),
                "/v1/completions",
                body,
                b"x-quillcache-request-id: " + request.request_id.encode() + b"\r\n",
            )
            try:
                data = await reply.read_all()
            finally:
                reply.release()
        except UPSTREAM_ERRORS as exc:
            logger.warning("prewarm: engine %s failed: %r", engine.engine_id, exc)
            self._finish(plan, conductor_pb2.FinishRequest.ERROR, prefix, None)
            return "engine_failed"
        if reply.status != 200:
            self._finish(plan, conductor_pb2.FinishRequest.ERROR, prefix, None)
            return "engine_failed"
        cached = None
        with contextlib.suppress(ValueError, AttributeError):
            cached = cached_tokens(json.loads(data).get("usage"))
        ttft_ms = (time.perf_counter() - started) * 1000
        self._finish(plan, conductor_pb2.FinishRequest.SUCCESS, prefix, cached, ttft_ms)
        return "warmed"

    def _finish(self, plan, outcome, prefix: Prefix, cached, ttft_ms: float = 0.0) -> None:
        finish = conductor_pb2.FinishRequest(
            reservation_id=plan.reservation_id, outcome=outcome, ttft_ms=ttft_ms
        )
        if outcome == conductor_pb2.FinishRequest.SUCCESS:
            finish.identity.CopyFrom(prefix.ident.finish_identity)
            finish.observe_packed_hashes = prefix.packed
            finish.observe_block_tokens = prefix.block_size
            if cached is not None:
                finish.delivered_cached_tokens = cached
        self._submit(finish)


def _serves_same(a: str, b: str) -> bool:
    """Whether engines serving models `a` and `b` ("" = any) can stand in for each other."""
    return not a or not b or a == b
