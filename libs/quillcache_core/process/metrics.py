"""A small Prometheus text-format registry: counters, gauges and histograms with labels.

Not thread-safe: each service updates its metrics from its event loop. Gauges may be
backed by a callable read at scrape time, so live values are never stale.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    inner = ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + inner + "}"


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labels: Iterable[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.label_names = tuple(labels)
        self.values: dict[tuple[str, ...], float] = {}

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

    def get(self, **labels: str) -> float:
        return self.values.get(self._key(labels), 0.0)

    def samples(self) -> Iterable[tuple[tuple[str, ...], float]]:
        return self.values.items()

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for key, value in sorted(self.samples()):
            lines.append(f"{self.name}{_labels(self.label_names, key)} {_number(value)}")
        return lines


def _number(value: float) -> str:
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class Counter(_Metric):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount


class Gauge(_Metric):
    kind = "gauge"

    def __init__(
        self,
        name: str,
        help_text: str,
        labels: Iterable[str] = (),
        read: Callable[[], Iterable[tuple[tuple[str, ...], float]]] | None = None,
    ) -> None:
        super().__init__(name, help_text, labels)
        self._read = read

    def set(self, value: float, **labels: str) -> None:
        self.values[self._key(labels)] = value

    def samples(self):
        if self._read is not None:
            return list(self._read())
        return self.values.items()


class Histogram(_Metric):
    """Observations counted into fixed buckets (upper bounds, ascending), with their sum.

    Rendered as Prometheus does: cumulative `_bucket{le=...}` lines ending in `+Inf`,
    then `_sum` and `_count`, per label set. Memory is buckets x label sets.
    """

    kind = "histogram"

    def __init__(
        self, name: str, help_text: str, buckets: Iterable[float], labels: Iterable[str] = ()
    ) -> None:
        super().__init__(name, help_text, labels)
        self.buckets = tuple(sorted(float(b) for b in buckets))
        if not self.buckets:
            raise ValueError(f"{name} needs at least one bucket")
        self.counts: dict[tuple[str, ...], list[int]] = {}
        self.sums: dict[tuple[str, ...], float] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        counts = self.counts.get(key)
        if counts is None:
            counts = self.counts[key] = [0] * (len(self.buckets) + 1)
            self.sums[key] = 0.0
        counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sums[key] += value

    def count(self, **labels: str) -> int:
        """Observations so far under these labels."""
        return sum(self.counts.get(self._key(labels), ()))

    def sum(self, **labels: str) -> float:
        return self.sums.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        names = self.label_names
        for key in sorted(self.counts):
            counts = self.counts[key]
            running = 0
            for bound, n in zip((*self.buckets, float("inf")), counts, strict=True):
                running += n
                le = "+Inf" if bound == float("inf") else _number(bound)
                labels = _labels((*names, "le"), (*key, le))
                lines.append(f"{self.name}_bucket{labels} {running}")
            labels = _labels(names, key)
            lines.append(f"{self.name}_sum{labels} {_number(self.sums[key])}")
            lines.append(f"{self.name}_count{labels} {running}")
        return lines


class MetricsRegistry:
    def __init__(self, prefix: str = "quillcache_") -> None:
        self.prefix = prefix
        self._metrics: list[_Metric] = []

    def counter(self, name: str, help_text: str, labels: Iterable[str] = ()) -> Counter:
        metric = Counter(self.prefix + name, help_text, labels)
        self._metrics.append(metric)
        return metric

    def gauge(self, name: str, help_text: str, labels: Iterable[str] = (), read=None) -> Gauge:
        metric = Gauge(self.prefix + name, help_text, labels, read)
        self._metrics.append(metric)
        return metric

    def histogram(
        self, name: str, help_text: str, buckets: Iterable[float], labels: Iterable[str] = ()
    ) -> Histogram:
        metric = Histogram(self.prefix + name, help_text, buckets, labels)
        self._metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics:
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"
