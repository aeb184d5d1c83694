"""bench-live's verdict on its goals: TTFT against sglang-router cache_aware, the
engines' load, and the control path's CPU a request against SMG's and sglang-router's
in the same run."""

from __future__ import annotations

import pytest

from quillcache_bench.live_report import (
    FIELDS,
    REFERENCE,
    goals,
    goals_text,
    summarise,
    table,
)
from quillcache_bench.live_systems import SMG, EngineCounters
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


def test_the_cpu_goal_is_judged_against_smg_and_sglang_router_in_the_same_run():
    ours = summarise(_samples(200), _served(200), control_cpu_s=0.6)  # 3 ms a request
    ref = dict(ours, ttft_mean_ms=ours["ttft_mean_ms"] * 2, control_cpu_ms_per_request=2.5)
    smg = dict(ours, control_cpu_ms_per_request=2.0)
    lean = dict(smg, control_cpu_ms_per_request=1.0)
    runs = [
        {"workload": "chat", "load": "light", "systems": {"quillcache": ours, REFERENCE: ref}},
        {
            "workload": "chat",
            "load": "heavy",
            "systems": {"quillcache": ours, REFERENCE: ref, "smg-cache_aware": smg},
        },
        {"workload": "docqa", "load": "heavy", "systems": {"quillcache": ours, SMG: lean}},
        {"workload": "mix", "load": "heavy", "systems": {"quillcache": ours}},
    ]
    found = goals(runs)
    # 1.2x sglang-router's; 1.2x and 1.5x (both within); 3x SMG's; no peer: not judged.
    assert [g["cpu_met"] for g in found] == [True, True, False, None]
    assert found[1]["cpu_ratio_vs"] == {SMG: 1.5, REFERENCE: 1.2}
    assert found[0]["ttft_met"] and found[0]["ttft_ratio_vs_sglang_cache_aware"] == 0.5
    text = goals_text(found)
    assert "control CPU 3.00 ms a request = 3.00x smg-cache_aware's (NOT met)" in text
    assert "(not judged: no peer's figure)" in text
