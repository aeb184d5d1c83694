"""docs/metrics.md is every process's metrics as they register them, and each process's
/metrics text passes `promtool check metrics`.

Each service is built as it runs (a store node started, with TLS and its data port, so
its conditional metrics register too); the reference is generated from their
registries, and the test fails when the file differs. After adding or changing a
metric, regenerate it: `QUILLCACHE_WRITE_METRICS_DOC=1 pytest
tests/unit/test_metrics_reference.py`.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
from dataclasses import fields
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from quillcache_conductor.config import ConductorConfig
from quillcache_conductor.server import ConductorServer
from quillcache_core.process.metrics import Counter, Gauge, Histogram, MetricsRegistry, ReadGauge
from quillcache_core.rpc.server import grpc_server
from quillcache_gateway.config import GatewayConfig
from quillcache_gateway.server import Gateway
from quillcache_simengine.config import SimEngineConfig
from quillcache_simengine.server import SimEngineServer
from quillcache_store.config import StoreConfig
from quillcache_store.server import StoreServer
from quillcache_transfer.config import TransferConfig
from quillcache_transfer.server import TransferServer
from quillcache_vllm import metrics as connector_metrics
from quillcache_vllm.pool import PoolCounters
from tests.support.tls import certs_dir

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
PROMTOOL = "/usr/bin/promtool"

# Where each process serves its metrics, in the reference's order.
PROCESSES = {
    "gateway": "the gateway's HTTPS port, `/metrics` (a certificate of the cluster's CA)",
    "conductor": "the conductor's metrics port (`--metrics-port`), `/metrics`",
    "store": "the store node's metrics port (`--metrics-port`), `/metrics`",
    "transfer": "the transfer service's metrics port (`--metrics-port`), `/metrics`",
    "sim engine": "the sim engine's HTTP port, `/metrics` (beside its vLLM-named gauges)",
    "vLLM connector": "the connector's `metrics_port` (worker side) and "
    "`scheduler_metrics_port` (scheduler side), `/metrics`",
    "vLLM": "vLLM's own `/metrics` (the API server), beside vLLM's metrics",
}


async def _build() -> dict[str, list[MetricsRegistry]]:
    tls_dir = str(certs_dir())
    gateway = Gateway(GatewayConfig(conductor="127.0.0.1:1", tls_dir=tls_dir))
    conductor = ConductorServer(ConductorConfig(tls_dir=tls_dir, registry="memory"))
    grpc_server(conductor.tls, conductor.metrics)  # its role checks' counter (start() does it)
    transfer = TransferServer(TransferConfig(tls_dir=tls_dir, registry="memory"))
    grpc_server(transfer.tls, transfer.metrics)
    sim = SimEngineServer(SimEngineConfig(tls_dir=tls_dir))
    try:
        with tempfile.TemporaryDirectory(prefix="qc-metrics-") as data_dir:
            store = StoreServer(
                StoreConfig(
                    tls_dir=tls_dir,
                    registry="memory",
                    data_dir=data_dir,
                    dram_capacity_bytes=1 << 20,
                    ssd_capacity_bytes=16 << 20,
                )
            )
            await store.start()
            try:
                built = {
                    "gateway": [gateway.metrics],
                    "conductor": [conductor.metrics],
                    "store": [store.metrics],
                    "transfer": [transfer.metrics],
                    "sim engine": [sim.metrics, sim.vllm_metrics],
                }
                texts = {name: "".join(r.render() for r in regs) for name, regs in built.items()}
                texts["vLLM connector"] = connector_metrics.render(PoolCounters())
            finally:
                await store.stop()
    finally:
        conductor.index.close()
    return built, texts


@pytest.fixture(scope="module")
def services():
    """(process -> its MetricsRegistry list, process -> its /metrics text)."""
    return asyncio.run(_build())


# --- the reference -------------------------------------------------------------------


def _rows(built) -> dict[str, list[tuple[str, str, str, str]]]:
    """Per process, (name, type, labels, meaning) of each metric, in registration order."""
    rows: dict[str, list[tuple[str, str, str, str]]] = {}
    for process, registries in built.items():
        rows[process] = [
            (m.name, m.kind, ", ".join(m.label_names), m.help)
            for registry in registries
            for m in registry.metrics()
        ]
    rows["vLLM connector"] = [
        (connector_metrics.PREFIX + f.name + "_total", "counter", "", help_text)
        for f in fields(PoolCounters)
        for help_text in [connector_metrics.COUNTER_HELP[f.name]]
    ]
    rows["vLLM"] = [
        (name, "histogram", "model_name, engine", help_text)
        for name, help_text, _ in connector_metrics.HISTOGRAMS
    ]
    return rows


def _buckets(built) -> list[tuple[str, tuple[float, ...]]]:
    seen: dict[str, tuple[float, ...]] = {}
    for registries in built.values():
        for registry in registries:
            for m in registry.metrics():
                if isinstance(m, Histogram):
                    seen.setdefault(m.name, m.buckets)
    for name, _, _ in connector_metrics.HISTOGRAMS:
        seen[name] = connector_metrics.LOAD_BUCKETS_S
    return sorted(seen.items())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reference(built) -> str:
    lines = [
        "# Metrics reference",
        "",
        "Every metric each QuillCache process exposes, in Prometheus' text format. This",
        "page is generated from the processes' own registries by",
        "`tests/unit/test_metrics_reference.py`, which fails when it differs from what they",
        "register (regenerate it with `QUILLCACHE_WRITE_METRICS_DOC=1 pytest",
        "tests/unit/test_metrics_reference.py`).",
        "",
        "Conventions: names start with `quillcache_` (the sim engine's own with",
        "`quillcache_sim_`; its `vllm:` gauges copy vLLM's names for tools that read",
        "engines' load). Durations are in seconds (`_seconds`), sizes in bytes (`_bytes`),",
        "and every counter ends in `_total`. Histograms expose `_bucket{le}`, `_sum` and",
        "`_count`; their buckets are listed at the end. With TLS every metrics port demands",
        "a certificate of the cluster's CA. Metrics of optional parts (`rpc_denied_total`:",
        "TLS role checks; `store_data_*`: the block-data port) appear only when those",
        "parts are on.",
        "",
        "Every process (gateway, conductor, store, transfer, sim engine) also exposes",
        "prometheus_client's process series: `process_cpu_seconds_total`,",
        "`process_resident_memory_bytes`, `process_virtual_memory_bytes`,",
        "`process_open_fds`, `process_max_fds`, `process_start_time_seconds`.",
        "",
    ]
    for process, rows in _rows(built).items():
        lines += [f"## {process}", "", f"Served on {PROCESSES[process]}.", ""]
        lines += ["| name | type | labels | meaning |", "|---|---|---|---|"]
        for name, kind, labels, meaning in rows:
            lines.append(f"| `{name}` | {kind} | {_cell(labels)} | {_cell(meaning)} |")
        lines.append("")
    lines += ["## Histogram buckets", "", "Upper bounds, in the metric's unit.", ""]
    lines += ["| histogram | buckets |", "|---|---|"]
    for name, bounds in _buckets(built):
        lines.append(f"| `{name}` | {', '.join(f'{b:g}' for b in bounds)} |")
    return "\n".join(lines) + "\n"


def test_the_metrics_reference_lists_every_metric_of_every_process(services):
    built, _ = services
    want = reference(built)
    if os.environ.get("QUILLCACHE_WRITE_METRICS_DOC"):
        DOC.write_text(want)
    assert DOC.read_text() == want, (
        "docs/metrics.md is not what the processes register: regenerate it with "
        "QUILLCACHE_WRITE_METRICS_DOC=1 pytest tests/unit/test_metrics_reference.py"
    )


OWN_PROCESSES = frozenset({"gateway", "conductor", "store", "transfer", "sim engine"})
PROCESS_SERIES = (
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_open_fds",
    "process_max_fds",
    "process_start_time_seconds",
)


def test_every_name_the_exposition_carries_is_in_the_reference(services):
    """Each family of each process's /metrics text, by name, in the reference's rows."""
    built, texts = services
    documented = {row[0] for rows in _rows(built).values() for row in rows}
    for process, text in texts.items():
        exposed = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
        found = {n for n in exposed if n.startswith("process_")}
        assert found == (set(PROCESS_SERIES) if process in OWN_PROCESSES else set()), process
        exposed -= set(PROCESS_SERIES)
        assert exposed <= documented, f"{process}: {sorted(exposed - documented)}"
        assert exposed, process


# --- conventions and promtool -----------------------------------------------------------


def test_counters_end_in_total_and_nothing_else_does(services):
    built, _ = services
    for rows in _rows(built).values():
        for name, kind, _, _ in rows:
            assert name.endswith("_total") == (kind == "counter"), (name, kind)
            if kind == "histogram":
                assert not name.endswith(("_ms", "_us")), name


def _promtool(text: str) -> list[str]:
    done = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30
    )
    problems = (done.stdout + done.stderr).decode().splitlines()
    assert done.returncode in (0, 3), problems  # 3: lint problems (listed); else unparsable
    return [p for p in problems if p.strip()]


def _acceptable(process: str, problem: str) -> bool:
    # The sim engine copies vLLM's own gauge names, colon and all (promtool prefers none).
    return process == "sim engine" and problem.startswith("vllm:") and "':'" in problem


def _one_sample_each(registries: list[MetricsRegistry]) -> str:
    """Every metric with one sample (labels set to "x"), so promtool lints each name,
    type and help, whether or not it has been counted yet."""
    families: list[Metric] = []
    for source in registries:
        for m in source.metrics():
            labels = {n: "x" for n in m.label_names}
            if isinstance(m, ReadGauge):
                family = m.describe()[0]
                family.add_metric(["x"] * len(m.label_names), 1.0)
                families.append(family)
                continue
            if isinstance(m, Histogram):
                m.observe(m.buckets[0], **labels)
            elif isinstance(m, Counter):
                m.inc(**labels)
            elif isinstance(m, Gauge):
                m.set(1, **labels)
            families.extend(m.collect())
    registry = CollectorRegistry()
    registry.register(_Fixed(families))
    return generate_latest(registry).decode()


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families


def test_every_process_s_metrics_pass_promtool(services):
    built, texts = services
    for process, text in texts.items():
        problems = [p for p in _promtool(text) if not _acceptable(process, p)]
        assert problems == [], f"{process}: {problems}"
    for process, registries in built.items():
        text = _one_sample_each(registries)
        problems = [p for p in _promtool(text) if not _acceptable(process, p)]
        assert problems == [], f"{process} (one sample each): {problems}"


def test_the_conductor_s_counts_read_at_scrape_time_are_counters(services):
    _, texts = services
    assert "# TYPE quillcache_plans_total counter" in texts["conductor"]
    assert "# TYPE quillcache_store_hits_total counter" in texts["store"]
    assert "# TYPE quillcache_transfer_bytes_total counter" in texts["transfer"]
