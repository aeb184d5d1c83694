"""A process's metrics: counters, gauges and histograms with labels, on prometheus_client.

Each `MetricsRegistry` owns its own `CollectorRegistry` (never prometheus_client's global
one: several services can share a process, as in tests) and renders it with
`generate_latest`. Counters, plain gauges and histograms are prometheus_client's own,
thread-safe (the store's data port observes from its threads). A gauge may instead be
backed by a callable read at scrape time (`read=`), so live values are never stale; it
is exposed through a custom collector, as a counter (TYPE counter) when its name ends in
`_total` (a running count kept elsewhere) or its `kind` is set to "counter".

Costs (timeit on a busy 2-core machine): `inc()` 0.5 µs, `observe()` 1 µs, 1-2 µs with
labels (each label set's child is cached here; prometheus_client takes a lock per
update), two to three times the hand-written registry this replaced; a scrape walks
every metric. Label sets must stay bounded (engines, tiers, statuses: never request
ids). A histogram with a negative bucket has no `_sum` series (prometheus_client's
rule: a sum that can fall defeats counter-reset detection).

Counters' and histograms' `_created` series are left out of the rendering: they double
the exposition and nothing of ours reads them. (prometheus_client's own switch,
`disable_created_metrics`, is process-wide: in the vLLM process the connector imports
this module into, it would change vLLM's /metrics.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds buckets shared by the services' histograms.
# Work inside one process or one hop: a plan, a block from DRAM (50 µs .. 2.5 s).
MICRO_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5,
)  # fmt: skip
# A first token, an engine's answer head, a transfer, an event's lag (0.5 ms .. 30 s).
LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# A whole request, decode included (5 ms .. 10 min).
DURATION_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
)  # fmt: skip

Samples = Iterable[tuple[tuple[str, ...], float]]


class _Labelled:
    """A prometheus_client metric and its children, one per label set (cached)."""

    kind = "untyped"

    def __init__(self, name: str, help_text: str, labels: Iterable[str], metric) -> None:
        self.name = name
        self.help = help_text
        self.label_names = tuple(labels)
        self._metric = metric
        self._children: dict[tuple[str, ...], object] = {}

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        names = self.label_names
        if not names and not labels:
            return ()
        try:
            if len(labels) == len(names):
                return tuple([str(labels[n]) for n in names])
        except KeyError:
            pass
        raise ValueError(f"{self.name} takes labels {names}, got {tuple(labels)}")

    def _child(self, labels: dict[str, str]):
        names = self.label_names
        if not names and not labels:
            return self._metric
        try:  # the hot path: labels as declared, their values taken as given
            key = tuple([labels[n] for n in names]) if len(labels) == len(names) else None
        except KeyError:
            key = None
        child = self._children.get(key) if key is not None else None
        if child is None:
            key = self._key(labels)  # raises on a wrong label set
            child = self._children[key] = self._metric.labels(*key)
        return child

    def collect(self) -> list[Metric]:
        """The metric's family with its samples (prometheus_client's collect)."""
        return self._metric.collect()

    def _values(self, suffix: str) -> dict[tuple[str, ...], float]:
        """The samples named name+suffix, by label values (read through collect())."""
        names = self.label_names
        found: dict[tuple[str, ...], float] = {}
        for family in self._metric.collect():
            for sample in family.samples:
                if sample.name == family.name + suffix:
                    found[tuple(sample.labels[n] for n in names)] = sample.value
        return found


class Counter(_Labelled):
    kind = "counter"

    def __init__(self, registry, name: str, help_text: str, labels: Iterable[str] = ()) -> None:
        labels = tuple(labels)
        metric = prometheus_client.Counter(name, help_text, labels, registry=registry)
        super().__init__(name, help_text, labels, metric)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).inc(amount)

    def get(self, **labels: str) -> float:
        return self._values("_total").get(self._key(labels), 0.0)

    def samples(self) -> Samples:
        return list(self._values("_total").items())


class Gauge(_Labelled):
    kind = "gauge"

    def __init__(self, registry, name: str, help_text: str, labels: Iterable[str] = ()) -> None:
        labels = tuple(labels)
        metric = prometheus_client.Gauge(name, help_text, labels, registry=registry)
        super().__init__(name, help_text, labels, metric)

    def set(self, value: float, **labels: str) -> None:
        self._child(labels).set(value)

    def get(self, **labels: str) -> float:
        return self._values("").get(self._key(labels), 0.0)

    def samples(self) -> Samples:
        return list(self._values("").items())


class ReadGauge:
    """A value read from a callable at scrape time: `read()` yields (label values, value).

    Exposed as a counter when its name ends in `_total` or `kind` is "counter" (the
    callable then reads a count that only grows), else as a gauge.
    """

    def __init__(
        self, name: str, help_text: str, labels: Iterable[str], read: Callable[[], Samples]
    ) -> None:
        self.name = name
        self.help = help_text
        self.label_names = tuple(labels)
        self._read = read
        self.kind = "counter" if name.endswith("_total") else "gauge"

    def _family(self) -> Metric:
        if self.kind == "counter":
            return CounterMetricFamily(self.name, self.help, labels=self.label_names)
        return GaugeMetricFamily(self.name, self.help, labels=self.label_names)

    def describe(self) -> list[Metric]:
        return [self._family()]  # no samples: registering reads no callable

    def collect(self) -> list[Metric]:
        family = self._family()
        for key, value in self._read():
            family.add_metric([str(v) for v in key], float(value))
        return [family]

    def samples(self) -> Samples:
        return list(self._read())

    def get(self, **labels: str) -> float:
        key = tuple(str(labels[n]) for n in self.label_names)
        return float(dict((tuple(map(str, k)), v) for k, v in self._read()).get(key, 0.0))


class Histogram(_Labelled):
    """Observations counted into fixed buckets (upper bounds, ascending), with their sum.

    Rendered as Prometheus does: cumulative `_bucket{le=...}` lines ending in `+Inf`,
    then `_sum` and `_count`, per label set. Memory is buckets x label sets.
    """

    kind = "histogram"

    def __init__(
        self,
        registry,
        name: str,
        help_text: str,
        buckets: Iterable[float],
        labels: Iterable[str] = (),
    ) -> None:
        labels = tuple(labels)
        bounds = tuple(sorted(float(b) for b in buckets))
        if not bounds:
            raise ValueError(f"{name} needs at least one bucket")
        self.buckets = bounds
        metric = prometheus_client.Histogram(
            name, help_text, labels, buckets=bounds, registry=registry
        )
        super().__init__(name, help_text, labels, metric)

    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(value)

    def count(self, **labels: str) -> int:
        """Observations so far under these labels."""
        return int(self._values("_count").get(self._key(labels), 0.0))

    def sum(self, **labels: str) -> float:
        return self._values("_sum").get(self._key(labels), 0.0)

    def total_count(self) -> int:
        """Observations so far under every label set."""
        return int(sum(self._values("_count").values()))


class _WithoutCreated:
    """A registry's families, their `_created` samples dropped (see the module doc)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():  # fresh Metric objects on each collect
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class MetricsRegistry:
    """One process's (or one component's) metrics, each name prefixed with `prefix`.

    A name registered twice raises ValueError (prometheus_client's duplicate check).
    """

    def __init__(self, prefix: str = "quillcache_", *, process: bool = False) -> None:
        """`process`: also expose the process's own CPU, memory and open files
        (prometheus_client's `process_*` series), once per process's /metrics."""
        self.prefix = prefix
        self.registry = CollectorRegistry()
        if process:
            ProcessCollector(registry=self.registry)
        self._exposed = CollectorRegistry()
        self._exposed.register(_WithoutCreated(self.registry))
        self._metrics: list[_Labelled | ReadGauge] = []

    def counter(self, name: str, help_text: str, labels: Iterable[str] = ()) -> Counter:
        metric = Counter(self.registry, self.prefix + name, help_text, labels)
        self._metrics.append(metric)
        return metric

    def gauge(
        self,
        name: str,
        help_text: str,
        labels: Iterable[str] = (),
        read: Callable[[], Samples] | None = None,
    ) -> Gauge | ReadGauge:
        if read is None:
            metric: Gauge | ReadGauge = Gauge(self.registry, self.prefix + name, help_text, labels)
        else:
            metric = ReadGauge(self.prefix + name, help_text, labels, read)
            self.registry.register(metric)
        self._metrics.append(metric)
        return metric

    def histogram(
        self, name: str, help_text: str, buckets: Iterable[float], labels: Iterable[str] = ()
    ) -> Histogram:
        metric = Histogram(self.registry, self.prefix + name, help_text, buckets, labels)
        self._metrics.append(metric)
        return metric

    def metrics(self) -> list[_Labelled | ReadGauge]:
        """Every metric registered, in order (for references and tests)."""
        return list(self._metrics)

    def render(self) -> str:
        """The registry in Prometheus' text format (version 0.0.4)."""
        return generate_latest(self._exposed).decode()
