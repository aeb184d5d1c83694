"""RenewalTracker: a record is alive while its owner rewrites it, by the reader's clock."""

from __future__ import annotations

import math

import pytest

from quillcache_core.registry.renewals import STALE_AFTER_TTLS, RenewalTracker

pytestmark = pytest.mark.unit

KEY = "/quillcache/v1/nodes/store/store-0"
NO_TROUBLE = -math.inf
TTL_S = 2.0
STALE_S = STALE_AFTER_TTLS * TTL_S


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("rewrites", "elapsed_s", "alive"),
    [
        ((), STALE_S - 0.01, True),  # within the stale time of the first look
        ((), STALE_S, False),  # the same revision for the stale time: gone
        ((1.0, 2.0, 3.0), 3.0 + STALE_S - 0.01, True),  # each rewrite counts
        ((1.0,), 1.0 + STALE_S, False),  # rewrites stopped
    ],
)
def test_a_record_lives_while_its_revision_changes(rewrites, elapsed_s, alive) -> None:
    clock, ttl_s = Clock(), TTL_S
    tracker = RenewalTracker(clock)
    start, revision = clock.now, 10
    assert tracker.alive(KEY, revision, ttl_s, NO_TROUBLE)
    for at in rewrites:
        clock.now, revision = start + at, revision + 1
        tracker.observe(KEY, revision)
    clock.now = start + elapsed_s
    assert tracker.alive(KEY, revision, ttl_s, NO_TROUBLE) is alive


def test_a_record_without_a_ttl_promises_no_renewals() -> None:
    clock = Clock()
    tracker = RenewalTracker(clock)
    assert tracker.alive(KEY, 1, 0.0, NO_TROUBLE)
    clock.now += 1e9
    assert tracker.alive(KEY, 1, 0.0, NO_TROUBLE)
    assert tracker.due_at(KEY, 0.0, NO_TROUBLE) == math.inf


def test_time_the_reader_could_not_reach_etcd_does_not_count() -> None:
    clock, ttl_s = Clock(), 2.0
    tracker = RenewalTracker(clock)
    tracker.observe(KEY, 1)
    clock.now += 60.0  # an outage: no rewrite could have arrived
    trouble_at = clock.now - 0.1
    assert tracker.alive(KEY, 1, ttl_s, trouble_at)
    clock.now = trouble_at + STALE_AFTER_TTLS * ttl_s
    assert not tracker.alive(KEY, 1, ttl_s, trouble_at)


def test_the_tracker_holds_at_most_max_keys() -> None:
    clock = Clock()
    tracker = RenewalTracker(clock, max_keys=3)
    for i in range(10):
        tracker.observe(f"{KEY}{i}", 1)
    assert len(tracker) == 3
    assert tracker.due_at(f"{KEY}0", 1.0, NO_TROUBLE) == math.inf  # evicted
    assert tracker.due_at(f"{KEY}9", 1.0, NO_TROUBLE) < math.inf
