"""`quillcache bench-live`'s figures: one system's run summarised, the table of ratios
against QuillCache, the live goals (and the disaggregation goal on the decode-heavy
workload: QuillCache split against colocated), the plans' predicted against delivered
figures (`prediction_errors`, QuillCache's rows), the JSON payload and the PNG. Pure but
for `plot` (which writes the file)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import mean

import numpy as np

from quillcache_bench.common import render_table
from quillcache_bench.disagg import GOAL_ITL_P99, GOAL_TTFT_MEAN, latency_ms
from quillcache_bench.live_systems import EngineCounters
from quillcache_bench.live_workloads import Sample

OURS = "quillcache"
SPLIT = "quillcache-split"  # the same gateway, the engines given prefill/decode roles
REFERENCE = "sglang-router-cache_aware"
TTFT_GOAL = 0.8  # ours at most 0.8x the reference's mean TTFT
LOAD_GOAL = 1.5  # engine load max/mean at most 1.5
CPU_GOAL_RATIO = 1.5  # the gateway and the conductors: at most 1.5x the CPU a request...
CPU_PEERS = ("smg-cache_aware", "sglang-router-cache_aware")  # ...of each, in the same run
FIELDS = (
    "ttft_mean_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "throughput_rps",
    "errors",
    "load_max_over_mean",
    "control_cpu_s",
    "control_cpu_ms_per_request",
    "cached_token_share",
)
# Added for every system on a workload whose streams are timed (the decode workload).
ITL_FIELDS = ("itl_mean_ms", "itl_p50_ms", "itl_p99_ms")
# Added for QuillCache's rows: its plans against what the engines delivered, from each
# request's explain figures (`prediction_errors`).
PREDICTION_FIELDS = (
    "pred_requests",
    "pred_fallback_plans",
    "pred_mae_tokens",
    "pred_mae_share",
    "pred_bias_tokens",
    "pred_mispredicted_share",
    "pred_ttft_abs_err_p50_ms",
    "pred_ttft_abs_err_p90_ms",
    "pred_ttft_err_p50_ms",
)
PREDICTION_GOAL = 0.05  # cached-token MAE below 5% of prompt tokens...
PREDICTION_GOAL_WC = 1.0  # ...where the working set fits the fleet's caches (W/C <= 1)


def summarise(
    samples: Sequence[Sample],
    served: Sequence[EngineCounters],
    control_cpu_s: float,
    itl: bool = False,
) -> dict[str, float | int]:
    """The figures of one system on one cell: TTFT over the requests that streamed
    content; throughput over the span first send to last answer; load from the
    requests each engine served in the run (every engine counted, idle ones too);
    cached share from the engines' prompt tokens not computed. With `itl`, also the
    inter-token latency over every gap of every stream that completed (ITL_FIELDS)."""
    ok = [s for s in samples if s.ok and s.ttft_s is not None]
    ttft = np.array([s.ttft_s * 1000 for s in ok]) if ok else np.array([np.nan])
    span = (max(s.done_s for s in samples) - min(s.sent_s for s in samples)) if samples else 0
    per_engine = np.array([c.requests for c in served], dtype=float)
    prompt = sum(c.prompt_tokens for c in served)
    out: dict[str, float | int] = {
        "ttft_mean_ms": float(np.mean(ttft)),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "throughput_rps": len(ok) / span if span > 0 else 0.0,
        "errors": len(samples) - len(ok),
        "load_max_over_mean": float(per_engine.max() / per_engine.mean())
        if per_engine.sum() > 0
        else 0.0,
        "control_cpu_s": round(control_cpu_s, 3),
        "control_cpu_ms_per_request": 1000 * control_cpu_s / len(samples) if samples else 0.0,
        "cached_token_share": sum(c.cached_tokens for c in served) / prompt if prompt else 0.0,
    }
    out.update(prediction_errors(samples))
    if itl:
        gaps = latency_ms([g for s in ok for g in s.itl_s])
        out["itl_mean_ms"], out["itl_p50_ms"], out["itl_p99_ms"] = (
            gaps["mean"],
            gaps["p50"],
            gaps["p99"],
        )
    return out


def table(runs: Sequence[Mapping]) -> str:
    """Every run's systems, with each one's mean TTFT as a multiple of QuillCache's."""
    rows = []
    for run in runs:
        systems = run["systems"]
        ours = systems.get(OURS, {}).get("ttft_mean_ms")
        for name, f in systems.items():
            ratio = f["ttft_mean_ms"] / ours if ours else float("nan")
            rows.append(
                (
                    f"{run['workload']}/{run['load']}",
                    name,
                    f["ttft_mean_ms"],
                    f["ttft_p50_ms"],
                    f["ttft_p99_ms"],
                    f"{ratio:.2f}x",
                    f["throughput_rps"],
                    f["errors"],
                    f["load_max_over_mean"],
                    f["control_cpu_s"],
                    f.get("control_cpu_ms_per_request", float("nan")),
                    f"{100 * f['cached_token_share']:.0f}%",
                    f"{100 * f['pred_mae_share']:.1f}%" if "pred_mae_share" in f else "-",
                )
            )
    return render_table(
        [
            "workload/load",
            "system",
            "TTFT mean ms",
            "p50 ms",
            "p99 ms",
            "mean vs QC",
            "req/s",
            "errors",
            "load max/mean",
            "control CPU s",
            "CPU ms/req",
            "cached",
            "pred MAE",
        ],
        rows,
    )


def itl_table(runs: Sequence[Mapping]) -> str:
    """The timed workloads' systems: TTFT and inter-token latency, mean and p99, each as
    a multiple of colocated QuillCache's ('' when no run has them)."""
    rows = []
    for run in runs:
        systems = run["systems"]
        base = systems.get(OURS, {})
        for name, f in systems.items():
            if "itl_p99_ms" not in f:
                continue

            def vs(field: str, f=f, base=base) -> str:
                ours = base.get(field)
                return f"{f[field]:.1f} ({f[field] / ours:.2f}x)" if ours else f"{f[field]:.1f}"

            rows.append(
                (
                    f"{run['workload']}/{run['load']}",
                    name,
                    vs("ttft_mean_ms"),
                    vs("ttft_p99_ms"),
                    vs("itl_mean_ms"),
                    vs("itl_p99_ms"),
                    f["throughput_rps"],
                    f["errors"],
                )
            )
    if not rows:
        return ""
    return render_table(
        ["workload/load", "system", "TTFT mean ms", "TTFT p99 ms", "ITL mean ms",
         "ITL p99 ms", "req/s", "errors"],
        rows,
    )  # fmt: skip


def split_goals(runs: Sequence[Mapping]) -> list[dict]:
    """The disaggregation goal per timed run with both QuillCache rows: split inter-token p99 at
    most 0.7x colocated's, with mean TTFT at most 1.1x (judged at heavy load)."""
    out = []
    for run in runs:
        systems = run["systems"]
        if OURS not in systems or SPLIT not in systems or "itl_p99_ms" not in systems[OURS]:
            continue
        base, split = systems[OURS], systems[SPLIT]
        itl = split["itl_p99_ms"] / base["itl_p99_ms"]
        ttft = split["ttft_mean_ms"] / base["ttft_mean_ms"]
        out.append(
            {
                "workload": run["workload"],
                "load": run["load"],
                "itl_p99_ratio": itl,
                "itl_met": itl <= GOAL_ITL_P99,
                "ttft_mean_ratio": ttft,
                "ttft_met": ttft <= GOAL_TTFT_MEAN,
                "errors": split["errors"],
            }
        )
    return out


def split_goals_text(found: Sequence[Mapping]) -> str:
    if not found:
        return ""
    lines = [
        f"Goal: {SPLIT} inter-token p99 <= {GOAL_ITL_P99}x {OURS}'s (colocated) "
        f"with mean TTFT <= {GOAL_TTFT_MEAN}x, at heavy load"
    ]
    for g in found:
        lines.append(
            f"  {g['workload']}/{g['load']}: ITL p99 {g['itl_p99_ratio']:.2f}x "
            f"({'met' if g['itl_met'] else 'NOT met'}), TTFT mean {g['ttft_mean_ratio']:.2f}x "
            f"({'met' if g['ttft_met'] else 'NOT met'})"
        )
    return "\n".join(lines)


def goals(runs: Sequence[Mapping]) -> list[dict]:
    """The live goals per run: ours <= 0.8x sglang-router cache_aware's mean TTFT,
    our engines' load max/mean <= 1.5, and our control path (gateway and every
    conductor replica) at most 1.5x the CPU a request of SMG's and of sglang-router's
    cache_aware in the same run (judged against those of them that ran; None when
    neither did)."""
    out = []
    for run in runs:
        systems = run["systems"]
        if OURS not in systems:
            continue
        ours = systems[OURS]
        ref = systems.get(REFERENCE)
        ratio = ours["ttft_mean_ms"] / ref["ttft_mean_ms"] if ref else None
        cpu = ours.get("control_cpu_ms_per_request")
        peers = {
            name: systems[name]["control_cpu_ms_per_request"]
            for name in CPU_PEERS
            if systems.get(name, {}).get("control_cpu_ms_per_request")
        }
        cpu_ratios = {name: cpu / theirs for name, theirs in peers.items()} if cpu else {}
        out.append(
            {
                "workload": run["workload"],
                "load": run["load"],
                "ttft_ratio_vs_sglang_cache_aware": ratio,
                "ttft_met": ratio is not None and ratio <= TTFT_GOAL,
                "load_max_over_mean": ours["load_max_over_mean"],
                "load_met": ours["load_max_over_mean"] <= LOAD_GOAL,
                "control_cpu_ms_per_request": cpu,
                "cpu_ratio_vs": cpu_ratios,
                "cpu_met": (
                    all(r <= CPU_GOAL_RATIO for r in cpu_ratios.values()) if cpu_ratios else None
                ),
                "errors": ours["errors"],
            }
        )
    return out


def goals_text(found: Sequence[Mapping]) -> str:
    lines = [
        f"Goals: QuillCache mean TTFT <= {TTFT_GOAL}x {REFERENCE}'s, "
        f"engine load max/mean <= {LOAD_GOAL}, control path CPU a request <= "
        f"{CPU_GOAL_RATIO:g}x {' and '.join(CPU_PEERS)}'s"
    ]
    for g in found:
        ratio = g["ttft_ratio_vs_sglang_cache_aware"]
        shown = "n/a" if ratio is None else f"{ratio:.2f}x"
        lines.append(
            f"  {g['workload']}/{g['load']}: TTFT {shown} "
            f"({'met' if g['ttft_met'] else 'NOT met'}), load max/mean "
            f"{g['load_max_over_mean']:.2f} ({'met' if g['load_met'] else 'NOT met'})"
            + _cpu_text(g)
        )
    return "\n".join(lines)


def _cpu_text(g: Mapping) -> str:
    cpu = g.get("control_cpu_ms_per_request")
    if cpu is None:
        return ""
    verdict = {True: "met", False: "NOT met", None: "not judged: no peer's figure"}
    ratios = ", ".join(f"{r:.2f}x {name}'s" for name, r in g.get("cpu_ratio_vs", {}).items())
    return (
        f", control CPU {cpu:.2f} ms a request{' = ' + ratios if ratios else ''} "
        f"({verdict[g['cpu_met']]})"
    )


def plot(runs: Sequence[Mapping], path: Path) -> Path:
    """Mean TTFT (bars) and engine load max/mean (dots) of every system, per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = [n for n in (OURS, SPLIT) if any(n in r["systems"] for r in runs)]
    for run in runs:
        names += [n for n in run["systems"] if n not in names]
    labels = [f"{r['workload']}\n{r['load']}" for r in runs]
    x = np.arange(len(runs))
    width = 0.8 / max(1, len(names))
    timed = any("itl_p99_ms" in f for r in runs for f in r["systems"].values())
    panels = 3 if timed else 2
    fig, axes = plt.subplots(
        panels, 1, figsize=(max(8, 1.6 * len(runs)), 3.5 * panels), sharex=True
    )
    top, bottom = axes[0], axes[1]
    for i, name in enumerate(names):
        at = x + i * width - 0.4 + width / 2
        ttft = [r["systems"].get(name, {}).get("ttft_mean_ms", np.nan) for r in runs]
        load = [r["systems"].get(name, {}).get("load_max_over_mean", np.nan) for r in runs]
        top.bar(at, ttft, width, label=name)
        bottom.plot(at, load, "o", label=name)
        if timed:
            itl = [r["systems"].get(name, {}).get("itl_p99_ms", np.nan) for r in runs]
            axes[2].bar(at, itl, width, label=name)
    if timed:
        axes[2].set_ylabel("inter-token p99 (ms)\n(timed workloads)")
    top.set_yscale("log")  # light-load tens of ms beside heavy-load seconds
    top.set_ylabel("TTFT mean (ms, log scale)")
    top.set_title("quillcache bench-live: the same engines behind each system")
    top.legend(fontsize=7, ncol=2)
    bottom.axhline(LOAD_GOAL, color="grey", linestyle="--", linewidth=0.8)
    bottom.set_ylabel("engine load max/mean")
    axes[-1].set_xticks(x, labels)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plan_kind(plan: dict) -> str | None:
    """What a QuillCache plan mostly did with the prompt's blocks: `compute` (more than
    half recomputed), `fetch` (any loaded from the pool), else `hit`."""
    try:
        hit, fetch = int(plan["hit-blocks"]), int(plan["fetch-blocks"])
        compute = int(plan["recompute-blocks"])
    except (KeyError, ValueError):
        return None
    if 2 * compute > hit + fetch + compute:
        return "compute"
    return "fetch" if fetch else "hit"


def by_plan_kind(samples: list) -> dict[str, dict]:
    """Per kind of plan: requests, mean measured and estimated TTFT (ms), mean blocks hit,
    fetched and recomputed: where the estimate is off, and for which requests."""
    groups: dict[str, list] = {}
    for s in samples:
        kind = plan_kind(s.plan) if s.ok and s.ttft_s is not None else None
        if kind is not None:
            groups.setdefault(kind, []).append(s)
    out = {}
    for kind, group in sorted(groups.items()):
        out[kind] = {
            "requests": len(group),
            "ttft_mean_ms": round(mean(s.ttft_s * 1000 for s in group), 1),
            "est_ttft_mean_ms": round(mean(float(s.plan.get("est-ttft-ms", 0)) for s in group), 1),
            **{
                f"{field}_mean": round(mean(int(s.plan[f"{field}-blocks"]) for s in group), 1)
                for field in ("hit", "fetch", "recompute")
            },
        }
    return out


def prediction_errors(samples: Sequence[Sample]) -> dict[str, float | int]:
    """The plans' cached tokens and TTFT against the engines' delivery, over the samples
    whose gateway explained them (empty: none did, e.g. a router's run).

    Cached tokens: `pred_mae_tokens` is the mean |delivered - predicted| over the requests
    whose engine reported its cached tokens, `pred_mae_share` the same as a share of
    their prompt tokens (sum of |errors| over sum of prompt tokens: the MAE over the
    mean prompt), `pred_bias_tokens` the mean signed error (delivered - predicted),
    `pred_mispredicted_share` the share with any error. TTFT: the median and p90 of
    |realized - predicted| and the median signed error, over the streams the conductor
    planned. The gateway's own fallback plans (no conductor answered in time) predict
    nothing: they are left out and counted (`pred_fallback_plans`)."""
    tokens, prompts, ttft = [], [], []
    fallbacks = 0
    for s in samples:
        if not s.ok or not s.explain:
            continue
        if not s.explain.get("replica"):
            fallbacks += 1
            continue
        error = s.explain.get("error") or {}
        if isinstance(error.get("tokens"), int) and s.prompt_tokens > 0:
            tokens.append(error["tokens"])
            prompts.append(s.prompt_tokens)
        if isinstance(error.get("ttft_ms"), int | float):
            ttft.append(float(error["ttft_ms"]))
    if not tokens and not ttft and not fallbacks:
        return {}
    out: dict[str, float | int] = {"pred_requests": len(tokens), "pred_fallback_plans": fallbacks}
    if tokens:
        errors = np.abs(np.array(tokens, dtype=float))
        out["pred_mae_tokens"] = float(errors.mean())
        out["pred_mae_share"] = float(errors.sum() / sum(prompts))
        out["pred_bias_tokens"] = float(np.mean(tokens))
        out["pred_mispredicted_share"] = float(np.count_nonzero(errors) / len(errors))
    if ttft:
        late = np.array(ttft)
        out["pred_ttft_abs_err_p50_ms"] = float(np.percentile(np.abs(late), 50))
        out["pred_ttft_abs_err_p90_ms"] = float(np.percentile(np.abs(late), 90))
        out["pred_ttft_err_p50_ms"] = float(np.percentile(late, 50))
    return out


def prediction_goals(cells: Sequence[Mapping]) -> list[dict]:
    """The prediction goal per cell with QuillCache's figures: cached-token MAE below
    PREDICTION_GOAL of prompt tokens, judged where the cell's W/C (`w_over_c`: working
    set over the fleet's KV capacity; None when not known) is at most
    PREDICTION_GOAL_WC; `met` None where not judged."""
    out = []
    for cell in cells:
        ours = cell["systems"].get(OURS, {})
        if "pred_mae_share" not in ours or not ours.get("pred_requests"):
            continue
        wc = cell.get("w_over_c")
        judged = wc is not None and wc <= PREDICTION_GOAL_WC
        out.append(
            {
                "cell": cell["cell"],
                "w_over_c": wc,
                "mae_share": ours["pred_mae_share"],
                "mae_tokens": ours["pred_mae_tokens"],
                "ttft_abs_err_p50_ms": ours.get("pred_ttft_abs_err_p50_ms"),
                "ttft_abs_err_p90_ms": ours.get("pred_ttft_abs_err_p90_ms"),
                "met": (ours["pred_mae_share"] < PREDICTION_GOAL) if judged else None,
            }
        )
    return out


def prediction_text(found: Sequence[Mapping]) -> str:
    """The prediction table and goal line, then a README-ready summary ('' if none)."""
    if not found:
        return ""
    rows = [
        (
            g["cell"],
            "-" if g["w_over_c"] is None else f"{g['w_over_c']:.2f}",
            f"{100 * g['mae_share']:.1f}%",
            g["mae_tokens"],
            _ms(g["ttft_abs_err_p50_ms"]),
            _ms(g["ttft_abs_err_p90_ms"]),
            {True: "met", False: "NOT met", None: "not judged"}[g["met"]],
        )
        for g in found
    ]
    table_text = render_table(
        ["cell", "W/C", "MAE % prompt", "MAE tokens", "|TTFT err| p50 ms", "p90 ms", "goal"],
        rows,
    )
    goal = (
        f"Goal: predicted vs delivered cached tokens, MAE < {100 * PREDICTION_GOAL:g}% of "
        f"prompt tokens at W/C <= {PREDICTION_GOAL_WC:g}"
    )
    return f"{goal}\n{table_text}\n\n{prediction_summary(found)}"


def prediction_summary(found: Sequence[Mapping]) -> str:
    """One paragraph for the README: the MAE range where judged, the TTFT error."""
    judged = [g for g in found if g["met"] is not None]
    shares = [g["mae_share"] for g in (judged or found)]
    p50s = [g["ttft_abs_err_p50_ms"] for g in found if g["ttft_abs_err_p50_ms"] is not None]
    p90s = [g["ttft_abs_err_p90_ms"] for g in found if g["ttft_abs_err_p90_ms"] is not None]
    where = (
        f"over the {len(judged)} cells at W/C <= {PREDICTION_GOAL_WC:g}"
        if judged
        else f"over {len(found)} cells (none at a known W/C <= {PREDICTION_GOAL_WC:g})"
    )
    met = sum(bool(g["met"]) for g in judged)
    text = (
        f"- **Predicted vs delivered:** the plans' cached tokens were off by "
        f"{100 * min(shares):.1f}-{100 * max(shares):.1f}% of prompt tokens (MAE) {where}"
    )
    if judged:
        text += f", goal < {100 * PREDICTION_GOAL:g}% met in {met} of {len(judged)}"
    if p50s:
        text += (
            f"; TTFT predictions off by a median {min(p50s):.0f}-{max(p50s):.0f} ms "
            f"(p90 {min(p90s):.0f}-{max(p90s):.0f} ms)"
        )
    return text + "."


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
