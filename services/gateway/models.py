"""What the gateway knows of the models its engines serve, and how it tokenizes for them.

From the conductor's Stats (at most once a second; a known model never waits for a
refresh, and a failed refresh is not tried again for a second): which models live
engines serve, the tokenizer their registry records name (the identity's), their ids
and base URLs (what the gateway routes to itself while the conductor is unreachable:
fallback.py), and the conductor's index block size. For a model it
finds the local tokenizer whose ids are the engine's, or has an engine tokenize
(vLLM's `POST /tokenize`) when there is none here.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import grpc

from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
from quillcache_core.errors import InvalidArgument
from quillcache_core.identity.tokenize import (
    BuiltinTokenizer,
    ModelTokenizer,
    Tokenizer,
    TokenizerView,
    TokenMemo,
    load_tokenizers,
    prompt_tokens,
)
from quillcache_gateway.errors import ApiError
from quillcache_gateway.upstream import UPSTREAM_ERRORS, UpstreamPool

logger = logging.getLogger(__name__)

MODELS_TTL_S = 1.0
MAX_TOKENIZERS = 4096
# A chat request's fields vLLM's /tokenize also reads (it renders the same template).
TOKENIZE_CHAT_FIELDS = (
    "tools",
    "documents",
    "continue_final_message",
    "add_special_tokens",
    "chat_template_kwargs",
    "chat_template",
)


class ModelCatalog:
    """Served models, their tokenizers and the index block size, from the conductor."""

    def __init__(
        self,
        tokenizers_spec: str,
        block_size: int,
        timeout_s: float,
        stats: Callable[[], conductor_pb2_grpc.ConductorStub],
        upstream: Callable[[], UpstreamPool],
    ) -> None:
        self.tokenizers: dict[str, Tokenizer] = load_tokenizers(tokenizers_spec)
        # Prompts repeat their openings (a document, a conversation so far): ids are
        # reused from the tenant's own memo (`tokenizer_for`).
        self.builtin = BuiltinTokenizer()
        self.timeout_s = timeout_s
        # Tokens a block, as the conductor's index keeps them (its Stats say; the
        # configured --block-size until they do).
        self.block_size = block_size
        self._stats = stats
        self._upstream = upstream
        # model -> the tokenizer its engines' records name ("" = the model's own)
        self._models: tuple[float, dict[str, str]] = (-MODELS_TTL_S, {})
        self._refresh: asyncio.Task | None = None
        self._retry_at = 0.0  # after a failed fetch, no background refresh until then
        # model -> its engines as (engine id, base URL), in Stats' order
        self._model_engines: dict[str, list[tuple[str, str]]] = {}
        self._prefill_only: set[str] = set()  # engine ids whose role is prefill
        self._engine_blocks: dict[str, int] = {}  # engine id -> its own KV block size
        # Record tokenizer id -> its local files (None: ask an engine's /tokenize).
        self._record_tokenizers: dict[str, Tokenizer | None] = {}
        self._turn = itertools.count()

    def set_served(
        self,
        models: dict[str, str],
        urls: dict[str, list[str | tuple[str, str]]] | None = None,
        prefill_only: Iterable[str] = (),
        engine_blocks: dict[str, int] | None = None,
    ) -> None:
        """As if the conductor had just listed these (tests, and the fetch below).

        `urls` lists each model's engines as (engine id, base URL), or as bare base URLs
        (the URL then stands for the id too); `prefill_only` the ids of engines whose
        role is prefill; `engine_blocks` the engines' own KV block sizes."""
        self._engine_blocks = dict(engine_blocks or {})
        self._model_engines = {
            model: [e if isinstance(e, tuple) else (e, e) for e in engines]
            for model, engines in (urls or {}).items()
        }
        self._prefill_only = set(prefill_only)
        self._models = (time.monotonic(), models)

    def engine_block_size(self, engine_id: str) -> int:
        """Tokens in one of the engine's own KV blocks (the index's when not known)."""
        return self._engine_blocks.get(engine_id) or self.block_size

    def engines_for(self, model: str) -> list[tuple[str, str]]:
        """(engine id, base URL) of the engines Stats last listed for `model`, and of those
        serving any model."""
        found = self._model_engines.get(model, [])
        if model:
            found = found + [e for e in self._model_engines.get("", []) if e not in found]
        return found

    def decoding_engines_for(
        self, model: str, excluded: Sequence[str] = ()
    ) -> list[tuple[str, str]]:
        """`engines_for` but `excluded`, and without the engines whose role is prefill
        (they would decode stalled by every prefill) unless no other is left."""
        found = [e for e in self.engines_for(model) if e[0] not in excluded]
        decoding = [e for e in found if e[0] not in self._prefill_only]
        return decoding or found

    async def served_models(self) -> dict[str, str]:
        """Models the live engines serve ("" present = some engine serves any model).

        Fetched from the conductor at most once a second, and waited for only when the
        last answer is older than that: `served_tokenizer` refreshes in the background instead.
        """
        fetched_at, models = self._models
        if time.monotonic() - fetched_at < MODELS_TTL_S:
            return models
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.get_running_loop().create_task(self._fetch())
        return await asyncio.shield(self._refresh)

    async def _fetch(self) -> dict[str, str]:
        try:
            stats = await self._stats().Stats(conductor_pb2.StatsRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            self._retry_at = time.monotonic() + MODELS_TTL_S
            raise ApiError(
                503, f"conductor unavailable: {exc.details()}", type_="service_unavailable"
            ) from None
        if stats.block_tokens and stats.block_tokens != self.block_size:
            logger.info("conductor's index blocks are %d tokens: hashing so", stats.block_tokens)
            self.block_size = stats.block_tokens
        models: dict[str, str] = {}
        urls: dict[str, list[str | tuple[str, str]]] = {}
        prefill_only = []
        blocks = {}
        for engine in stats.engines:  # the first engine's record names the model's tokenizer
            models.setdefault(engine.model, engine.tokenizer)
            if engine.block_size:
                blocks[engine.engine_id] = engine.block_size
            if engine.base_url:
                pair = (engine.engine_id or engine.base_url, engine.base_url)
                urls.setdefault(engine.model, []).append(pair)
                if engine.role == "prefill":
                    prefill_only.append(pair[0])
        self.set_served(models, urls, prefill_only, blocks)
        return models

    async def served_tokenizer(self, model: str) -> str | None:
        """The tokenizer id the records of `model`'s engines name ("" = the model's own),
        None when no engine serves it; a known model does not wait for a refresh."""
        fetched_at, models = self._models
        if model in models or "" in models:
            now = time.monotonic()
            if (
                now - fetched_at >= MODELS_TTL_S
                and now >= self._retry_at
                and (self._refresh is None or self._refresh.done())
            ):
                task = asyncio.get_running_loop().create_task(self._fetch())
                task.add_done_callback(_ignore_result)
                self._refresh = task
            return models.get(model, models.get(""))
        served = await self.served_models()
        return served.get(model, served.get(""))

    def tokenizer_for(self, model: str, tokenizer_id: str, memo: TokenMemo) -> TokenizerView | None:
        """The local tokenizer for a model served under `tokenizer_id` (its engines' record),
        as a view for one request that reuses and keeps (its `commit`) only `memo`'s
        work (the tenant's); None when there is none here and an engine must tokenize.

        In order: the gateway's --tokenizers entry for the model; the built-in one when
        the record names it (the sim engine's); the model directory the record names (or
        the model, when it names no tokenizer), if it exists on this host.
        """
        configured = self.tokenizers.get(model)
        if configured is not None:
            return configured.scoped(memo)
        if tokenizer_id == self.builtin.name:
            return self.builtin.scoped(memo)
        name = tokenizer_id or model
        if name in self._record_tokenizers:
            known = self._record_tokenizers[name]
            return None if known is None else known.scoped(memo)
        found = None
        path = Path(name)
        if path.is_dir() and (path / "tokenizer.json").exists():
            try:
                found = ModelTokenizer(path, name=name)
            except InvalidArgument as exc:
                logger.warning("cannot use the tokenizer at %s (%s): engines tokenize", name, exc)
        if len(self._record_tokenizers) >= MAX_TOKENIZERS:
            self._record_tokenizers.clear()
        self._record_tokenizers[name] = found
        return None if found is None else found.scoped(memo)

    async def engine_tokens(self, model: str, payload: dict, kind: str) -> list[int]:
        """The prompt ids from an engine serving `model` (vLLM's POST /tokenize)."""
        engines = self._model_engines
        urls = [url for _, url in engines.get(model) or engines.get("") or []]
        if not urls:
            raise ApiError(
                503, f"no engine to tokenize for model {model!r}", type_="service_unavailable"
            )
        body: dict = {"model": model}
        if kind == "chat":
            body["messages"] = payload["messages"]
            body["add_generation_prompt"] = payload.get("add_generation_prompt", True)
            for name in TOKENIZE_CHAT_FIELDS:
                if name in payload:
                    body[name] = payload[name]
        else:
            prompt = payload["prompt"]
            if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                prompt = prompt[0]  # a batch is planned by its first prompt
            if not isinstance(prompt, str):
                return prompt_tokens(prompt, self.builtin)[0]  # token ids: used as given
            body["prompt"] = prompt
            if "add_special_tokens" in payload:
                body["add_special_tokens"] = payload["add_special_tokens"]
        url = urls[next(self._turn) % len(urls)]
        try:
            reply = await self._upstream().post(url, "/tokenize", json.dumps(body).encode(), b"")
            try:
                raw = await reply.read_all()
            finally:
                reply.release()
        except UPSTREAM_ERRORS as exc:
            raise ApiError(
                502, f"engine {url} could not tokenize: {exc}", type_="upstream_error"
            ) from None
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if reply.status != 200 or not isinstance(tokens, list):
            if reply.status in (400, 413, 422):  # the engine refused the request itself
                message = answer.get("message") if isinstance(answer, dict) else None
                raise ApiError(400, f"the engine refused the prompt: {message or raw[:200]!r}")
            raise ApiError(
                502, f"engine {url} /tokenize answered {reply.status}", type_="upstream_error"
            )
        return tokens


def _ignore_result(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
