"""`quillcache bench-live`'s plumbing where it can break for real: a secure sim engine's
plain listener (open to a router, while the TLS port still wants the credential), the
real sglang-router started in front of it, a tiny workload through it, the engine's
counters and the router's CPU read back, and the results' JSON shape."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from quillcache_bench.live_bench import _slowest
from quillcache_bench.live_report import FIELDS, goals, summarise, table
from quillcache_bench.live_systems import Engine, start_router, tree_cpu_s
from quillcache_bench.live_workloads import Target, drive, make_sessions
from tests.support.services import ServiceProcess
from tests.support.tls import client_context

pytestmark = pytest.mark.integration


class PlainSimEngine(ServiceProcess):
    def __init__(self, log_dir: Path) -> None:
        super().__init__(
            "sim-engine",
            ["--registry", "", "--plain-http-port", "0", "--time-scale", "0.02"],
            log_dir,
        )

    def _serving(self) -> bool:
        with urllib.request.urlopen(self.fields["plain_http"] + "/health", timeout=1.0) as r:
            return r.status == 200


def test_a_tiny_run_through_the_real_sglang_router(tmp_path: Path) -> None:
    engine = PlainSimEngine(tmp_path).start(timeout_s=20.0)
    try:
        plain = engine.fields["plain_http"]
        # The TLS port still refuses a caller without the engine credential.
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(
                engine.fields["http"] + "/v1/models", timeout=5.0, context=client_context()
            )
        assert refused.value.code == 401
        sim = Engine("engine-0", plain)
        assert sim.reset_cache()
        router = start_router("sglang-router-round_robin", [plain], tmp_path)
        try:
            before = sim.counters()
            cpu0 = tree_cpu_s([router.proc.pid])
            sessions = make_sessions("docqa", 3, 20.0, seed=1, nonce="test")
            samples = asyncio.run(asyncio.wait_for(drive(Target(router.url, None), sessions), 30.0))
            cpu1 = tree_cpu_s([router.proc.pid])
            served = [sim.counters().minus(before)]
        finally:
            router.stop()
    finally:
        engine.stop()
    assert [s.error for s in samples] == ["", "", ""]
    assert served[0].requests == 3
    assert served[0].prompt_tokens > 3 * 3000  # three questions on documents of 1,500+ words
    figures = summarise(samples, served, cpu1 - cpu0)
    assert set(figures) == set(FIELDS)
    assert figures["errors"] == 0 and figures["load_max_over_mean"] == 1.0
    assert 0 < figures["ttft_p50_ms"] <= figures["ttft_p99_ms"]
    assert figures["control_cpu_s"] >= 0
    runs = [
        {"workload": "docqa", "load": "light", "systems": {"sglang-router-round_robin": figures}}
    ]
    assert json.loads(json.dumps({"runs": runs})) == {"runs": runs}
    assert "sglang-router-round_robin" in table(runs)
    assert goals(runs) == []  # no quillcache row, no goal to judge
    slowest = _slowest(samples, 2)  # the run's details name its slowest first tokens
    assert [s["ttft_ms"] for s in slowest] == sorted(
        (round(s.ttft_s * 1000, 1) for s in samples), reverse=True
    )[:2]
    assert all(s["sent_at_s"] >= 0 for s in slowest)


def test_a_sim_engine_takes_new_settings_in_place(tmp_path: Path) -> None:
    """POST /sim/settings (bench-live's decode workload and its split row): the role,
    the interference model and the KV shape change without a restart; a bad value is a
    400 and changes nothing."""
    engine = PlainSimEngine(tmp_path).start(timeout_s=20.0)
    try:
        sim = Engine("engine-0", engine.fields["plain_http"])
        before = sim.settings()
        assert before["role"] == "both" and before["prefill_stalls_decodes"] is False
        assert before["store_writes"] == "computed"
        change = {"role": "decode", "prefill_stalls_decodes": True, "kv_layers": 2}
        after = sim.settings({**change, "store_writes": "none"})
        assert after == {**before, **change, "store_writes": "none"}
        bad_values = ({"role": "boss"}, {"kv_layers": 0}, {"port": 1}, {"kv_heads": "2"},
                      {"store_writes": "all"})  # fmt: skip
        for bad in bad_values:
            with pytest.raises(urllib.error.HTTPError) as refused:
                sim.settings(bad)
            assert refused.value.code == 400
        assert sim.settings() == after
        # the TLS port wants the engine credential for it, as for everything else
        request = urllib.request.Request(
            engine.fields["http"] + "/sim/settings", data=b"{}", method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5.0, context=client_context())
        assert refused.value.code == 401
    finally:
        engine.stop()


def test_the_engines_warm_up_reaches_every_engine_straight(tmp_path: Path) -> None:
    """Before any system runs (real vLLM: its first minutes are slow, and the first
    system would pay for them), every workload goes straight to the engines in turn."""
    from argparse import Namespace

    from quillcache_bench.live_bench import _engine_warm_up

    first = PlainSimEngine(tmp_path / "a").start(timeout_s=20.0)
    second = PlainSimEngine(tmp_path / "b").start(timeout_s=20.0)
    try:
        engines = [
            Engine("engine-0", first.fields["plain_http"]),
            Engine("engine-1", second.fields["plain_http"]),
        ]
        before = [e.counters() for e in engines]
        args = Namespace(prompt_scale=0.05, engine="sim", heavy_rps=8.0)
        _engine_warm_up(args, engines, ["docqa", "decode"], "sim-model", 1.0)
        served = [e.counters().minus(b).requests for e, b in zip(engines, before, strict=True)]
    finally:
        first.stop()
        second.stop()
    assert all(n >= 1 for n in served), served
    assert sum(served) <= 8  # docqa's 8 (one second at 8/s); the decode workload not sent


def test_ours_stand_still_while_a_router_runs_and_go_on_after(tmp_path: Path) -> None:
    """`paused` stops QuillCache's processes for a router's runs (no CPU taken from the
    engines) and continues them afterwards, also when the runs fail."""
    import subprocess
    import sys
    import time

    from quillcache_bench.live_systems import paused

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])

    def state() -> str:
        text = Path(f"/proc/{busy.pid}/stat").read_text()
        return text[text.rindex(")") + 2]

    try:
        with pytest.raises(RuntimeError), paused([busy.pid, 2**22 + 7], settle_s=0.0):
            assert state() == "T"
            cpu = tree_cpu_s([busy.pid])
            time.sleep(0.5)
            assert tree_cpu_s([busy.pid]) == cpu  # stopped: no CPU
            raise RuntimeError("a router's run failed")
        assert state() in "RS"
        cpu = tree_cpu_s([busy.pid])
        time.sleep(0.5)
        assert tree_cpu_s([busy.pid]) > cpu
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.timeout(120)
def test_the_scale_scenario_runs_end_to_end_on_sim_engines(tmp_path: Path) -> None:
    """`bench-live --scenario scale`, short: a steady phase, a drain under load (no
    request fails), an engine added, and the results written with their goals."""
    import time

    from quillcache_bench.live_bench import main

    started = time.monotonic()
    code = main(
        ["--scenario", "scale", "--phase-s", "4", "--scale-window-s", "5", "--scale-rps", "6",
         "--prompt-scale", "0.3", "--out-dir", str(tmp_path)]
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert code == 0
    result = json.loads((tmp_path / "scale-latest.json").read_text())
    assert (tmp_path / "scale-latest.png").stat().st_size > 0
    figures = result["figures"]
    drained = figures["drain"]["engine"]
    assert drained in {"engine-0", "engine-1", "engine-2"}
    assert result["drain_report"]["state"] == "drained", result["drain_report"]
    assert result["drain_report"]["open_requests"] == 0
    assert figures["drain"]["failed_through_drain"] == 0
    assert figures["scale_out"]["engine"] == "engine-3"
    timeline = result["timeline"]
    assert len(timeline) >= 50 and not [r for r in timeline if not r[5]]
    # no request was sent to the drained engine once its drain had returned
    drained_at = result["marks_s"]["drain_end"]
    assert not [r for r in timeline if r[0] > drained_at + 1.0 and r[2] == drained]
    assert figures["prediction"]["pred_requests"] > 0
    assert 0 <= figures["prediction"]["pred_mae_share"] <= 1
    assert len(result["goals"]) == 6
    print(f"scale scenario in {elapsed:.0f}s: {[(g['goal'], g['met']) for g in result['goals']]}")
    assert elapsed < 60
