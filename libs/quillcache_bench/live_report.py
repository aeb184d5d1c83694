"""`quillcache bench-live`'s figures: one system's run summarised, the table of ratios
against QuillCache, the goals of issue 19, the JSON payload and the PNG. Pure but for
`plot` (which writes the file)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from quillcache_bench.common import render_table
from quillcache_bench.live_systems import EngineCounters
from quillcache_bench.live_workloads import Sample

OURS = "quillcache"
REFERENCE = "sglang-router-cache_aware"
TTFT_GOAL = 0.8  # ours at most 0.8x the reference's mean TTFT
LOAD_GOAL = 1.5  # engine load max/mean at most 1.5
FIELDS = (
    "ttft_mean_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "throughput_rps",
    "errors",
    "load_max_over_mean",
    "control_cpu_s",
    "cached_token_share",
)


def summarise(
    samples: Sequence[Sample], served: Sequence[EngineCounters], control_cpu_s: float
) -> dict[str, float | int]:
    """The figures of one system on one cell: TTFT over the requests that streamed
    content; throughput over the span first send to last answer; load from the
    requests each engine served in the run (every engine counted, idle ones too);
    cached share from the engines' prompt tokens not computed."""
    ok = [s for s in samples if s.ok and s.ttft_s is not None]
    ttft = np.array([s.ttft_s * 1000 for s in ok]) if ok else np.array([np.nan])
    span = (max(s.done_s for s in samples) - min(s.sent_s for s in samples)) if samples else 0
    per_engine = np.array([c.requests for c in served], dtype=float)
    prompt = sum(c.prompt_tokens for c in served)
    return {
        "ttft_mean_ms": float(np.mean(ttft)),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "throughput_rps": len(ok) / span if span > 0 else 0.0,
        "errors": len(samples) - len(ok),
        "load_max_over_mean": float(per_engine.max() / per_engine.mean())
        if per_engine.sum() > 0
        else 0.0,
        "control_cpu_s": round(control_cpu_s, 3),
        "cached_token_share": sum(c.cached_tokens for c in served) / prompt if prompt else 0.0,
    }


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
                    f"{100 * f['cached_token_share']:.0f}%",
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
            "cached",
        ],
        rows,
    )


def goals(runs: Sequence[Mapping]) -> list[dict]:
    """Issue 19's goals per run: ours <= 0.8x sglang-router cache_aware's mean TTFT,
    our engines' load max/mean <= 1.5."""
    out = []
    for run in runs:
        systems = run["systems"]
        if OURS not in systems:
            continue
        ours = systems[OURS]
        ref = systems.get(REFERENCE)
        ratio = ours["ttft_mean_ms"] / ref["ttft_mean_ms"] if ref else None
        out.append(
            {
                "workload": run["workload"],
                "load": run["load"],
                "ttft_ratio_vs_sglang_cache_aware": ratio,
                "ttft_met": ratio is not None and ratio <= TTFT_GOAL,
                "load_max_over_mean": ours["load_max_over_mean"],
                "load_met": ours["load_max_over_mean"] <= LOAD_GOAL,
                "errors": ours["errors"],
            }
        )
    return out


def goals_text(found: Sequence[Mapping]) -> str:
    lines = [
        f"Goals (issue 19): QuillCache mean TTFT <= {TTFT_GOAL}x {REFERENCE}'s, "
        f"engine load max/mean <= {LOAD_GOAL}"
    ]
    for g in found:
        ratio = g["ttft_ratio_vs_sglang_cache_aware"]
        shown = "n/a" if ratio is None else f"{ratio:.2f}x"
        lines.append(
            f"  {g['workload']}/{g['load']}: TTFT {shown} "
            f"({'met' if g['ttft_met'] else 'NOT met'}), load max/mean "
            f"{g['load_max_over_mean']:.2f} ({'met' if g['load_met'] else 'NOT met'})"
        )
    return "\n".join(lines)


def plot(runs: Sequence[Mapping], path: Path) -> Path:
    """Mean TTFT (bars) and engine load max/mean (dots) of every system, per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []
    for run in runs:
        names += [n for n in run["systems"] if n not in names]
    labels = [f"{r['workload']}\n{r['load']}" for r in runs]
    x = np.arange(len(runs))
    width = 0.8 / max(1, len(names))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(runs)), 7), sharex=True)
    for i, name in enumerate(names):
        ttft = [r["systems"].get(name, {}).get("ttft_mean_ms", np.nan) for r in runs]
        load = [r["systems"].get(name, {}).get("load_max_over_mean", np.nan) for r in runs]
        top.bar(x + i * width - 0.4 + width / 2, ttft, width, label=name)
        bottom.plot(x + i * width - 0.4 + width / 2, load, "o", label=name)
    top.set_yscale("log")  # light-load tens of ms beside heavy-load seconds
    top.set_ylabel("TTFT mean (ms, log scale)")
    top.set_title("quillcache bench-live: the same engines behind each system")
    top.legend(fontsize=7, ncol=2)
    bottom.axhline(LOAD_GOAL, color="grey", linestyle="--", linewidth=0.8)
    bottom.set_ylabel("engine load max/mean")
    bottom.set_xticks(x, labels)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
