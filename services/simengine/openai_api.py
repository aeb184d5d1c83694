"""OpenAI request parsing and response shapes, as vLLM's server produces them.

Pure: no aiohttp. `parse_request` turns a decoded JSON body into a `ParsedRequest` or
raises `ApiError` with the HTTP status and OpenAI's error body; the builders return
the dicts vLLM sends (chunk ids, `object`, `created`, `model`, `choices`, `usage`
with `prompt_tokens_details.cached_tokens`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from quillcache_core.errors import InvalidArgument
from quillcache_core.identity.tokenize import Tokenizer, prompt_tokens, render_chat
from quillcache_core.wire.engine_plan import FIELD as PLAN_FIELD
from quillcache_core.wire.engine_plan import EnginePlan

__all__ = [
    "ApiError",
    "ParsedRequest",
    "chat_chunk",
    "completion_chunk",
    "error_body",
    "parse_request",
    "usage",
]

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestEntityTooLarge",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error shape, with vLLM's type names and the status as `code`."""
    kind = _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    chat: bool
    model: str
    prompts: tuple[tuple[int, ...], ...]  # one per choice (completions allow a batch)
    max_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: str | None
    plan: EnginePlan | None
    return_token_ids: bool = False  # vLLM's: the answer gives prompt and output token ids
    # A split's continuation (the gateway's plan says): (p, k) = the prompt's first p ids
    # are the client's prompt, the rest its first k output tokens, sampled elsewhere.
    continues: tuple[int, int] | None = None


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _opt_int(body: Mapping, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer", name)
    return value


def _opt_bool(body: Mapping, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be a boolean", name)
    return value


def parse_request(
    body: Any,
    *,
    chat: bool,
    served_model: str,
    tokenizer: Tokenizer,
    default_max_tokens: int,
    max_model_len: int,
) -> ParsedRequest:
    """Validate an OpenAI (chat) completion request; raises ApiError (400, 404)."""
    if not isinstance(body, Mapping):
        raise _bad("the request body must be a JSON object")
    model = body.get("model", served_model)
    if model is None:
        model = served_model
    if not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    try:
        if chat:
            if "messages" not in body:
                raise _bad("'messages' is required", "messages")
            prompts = [tokenizer.encode(render_chat(body["messages"]))]
        else:
            if "prompt" not in body:
                raise _bad("'prompt' is required", "prompt")
            prompts = prompt_tokens(body["prompt"], tokenizer)
    except InvalidArgument as exc:
        raise _bad(str(exc), "messages" if chat else "prompt") from None
    params = body.get("kv_transfer_params")
    plan = _plan(params)
    continues = _continues(params, prompts) if plan is not None else None
    max_tokens = _opt_int(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens")
    if max_tokens is None:
        # A continuation's default budget counts the output tokens it continues from.
        max_tokens = max(1, default_max_tokens - (continues[1] if continues else 0))
    if max_tokens < 1:
        raise _bad(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    n = _opt_int(body, "n")
    if n is not None and n != 1:
        raise _bad("the sim engine supports only n=1", "n")
    for i, tokens in enumerate(prompts):
        if not tokens:
            raise _bad(f"prompt {i} is empty", "prompt")
        if len(tokens) + max_tokens > max_model_len:
            raise _bad(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"you requested {len(tokens) + max_tokens} tokens ({len(tokens)} in the "
                f"messages, {max_tokens} in the completion).",
                "max_tokens",
            )
    stream = _opt_bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, Mapping):
            raise _bad("'stream_options' must be an object", "stream_options")
        include_usage = _opt_bool(options, "include_usage")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _bad("'cache_salt' must be a non-empty string", "cache_salt")
    return ParsedRequest(
        chat=chat,
        model=model,
        prompts=tuple(tuple(p) for p in prompts),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        cache_salt=salt,
        plan=plan,
        return_token_ids=_opt_bool(body, "return_token_ids"),
        continues=continues,
    )


def _continues(params: Mapping, prompts: list) -> tuple[int, int] | None:
    """The plan's `continues` ({"prompt_tokens": p, "output_tokens": k}), checked against
    the (first) prompt: p ids of prompt, then at least one id of output."""
    raw = params[PLAN_FIELD].get("continues")  # a plan is an object (EnginePlan checked)
    if raw is None:
        return None
    where = f"kv_transfer_params.{PLAN_FIELD}.continues"
    if not isinstance(raw, Mapping):
        raise _bad(f"{where} must be an object", "kv_transfer_params")
    prompt, output = raw.get("prompt_tokens"), raw.get("output_tokens")
    for name, value in (("prompt_tokens", prompt), ("output_tokens", output)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _bad(f"{where}.{name} must be a positive integer", "kv_transfer_params")
    if prompt >= len(prompts[0]):
        raise _bad(
            f"{where}.prompt_tokens ({prompt}) leaves no output token in the prompt "
            f"({len(prompts[0])} tokens)",
            "kv_transfer_params",
        )
    return prompt, output


def _plan(params: Any) -> EnginePlan | None:
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise _bad("'kv_transfer_params' must be an object", "kv_transfer_params")
    raw = params.get(PLAN_FIELD)
    if raw is None:
        return None
    try:
        plan = EnginePlan.from_json(raw)
        for action in plan.fetch:
            if isinstance(action.block_index, bool) or not isinstance(action.block_index, int):
                raise InvalidArgument("fetch block_index must be an integer")
            for name in ("block_hash", "source_node", "source_address"):
                if not isinstance(getattr(action, name), str):
                    raise InvalidArgument(f"fetch {name} must be a string")
        if isinstance(plan.block_size, bool) or not isinstance(plan.block_size, int):
            raise InvalidArgument("block_size must be an integer")
    except (InvalidArgument, ValueError) as exc:
        raise _bad(f"kv_transfer_params.{PLAN_FIELD}: {exc}", "kv_transfer_params") from None
    return plan


# --- responses ---------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt: int, completion: int, cached: int, quillcache: dict | None = None) -> dict:
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if quillcache is not None:
        body["quillcache"] = quillcache
    return body


def chat_chunk(
    id_: str,
    created: int,
    model: str,
    delta: dict | None,
    finish_reason: str | None = None,
    *,
    index: int = 0,
) -> dict:
    choices = []
    if delta is not None:
        choices.append(
            {
                "index": index,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        )
    return {
        "id": id_,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }


def completion_chunk(
    id_: str,
    created: int,
    model: str,
    text: str | None,
    finish_reason: str | None = None,
    *,
    index: int = 0,
) -> dict:
    choices = []
    if text is not None:
        choices.append(
            {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        )
    return {
        "id": id_,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }


def chat_response(id_: str, created: int, model: str, text: str, finish_reason: str) -> dict:
    return {
        "id": id_,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        ],
    }


def completion_response(
    id_: str, created: int, model: str, texts: list[str], finish_reason: str
) -> dict:
    return {
        "id": id_,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
            for i, text in enumerate(texts)
        ],
    }
