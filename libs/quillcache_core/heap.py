"""Keeping CPython's cycle collector off a heap of millions of long-lived objects.

The conductor's index holds two NamedTuples per resident block, and CPython never
untracks tuple subclasses: a full collection walks every one of them (4-5 ms at 1M
records, inside whatever Plan is running), and young collections keep re-scanning
the ones created since. `HeapSettler.maybe_settle()` collects the young
generations (so fresh garbage cycles are reclaimed, not frozen) and then freezes
everything still alive, at most once per `interval_s`. Frozen objects are still
freed by reference counting; only a cycle that becomes garbage after it was frozen
is never reclaimed, which the index, whose records hold no cycles, does not create.
"""

from __future__ import annotations

import gc
import time


class HeapSettler:
    def __init__(self, interval_s: float = 1.0, clock=time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last = clock()
        self.settles = 0

    def settle(self) -> None:
        gc.collect(1)
        gc.freeze()
        self._last = self._clock()
        self.settles += 1

    def maybe_settle(self) -> bool:
        if self._clock() - self._last < self.interval_s:
            return False
        self.settle()
        return True
