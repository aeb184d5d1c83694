"""What a client may send the gateway: every mistake is a 4xx in OpenAI's error shape.

Checked before any work is done for a request (no Plan, no engine call):

- the body: in at most `--body-timeout-s` (408), UTF-8, JSON nested at most `--max-json-depth` levels (checked by a scan
  that never recurses, before the parser, whose recursion would otherwise blow up on
  a body nested thousands deep), no NaN/Infinity literals, no number outside a double
  or over Python's 4,300-digit integer limit, no lone UTF-16 surrogate ("\\ud800":
  not text; no tokenizer or engine can read it), and a JSON object;
- its Content-Type: read as JSON whatever it says, except a multipart form or a
  charset other than UTF-8 (415);
- the OpenAI fields the gateway reads or forwards to the engine, by type and range
  (`check_fields`), with `max_tokens` at most `--max-tokens-limit`;
- the x-quillcache-ttft-slo-ms header: an integer of milliseconds from 1 to
  `--max-ttft-slo-ms` (`parse_slo`).

Fields not listed here (an engine's own extensions) are forwarded as they came.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Mapping
from itertools import accumulate

from aiohttp import web

from quillcache_gateway.errors import ApiError

MAX_DEPTH_CAP = 512  # well below the interpreter's recursion limit
MAX_STOP_STRINGS = 64
MAX_N = 128
MAX_LOGPROBS = 20
SEED_RANGE = (-(2**63), 2**64 - 1)

_NOT_BRACKETS_OR_QUOTES = bytes(b for b in range(256) if b not in b'[]{}"')
_STEP = [0] * 256  # a bracket's change of the nesting level
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_UTF8_CHARSETS = ("utf-8", "utf8", "us-ascii", "ascii")
CLOSE = {"Connection": "close"}


def check_content_type(header: str | None) -> None:
    """Refuse what cannot be a JSON body: a multipart form, a charset other than UTF-8."""
    if not header:
        return
    media, *params = (p.strip().lower() for p in header.split(";"))
    if media.startswith("multipart/"):
        raise _unsupported(f"Content-Type {media!r}: send the request as application/json")
    for param in params:
        name, _, value = param.partition("=")
        charset = value.strip().strip('"')
        if name.strip() == "charset" and charset and charset not in _UTF8_CHARSETS:
            raise _unsupported(f"charset {charset!r}: the body must be UTF-8 JSON")


def _unsupported(message: str) -> ApiError:
    return ApiError(415, message, code="unsupported_media_type")


def loads(raw: bytes, max_depth: int) -> dict:
    """The body as a JSON object, or ApiError(400)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(
            400, f"request body is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    check_depth(raw, max_depth)
    try:
        payload = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise ApiError(
            400,
            f"request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})",
        ) from None
    except (ValueError, RecursionError) as exc:  # a number out of range, NaN, too deep
        raise ApiError(400, f"request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(text):  # a pair is one character; a lone half is no text
        try:
            json.dumps(payload, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(
                400, "request body holds a lone UTF-16 surrogate (like \\ud800): not text"
            ) from None
    return payload


def check_depth(raw: bytes, limit: int) -> None:
    """ApiError(400) when a body's arrays and objects nest deeper than `limit`.

    No recursion, and linear: the strings are cut out (after their escaped backslashes
    and quotes), leaving the brackets; their nesting is followed a chunk at a time, a
    chunk's brackets counted one by one only when its openers could go over the limit.
    """
    kept = raw.translate(None, _NOT_BRACKETS_OR_QUOTES)
    if kept.count(b"[") + kept.count(b"{") <= limit:
        return  # the usual body: too few brackets to nest that deep
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
        kept = raw.translate(None, _NOT_BRACKETS_OR_QUOTES)
    brackets = b"".join(kept.split(b'"')[::2])
    level = 0
    size = max(limit, 64)
    for start in range(0, len(brackets), size):
        chunk = brackets[start : start + size]
        opens = chunk.count(b"[") + chunk.count(b"{")
        if (
            level + opens > limit
            and max(accumulate(map(_STEP.__getitem__, chunk), initial=level)) > limit
        ):
            raise ApiError(400, f"request body nests arrays and objects deeper than {limit} levels")
        level += 2 * opens - len(chunk)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def parse_slo(value: str | None, default: int, max_ms: int, header: str) -> int:
    """The TTFT budget in ms from its header: ASCII digits, 1..max_ms."""
    if value is None:
        return default
    value = value.strip()
    if value.isascii() and value.isdigit() and len(value) <= 12 and 1 <= int(value) <= max_ms:
        return int(value)
    raise ApiError(400, f"{header} must be an integer of milliseconds from 1 to {max_ms}")


def check_fields(payload: Mapping, kind: str, max_tokens_limit: int) -> tuple[int | None, bool]:
    """Type and range checks of the OpenAI fields; returns (max_tokens or None, stream).

    null is the same as a field left out, as in OpenAI's API.
    """
    field = "messages" if kind == "chat" else "prompt"
    if payload.get(field) is None:
        raise ApiError(400, f"'{field}' is required", param=field)
    if kind == "chat":
        _check_messages(payload["messages"])
        _of_type(payload, "logprobs", bool, "a boolean")
        _int(payload, "top_logprobs", 0, MAX_LOGPROBS)
        _of_type(payload, "tools", list, "an array")
        _of_type(payload, "tool_choice", (str, dict), "a string or an object")
        _of_type(payload, "response_format", dict, "an object")
        _of_type(payload, "parallel_tool_calls", bool, "a boolean")
    else:
        prompt = payload["prompt"]
        if not isinstance(prompt, str | list):
            raise ApiError(400, "'prompt' must be a string or an array", param="prompt")
        _int(payload, "logprobs", 0, MAX_LOGPROBS)
        _of_type(payload, "echo", bool, "a boolean")
        _int(payload, "best_of", 1, MAX_N)
        _of_type(payload, "suffix", str, "a string")
    max_tokens = _int(payload, "max_tokens", 1, max_tokens_limit)
    completion_tokens = _int(payload, "max_completion_tokens", 1, max_tokens_limit)
    stream = _of_type(payload, "stream", bool, "a boolean") or False
    _of_type(payload, "stream_options", dict, "an object")
    _int(payload, "n", 1, MAX_N)
    _number(payload, "temperature", 0.0, 2.0)
    _number(payload, "top_p", 0.0, 1.0)
    _number(payload, "presence_penalty", -2.0, 2.0)
    _number(payload, "frequency_penalty", -2.0, 2.0)
    _int(payload, "seed", *SEED_RANGE)
    _of_type(payload, "user", str, "a string")
    _check_stop(payload.get("stop"))
    _check_logit_bias(payload.get("logit_bias"))
    return (completion_tokens if completion_tokens is not None else max_tokens), stream


def _of_type(payload: Mapping, name: str, types, what: str):
    value = payload.get(name)
    if value is not None and not isinstance(value, types):
        raise ApiError(400, f"'{name}' must be {what}", param=name)
    return value


def _int(payload: Mapping, name: str, lo: int, hi: int) -> int | None:
    value = payload.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be an integer from {lo} to {hi}", param=name)
    return value


def _number(payload: Mapping, name: str, lo: float, hi: float) -> None:
    value = payload.get(name)
    if value is None:
        return
    if not isinstance(value, int | float) or isinstance(value, bool) or not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be a number from {lo:g} to {hi:g}", param=name)


def _check_stop(stop) -> None:
    if stop is None or isinstance(stop, str):
        return
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) for s in stop)
    ):
        raise ApiError(
            400,
            f"'stop' must be a string or an array of at most {MAX_STOP_STRINGS} strings",
            param="stop",
        )


def _check_logit_bias(bias) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and -100 <= v <= 100
        for v in bias.values()
    ):
        raise ApiError(
            400,
            "'logit_bias' must be an object of token ids to numbers from -100 to 100",
            param="logit_bias",
        )


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(
                400, f"messages[{i}] must be an object with a string role", param="messages"
            )
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
            raise ApiError(
                400,
                f"messages[{i}].content must be a string or an array of objects",
                param="messages",
            )


async def read_json(
    request: web.Request, max_body_bytes: int, max_depth: int, timeout_s: float
) -> tuple[bytes, dict]:
    """A request's body and its JSON object, or a 4xx ApiError: 408 when the body takes
    longer than `timeout_s` to arrive. An error that leaves the body unread says
    `Connection: close`: the connection ends with it."""
    check_content_type(request.headers.get("Content-Type"))
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout_s:g} s",
            code="request_timeout",
            headers=CLOSE,
        ) from None
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body exceeds {max_body_bytes} bytes") from None
    except web.RequestPayloadError as exc:  # a bad Content-Encoding or framing
        # aiohttp drops the connection after such a body: tell the client so.
        message = f"request body cannot be read: {str(exc).strip()}"
        raise ApiError(400, message, headers=CLOSE) from None
    return raw, loads(raw, max_depth)
