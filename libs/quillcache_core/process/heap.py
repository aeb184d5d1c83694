"""Keeping CPython's cycle collector off a heap of millions of long-lived objects.

The conductor's index holds two NamedTuples per resident block, and CPython never
untracks tuple subclasses: a full collection walks every one of them (4-5 ms at 1M
records, inside whatever Plan is running), and young collections keep re-scanning
the ones created since. `HeapSettler.maybe_settle()` collects the young
generations (so fresh garbage cycles are reclaimed, not frozen) and then freezes
everything still alive, at most once per `interval_s`. Frozen objects are still
freed by reference counting; only a cycle that becomes garbage after it was frozen
is not reclaimed by that. So when the frozen heap has doubled since the last full
collection (plus `slack` objects), the settler unfreezes and runs one: a pause of
about 0.4 s per million index records here, paid each time the heap doubles, like
a growing array's copies, instead of whenever CPython's own heuristic fires.
"""

from __future__ import annotations

import gc
import time


class HeapSettler:
    def __init__(self, interval_s: float = 1.0, clock=time.monotonic, slack: int = 500_000) -> None:
        self.interval_s = interval_s
        self.slack = slack
        self._clock = clock
        self._last = clock()
        self._baseline: int | None = None  # frozen objects after the last full collection
        self._frozen = 0  # frozen objects now (counted as they are frozen)
        self.settles = 0
        self.full_collections = 0

    def settle(self) -> None:
        gc.collect(1)
        if self._baseline is None:
            gc.freeze()
            self._frozen = self._baseline = gc.get_freeze_count()
        else:
            # The young collection left its survivors in the oldest generation, where
            # nothing else is (the rest is frozen): counting them is O(growth), while
            # gc.get_freeze_count() walks the whole frozen heap (41 ms at 1M records).
            self._frozen += len(gc.get_objects(generation=2))
            gc.freeze()
        limit = 2 * self._baseline + self.slack
        if self._frozen > limit:
            # The estimate only grows (frozen objects freed since are not subtracted):
            # count exactly before paying for a full collection.
            self._frozen = gc.get_freeze_count()
        if self._frozen > limit:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            self._frozen = self._baseline = gc.get_freeze_count()
            self.full_collections += 1
        self._last = self._clock()
        self.settles += 1

    def maybe_settle(self) -> bool:
        if self._clock() - self._last < self.interval_s:
            return False
        self.settle()
        return True
