"""bench-live's verdict on its goals: TTFT against sglang-router cache_aware, the
engines' load, and the control path's CPU a request, judged only on a run offered the
goal's rate."""

from __future__ import annotations

import pytest

from quillcache_bench.live_report import (
    CPU_GOAL_RPS,
    FIELDS,
    REFERENCE,
    goals,
    goals_text,
    summarise,
    table,
)
from quillcache_bench.live_systems import EngineCounters
from quillcache_bench.live_workloads import Sample

pytestmark = pytest.mark.unit


def _samples(n: int) -> list[Sample]:
    return [
        Sample("t", sent_s=i * 0.01, ttft_s=0.02, done_s=i * 0.01 + 0.05, ok=True) for i in range(n)
    ]


def _served(requests: int) -> list[EngineCounters]:
    return [EngineCounters(requests=requests, prompt_tokens=100, cached_tokens=50)]


def test_cpu_a_request_is_the_runs_control_cpu_over_its_requests():
    figures = summarise(_samples(200), _served(200), control_cpu_s=0.5)
    assert set(figures) == set(FIELDS)
    assert figures["control_cpu_ms_per_request"] == 2.5
    assert "2.50" in table(
        [{"workload": "chat", "load": "heavy", "systems": {"quillcache": figures}}]
    )


def test_the_cpu_goal_is_judged_only_at_its_rate():
    ours = summarise(_samples(200), _served(200), control_cpu_s=0.1)  # 0.5 ms a request
    ref = dict(ours, ttft_mean_ms=ours["ttft_mean_ms"] * 2)
    dear = dict(ours, control_cpu_ms_per_request=3.0)
    runs = [
        {
            "workload": "chat",
            "load": "light",
            "rate_rps": 8.0,
            "systems": {"quillcache": ours, REFERENCE: ref},
        },
        {
            "workload": "chat",
            "load": "heavy",
            "rate_rps": CPU_GOAL_RPS,
            "systems": {"quillcache": ours},
        },
        {"workload": "docqa", "load": "heavy", "rate_rps": 120.0, "systems": {"quillcache": dear}},
    ]
    found = goals(runs)
    assert [g["cpu_met"] for g in found] == [None, True, False]
    assert found[0]["ttft_met"] and found[0]["ttft_ratio_vs_sglang_cache_aware"] == 0.5
    text = goals_text(found)
    assert "control CPU 0.50 ms a request (not judged" in text
    assert "control CPU 3.00 ms a request (NOT met)" in text
