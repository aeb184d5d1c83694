"""bench-live's reading of where the gateway's time went in a run (its /metrics sums)."""

from __future__ import annotations

from quillcache_bench.live_bench import STAGES, _stage_means


def snapshot(scale: float, count: float) -> dict[str, float]:
    sums = {total: scale * (i + 1) for i, (total, _) in enumerate(STAGES.values())}
    counts = {n: count for _, n in STAGES.values()}
    return {**sums, **counts}


def test_each_stage_s_mean_is_the_run_s_share_of_its_sum():
    before, after = snapshot(1.0, 10), snapshot(1.5, 20)  # 10 more requests in the run
    means = _stage_means(before, after)
    assert list(means) == list(STAGES)
    # sums rose by 0.5, 1.0, 1.5, 2.0 s over 10 requests
    assert list(means.values()) == [50.0, 100.0, 150.0, 200.0]


def test_a_run_with_no_request_or_unreadable_metrics_has_no_means():
    assert _stage_means(snapshot(1.0, 10), snapshot(1.0, 10)) == {}
    assert _stage_means({}, snapshot(1.0, 10)) == {}
