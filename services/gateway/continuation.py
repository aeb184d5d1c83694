"""A split answer whose first token comes from the prefill call (disagg.py): the shapes.

The prefill engine samples the answer's first token anyway. The gateway sends it to the
client at once, then has the decode engine continue from the prompt's ids and that
token's (a completions call with a token-id prompt, which vLLM and the sim engine both
serve, for chat requests too), asking for one token fewer. This module is the pure part:
which requests can be continued faithfully, the continuation's body, and the client's
one answer (chat or completions, streamed or whole) put together from the prefill's
answer and the continuation's, with usage counted as one colocated run would count it.

What cannot be continued keeps the decode engine's first token (`continuable` says why):
options whose meaning spans the whole output (`logprobs`, `n` > 1, `echo`, `suffix`,
stop strings, which could straddle the two calls, presence and frequency penalties,
which count output tokens, tools and response formats), a per-request `seed` (a
continuation's random stream differs from a colocated run's; without a seed none is
promised, so sampled requests are continued), and any field this module does not know.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from quillcache_core.wire import engine_plan

# Fields that mean the same for the continuation as for the client's request: passed on.
CARRIED = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",  # vLLM counts prompt and output tokens alike
        "logit_bias",
        "allowed_token_ids",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "user",
        "priority",
        "stream",
        "stream_options",
    }
)
# Fields the continuation replaces (the prompt is ids, the budget one token less), or
# that only shape the prompt, whose ids come from the prefill engine.
REPLACED = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "cache_salt",
        "kv_transfer_params",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "chat_template",
        "chat_template_kwargs",
    }
)
# Fields that do not change the output at their default (or empty) value.
NEUTRAL = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "stop": ("", ()),
    "tools": ((),),
    "response_format": ({"type": "text"},),
}
FIRST_KEYS = ("token_ids", "prompt_token_ids")  # what the prefill call asked for, not the client


def continuable(payload: Mapping) -> str:
    """ "" when the decode engine can continue the request from the prefill's first token
    with the output a colocated run would give; otherwise why not (for a header)."""
    for name, value in payload.items():
        if value is None or name in CARRIED or name in REPLACED:
            continue
        neutral = NEUTRAL.get(name)
        if neutral is None:
            return f"{name} given"
        if isinstance(value, list):
            value = tuple(value)
        if value not in neutral or isinstance(value, bool) != isinstance(neutral[0], bool):
            return f"{name} given"
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return "stream not a boolean"
    return ""


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The prefill call's answer, read: its first output token and what it counted."""

    body: dict  # the prefill engine's answer (chat or completions shape), as it came
    chat: bool  # the client asked for a chat completion
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int

    @property
    def choice(self) -> dict:
        return self.body["choices"][0]

    def ends_answer(self, payload: Mapping) -> bool:
        """Whether the first token is the whole answer (an end of sequence, a stop token,
        or a budget of one token)."""
        if self.finish_reason not in (None, "length"):
            return True
        budget = budget_of(payload, chat=self.chat)
        return budget is not None and budget <= self.completion_tokens


def budget_of(payload: Mapping, *, chat: bool) -> int | None:
    """The client's output budget, None when it left it to the engine."""
    budget = _int_or_none(payload.get("max_completion_tokens")) if chat else None
    return budget if budget is not None else _int_or_none(payload.get("max_tokens"))


def read_first_token(data: bytes, *, chat: bool) -> FirstToken | None:
    """The prefill call's answer, or None when it lacks what a continuation needs (the
    engine did not give token ids: it cannot be continued)."""
    try:
        body = json.loads(data)
        choice = body["choices"][0]
        text = (choice["message"].get("content") if chat else choice["text"]) or ""
        ids = choice.get("token_ids")
        prompt_ids = body.get("prompt_token_ids") if chat else choice.get("prompt_token_ids")
        usage = body.get("usage") or {}
        prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
        completion = _int_or_none(usage.get("completion_tokens"))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    if not _ids(ids) or not _ids(prompt_ids) or not isinstance(text, str):
        return None
    if prompt_tokens is None or completion is None:
        return None
    return FirstToken(
        body, chat, text, ids, prompt_ids, choice.get("finish_reason"), prompt_tokens, completion
    )


def _ids(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(_int_or_none(t) is not None for t in value)
    )


def continuation_body(payload: Mapping, first: FirstToken, salt: str, plan: dict) -> bytes:
    """The decode engine's call: a completions request over the prompt's ids and the
    first token's, for the rest of the client's budget (left to the engine when the
    client left it), with the client's sampling options."""
    body: dict[str, Any] = {k: v for k, v in payload.items() if k in CARRIED and v is not None}
    body["model"] = payload.get("model")
    body["prompt"] = first.prompt_token_ids + first.token_ids
    budget = budget_of(payload, chat=first.chat)
    if budget is not None:
        body["max_tokens"] = budget - first.completion_tokens
    min_tokens = _int_or_none(payload.get("min_tokens"))
    if min_tokens:
        body["min_tokens"] = max(0, min_tokens - first.completion_tokens)
    body["cache_salt"] = salt
    params = payload.get("kv_transfer_params")
    if isinstance(params, dict):
        body["kv_transfer_params"] = params
    return json.dumps(engine_plan.attach(body, plan), separators=(",", ":")).encode()


def merged_usage(first: FirstToken, usage: Mapping) -> dict:
    """The continuation's usage counted as the client's request: its prompt without the
    first token, which counts as output; cached tokens are the decode engine's."""
    merged = dict(usage)
    completion = (_int_or_none(usage.get("completion_tokens")) or 0) + first.completion_tokens
    merged["prompt_tokens"] = first.prompt_tokens
    merged["completion_tokens"] = completion
    merged["total_tokens"] = first.prompt_tokens + completion
    details = usage.get("prompt_tokens_details")
    if isinstance(details, Mapping):
        cached = _int_or_none(details.get("cached_tokens"))
        if cached is not None:
            merged["prompt_tokens_details"] = {
                **details,
                "cached_tokens": min(cached, first.prompt_tokens),
            }
    return merged


# An answer's own keys; any other a continuation's event or answer has is passed on.
_PLAIN_KEYS = frozenset(("id", "object", "created", "model", "choices", "usage"))


def _sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


class StreamShaper:
    """The client's stream: the first token's events, then the continuation's events
    (completions chunks) re-shaped as the client's (chat chunks for a chat), all under
    the prefill answer's id, with usage counted as the client's request."""

    def __init__(self, first: FirstToken, *, include_usage: bool) -> None:
        self.first = first
        self.chat = chat = first.chat
        self.include_usage = include_usage
        body = first.body
        self._head = {
            "id": body.get("id", ""),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": body.get("created", 0),
            "model": body.get("model", ""),
        }
        self._buffer = b""
        # A plain token's event, the stream's bulk, is written from these two halves
        # around its text (the same bytes as `_chunk`'s, without building a dict).
        plain = _sse(self._chunk("\0", None))
        text_at = plain.index(b'"\\u0000"')
        self._plain = (plain[:text_at], plain[text_at + len(b'"\\u0000"') :])

    def _chunk(self, text: str | None, finish_reason: str | None, **extra) -> dict:
        choices = []
        if text is not None:
            choice: dict[str, Any]
            if self.chat:
                choice = {"index": 0, "delta": {"content": text} if text else {}}
            else:
                choice = {"index": 0, "text": text}
            choice.update(logprobs=None, finish_reason=finish_reason, stop_reason=None)
            choices.append(choice)
        return {**self._head, "choices": choices, **extra}

    def first_events(self, ends_answer: bool) -> bytes:
        """The first token's events; with `ends_answer`, the stream's end too."""
        first = self.first
        events = []
        if self.chat:
            role = self._chunk("", None)
            role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            events.append(role)
        if ends_answer:
            events.append(self._chunk(first.text, first.finish_reason))
            if self.include_usage:
                events.append(self._chunk(None, None, usage=first.body.get("usage")))
            return b"".join(map(_sse, events)) + DONE
        events.append(self._chunk(first.text, None))
        return b"".join(map(_sse, events))

    def feed(self, data: bytes) -> bytes:
        """The client's bytes for the continuation's next bytes (whole events only)."""
        buffer = self._buffer + data
        end = buffer.rfind(b"\n\n")
        if end < 0:
            self._buffer = buffer
            return b""
        self._buffer = buffer[end + 2 :]
        return b"".join(self._event(raw) for raw in buffer[: end + 2].split(b"\n\n") if raw)

    def close(self) -> bytes:
        """What was left of the continuation's stream (an event cut short: dropped, so
        the client's stream ends as the gateway ends a failed one)."""
        self._buffer = b""
        return b""

    def _event(self, raw: bytes) -> bytes:
        line = raw.strip()
        if not line.startswith(b"data:"):
            return raw + b"\n\n"  # a comment or another SSE field: as it came
        data = line[5:].strip()
        if data == b"[DONE]":
            return DONE
        try:
            event = json.loads(data)
        except ValueError:
            return raw + b"\n\n"
        if not isinstance(event, dict):
            return raw + b"\n\n"
        choices = event.get("choices")
        if len(event) <= 6 and event.get("usage") is None and len(choices or ()) == 1:
            choice = choices[0]
            if (
                isinstance(choice, dict)
                and choice.get("text")
                and choice.get("finish_reason") is None
                and choice.get("stop_reason") is None
                and not choice.get("logprobs")
                and _PLAIN_KEYS.issuperset(event)
            ):
                head, tail = self._plain
                return head + json.dumps(choice["text"]).encode() + tail
        extra = {k: v for k, v in event.items() if k not in _PLAIN_KEYS}
        usage = event.get("usage")
        if isinstance(usage, Mapping):
            extra["usage"] = merged_usage(self.first, usage)
        out = self._chunk(None, None, **extra)
        for choice in choices or ():
            if not isinstance(choice, dict):
                continue
            shaped = self._chunk(choice.get("text") or "", choice.get("finish_reason"))
            shaped = shaped["choices"][0]
            shaped["stop_reason"] = choice.get("stop_reason")
            out["choices"].append(shaped)
        return _sse(out)


def whole_answer(first: FirstToken, continuation: bytes | None) -> bytes:
    """The client's whole answer: the prefill's answer with the continuation's text after
    its first token, the continuation's finish reason and usage (None: the first token
    was the whole answer). ValueError when the continuation is not a completion."""
    body = {k: v for k, v in first.body.items() if k not in FIRST_KEYS}
    choice = {k: v for k, v in first.choice.items() if k not in FIRST_KEYS}
    body["choices"] = [choice]
    if continuation is None:
        return json.dumps(body, separators=(",", ":")).encode()
    try:
        more = json.loads(continuation)
        cont = more["choices"][0]
        if not isinstance(cont, dict):
            raise TypeError("a choice is not an object")
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"not a completion: {exc!r}") from None
    text = first.text + (cont.get("text") or "")
    if first.chat:
        choice["message"] = {**choice["message"], "content": text}
    else:
        choice["text"] = text
    choice["finish_reason"] = cont.get("finish_reason")
    choice["stop_reason"] = cont.get("stop_reason")
    for key, value in more.items():
        if key not in _PLAIN_KEYS:
            body[key] = value  # the decode engine's extras (the sim engine's report)
    if isinstance(more.get("usage"), Mapping):
        body["usage"] = merged_usage(first, more["usage"])
    return json.dumps(body, separators=(",", ":")).encode()
