"""HeapSettler: live objects are frozen out of the collector's walks, fresh cycles are not."""

from __future__ import annotations

import gc
import weakref

import pytest

from quillcache_core.heap import HeapSettler

pytestmark = pytest.mark.unit


class Node:
    def __init__(self) -> None:
        self.other = None


def test_settle_freezes_live_objects_but_reclaims_fresh_garbage_cycles():
    now = [0.0]
    heap = HeapSettler(interval_s=1.0, clock=lambda: now[0])
    try:
        live = [Node() for _ in range(1000)]
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle that is garbage once the names go
        cycle = weakref.ref(a)
        del a, b
        frozen_before = gc.get_freeze_count()
        assert heap.maybe_settle() is False, "not before the interval"
        now[0] = 1.5
        assert heap.maybe_settle() is True
        assert gc.get_freeze_count() >= frozen_before + len(live)
        assert cycle() is None, "the young cycle was collected, not frozen"
        assert heap.maybe_settle() is False
    finally:
        gc.unfreeze()
