"""Every answer against its plan, where an operator sees it: two histograms (the error in
cached tokens and in TTFT, by engine and the conductor replica that planned), a
misprediction counter by cause, and one INFO line per request in the
`quillcache_gateway.access` log (no prompt, no key).

Label sets are bounded by the fleet: engines x conductor replicas ("fallback" for
the gateway's own plans).
"""

from __future__ import annotations

import logging

from aiohttp import web

from quillcache_core.process.metrics import MetricsRegistry
from quillcache_gateway.delivered import Delivery

access_log = logging.getLogger("quillcache_gateway.access")

# Delivered - predicted cached tokens, and realized - predicted TTFT (seconds).
TOKEN_ERROR_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096)
TTFT_ERROR_BUCKETS = (-1, -0.25, -0.1, -0.025, -0.005, 0, 0.005, 0.025, 0.1, 0.25, 1, 5)
# The request's Delivery, kept for its access log line.
DELIVERY_KEY = web.RequestKey("quillcache_delivery", Delivery)


class DeliveryMeter:
    def __init__(self, metrics: MetricsRegistry) -> None:
        self.hit_error = metrics.histogram(
            "gateway_cached_tokens_error",
            "delivered minus predicted cached prompt tokens (engine hits + pool loads)",
            TOKEN_ERROR_BUCKETS,
            ["engine", "replica"],
        )
        self.ttft_error = metrics.histogram(
            "gateway_ttft_error_seconds",
            "a stream's realized minus predicted time to first token, seconds",
            TTFT_ERROR_BUCKETS,
            ["engine", "replica"],
        )
        self.mispredictions = metrics.counter(
            "gateway_mispredictions_total",
            "answers whose delivered cached tokens differ from the plan's, by cause",
            ["engine", "cause"],
        )

    def count(self, request: web.Request, done: Delivery) -> None:
        """Count an answer against its plan, and keep it for the request's log line."""
        request[DELIVERY_KEY] = done
        p = done.prediction
        replica = p.replica or "fallback"
        if done.token_error is not None and not p.fallback:
            self.hit_error.observe(done.token_error, engine=p.engine_id, replica=replica)
        if done.ttft_error_ms is not None:
            self.ttft_error.observe(done.ttft_error_ms / 1000, engine=p.engine_id, replica=replica)
        cause = done.cause
        if cause is not None:
            self.mispredictions.inc(engine=p.engine_id, cause=cause)

    def log(self, request: web.Request, request_id: str, status: str, elapsed_ms: float) -> None:
        """The request's one access line; with the plan's figures against the answer's
        when an engine answered it."""
        done = request.get(DELIVERY_KEY)
        if done is None:
            access_log.info("%s %s %s %.1fms", request_id, request.path, status, elapsed_ms)
            return
        p = done.prediction
        access_log.info(
            "%s %s %s %.1fms engine=%s replica=%s predicted_cached=%d (hit %d, loaded %d) "
            "delivered_cached=%s predicted_ttft_ms=%.1f ttft_ms=%s replica_behind_ms=%d cause=%s",
            request_id,
            request.path,
            status,
            elapsed_ms,
            p.engine_id,
            p.replica or "fallback",
            p.cached_tokens,
            p.hit_tokens,
            p.loaded_tokens,
            done.cached_tokens,
            p.ttft_ms,
            "-" if done.ttft_ms is None else f"{done.ttft_ms:.1f}",
            p.replica_behind_ms,
            done.cause or "-",
        )
