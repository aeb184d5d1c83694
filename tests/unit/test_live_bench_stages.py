"""bench-live's reading of a run: where the gateway's time went (its /metrics sums), and each
kind of plan's TTFT against its estimate."""

from __future__ import annotations

import pytest

from quillcache_bench.live_counters import STAGES, stage_means

pytestmark = pytest.mark.unit


def snapshot(scale: float, count: float) -> dict[str, float]:
    sums = {total: scale * (i + 1) for i, (total, _) in enumerate(STAGES.values())}
    counts = {n: count for _, n in STAGES.values()}
    return {**sums, **counts}


def test_each_stage_s_mean_is_the_run_s_share_of_its_sum():
    before, after = snapshot(1.0, 10), snapshot(1.5, 20)  # 10 more requests in the run
    means = stage_means(before, after)
    assert list(means) == list(STAGES)
    # sums rose by 0.5, 1.0, 1.5, 2.0 s over 10 requests
    assert list(means.values()) == [50.0, 100.0, 150.0, 200.0]


def test_a_run_with_no_request_or_unreadable_metrics_has_no_means():
    assert stage_means(snapshot(1.0, 10), snapshot(1.0, 10)) == {}
    assert stage_means({}, snapshot(1.0, 10)) == {}


def test_ttft_by_plan_kind_compares_each_kind_of_plan_with_its_estimate():
    from quillcache_bench.live_report import by_plan_kind
    from quillcache_bench.live_workloads import Sample

    def sample(ttft_ms, hit, fetch, compute, est_ms, ok=True):
        plan = {
            "hit-blocks": str(hit),
            "fetch-blocks": str(fetch),
            "recompute-blocks": str(compute),
            "est-ttft-ms": str(est_ms),
        }
        return Sample("t", ttft_s=ttft_ms / 1000, ok=ok, plan=plan)

    samples = [
        sample(90, 30, 0, 2, 20),
        sample(70, 30, 0, 2, 30),
        sample(150, 2, 28, 2, 25),
        sample(300, 2, 0, 30, 200),
        sample(999, 2, 0, 30, 200, ok=False),  # failed: not counted
        Sample("t", ttft_s=0.05, ok=True, plan={"disagg": "fallback"}),  # no plan: skipped
    ]
    kinds = by_plan_kind(samples)
    assert set(kinds) == {"hit", "fetch", "compute"}
    assert kinds["hit"]["requests"] == 2
    assert kinds["hit"]["ttft_mean_ms"] == 80.0 and kinds["hit"]["est_ttft_mean_ms"] == 25.0
    assert kinds["fetch"]["fetch_mean"] == 28.0
    assert kinds["compute"] == {
        "requests": 1,
        "ttft_mean_ms": 300.0,
        "est_ttft_mean_ms": 200.0,
        "hit_mean": 2.0,
        "fetch_mean": 0.0,
        "recompute_mean": 30.0,
    }
    assert by_plan_kind([Sample("t", ttft_s=0.01, ok=True)]) == {}
