"""How long a node's Gets and Puts take, by the tier that answered: two histograms.

One Get or Put is one block, over gRPC or the block-data port alike. A Get is labelled
with the tier it was read from (`dram`, `ssd`), `peer` when this node fetched it from
another node first, or `miss` when no copy was found; a Put with the tier it landed in.
Thread-safe: the data port's connection threads observe here too.
"""

from __future__ import annotations

import time

from quillcache_core.model import CacheTier
from quillcache_core.process.metrics import MICRO_BUCKETS_S, MetricsRegistry

TIER_LABELS = {CacheTier.CPU_DRAM: "dram", CacheTier.LOCAL_SSD: "ssd"}


class StoreTimings:
    def __init__(self, metrics: MetricsRegistry) -> None:
        self.get_seconds = metrics.histogram(
            "store_get_seconds",
            "one block's Get (gRPC or data port), from the request to its last byte sent, "
            "by the tier that answered (dram, ssd, peer: fetched from another node, miss)",
            MICRO_BUCKETS_S,
            ["tier"],
        )
        self.put_seconds = metrics.histogram(
            "store_put_seconds",
            "one block's Put (gRPC or data port), from its first byte to stored, by the "
            "tier it landed in (dram, ssd)",
            MICRO_BUCKETS_S,
            ["tier"],
        )

    def got(self, started: float, tier: CacheTier | None, *, remote: bool = False) -> None:
        """A Get begun at `started` (time.perf_counter()) answered from `tier` (None: a
        miss); `remote`: the block came from a peer node first."""
        label = "miss" if tier is None else ("peer" if remote else TIER_LABELS.get(tier, "other"))
        self.get_seconds.observe(time.perf_counter() - started, tier=label)

    def put(self, started: float, tier: CacheTier) -> None:
        """A Put begun at `started` that landed in `tier`."""
        self.put_seconds.observe(time.perf_counter() - started, tier=TIER_LABELS.get(tier, "other"))
