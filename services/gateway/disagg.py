"""Carrying out a split plan (prefill/decode disaggregation): a prefill call whose first
token is the client's first token, then the decode call that continues from it over the
prompt's KV from the pool.

1. **Prefill.** The client's request goes to the plan's prefill engine with
   `max_tokens` 1, not streamed, token ids asked for (`return_token_ids`), and the plan
   marked `"disagg": "prefill"`: the engine computes the prompt, writes its full blocks
   to its store node before it answers (the sim engine's offload, vLLM's QuillCache
   connector) and samples the answer's first token.
2. **First token.** It goes to the client at once: a streamed answer's first events
   (chat or completions, as the client asked) are sent before the transfer and the
   decode call even start, so the client's TTFT is the prefill call's (continuation.py).
3. **Transfer.** When the two engines have different store nodes, the transfer service
   prefetches those blocks into the decode engine's store node (resolved in the
   registry; the gateway's role may Prefetch). The measured bytes per second go back to
   the conductor with the prefill's Finish: it prices the next splits' transfers.
4. **Decode.** The decode engine gets a continuation: a completions call over the
   prompt's ids and the first token's, for one token fewer, with FETCH actions naming the
   moved blocks on its store node: it loads them and computes only the prompt's last
   partial block and the first token. Its output is re-shaped into the client's answer.

A request whose options a continuation cannot honour (continuation.py's `continuable`:
`logprobs`, `n` > 1, stop strings, a `seed`, ...) or whose prefill engine gives no token
ids is carried out as vLLM's disaggregated proxy does: after the prefill and the
transfer, the client's own request goes to the decode engine, whose first token is the
client's (`x-quillcache-first-token: decode; <why>`).

Nothing here fails a request. A prefill that fails, answers an error or takes longer
than its deadline leaves the request to the decode engine alone (it computes the
prompt: colocated). A transfer that fails or is slow, or a decode engine that fails the
continuation's call, sends the continuation to the prefill engine instead, which holds
the prompt in its own cache (colocated there): it continues from the first token the
client has, never restarts. A streamed answer's headers go out with its first token,
before the transfer: they name the planned engines and carry no transfer figures when
a transfer was still to come (its outcome is in the logs and
`gateway_disagg_requests_total{outcome}`); a whole answer's headers say what was done.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from quillcache.v1 import common_pb2, conductor_pb2, transfer_pb2, transfer_pb2_grpc
from quillcache_core.process.metrics import MetricsRegistry
from quillcache_core.registry import open_registry
from quillcache_core.security.tls import Tls, grpc_channel
from quillcache_core.wire import engine_plan
from quillcache_core.wire.keys import key_to_proto
from quillcache_gateway.continuation import (
    FirstToken,
    StreamShaper,
    continuable,
    continuation_body,
    read_first_token,
    whole_answer,
)
from quillcache_gateway.errors import ApiError
from quillcache_gateway.reservations import OpenPlans
from quillcache_gateway.upstream import (
    RELAY_HIGH,
    RELAY_POLL_S,
    UPSTREAM_ERRORS,
    UpstreamError,
    UpstreamReply,
)

logger = logging.getLogger(__name__)

HEADER = "x-quillcache-disagg"  # client: auto | split | colocated; answer: what was done
MODES = ("auto", "split", "colocated")
SUCCESS = conductor_pb2.FinishRequest.SUCCESS
ERROR = conductor_pb2.FinishRequest.ERROR
CANCELLED = conductor_pb2.FinishRequest.CANCELLED
CONTINUATION_PATH = "/v1/completions"  # a token-id prompt, for chat requests too


def requested_mode(value: str | None) -> str:
    """The client's `x-quillcache-disagg` header; a 400 ApiError if it names no mode."""
    if value is None or not value.strip():
        return ""
    mode = value.strip().lower()
    if mode not in MODES:
        raise ApiError(
            400, f"{HEADER} must be one of {', '.join(MODES)}, got {value!r}", param=HEADER
        )
    return mode


def answer_headers(plan, notes: dict[str, str]) -> dict[str, str]:
    """The plan's disaggregation headers: what was chosen and why, then what was done."""
    if not plan.disagg:
        return notes
    return {HEADER: plan.disagg_reason or plan.disagg, **notes}


def prefill_body(payload: dict, salt: str, plan: dict) -> bytes:
    """The prefill call: the client's request cut to one token, whole, not streamed,
    with the token ids of its prompt and output (a continuation's prompt)."""
    body = {k: v for k, v in payload.items() if k not in ("stream", "stream_options")}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 1:
        body["min_tokens"] = 1  # an engine refuses a minimum above the maximum
    body["n"] = 1
    body["stream"] = False
    body["return_token_ids"] = True
    body["cache_salt"] = salt
    return json.dumps(engine_plan.attach(body, plan), separators=(",", ":")).encode()


@dataclass(slots=True)
class _Move:
    """The prompt's blocks on their way from the prefill engine's store node to the
    decode engine's, and what became of them."""

    keys: list  # the prompt's full blocks but its last token's (KvBlockKey, prompt order)
    source: str  # the prefill engine's store node
    destination: str  # the decode engine's
    started: float  # perf_counter when the split began
    prefill_ms: float = 0.0
    moved: int = 0  # leading blocks the decode engine can load
    nbytes: int = 0
    rate: float = 0.0  # measured bytes per second
    fetch_node: str = ""  # the store node the decode engine loads them from
    reason: str = ""  # why nothing moved
    transfer_ms: float = 0.0
    settled: bool | None = None  # None: not yet; True: the decode engine loads them
    finished: bool = False  # the prefill's reservation is Finished (or became the plan's)

    def __post_init__(self) -> None:
        self.moved = len(self.keys)
        self.fetch_node = self.destination or self.source

    @property
    def pending(self) -> bool:
        """Whether the blocks must travel between two store nodes."""
        return bool(
            self.source and self.destination and self.source != self.destination and self.keys
        )


class SplitAnswer:
    """The client's answer when its first token came from the prefill call, read by the
    gateway's answer paths as an engine's reply (UpstreamReply's `status`, `headers`,
    `read`, `read_all`, `relay`, `release`): the first token's events at once, then the
    continuation's, re-shaped (continuation.py). Not thread-safe: one event loop."""

    def __init__(self, first: FirstToken, payload: dict) -> None:
        self.first = first
        self.status = 200
        stream = payload.get("stream") is True
        self.headers = {"content-type": "text/event-stream" if stream else "application/json"}
        options = payload.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        self._shaper = StreamShaper(first, include_usage=include_usage) if stream else None
        self._pending = b""  # the answer's bytes to give before the continuation's
        self._opening: asyncio.Future | None = None  # the continuation's reply, to come
        self._reply: UpstreamReply | None = None
        self._error: Exception | None = None
        self._done = False
        if self._shaper is not None:
            self._pending = self._shaper.first_events(False)

    def ended(self) -> None:
        """The first token is the whole answer: nothing is continued."""
        if self._shaper is not None:
            self._pending = self._shaper.first_events(True)
        else:
            self._pending = whole_answer(self.first, None)

    def start(self, continuation) -> None:
        """Run `continuation` (the coroutine that returns the continuation's reply) in
        the background: the first token's events are read meanwhile."""
        self._opening = asyncio.ensure_future(continuation)
        self._opening.add_done_callback(_retrieved)

    async def open(self, continuation) -> None:
        """Run `continuation` now (a whole answer: its headers say what was done)."""
        self.start(continuation)
        await self._continuation()

    async def _continuation(self) -> UpstreamReply:
        if self._reply is None and self._error is None:
            try:
                self._reply = await self._opening
            except Exception as exc:  # noqa: BLE001 - the client's answer ends with an error
                self._error = exc
        if self._error is not None:
            raise UpstreamError(f"no engine continued the answer: {_short(self._error)}")
        return self._reply

    async def read(self) -> bytes:
        """The streamed answer's next bytes; b"" at its end."""
        if self._pending:
            out, self._pending = self._pending, b""
            return out
        if self._done or self._opening is None:
            return b""
        reply = await self._continuation()
        while True:
            data = await reply.read()
            if not data:
                self._done = True
                return self._shaper.close()
            out = self._shaper.feed(data)
            if out:
                return out

    async def relay(self, sink: Callable[[bytes], bool], backlog: Callable[[], int]) -> None:
        """`read`'s pieces to `sink`, as UpstreamReply.relay hands an engine's: until the
        end, or until `sink` returns False; waits while `backlog` is over RELAY_HIGH."""
        while data := await self.read():
            if sink(data) is False:
                return
            while backlog() > RELAY_HIGH:
                await asyncio.sleep(RELAY_POLL_S)

    async def read_all(self) -> bytes:
        """The whole answer (not streamed)."""
        if self._opening is None:
            out, self._pending = self._pending, b""
            return out
        reply = await self._continuation()
        data = await reply.read_all()
        try:
            return whole_answer(self.first, data)
        except ValueError as exc:
            raise UpstreamError(f"the continuation's answer: {exc}") from None

    def release(self) -> None:
        """Once, at the end: a continuation still on its way is cancelled."""
        opening, self._opening = self._opening, None
        if opening is not None and not opening.done():
            opening.cancel()
        elif opening is not None and self._reply is None and not opening.cancelled():
            if opening.exception() is None:
                self._reply = opening.result()
        if self._reply is not None:
            self._reply.release()
            self._reply = None


def _retrieved(task: asyncio.Future) -> None:
    """A background continuation's failure is the answer's (read raises it), not a
    never-retrieved task exception's."""
    if not task.cancelled():
        task.exception()


def _note_engine(notes: dict[str, str], plan) -> None:
    notes["x-quillcache-decode-engine"] = plan.engine_id


@dataclass(frozen=True, slots=True)
class SplitContext:
    """What the disaggregator uses of the gateway: its engine connection pool's `post`,
    its Finish queue's `submit_finish`, and its open plans (each Finished once)."""

    post: Callable[..., Awaitable[UpstreamReply]]
    submit_finish: Callable[[conductor_pb2.FinishRequest], None]
    open_plans: OpenPlans


class Disaggregator:
    """The gateway's side of split plans, given a `SplitContext` once the gateway runs."""

    def __init__(
        self,
        *,
        registry_url: str,
        tls: Tls | None,
        metrics: MetricsRegistry,
        prefill_timeout_s: float = 30.0,
        transfer_timeout_s: float = 5.0,
    ) -> None:
        self.registry_url = registry_url
        self.tls = tls
        self.prefill_timeout_s = prefill_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._context: SplitContext | None = None
        self._registry = None
        self._transfer: tuple[str, transfer_pb2_grpc.TransferStub, grpc.aio.Channel] | None = None
        self.splits = metrics.counter(
            "gateway_disagg_requests_total",
            "split plans, by what became of them (split, or the fallback taken)",
            ["outcome"],
        )
        self.first_tokens = metrics.counter(
            "gateway_disagg_first_tokens_total",
            "split requests by the engine whose token was the client's first",
            ["engine"],
        )
        self.transfer_bytes = metrics.counter(
            "gateway_disagg_transfer_bytes_total", "KV bytes moved between store nodes for splits"
        )

    def bind(self, context: SplitContext) -> None:
        """What a split needs of the gateway, once it has started."""
        self._context = context

    def _finish(self, reservation_id: str, outcome: int) -> None:
        if reservation_id:
            self._context.submit_finish(
                conductor_pb2.FinishRequest(reservation_id=reservation_id, outcome=outcome)
            )

    async def close(self) -> None:
        if self._transfer is not None:
            await self._transfer[2].close()
            self._transfer = None
        if self._registry is not None:
            await self._registry.close()
            self._registry = None

    # --- the transfer service --------------------------------------------------------

    async def _transfer_stub(self) -> transfer_pb2_grpc.TransferStub | None:
        if self._transfer is not None:
            return self._transfer[1]
        if not self.registry_url or self.registry_url == "memory":
            return None
        if self._registry is None:
            self._registry = open_registry(self.registry_url, self.tls)
        nodes = [r for r in await self._registry.list("transfer") if r.address]
        if not nodes:
            return None
        if self._transfer is not None:  # another split resolved it meanwhile
            return self._transfer[1]
        address = sorted(nodes, key=lambda r: r.id)[0].address
        channel = grpc_channel(address, self.tls)
        stub = transfer_pb2_grpc.TransferStub(channel)
        self._transfer = (address, stub, channel)
        return stub

    async def _forget_transfer(self) -> None:
        found, self._transfer = self._transfer, None
        if found is not None:
            await found[2].close()

    async def prefetch(self, source: str, destination: str, keys) -> tuple[int, int, float]:
        """Copy `keys` (in prompt order) into `destination`'s DRAM; returns the leading
        blocks now there, the bytes moved and the measured bytes per second."""
        stub = await self._transfer_stub()
        if stub is None:
            raise LookupError("no transfer service registered")
        request = transfer_pb2.TransferRequest(
            source_node=source,
            destination_node=destination,
            keys=[key_to_proto(k) for k in keys],
        )
        last = None
        async for progress in stub.Prefetch(request, timeout=self.transfer_timeout_s):
            last = progress
        if last is None:
            return 0, 0, 0.0
        leading = 0
        for result in last.results:
            if not result.ok:
                break
            leading += 1
        return leading, int(last.bytes_done), float(last.bytes_per_s)

    # --- one split request -----------------------------------------------------------

    async def split(self, call, plan, path: str):
        """Carry out a split plan. Returns (plan, answer): `answer` None means the client's
        own request is to be sent to `plan`'s engine, as before splits (a prefill that
        failed, a request that cannot be continued: its first token is the decode
        engine's); otherwise `answer` is the client's answer already under way, its first
        token the prefill's (a `SplitAnswer`, read as an engine's reply). The answer's
        headers go to `call.notes`; `plan` is the reservation to Finish at the end."""
        job = call.job
        # The prompt's full blocks but for its last token, which the decode engine computes.
        usable = (len(job.tokens) - 1) // call.block_size * call.block_size
        move = _Move(
            call.ident.identity.keys(job.tokens[:usable], call.block_size),
            plan.prefill_store_node,
            plan.decode_store_node,
            time.perf_counter(),
        )
        try:
            return await self._split(call, plan, path, move)
        except BaseException:
            # The client left (or the gateway stops) mid-split: both reservations end now.
            if self._context.open_plans.take(plan):
                self._finish(plan.reservation_id, CANCELLED)
            if not move.finished:
                move.finished = True
                self._finish(plan.prefill_reservation_id, CANCELLED)
            raise

    async def _split(self, call, plan, path: str, move: _Move):
        started = move.started
        notes = call.notes
        notes["x-quillcache-prefill-engine"] = plan.prefill_engine_id
        notes["x-quillcache-decode-engine"] = plan.engine_id
        try:
            async with asyncio.timeout(self.prefill_timeout_s):
                ok, detail, data = await self._prefill_call(call, plan, path)
        except TimeoutError:
            ok, detail, data = False, f"prefill slower than {self.prefill_timeout_s:g}s", b""
        move.prefill_ms = prefill_ms = (time.perf_counter() - started) * 1000
        notes["x-quillcache-prefill-ms"] = f"{prefill_ms:.1f}"
        if not ok:
            # The decode engine computes the prompt itself: colocated there.
            move.finished = True
            self._finish(plan.prefill_reservation_id, ERROR)
            self.splits.inc(outcome="prefill_failed")
            logger.warning("split of %s: %s; decoding colocated", call.request_id, detail)
            notes["x-quillcache-prefill-engine"] = plan.engine_id
            notes[HEADER] = f"colocated; fallback: {detail}"
            return plan, None
        job = call.job
        chat = path.endswith("/chat/completions")
        why_not = continuable(job.payload)
        first = None if why_not else read_first_token(data, chat=chat)
        if first is None:
            self.first_tokens.inc(engine="decode")
            notes["x-quillcache-first-token"] = (
                f"decode; {why_not or 'the prefill engine gave no token ids'}"
            )
            await self._move(move)
            if self._settle(call, plan, move):
                self._finish_prefill(call, plan, move)
                self._fetch_actions(call, plan, move.moved, move.fetch_node)
            return plan, None
        self.first_tokens.inc(engine="prefill")
        notes["x-quillcache-first-token"] = "prefill"
        answer = SplitAnswer(first, job.payload)
        if first.ends_answer(job.payload):
            # Nothing to decode: the prefill engine's answer is the whole answer.
            if not self._to_prefill_engine(plan, move, CANCELLED):
                raise asyncio.CancelledError  # the request ended meanwhile
            _note_engine(notes, plan)
            notes[HEADER] = "colocated; the first token ended the answer"
            self.splits.inc(outcome="first_token_only")
            answer.ended()
            return plan, answer
        if not move.pending:
            # Nothing to move (one store node, or none): settled at once, so the headers
            # that go out with the first token say what is done.
            await self._move(move)
            move.settled = self._settle(call, plan, move)
            if move.settled:
                self._fetch_actions(call, plan, move.moved, move.fetch_node)
        else:
            # What the decode engine is to load, as the headers say it before the move.
            self._fetch_actions(call, plan, len(move.keys), move.destination)
            notes[HEADER] = f"split; {plan.disagg_reason.removeprefix('split; ')}"
        continuation = self._continue(call, plan, answer, move)
        if job.stream:
            answer.start(continuation)  # the first token goes out now; the rest follows
        else:
            await answer.open(continuation)  # a whole answer's headers say what was done
        return plan, answer

    async def _continue(self, call, plan, answer: SplitAnswer, move: _Move):
        """Move the KV (if it must), then the continuation's call: on the decode engine,
        or on the prefill engine when the KV did not make it or the decode engine failed
        the call. Returns the engine's reply (status 200); one of UPSTREAM_ERRORS when
        neither engine answered."""
        notes = call.notes
        try:
            if move.settled is None:
                await self._move(move)
                move.settled = self._settle(call, plan, move)
            if move.settled:
                self._fetch_actions(call, plan, move.moved, move.fetch_node)
                try:
                    reply = await self._post_continuation(call, plan, answer)
                except UPSTREAM_ERRORS as exc:
                    reason = f"decode engine {plan.engine_id} failed: {_short(exc)}"
                    self.splits.inc(outcome="decode_failed")
                    logger.warning("split of %s: %s", call.request_id, reason)
                    if not self._to_prefill_engine(plan, move, ERROR):
                        raise
                    notes[HEADER] = f"colocated; fallback: {reason}"
                    _note_engine(notes, plan)
                else:
                    self._finish_prefill(call, plan, move)
                    return reply
            # The prefill engine holds the prompt and continues from the first token.
            return await self._post_continuation(call, plan, answer)
        finally:
            if not move.finished:
                # Ended before the prefill's reservation was settled (the client left).
                move.finished = True
                self._finish(plan.prefill_reservation_id, CANCELLED)

    def _settle(self, call, plan, move: _Move) -> bool:
        """After the KV's move: True when the decode engine can load it (the prefill's
        reservation is the caller's to Finish), else the prefill engine decodes (its
        reservation becomes the plan's)."""
        notes = call.notes
        if move.moved == 0 and move.keys:
            if not self._to_prefill_engine(plan, move, CANCELLED):
                raise asyncio.CancelledError  # the request ended meanwhile
            self.splits.inc(outcome="transfer_failed")
            reason = move.reason or "no block moved"
            logger.warning(
                "split of %s: %s; decoding on %s", call.request_id, reason, plan.engine_id
            )
            _note_engine(notes, plan)
            notes[HEADER] = f"colocated; fallback: {reason}"
            return False
        notes["x-quillcache-transfer-blocks"] = str(
            move.moved if move.source != move.destination else 0
        )
        notes["x-quillcache-transfer-ms"] = f"{move.transfer_ms:.1f}"
        notes[HEADER] = f"split; {plan.disagg_reason.removeprefix('split; ')}"
        return True

    def _finish_prefill(self, call, plan, move: _Move) -> None:
        """The prefill's reservation succeeded: Finish it with the transfer's measures."""
        move.finished = True
        finish = conductor_pb2.FinishRequest(
            reservation_id=plan.prefill_reservation_id,
            outcome=SUCCESS,
            ttft_ms=move.prefill_ms,
            transfer_bytes=move.nbytes,
            transfer_bytes_per_s=move.rate,
            transfer_blocks=move.moved if move.nbytes else 0,
        )
        if call.packed:  # the prefill engine holds the prompt now
            finish.identity.CopyFrom(call.ident.finish_identity)
            finish.observe_packed_hashes = call.packed
            finish.observe_block_tokens = call.block_size
        self._context.submit_finish(finish)
        self.transfer_bytes.inc(move.nbytes)
        self.splits.inc(outcome="split")

    def _to_prefill_engine(self, plan, move: _Move, outcome: int) -> bool:
        """The prefill engine answers instead: `plan` (the object the gateway Finishes at
        the end) takes its reservation and engine; the decode engine's reservation ends
        with `outcome`. False when the plan was finished already (the request ended)."""
        if not self._context.open_plans.take(plan):
            return False
        move.finished = True
        self._finish(plan.reservation_id, outcome)
        plan.reservation_id = plan.prefill_reservation_id
        plan.engine_id = plan.prefill_engine_id
        plan.engine_base_url = plan.prefill_engine_base_url
        del plan.actions[:]
        plan.fetch_blocks = 0
        self._context.open_plans.add(plan)
        return True

    @staticmethod
    def _fetch_actions(call, plan, blocks: int, node: str) -> None:
        """The decode engine loads the prompt's first `blocks` blocks from `node`, its
        store node (which pulls from a peer if needed), instead of computing them."""
        del plan.actions[:]
        if not blocks:
            return
        plan.actions.add(
            kind=conductor_pb2.BlockAction.FETCH,
            block_index=0,
            block_hash=call.hashes[0],
            block_count=blocks,
            source_node=node,
            source_tier=common_pb2.TIER_CPU_DRAM,
        )
        plan.hit_blocks = 0
        plan.fetch_blocks = blocks
        plan.recompute_blocks = len(call.hashes) - blocks

    async def _move(self, move: _Move) -> None:
        """The transfer: the prompt's blocks into the decode engine's store node, when
        that is another node than the prefill engine's (sets `move`'s outcome)."""
        if move.pending:
            try:
                async with asyncio.timeout(self.transfer_timeout_s):  # the lookup too
                    move.moved, move.nbytes, move.rate = await self.prefetch(
                        move.source, move.destination, move.keys
                    )
            except Exception as exc:  # noqa: BLE001 - whatever failed, the request goes on
                move.moved, move.reason = 0, f"transfer failed: {_short(exc)}"
                if not isinstance(exc, LookupError):
                    await self._forget_transfer()  # resolved again for the next split
                else:
                    # No transfer service: the decode engine reads the prefill's store.
                    move.moved, move.fetch_node, move.reason = len(move.keys), move.source, ""
        if not move.source:
            move.moved = 0
            move.reason = move.reason or "the prefill engine has no store node"
        move.transfer_ms = (time.perf_counter() - move.started) * 1000 - move.prefill_ms

    async def _post_continuation(self, call, plan, answer: SplitAnswer):
        """The continuation's call to `plan`'s engine; its reply once it answered 200."""
        first = answer.first
        plan_json = engine_plan.continued(
            _plan_json(plan, call), len(first.prompt_token_ids), first.completion_tokens
        )
        salt = call.ident.identity.cache_salt
        body = continuation_body(call.job.payload, first, salt, plan_json)
        reply = await self._context.post(
            plan.engine_base_url.rstrip("/"),
            CONTINUATION_PATH,
            body,
            b"x-quillcache-request-id: " + call.request_id.encode() + b"\r\n",
        )
        if reply.status == 200:
            return reply
        try:
            data = await reply.read_all()
        finally:
            reply.release()
        raise UpstreamError(f"the continuation was answered {reply.status}: {data[:200]!r}")

    async def _prefill_call(self, call, plan, path: str) -> tuple[bool, str, bytes]:
        plan_json = engine_plan.for_prefill(
            _plan_json(plan, call), plan.prefill_reservation_id, plan.prefill_engine_id
        )
        body = prefill_body(call.job.payload, call.ident.identity.cache_salt, plan_json)
        try:
            reply = await self._context.post(
                plan.prefill_engine_base_url.rstrip("/"),
                path,
                body,
                b"x-quillcache-request-id: " + call.request_id.encode() + b"\r\n",
            )
        except Exception as exc:  # noqa: BLE001 - any failure of the call means colocated
            return False, f"prefill on {plan.prefill_engine_id} failed: {_short(exc)}", b""
        try:
            data = await reply.read_all()
        except Exception as exc:  # noqa: BLE001
            return False, f"prefill on {plan.prefill_engine_id} failed: {_short(exc)}", b""
        finally:
            reply.release()
        if reply.status != 200:
            return False, f"prefill on {plan.prefill_engine_id} answered {reply.status}", b""
        logger.debug("prefill of %s: %s", call.request_id, data[:200])
        return True, "", data


def _plan_json(plan, call) -> dict:
    return engine_plan.plan_json(plan, call.ident.identity, call.block_size, call.hashes)


def _short(exc: BaseException) -> str:
    """One line for a header and a log: no CR/LF, ASCII, bounded."""
    if isinstance(exc, grpc.aio.AioRpcError):
        text = f"{exc.code().name}: {exc.details()}"
    else:
        text = str(exc) or repr(exc)
    text = " ".join(text.split())
    return text.encode("ascii", "replace").decode()[:120]
