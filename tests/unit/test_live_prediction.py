"""bench-live's predicted-against-delivered figures (each request's explain object from
the gateway), the goal "MAE < 5% of prompt tokens at W/C <= 1", and the scale
scenario's figures from a timeline of samples."""

from __future__ import annotations

import pytest

from quillcache_bench.live_report import (
    PREDICTION_FIELDS,
    prediction_errors,
    prediction_goals,
    prediction_text,
    summarise,
    table,
)
from quillcache_bench.live_scale import (
    catch_up_s,
    hot_docqa,
    moved_prefixes,
    scale_figures,
    scale_goals,
    summary,
)
from quillcache_bench.live_systems import EngineCounters
from quillcache_bench.live_workloads import Sample, make_sessions, working_set_tokens

pytestmark = pytest.mark.unit


def explained(predicted: int, delivered: int | None, ttft_err: float | None, replica="c-0"):
    return {
        "engine_id": "engine-0",
        "replica": replica,
        "predicted": {"cached_tokens": predicted},
        "delivered": {"cached_tokens": delivered},
        "error": {
            "tokens": None if delivered is None else delivered - predicted,
            "ttft_ms": ttft_err,
        },
    }


def sample(prompt: int, explain: dict, ok: bool = True, **kw) -> Sample:
    return Sample("t", ttft_s=0.05, ok=ok, prompt_tokens=prompt, explain=explain, **kw)


def test_the_mae_is_the_mean_absolute_error_and_its_share_is_over_the_prompts():
    samples = [
        sample(1000, explained(800, 800, 10.0)),  # exact
        sample(1000, explained(800, 700, -30.0)),  # 100 short
        sample(2000, explained(0, 200, 50.0)),  # 200 more than planned
        sample(500, explained(0, None, 20.0)),  # no usage: no token figure, a TTFT one
        sample(900, explained(0, 900, None, replica="")),  # the gateway's own plan: left out
        sample(900, explained(0, 900, 5.0), ok=False),  # failed: left out
    ]
    found = prediction_errors(samples)
    assert set(found) == set(PREDICTION_FIELDS)
    assert found["pred_requests"] == 3 and found["pred_fallback_plans"] == 1
    assert found["pred_mae_tokens"] == pytest.approx(100.0)  # (0 + 100 + 200) / 3
    assert found["pred_mae_share"] == pytest.approx(300 / 4000)
    assert found["pred_bias_tokens"] == pytest.approx((0 - 100 + 200) / 3)
    assert found["pred_mispredicted_share"] == pytest.approx(2 / 3)
    # |TTFT errors| 10, 30, 50, 20: median 25, p90 44 (numpy's linear percentiles)
    assert found["pred_ttft_abs_err_p50_ms"] == pytest.approx(25.0)
    assert found["pred_ttft_abs_err_p90_ms"] == pytest.approx(44.0)
    assert found["pred_ttft_err_p50_ms"] == pytest.approx(15.0)


def test_a_run_without_explained_requests_has_no_prediction_figures():
    plain = [Sample("t", ttft_s=0.02, ok=True, prompt_tokens=100)]
    assert prediction_errors(plain) == {}
    served = [EngineCounters(requests=1, prompt_tokens=100, cached_tokens=0)]
    assert not any(k.startswith("pred_") for k in summarise(plain, served, 0.0))


def cell(name: str, share: float, wc: float | None) -> dict:
    ours = {"pred_requests": 10, "pred_mae_share": share, "pred_mae_tokens": 40.0,
            "pred_ttft_abs_err_p50_ms": 3.0, "pred_ttft_abs_err_p90_ms": 9.0}  # fmt: skip
    return {"cell": name, "w_over_c": wc, "systems": {"quillcache": ours, "smg": {}}}


@pytest.mark.parametrize(
    ("share", "wc", "met"),
    [
        (0.049, 1.0, True),
        (0.05, 0.5, False),  # "below 5%": 5% itself is not
        (0.30, 2.0, None),  # the working set outgrows the caches: not judged
        (0.01, None, None),  # W/C unknown: not judged
    ],
)
def test_the_prediction_goal_is_judged_only_where_the_working_set_fits(share, wc, met):
    [found] = prediction_goals([cell("docqa/light", share, wc)])
    assert found["met"] is met
    assert found["mae_share"] == share


def test_the_report_prints_the_goal_table_and_a_readme_summary():
    found = prediction_goals(
        [cell("chat/light", 0.02, 0.4), cell("docqa/heavy", 0.08, 0.9), cell("x", 0.5, 3.0)]
    )
    text = prediction_text(found)
    assert "MAE < 5% of prompt tokens at W/C <= 1" in text
    assert "NOT met" in text and "not judged" in text
    summary_line = text.splitlines()[-1]
    # the range over the judged cells only (2% and 8%), and how many met the goal
    assert "2.0-8.0% of prompt tokens" in summary_line and "met in 1 of 2" in summary_line
    runs = [{"workload": "chat", "load": "light", "systems": {"quillcache": {
        "ttft_mean_ms": 1.0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 1.0, "throughput_rps": 1.0,
        "errors": 0, "load_max_over_mean": 1.0, "control_cpu_s": 0.0,
        "cached_token_share": 0.5, "pred_mae_share": 0.021}}}]  # fmt: skip
    assert "2.1%" in table(runs)


def test_the_working_set_counts_a_document_asked_again_once():
    one = make_sessions("docqa", 1, 1.0, seed=3, nonce="n")
    many = make_sessions("docqa", 40, 1.0, seed=3, nonce="n")
    documents = {s.turns[0].user.split("\n\nQuestion:")[0] for s in many}
    assert len(documents) < 40  # questions share documents
    assert working_set_tokens(one) < working_set_tokens(many)
    words = sum(len(d.split()) for d in documents)
    assert working_set_tokens(many) < 2 * words * 1.2  # not 40 documents' worth


# --- the scale scenario's figures ---------------------------------------------------


def at(t: float, engine: str, doc: str, kind: str = "hit", *, ttft_ms=50.0, share=0.9, ok=True):
    blocks = {"hit": ("10", "0", "1"), "fetch": ("0", "10", "1"), "compute": ("0", "0", "11")}
    hit, fetch, compute = blocks[kind]
    plan = {"engine": engine, "hit-blocks": hit, "fetch-blocks": fetch,
            "recompute-blocks": compute}  # fmt: skip
    return Sample("t", sent_s=t, ttft_s=ttft_ms / 1000, ok=ok, session=doc, plan=plan,
                  prompt_tokens=1000, explain=explained(0, round(1000 * share), 1.0))  # fmt: skip


def test_a_drained_engines_prefixes_are_their_first_requests_served_elsewhere():
    before = [at(1, "e0", "a"), at(2, "e1", "a"), at(3, "e0", "b"), at(4, "e0", "c")]
    after = [at(10, "e0", "b"), at(11, "e1", "b", "fetch"), at(12, "e2", "b"),
             at(13, "e1", "a"), at(14, "e2", "c", "compute")]  # fmt: skip
    moved = moved_prefixes(before, after, "e0")
    # "a" was last served by e1: not the drained engine's
    assert [(s.session, s.sent_s) for s in moved] == [("b", 11), ("c", 14)]


def test_a_new_engine_catches_up_when_its_share_reaches_the_fleets():
    fleet = [at(t, "e1", "a", share=0.9) for t in range(0, 30)]
    cold = [at(10 + t, "new", "a", share=0.0) for t in range(3)]
    warm = [at(13 + t, "new", "a", share=0.9) for t in range(5)]
    # its last 5 requests' share reaches the fleet's once they are all warm (t=17)
    assert catch_up_s(fleet + cold + warm, "new", adding=9.0, added=9.5) == pytest.approx(7.5)
    assert catch_up_s(fleet + cold, "new", adding=9.0, added=9.5) is None


def test_the_scale_goals_from_a_timeline():
    marks = {"start": 0.0, "steady_from": 1.0, "drain_start": 10.0, "drain_end": 11.0,
             "adding": 25.0, "added": 26.0, "end": 40.0}  # fmt: skip
    samples = [at(t / 2, "e0" if t % 2 else "e1", f"d{t % 4}") for t in range(2, 20)]
    samples += [at(12.0, "e1", "d1", "fetch", ttft_ms=60.0), at(13.0, "e1", "d3", "fetch")]
    samples += [at(15.0, "e1", "d2", "fetch", ttft_ms=40.0)]  # a pool load elsewhere
    samples += [at(22.0, "e1", "dx", "compute", ttft_ms=300.0)]  # after the drain window
    samples += [at(26.5 + i, "e3", f"d{i % 4}", "fetch") for i in range(4)]
    f = scale_figures(samples, marks, "e0", "e3")
    d, s = f["drain"], f["scale_out"]
    assert d["failed_through_drain"] == 0 and d["window_s"] == 10.0
    assert d["moved_prefixes"] == 2 and d["moved_kinds"] == {"fetch": 2}
    assert d["moved_pool_load_share"] == 1.0 and d["moved_cached_share"] == 1.0
    # the other pool loads: 40 ms, and the new engine's four of 50 ms
    assert d["pool_load_ttft_median_ms"] == pytest.approx(50.0)
    assert d["moved_vs_pool_load"] == pytest.approx(55.0 / 50.0)
    assert d["recompute_ttft_median_ms"] == pytest.approx(300.0)
    assert s["first_hot_requests"] == 4 and s["first_recompute_share"] == 0.0
    assert s["catch_up_s"] == pytest.approx(2.5)  # its third request, at 28.5
    assert d["p99_vs_steady"] == pytest.approx(59.8 / 50.0)  # p99 of 40, 50, 60 ms
    verdicts = {g["goal"]: g["met"] for g in scale_goals(f)}
    assert all(v is not False for v in verdicts.values()), verdicts
    assert "0 requests failed" in summary(f)


def test_hot_docqa_asks_a_fixed_set_of_documents_at_the_rate():
    sessions = hot_docqa(400, 10.0, seed=1, nonce="n", size_scale=0.1)
    docs = {s.session_id for s in sessions}
    assert len(docs) <= 12 and len(docs) >= 8
    assert 30 < sessions[-1].start_s < 50  # 400 arrivals at 10/s
    first = next(s for s in sessions if s.session_id == "doc-0")
    again = [s for s in sessions if s.session_id == "doc-0"][1]
    assert (
        first.turns[0].user.split("\n\nQuestion:")[0]
        == again.turns[0].user.split("\n\nQuestion:")[0]
    )
    assert hot_docqa(400, 10.0, 1, "n", 0.1) == sessions
