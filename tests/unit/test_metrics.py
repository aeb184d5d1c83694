"""MetricsRegistry on prometheus_client: what it renders, what it reads back, that it
keeps to its own registry and counts right from threads; the conductor's per-batch KV
event lag; the vLLM connector's load and save statistics on their way to vLLM's
/metrics."""

from __future__ import annotations

import random
import threading
import time

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from quillcache.v1 import conductor_pb2
from quillcache_conductor.events import EventRouter
from quillcache_conductor.state import ConductorState
from quillcache_core.index.memory import MemoryIndex
from quillcache_core.model import CostModel
from quillcache_core.process.metrics import MetricsRegistry
from quillcache_core.registry import NodeRecord
from quillcache_core.routing.planner import CostPlanner
from quillcache_vllm import metrics as connector_metrics

pytestmark = pytest.mark.unit


def test_counters_gauges_and_histograms_render_and_read_back():
    m = MetricsRegistry(prefix="t_")
    requests = m.counter("requests_total", "requests", ["route", "status"])
    level = m.gauge("level", "a level")
    latency = m.histogram("latency_seconds", "latency", [0.1, 1], ["engine"])
    requests.inc(route="/a", status="200")
    requests.inc(2, route="/a", status="200")
    level.set(7.5)
    for value in (0.05, 0.1, 0.5, 3):
        latency.observe(value, engine="e0")
    text = m.render()
    assert "# TYPE t_requests_total counter" in text
    assert 't_requests_total{route="/a",status="200"} 3.0' in text
    assert "# TYPE t_level gauge" in text and "t_level 7.5" in text
    assert 't_latency_seconds_bucket{engine="e0",le="0.1"} 2.0' in text  # le: <= bound
    assert 't_latency_seconds_bucket{engine="e0",le="+Inf"} 4.0' in text
    assert 't_latency_seconds_sum{engine="e0"} 3.65' in text
    assert "_created" not in text
    assert requests.get(route="/a", status="200") == 3
    assert requests.get(route="/b", status="200") == 0
    assert requests.samples() == [(("/a", "200"), 3.0)]
    assert (latency.count(engine="e0"), latency.total_count()) == (4, 4)
    assert latency.sum(engine="e0") == pytest.approx(3.65)
    with pytest.raises(ValueError):
        requests.inc(route="/a")  # a label missing


def test_a_gauge_read_at_scrape_time_that_counts_up_is_exposed_as_a_counter():
    m = MetricsRegistry()
    plans = [0]
    m.gauge("plans_total", "routing decisions made", read=lambda: [((), plans[0])])
    m.gauge("engines", "engines", ["kind"], read=lambda: [(("sim",), 2)])
    plans[0] = 5
    text = m.render()
    assert "# TYPE quillcache_plans_total counter" in text
    assert "quillcache_plans_total 5.0" in text
    assert (
        "# TYPE quillcache_engines gauge" in text and 'quillcache_engines{kind="sim"} 2.0' in text
    )
    plans[0] = 6  # read again at the next scrape
    assert "quillcache_plans_total 6.0" in m.render()


def test_registries_are_their_own_never_the_global_one():
    a, b = MetricsRegistry(), MetricsRegistry()
    a.counter("same_total", "in a").inc()
    b.counter("same_total", "in b")  # the same name in another registry: no clash
    assert "quillcache_same_total 1.0" in a.render()
    assert "quillcache_same_total 0.0" in b.render()
    assert b"quillcache_same_total" not in generate_latest(prometheus_client.REGISTRY)
    with pytest.raises(ValueError):
        a.histogram("same_total", "twice in a", [1])


def test_threads_count_every_observation():
    m = MetricsRegistry()
    seconds = m.histogram("get_seconds", "gets", [0.001, 0.01], ["tier"])
    gets = m.counter("gets_total", "gets", ["tier"])

    def work() -> None:
        for _ in range(5000):
            seconds.observe(0.002, tier="dram")
            gets.inc(tier="dram")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seconds.count(tier="dram") == 20000 and gets.get(tier="dram") == 20000


def test_one_kv_event_lag_is_observed_per_batch_by_its_source():
    state = ConductorState(
        MemoryIndex(), CostPlanner(CostModel()), clock=lambda: 1000.0, rng=random.Random(1)
    )
    state.store_joined(NodeRecord("store", "s0", "127.0.0.1:1", "r"))
    metrics = MetricsRegistry()
    events = EventRouter(state, metrics, subscribe_zmq=False)
    batch = conductor_pb2.KvEventBatch(
        engine_id="s0", source_kind="store", ts_ms=int((time.time() - 2.0) * 1000)
    )
    for _ in range(3):
        batch.events.add().cleared.CopyFrom(conductor_pb2.AllBlocksCleared())
    events.ingest_proto(batch)
    assert events.lag.count(source="store") == 1  # three events, one batch
    assert 2.0 <= events.lag.sum(source="store") < 5.0
    batch.ts_ms = 0  # no timestamp: nothing to time
    events.ingest_proto(batch)
    assert events.lag.count(source="store") == 1


def test_the_connector_s_timings_reach_vllm_s_histograms_once_each():
    timings = connector_metrics.Timings()
    assert timings.drain() is None  # nothing timed: no stats for vLLM this step
    timings.load(0.02)
    timings.load(0.3)
    timings.save(0.004)
    worker = timings.drain()
    assert worker.to_dict() == {"load_seconds": [0.02, 0.3], "save_seconds": [0.004]}
    assert timings.drain() is None  # drained
    # vLLM aggregates the workers' and the scheduler side's stats, then sends a dict.
    other = connector_metrics.ConnectorStats({"load_seconds": [1.5]})
    sent = worker.aggregate(other).to_dict()
    assert worker.reduce() == {"loads": 3, "load_mean_ms": 606.667, "saves": 1, "save_mean_ms": 4.0}

    registry = CollectorRegistry()

    def histogram(**kwargs):  # vLLM's metric class, here on a registry of the test's own
        return prometheus_client.Histogram(registry=registry, **kwargs)

    prom = connector_metrics.prom_metrics(
        {prometheus_client.Histogram: histogram}, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    prom.observe(sent, engine_idx=0)
    labels = {"model_name": "tiny", "engine": "0"}
    value = registry.get_sample_value
    assert value("quillcache_connector_load_seconds_count", labels) == 3
    assert value("quillcache_connector_load_seconds_bucket", {**labels, "le": "0.025"}) == 1
    assert value("quillcache_connector_save_seconds_count", labels) == 1
    assert value("quillcache_connector_load_seconds_sum", labels) == pytest.approx(1.82)


def test_aggregated_connector_stats_stay_bounded():
    many = connector_metrics.ConnectorStats({"load_seconds": [0.1] * connector_metrics.MAX_KEPT})
    many.aggregate(connector_metrics.ConnectorStats({"load_seconds": [0.2] * 10}))
    assert len(many.data["load_seconds"]) == connector_metrics.MAX_KEPT
    assert connector_metrics.ConnectorStats().is_empty()
