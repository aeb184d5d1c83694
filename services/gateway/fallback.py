"""Degraded mode: while the conductor is unreachable, the gateway routes requests itself.

The conductor is one process; while it is down (killed, restarting) or hung, a Plan
fails with UNAVAILABLE or DEADLINE_EXCEEDED, or its plan-port connection drops. Rather
than failing every request until it is back, the gateway then picks an engine itself
among those the conductor's last Stats listed for the model (`ModelCatalog`), by
rendezvous hashing of the prompt's first block hash (the consistent-hash policy of the
SGLang and vLLM routers): the same prefix lands on the same engine, so engines' own
prefix caches still hit, and an engine leaving moves only its own prefixes. Engines
that just failed the request are skipped (the gateway's exclude-and-retry). Such a
request has no reservation: nothing is finished for it, and its answer's headers say
`x-quillcache-plan: fallback` (and which engine) instead of the plan's numbers.

A client's mistake the conductor answered (INVALID_ARGUMENT, NOT_FOUND,
RESOURCE_EXHAUSTED, or its own "no engine available") keeps its answer: only a
conductor that does not answer is routed around.

`CircuitBreaker` keeps a dead conductor from being asked on every request: after a
failure it is asked again at most every `retry_s` (by one request at a time, the
others routed meanwhile), and each Plan is waited for at most `timeout_s`, so a hung
conductor costs a request at most that (a plan that comes later has its reservation
cancelled: reservations.shielded). The first Plan it answers closes the breaker:
planning resumes by itself (gRPC reconnects; the plan port client re-resolves).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence

import grpc

from quillcache.v1 import conductor_pb2
from quillcache_core.process.metrics import MetricsRegistry
from quillcache_gateway.errors import ApiError
from quillcache_gateway.models import ModelCatalog

logger = logging.getLogger(__name__)

PLAN_HEADER = "x-quillcache-plan"
# The conductor's own UNAVAILABLE answer (state.py): it is up, but has no engine to plan
# on. Not a reason to route around it.
NO_ENGINE = "no engine available"

# Turns a Plan takes (CircuitBreaker.turn).
SKIP = 0  # the breaker is open: do not ask the conductor, route
CALL = 1  # the breaker is closed: ask
PROBE = 2  # the breaker is open but due: this one call asks whether the conductor is back


def unreachable_reason(exc: BaseException) -> str | None:
    """The fallback reason when `exc` (from a Plan call) says the conductor did not
    answer; None when it answered (a client's mistake, a refusal) or for anything else."""
    if isinstance(exc, TimeoutError):  # the gateway's own deadline (before OSError: a subclass)
        return "deadline_exceeded"
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return "deadline_exceeded"
        if code is grpc.StatusCode.UNAVAILABLE and not (exc.details() or "").startswith(NO_ENGINE):
            return "unavailable"
        return None
    if isinstance(exc, OSError):  # a connection to the conductor failed under the call
        return "unavailable"
    return None


class CircuitBreaker:
    """Closed while the conductor answers; open for `retry_s` after it did not.

    `turn()` says what a Plan does now: CALL (closed), SKIP (open), or PROBE (open, due,
    and no other probe in flight). Every call then reports: `answered` (the conductor
    answered, even with an error: closed), `failed` (it did not: open for `retry_s`) or
    `abandoned` (the caller left first: nothing learnt). Not thread-safe: one event loop.
    """

    def __init__(self, retry_s: float) -> None:
        self.retry_s = retry_s
        self._open_until = 0.0  # 0: closed
        self._probing = False

    @property
    def is_open(self) -> bool:
        return self._open_until > 0

    def turn(self) -> int:
        if not self._open_until:
            return CALL
        if self._probing or time.monotonic() < self._open_until:
            return SKIP
        self._probing = True
        return PROBE

    def answered(self, turn: int) -> bool:
        """Closed; True if it was open."""
        was_open = self.is_open
        self._open_until = 0.0
        if turn == PROBE:
            self._probing = False
        return was_open

    def failed(self, turn: int) -> bool:
        """Open for `retry_s` from now; True if it was closed."""
        was_closed = not self.is_open
        self._open_until = time.monotonic() + self.retry_s
        if turn == PROBE:
            self._probing = False
        return was_closed

    def abandoned(self, turn: int) -> None:
        if turn == PROBE:
            self._probing = False


def rendezvous(
    key: bytes, engines: Sequence[tuple[str, str]], excluded: Sequence[str] = ()
) -> tuple[str, str] | None:
    """The engine (id, base URL) with the highest hash of (`key`, its id), of those not
    `excluded`; None when there is none. Highest random weight: each key's choice is
    stable, spread evenly, and moves only when its own engine leaves."""
    best = None
    best_score = -1
    for engine in engines:
        if engine[0] in excluded:
            continue
        digest = hashlib.blake2b(key + b"\0" + engine[0].encode(), digest_size=8).digest()
        score = int.from_bytes(digest, "big")
        if score > best_score:
            best, best_score = engine, score
    return best


def is_fallback(plan: conductor_pb2.PlanResponse) -> bool:
    """A plan the gateway made itself: the conductor's always hold a reservation."""
    return not plan.reservation_id


class PlanFallback:
    """The breaker, the gateway's own routing, and their metrics."""

    def __init__(
        self,
        catalog: ModelCatalog,
        metrics: MetricsRegistry,
        *,
        enabled: bool,
        timeout_s: float,
        retry_s: float,
    ) -> None:
        self.catalog = catalog
        self.enabled = enabled
        # How long a request waits for its Plan (None: the call's own deadline).
        self.timeout_s = timeout_s if enabled else None
        self.breaker = CircuitBreaker(retry_s)
        self.fallbacks = metrics.counter(
            "gateway_plan_fallbacks_total",
            "requests routed by the gateway itself because the conductor was unreachable, "
            "by reason (unavailable, deadline_exceeded, circuit_open: not asked)",
            ["reason"],
        )
        metrics.gauge(
            "gateway_plan_fallback_active",
            "1 while the conductor is deemed unreachable and the gateway routes requests",
            read=lambda: [((), 1.0 if self.breaker.is_open else 0.0)],
        )

    def turn(self) -> int:
        return self.breaker.turn() if self.enabled else CALL

    def answered(self, turn: int) -> None:
        if self.enabled and self.breaker.answered(turn):
            logger.warning("the conductor answers again: requests are planned by it")

    def failed(self, exc: BaseException, turn: int) -> str | None:
        """The fallback reason if `exc` says the conductor did not answer and fallback is
        on (the breaker opens); else None (the caller answers as without fallback)."""
        if not self.enabled:
            return None
        reason = unreachable_reason(exc)
        if reason is None:
            if isinstance(exc, grpc.aio.AioRpcError):
                self.answered(turn)
            else:
                self.breaker.abandoned(turn)
            return None
        if self.breaker.failed(turn):
            logger.warning(
                "the conductor is unreachable (%s): routing requests by consistent hash, "
                "asking it again every %.1f s",
                _describe(exc),
                self.breaker.retry_s,
            )
        return reason

    def abandoned(self, turn: int) -> None:
        self.breaker.abandoned(turn)

    def route(
        self, call, excluded: Sequence[str], reason: str, exc: BaseException | None = None
    ) -> conductor_pb2.PlanResponse:
        """A plan without a reservation onto the engine of the model that the request
        (server._Call) hashes to, never a prefill-role one while another serves the model;
        503 when none of the model's is known or all were excluded."""
        model = call.job.model
        engines = self.catalog.engines_for(model)
        key = route_key(call.packed, call.ident.salt_json + model.encode(), call.job.tokens)
        chosen = rendezvous(key, self.catalog.decoding_engines_for(model, excluded))
        if chosen is None:
            if engines:
                message = f"no engine could serve the request (tried {', '.join(excluded)})"
            else:
                cause = _describe(exc) if exc is not None else "not asked: it failed just now"
                message = f"conductor unreachable ({cause}) and no engine known for {model!r}"
            raise ApiError(503, message, type_="service_unavailable", code="no_engine_available")
        self.fallbacks.inc(reason=reason)
        return conductor_pb2.PlanResponse(engine_id=chosen[0], engine_base_url=chosen[1])


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    return repr(exc)


def route_key(packed: bytes, scope: bytes, tokens: Sequence[int]) -> bytes:
    """What a request is hashed by: its first block's hash (16 bytes of `packed`), or for
    a prompt shorter than a block, its tokens in its `scope` (tenant and model)."""
    return packed[:16] or scope + b"\0" + ",".join(map(str, tokens)).encode()
