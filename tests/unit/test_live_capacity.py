"""The capacity race's figures and goals (`quillcache_bench.live_capacity`): goodput
against the SLO, the engine's and the pool's shares of the prompt, medians over runs,
and each goal judged against the best router only."""

from __future__ import annotations

import pytest

from quillcache_bench.live_capacity import Phase, best_router, figures, goals, medians
from quillcache_bench.live_systems import EngineCounters
from quillcache_bench.live_workloads import Sample

pytestmark = pytest.mark.unit


def sample(sent: float, ttft: float | None, done: float) -> Sample:
    s = Sample("tenant-0", sent_s=sent, ttft_s=ttft, done_s=done, ok=ttft is not None)
    s.itl_s = [0.01, 0.03] if ttft is not None else []
    return s


def test_goodput_counts_only_requests_within_the_slo_and_shares_come_from_the_engines():
    samples = [sample(0.0, 0.1, 1.0), sample(1.0, 0.3, 2.0), sample(2.0, 2.0, 4.0)]
    samples.append(sample(3.0, None, 3.5))  # an error: neither good nor throughput
    served = [
        EngineCounters(requests=2, prompt_tokens=1000, cached_tokens=250, external_tokens=500),
        EngineCounters(requests=1, prompt_tokens=1000, cached_tokens=0, external_tokens=0),
    ]
    f = figures(Phase(samples, served, cpu_s=0.4), slo_ms=400.0)
    assert f["requests"] == 4 and f["errors"] == 1
    assert f["goodput_rps"] == pytest.approx(2 / 4.0)  # two of three within 400 ms
    assert f["throughput_rps"] == pytest.approx(3 / 4.0)
    assert f["engine_hit_share"] == pytest.approx(0.125)
    assert f["pool_hit_share"] == pytest.approx(0.25)
    assert f["itl_mean_ms"] == pytest.approx(20.0)
    assert f["control_cpu_ms_per_request"] == pytest.approx(100.0)


def cell(workload, ratio, run, systems):
    return {"workload": workload, "ratio": ratio, "run": run, "systems": systems, "cold": {}}


def f(mean, p99=None, goodput=1.0):
    return {"ttft_mean_ms": mean, "ttft_p99_ms": p99 or 2 * mean, "goodput_rps": goodput}


def test_medians_take_each_figure_over_the_runs_of_a_cell():
    runs = [
        cell("capacity-docqa", 2.0, r, {"quillcache": f(m), "smg-cache_aware": f(10 * m)})
        for r, m in enumerate((100.0, 300.0, 200.0))
    ]
    (row,) = medians(runs)
    assert row["systems"]["quillcache"]["ttft_mean_ms"] == 200.0
    assert row["systems"]["smg-cache_aware"]["ttft_mean_ms"] == 2000.0
    assert row["systems"]["quillcache"]["runs"] == 3


def test_the_best_router_is_never_ours_nor_per_engine_offload():
    systems = {"quillcache": f(1.0), "vllm-native-offload": f(2.0), "round-robin": f(900.0),
               "smg-cache_aware": f(500.0)}  # fmt: skip
    assert best_router(systems) == "smg-cache_aware"
    assert best_router(systems, "goodput_rps", high=True) in ("round-robin", "smg-cache_aware")
    assert best_router({"quillcache": f(1.0)}) is None


def test_goals_at_high_and_low_ratios_and_the_cold_phase():
    measured = [
        {"workload": "capacity-docqa", "ratio": 2.0, "systems": {
            "quillcache": f(150.0, 600.0, goodput=0.4),
            "smg-cache_aware": f(1000.0, 2000.0, goodput=0.1),
            "round-robin": f(3000.0, 9000.0, goodput=0.05)}},
        {"workload": "capacity-docqa", "ratio": 0.5, "systems": {
            "quillcache": f(120.0), "smg-cache_aware": f(100.0)}},
    ]  # fmt: skip
    cold = [
        {"workload": "capacity-docqa", "ratio": 2.0, "systems": {
            "quillcache": f(1050.0), "smg-cache_aware": f(1000.0)}},
        {"workload": "capacity-docqa", "ratio": 0.5, "systems": {}},
    ]  # fmt: skip
    found = {(g["cell"], g["goal"].split(" /")[0]): g for g in goals(measured, cold)}
    high = "capacity-docqa W/C=2"
    assert found[(high, "mean TTFT")]["value"] == pytest.approx(0.15)
    assert found[(high, "mean TTFT")]["met"]
    assert found[(high, "p99 TTFT")]["value"] == pytest.approx(0.3)  # against SMG's p99
    assert (
        found[(high, "goodput")]["value"] == pytest.approx(4.0) and found[(high, "goodput")]["met"]
    )
    assert found[(high, "cold mean TTFT")]["value"] == pytest.approx(1.05)
    assert found[(high, "cold mean TTFT")]["met"]
    low = found[("capacity-docqa W/C=0.5", "mean TTFT")]
    assert low["value"] == pytest.approx(1.2) and not low["met"]
