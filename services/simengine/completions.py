"""POST /v1/completions and /v1/chat/completions, as vLLM serves them.

Each prompt is planned first (hits, fetches), so the `x-sim-*` headers go out before
the body; then it waits for its prefill turn and streams the deterministic output at
decode pace. The final chunk (or the response) carries a `quillcache` object with
the same numbers the headers give, and `usage.prompt_tokens_details.cached_tokens`
counts hit and fetched tokens.

A split's continuation (the gateway's plan has `continues`: its prompt is the client's
prompt and the first output tokens, sampled on the prefill engine) streams the rest of
the output the whole request would have had, so a split answer equals a colocated one.
`return_token_ids` (vLLM's) gives the prompt's and the output's token ids in a whole
answer, as vLLM does.

Fault flags (request headers, as in the SGLang router's tests): `x-sim-status: 503`
answers with that status at once; `x-sim-fail-after-tokens: N` resets the connection
after N output tokens (a stream then never sees [DONE]).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from quillcache_core.identity.tokenize import Tokenizer
from quillcache_core.process.metrics import Counter
from quillcache_simengine.config import SimEngineConfig
from quillcache_simengine.engine import Prepared, SimEngine
from quillcache_simengine.openai_api import (
    ApiError,
    ParsedRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    new_id,
    parse_request,
    usage,
)
from quillcache_simengine.output import generate

__all__ = ["CompletionRoutes", "json_error"]

logger = logging.getLogger(__name__)

FINISH_REASON = "length"  # the sim engine always generates max_tokens tokens


class CompletionRoutes:
    def __init__(
        self,
        config: SimEngineConfig,
        engine: SimEngine,
        tokenizer: Tokenizer,
        requests_total: Counter,
    ) -> None:
        self.config = config
        self.engine = engine
        self.scheduler = engine.scheduler
        self.tokenizer = tokenizer
        self._requests = requests_total

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's `POST /tokenize`: a prompt's or a chat's token ids, as a request would be."""
        try:
            body = await _read_json(request, self.config.max_body_bytes)
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be a JSON object")
            chat = "messages" in body
            if not chat and "prompt" not in body:
                raise ApiError(400, "'prompt' or 'messages' is required")
            parsed = parse_request(
                {**body, "max_tokens": 1, "stream": False},
                chat=chat,
                served_model=self.config.model,
                tokenizer=self.tokenizer,
                default_max_tokens=1,
                max_model_len=self.config.max_model_len,
            )
        except ApiError as exc:
            self._requests.inc(endpoint="tokenize", status=str(exc.status))
            return json_error(exc, self._headers())
        self._requests.inc(endpoint="tokenize", status="200")
        tokens = list(parsed.prompts[0])
        return web.json_response(
            {"count": len(tokens), "max_model_len": self.config.max_model_len, "tokens": tokens}
        )

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        endpoint = "chat" if chat else "completions"
        try:
            _fault_status(request)
            fail_after = _fail_after(request)
            parsed = parse_request(
                await _read_json(request, self.config.max_body_bytes),
                chat=chat,
                served_model=self.config.model,
                tokenizer=self.tokenizer,
                default_max_tokens=self.config.default_max_tokens,
                max_model_len=self.config.max_model_len,
            )
        except ApiError as exc:
            self._requests.inc(endpoint=endpoint, status=str(exc.status))
            return json_error(exc, self._headers())
        prepared: list[Prepared] = []
        try:
            for i, tokens in enumerate(parsed.prompts):
                plan = parsed.plan if i == 0 else None  # a plan covers the first prompt
                prepared.append(await self.engine.prepare(tokens, parsed.cache_salt, plan))
            report = self._report(prepared)
            headers = self._headers(report)
            if parsed.stream:
                response = await self._stream(
                    request, parsed, prepared, report, headers, fail_after
                )
            else:
                response = await self._complete(
                    request, parsed, prepared, report, headers, fail_after
                )
            self._requests.inc(endpoint=endpoint, status=str(response.status))
            return response
        except _Aborted as exc:
            self._requests.inc(endpoint=endpoint, status="aborted")
            return exc.response
        except (ConnectionResetError, asyncio.CancelledError):
            self._requests.inc(endpoint=endpoint, status="disconnected")
            logger.debug("client went away during a %s request", endpoint)
            raise
        finally:
            for item in prepared:
                self.engine.release(item)

    def _report(self, prepared: list[Prepared]) -> dict[str, Any]:
        return {
            "hit_blocks": sum(p.hit_blocks for p in prepared),
            "fetched_blocks": sum(p.fetched_blocks for p in prepared),
            "recomputed_blocks": sum(p.recomputed_blocks for p in prepared),
            "fetch_failed_blocks": sum(p.fetch_fallback_blocks for p in prepared),
            "engine_id": self.config.node_id,
        }

    def _headers(self, report: dict[str, Any] | None = None) -> dict[str, str]:
        headers = {"x-sim-engine": self.config.node_id}
        if report is not None:
            headers["x-sim-hit-blocks"] = str(report["hit_blocks"])
            headers["x-sim-fetched-blocks"] = str(report["fetched_blocks"])
            headers["x-sim-recomputed-blocks"] = str(report["recomputed_blocks"])
        return headers

    async def _tokens(
        self, item: Prepared, max_tokens: int, continues: tuple[int, int] | None
    ) -> AsyncIterator[str]:
        """Prefill, then the output pieces at decode pace."""
        end = await self.engine.prefill(item)
        pieces = _output(item.tokens, max_tokens, continues)
        # aclosing: an abandoned stream stops counting as running at once, not at GC.
        async with contextlib.aclosing(self.scheduler.decode(len(pieces), end)) as steps:
            async for i in steps:
                self.engine.stats.generation_tokens += 1
                yield pieces[i]

    def _usage(self, prepared: list[Prepared], parsed: ParsedRequest, report: dict) -> dict:
        prompt = sum(len(p.tokens) for p in prepared)
        cached = sum(p.cached_tokens(self.config.block_size) for p in prepared)
        return usage(prompt, parsed.max_tokens * len(prepared), cached, report)

    async def _complete(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        prepared: list[Prepared],
        report: dict,
        headers: dict[str, str],
        fail_after: int | None,
    ) -> web.Response:
        texts = []
        sent = 0
        for item in prepared:
            pieces = []
            continues = parsed.continues if not texts else None  # the plan's prompt
            output = self._tokens(item, parsed.max_tokens, continues)
            async with contextlib.aclosing(output) as tokens:
                async for piece in tokens:
                    if fail_after is not None and sent >= fail_after:
                        raise _Aborted(_reset_connection(request))
                    pieces.append(piece)
                    sent += 1
            texts.append("".join(pieces))
        if fail_after is not None and sent >= fail_after:
            raise _Aborted(_reset_connection(request))
        id_, created = new_id(parsed.chat), int(time.time())
        if parsed.chat:
            body = chat_response(id_, created, parsed.model, texts[0], FINISH_REASON)
        else:
            body = completion_response(id_, created, parsed.model, texts, FINISH_REASON)
        if parsed.return_token_ids:
            for item, text, choice in zip(prepared, texts, body["choices"], strict=True):
                choice["token_ids"] = self.tokenizer.encode(text)
                if not parsed.chat:
                    choice["prompt_token_ids"] = list(item.tokens)
            if parsed.chat:
                body["prompt_token_ids"] = list(prepared[0].tokens)
        body["usage"] = self._usage(prepared, parsed, report)
        body["quillcache"] = report
        return web.json_response(body, headers=headers)

    async def _stream(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        prepared: list[Prepared],
        report: dict,
        headers: dict[str, str],
        fail_after: int | None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                **headers,
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
            }
        )
        await response.prepare(request)
        id_, created, model = new_id(parsed.chat), int(time.time()), parsed.model
        sent = 0

        async def send(chunk: dict) -> None:
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        for index, item in enumerate(prepared):
            first = True
            continues = parsed.continues if index == 0 else None  # the plan's prompt
            output = self._tokens(item, parsed.max_tokens, continues)
            async with contextlib.aclosing(output) as tokens:
                async for piece in tokens:
                    if fail_after is not None and sent >= fail_after:
                        raise _Aborted(_reset_connection(request, response))
                    if parsed.chat:
                        if first:
                            role = {"role": "assistant", "content": ""}
                            await send(chat_chunk(id_, created, model, role, index=index))
                        await send(chat_chunk(id_, created, model, {"content": piece}, index=index))
                    else:
                        await send(completion_chunk(id_, created, model, piece, index=index))
                    first = False
                    sent += 1
            if fail_after is not None and sent >= fail_after:
                raise _Aborted(_reset_connection(request, response))
            if parsed.chat:
                final = chat_chunk(id_, created, model, {}, FINISH_REASON, index=index)
            else:
                final = completion_chunk(id_, created, model, "", FINISH_REASON, index=index)
            if index == len(prepared) - 1:
                final["quillcache"] = report
            await send(final)
        if parsed.include_usage:
            builder = chat_chunk if parsed.chat else completion_chunk
            last = builder(id_, created, model, None)
            last["usage"] = self._usage(prepared, parsed, report)
            await send(last)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _output(tokens: tuple[int, ...], max_tokens: int, continues: tuple[int, int] | None):
    """The output pieces of a prompt; a continuation's are the rest of its whole
    request's (the first `k` pieces were the prefill engine's)."""
    if continues is None:
        return generate(tokens, max_tokens)
    prompt, done = continues
    return generate(tokens[:prompt], done + max_tokens)[done:]


class _Aborted(Exception):
    """A fault flag reset the connection; `response` is what the handler returns."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("connection reset by a fault flag")
        self.response = response


def json_error(exc: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=headers)


def _fault_status(request: web.Request) -> None:
    raw = request.headers.get("x-sim-status")
    if raw is None:
        return
    try:
        status = int(raw)
    except ValueError:
        raise ApiError(400, f"x-sim-status must be an integer, got {raw!r}") from None
    if not 400 <= status <= 599:
        raise ApiError(400, f"x-sim-status must be an error status (400..599), got {status}")
    raise ApiError(status, f"sim engine fault injection: status {status}")


def _fail_after(request: web.Request) -> int | None:
    raw = request.headers.get("x-sim-fail-after-tokens")
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ApiError(400, f"x-sim-fail-after-tokens must be an integer >= 0, got {raw!r}")
    return value


async def _read_json(request: web.Request, limit: int) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body too large (limit {limit} bytes)") from None
    if not raw:
        raise ApiError(400, "the request body is empty")
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid UTF-8") from None
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


def _reset_connection(
    request: web.Request, response: web.StreamResponse | None = None
) -> web.StreamResponse:
    """Abort the TCP connection with a reset (SO_LINGER 0), as a crashing engine would."""
    transport = request.transport
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    logger.debug("fault flag: connection reset")
    return response if response is not None else web.Response(status=499)
