"""HeapSettler: live objects are frozen out of the collector's walks, fresh cycles are not."""

from __future__ import annotations

import gc
import weakref

import pytest

from quillcache_core.process.heap import HeapSettler

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


def test_a_doubled_frozen_heap_gets_one_full_collection_that_reclaims_frozen_cycles():
    heap = HeapSettler(interval_s=0.0, slack=1000)
    try:
        heap.settle()
        a, b = Node(), Node()
        a.other, b.other = b, a
        cycle = weakref.ref(a)
        heap.settle()  # the live cycle is frozen with everything else
        del a, b  # now garbage, but frozen: reference counting cannot free a cycle
        still_there = cycle() is not None  # (no assert on the object: pytest keeps it)
        assert still_there
        grow = [Node() for _ in range(2 * gc.get_freeze_count() + 2000)]
        heap.settle()
        assert heap.full_collections == 1
        assert cycle() is None, "the full collection reclaimed it"
        heap.settle()
        assert heap.full_collections == 1, "not again until the heap doubles again"
        del grow
    finally:
        gc.unfreeze()
