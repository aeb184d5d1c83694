"""Predicted against delivered: what a plan promised and what the engine's answer showed.

The engine reports the prompt tokens it did not compute in its usage
(`usage.prompt_tokens_details.cached_tokens`). In vLLM that is the request's
`num_cached_tokens`: its own prefix-cache hits plus what its KV connector loaded
(v1/metrics/stats.py, local + external), and the sim engine counts the same, so it is
compared with the plan's engine hits plus its pool loads. Both engines cache whole
blocks of their own and always compute a prompt's last token, so at most
`(prompt_tokens - 1) // engine_block_size` of the engine's blocks can be cached: the
prediction is capped there (an engine's blocks may be several of the index's).

A difference has one cause: `fallback_plan` (no conductor planned), else
`stale_replica` when the planning replica said its view of the engine was behind
(`PlanResponse.index_behind_ms`: an eviction or an extra it had not heard of yet),
else `engine_evicted`, `pool_load_failed` or `engine_extra` by where the count fell.

A streamed request whose client did not ask for usage is sent to the engine with
`stream_options.include_usage` set, and `StreamTap` takes that usage event back out of
what the client receives. Pure: no sockets, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

USAGE_MARK = b'"usage"'
EVENT_END = b"\n\n"
CRLF_END = b"\r\n\r\n"
# What a client sees of the comparison: only with this header set to 1.
EXPLAIN_HEADER = "x-quillcache-explain"
FIELD = "quillcache"


@dataclass(frozen=True, slots=True)
class Prediction:
    """What a plan promised: tokens the engine holds, tokens it loads from the pool,
    the TTFT (ms). `replica` is the conductor replica that planned ("" = the gateway's
    fallback planned without one); `replica_behind_ms` how far its view of the engine's
    cache trailed the engine (0 = current)."""

    engine_id: str
    replica: str
    hit_tokens: int
    loaded_tokens: int
    ttft_ms: float
    replica_behind_ms: int = 0

    @property
    def cached_tokens(self) -> int:
        return self.hit_tokens + self.loaded_tokens

    @property
    def fallback(self) -> bool:
        return not self.replica


def predict(
    engine_id: str,
    replica: str,
    hit_blocks: int,
    fetch_blocks: int,
    ttft_ms: float,
    block_size: int,
    prompt_tokens: int,
    engine_block_size: int,
    behind_ms: int = 0,
) -> Prediction:
    """The plan's figures in tokens (`block_size` a block of the plan's), capped at the
    blocks an engine of `engine_block_size` tokens a block can have cached; `behind_ms`
    the plan's `index_behind_ms`."""
    unit = engine_block_size or block_size
    cap = max(0, prompt_tokens - 1) // unit * unit
    hit = min(hit_blocks * block_size, cap)
    loaded = min(fetch_blocks * block_size, cap - hit)
    return Prediction(engine_id, replica, hit, loaded, ttft_ms, behind_ms)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One answer against its plan. `cached_tokens` None: the engine reported none;
    `ttft_ms` None: not a stream (a whole answer's time is not a first token's)."""

    prediction: Prediction
    cached_tokens: int | None
    ttft_ms: float | None

    @property
    def token_error(self) -> int | None:
        if self.cached_tokens is None:
            return None
        return self.cached_tokens - self.prediction.cached_tokens

    @property
    def ttft_error_ms(self) -> float | None:
        if self.ttft_ms is None or self.prediction.fallback:
            return None
        return self.ttft_ms - self.prediction.ttft_ms

    @property
    def cause(self) -> str | None:
        """Why the delivered hits differ from the plan's, or None when they agree."""
        p = self.prediction
        if p.fallback:
            return "fallback_plan"
        delivered = self.cached_tokens
        if delivered is None or delivered == p.cached_tokens:
            return None
        if p.replica_behind_ms:
            return "stale_replica"
        if delivered < p.hit_tokens:
            return "engine_evicted"
        if delivered < p.cached_tokens:
            return "pool_load_failed"
        return "engine_extra"

    def explain(self) -> dict:
        """The `quillcache` object an explaining client gets."""
        p = self.prediction
        return {
            "engine_id": p.engine_id,
            "replica": p.replica,
            "predicted": {
                "engine_hit_tokens": p.hit_tokens,
                "pool_loaded_tokens": p.loaded_tokens,
                "cached_tokens": p.cached_tokens,
                "ttft_ms": None if p.fallback else round(p.ttft_ms, 3),
                "replica_behind_ms": None if p.fallback else p.replica_behind_ms,
            },
            "delivered": {
                "cached_tokens": self.cached_tokens,
                "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 3),
            },
            "error": {
                "tokens": self.token_error,
                "ttft_ms": None if self.ttft_error_ms is None else round(self.ttft_error_ms, 3),
            },
            "cause": self.cause,
        }


def cached_tokens(usage: object) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` when it is a count, else None."""
    if not isinstance(usage, Mapping):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, Mapping):
        return None
    cached = details.get("cached_tokens")
    if type(cached) is not int or cached < 0:
        return None
    return cached


def wants_usage(payload: Mapping) -> bool:
    """Whether the client asked for a stream's usage itself."""
    options = payload.get("stream_options")
    return isinstance(options, Mapping) and options.get("include_usage") is True


def asking_usage(payload: Mapping) -> dict:
    """The stream options to send the engine: the client's, with include_usage set and
    without continuous_usage_stats (it had no effect without include_usage, and would
    put a usage in every event)."""
    options = payload.get("stream_options")
    kept = {
        k: v
        for k, v in (options.items() if isinstance(options, Mapping) else ())
        if k != "continuous_usage_stats"
    }
    return {**kept, "include_usage": True}


def whole_body(data: bytes, explain: Prediction | None) -> tuple[bytes, int | None]:
    """A whole answer's cached tokens, and its bytes for the client: as they came, or
    with the `quillcache` object comparing them with `explain` (None: not asked)."""
    try:
        body = json.loads(data)
    except ValueError:
        return data, None
    if not isinstance(body, dict):
        return data, None
    cached = cached_tokens(body.get("usage"))
    if explain is None:
        return data, cached
    fields = Delivery(explain, cached, None).explain()
    return json.dumps(_with_explain(body, fields)).encode(), cached


def _with_explain(event: dict, fields: dict) -> dict:
    """`event` with `fields` in its `quillcache` object (beside an engine's own extras)."""
    found = event.get(FIELD)
    event[FIELD] = {**found, **fields} if isinstance(found, dict) else fields
    return event


class StreamTap:
    """Finds a relayed stream's usage event (`cached`: its cached tokens) and shapes it
    for the client: without the usage when the client did not ask for it (`keep_usage`
    False; the event goes when nothing else is left in it), with the `quillcache`
    object comparing it with `explain` when asked (None: not asked) and the stream's
    `ttft_ms` (set by the caller at the first byte).

    `feed` returns the bytes to write: whole events only, the rest held until its end
    arrives (at most one event; `flush` gives it back at the stream's end).
    """

    def __init__(self, *, keep_usage: bool, explain: Prediction | None) -> None:
        self.keep_usage = keep_usage
        self.explain = explain
        self.ttft_ms = 0.0
        self.cached: int | None = None
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        # Events end in a blank line; an engine's CRLF ones pass through unshaped.
        lf, crlf = data.rfind(EVENT_END), data.rfind(CRLF_END)
        if lf < 0 and crlf < 0:
            self._pending = data
            return b""
        end = max(lf + len(EVENT_END) if lf >= 0 else 0, crlf + len(CRLF_END) if crlf >= 0 else 0)
        whole, self._pending = data[:end], data[end:]
        if USAGE_MARK not in whole:
            return whole
        return b"".join(self._shape(event + EVENT_END) for event in whole.split(EVENT_END)[:-1])

    def flush(self) -> bytes:
        pending, self._pending = self._pending, b""
        return pending

    def _shape(self, event: bytes) -> bytes:
        if USAGE_MARK not in event or not event.startswith(b"data: {"):
            return event
        try:
            obj = json.loads(event[6:])
        except ValueError:
            return event
        if not isinstance(obj, dict) or not isinstance(obj.get("usage"), dict):
            return event
        self.cached = cached_tokens(obj["usage"])
        if self.keep_usage and self.explain is None:
            return event  # the usage as the engine sent it
        if not self.keep_usage:
            del obj["usage"]
            if self.explain is None:
                return b""  # the event existed only because the gateway asked for it
        if self.explain is not None:
            _with_explain(obj, Delivery(self.explain, self.cached, self.ttft_ms).explain())
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + EVENT_END
