"""The connector's metrics: its counters on a port of its own, its load and save
histograms on vLLM's /metrics.

Counters (blocks and bytes saved, loaded, dropped, failed loads; seconds spent loading,
placing and copying saves out on the forward path, sending saves in the background, in
the scheduler's step) are served per connector side on its `metrics_port` or
`scheduler_metrics_port` (`serve`), as `quillcache_connector_<field>_total`.

The load and save durations are histograms, and they go where vLLM's own metrics are:
the connector runs in vLLM's engine-core process, while vLLM's /metrics renders the
API server's prometheus_client registry (a multiprocess one only with
PROMETHEUS_MULTIPROC_DIR, which vLLM sets for more than one API server), so a metric
registered where the connector runs never reaches it. vLLM carries a connector's own
statistics there instead: the worker's `get_kv_connector_stats()` each step
(`ConnectorStats`, built from `Timings`), sent with the scheduler's stats to the API
server, where the connector class's `build_prom_metrics` (`ConnectorPromMetrics`)
observes them into histograms of vLLM's registry, labelled like vLLM's own
(model_name, engine).

Nothing here imports vLLM: vLLM calls these objects by their methods, and the metrics
reference test reads the names without it.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from dataclasses import dataclass, field, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily

from quillcache_vllm.pool import PoolCounters

PREFIX = "quillcache_connector_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# A load: a request's blocks fetched and placed in the paged cache (1 ms .. 30 s).
LOAD_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# The histograms on vLLM's /metrics: (name, help, ConnectorStats key).
HISTOGRAMS = (
    (
        PREFIX + "load_seconds",
        "one load of a request's blocks from the pool until its bytes are in vLLM's "
        "paged cache (fetch and place; in the background with async loads)",
        "load_seconds",
    ),
    (
        PREFIX + "save_seconds",
        "one batch of saved blocks sent to the store node, in the background (the copy "
        "out of the paged cache is quillcache_connector_copy_out_seconds_total)",
        "save_seconds",
    ),
)
MAX_KEPT = 4096  # durations kept between two drains, per kind (the rest are dropped)


# Each PoolCounters field's meaning, as its counter's help (a test holds them in step).
COUNTER_HELP = {
    "blocks_saved": "blocks saved to the store node",
    "bytes_saved": "bytes of the blocks saved",
    "blocks_save_dropped": "blocks not saved: the save queue was full, or the store refused them",
    "blocks_loaded": "blocks loaded from the pool into vLLM's paged cache",
    "bytes_loaded": "bytes of the blocks loaded",
    "blocks_load_failed": "blocks a load missed (missing, corrupt, unreachable): recomputed",
    "requests_loaded_async": "requests whose load ran in the background (vLLM's async loading)",
    "save_seconds": "seconds sending saved blocks to the store node (in the background)",
    "load_seconds": "seconds loading, until the bytes are in the paged cache",
    "place_seconds": "seconds of the loads spent copying into the paged cache",
    "copy_out_seconds": "seconds copying saved blocks out of the paged cache (forward path)",
    "match_seconds": "seconds in get_num_new_matched_tokens (vLLM's scheduling step)",
    "lookups": "Exists calls asked of the store node (scheduler side)",
    "lookup_seconds": "seconds of those store lookups",
    "lookups_planned": "lookups answered from the conductor's plan, with no store call",
    "plans_malformed": "requests whose plan was refused by its codec (served without one)",
    "lookups_skipped": "lookups not needed: vLLM's own cache covered the prompt",
    "lookups_late": "lookups not answered by their deadline (the request computed instead)",
    "requests_bypassed": "requests served as without the connector (its bypass file)",
    "data_port_batches": "saves and loads sent as one batch on a store's data port",
    "blocks_loaded_from_peers": "blocks loaded straight from the data port of the plan's peer",
}


def counter_names() -> list[str]:
    """The counters `serve` renders (the metrics reference lists them)."""
    return [PREFIX + f.name + "_total" for f in fields(PoolCounters)]


class _Counters:
    """A PoolCounters as prometheus_client counter families, read at scrape time."""

    def __init__(self, counters: PoolCounters) -> None:
        self.counters = counters

    def collect(self):
        for f in fields(self.counters):
            family = CounterMetricFamily(PREFIX + f.name, COUNTER_HELP.get(f.name, f.name))
            family.add_metric([], float(getattr(self.counters, f.name)))
            yield family


def render(counters: PoolCounters) -> str:
    registry = CollectorRegistry()
    registry.register(_Counters(counters))
    return generate_latest(registry).decode()


def serve(counters: PoolCounters, host: str, port: int, tls=None) -> ThreadingHTTPServer:
    """Serve GET /metrics in a daemon thread; returns the server (its port is bound).
    With `tls` (a `Tls`), HTTPS that demands a certificate of the cluster's CA."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = render(counters).encode()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            return

    server = ThreadingHTTPServer((host, port), Handler)
    if tls is not None:
        # The handshake runs in the connection's own thread, on its first read.
        server.socket = tls.server_context().wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )
    threading.Thread(target=server.serve_forever, name="quillcache-metrics", daemon=True).start()
    return server


# --- load and save histograms, through vLLM's connector statistics --------------------


class Timings:
    """Load and save durations (seconds) since the last `drain`; thread-safe (loads
    finish on the loader thread, saves on the pool's loop), at most MAX_KEPT a kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[str, collections.deque] = {
            key: collections.deque(maxlen=MAX_KEPT) for _, _, key in HISTOGRAMS
        }

    def load(self, seconds: float) -> None:
        with self._lock:
            self._kept["load_seconds"].append(seconds)

    def save(self, seconds: float) -> None:
        with self._lock:
            self._kept["save_seconds"].append(seconds)

    def drain(self) -> ConnectorStats | None:
        """What was timed since the last drain (None: nothing)."""
        with self._lock:
            data = {key: list(kept) for key, kept in self._kept.items() if kept}
            for kept in self._kept.values():
                kept.clear()
        return ConnectorStats(data) if data else None


@dataclass
class ConnectorStats:
    """vLLM's KVConnectorStats contract: `data` is {ConnectorStats key: [seconds, ...]},
    sent from the worker to the API server (plain lists: vLLM serializes it)."""

    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: ConnectorStats) -> ConnectorStats:
        """Both's durations in one (at most MAX_KEPT a kind: vLLM's logger aggregates
        a whole log interval)."""
        for key, values in other.data.items():
            mine = self.data.setdefault(key, [])
            mine.extend(values[: max(0, MAX_KEPT - len(mine))])
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's periodic log line: per kind, how many and their mean in ms."""
        out: dict[str, int | float] = {}
        for _, _, key in HISTOGRAMS:
            values = self.data.get(key) or []
            kind = key.removesuffix("_seconds")
            out[f"{kind}s"] = len(values)
            if values:
                out[f"{kind}_mean_ms"] = round(1000 * sum(values) / len(values), 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


def prom_metrics(metric_types: dict, labelnames: list[str], per_engine_labelvalues):
    """The connector class's `build_prom_metrics` answer: `metric_types` maps
    prometheus_client's classes to the ones vLLM has metrics made with."""
    histogram_cls = metric_types.get(prometheus_client.Histogram, prometheus_client.Histogram)
    return ConnectorPromMetrics(histogram_cls, labelnames, per_engine_labelvalues)


# The histograms registered in this process (vLLM's API server), so a second stat
# logger (an engine built again in one process) replaces them rather than failing.
_registered: list = []


class ConnectorPromMetrics:
    """vLLM's KVConnectorPromMetrics contract: the histograms, made with the metric class
    vLLM hands over (its registry), one child per engine; `observe` each step's stats."""

    def __init__(
        self,
        histogram_cls,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        for old in _registered:
            with contextlib.suppress(KeyError, ValueError):
                prometheus_client.REGISTRY.unregister(old)
        _registered.clear()
        self._children: dict[str, dict[int, Any]] = {}
        for name, help_text, key in HISTOGRAMS:
            histogram = histogram_cls(
                name=name, documentation=help_text, buckets=LOAD_BUCKETS_S, labelnames=labelnames
            )
            _registered.append(histogram)
            self._children[key] = {
                idx: histogram.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, children in self._children.items():
            child = children.get(engine_idx)
            if child is None:
                continue
            for seconds in transfer_stats_data.get(key) or ():
                child.observe(float(seconds))
