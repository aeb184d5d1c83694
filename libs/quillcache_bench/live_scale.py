"""`quillcache bench-live --scenario scale`: scale-in and scale-out without losing the
cache, live, on a fleet under steady load.

The local cluster as bench-live starts it (etcd, conductors, two store nodes, transfer,
the gateway; mutual TLS on sim engines, plaintext with `--engine vllm`), with
`--scale-engines` engines (default 3). One load runs through the whole scenario: docqa
over a fixed set of hot documents (`hot_docqa`: 12 documents of 1,500-3,500 words over
4 tenants, Zipf popularity, a fresh question of 100-250 words each request: enough
prefill that the fleet is busy, so an added engine is worth its loads) at
`--scale-rps`, every request asking the gateway to explain its plan
(`x-quillcache-explain: 1`). Phases, the first two `--phase-s` long (60 s; 20 with
--quick):

1. steady: TTFT p50/p99 (over its last two thirds: the documents' first, cold requests
   are in its first third);
2. drain: the engine holding the most blocks in the conductor's index is drained as
   the operator does it (`quillcache drain`'s code path, `launch.drain.drain`, the
   endpoints' operator certificate). Requests failed through the phase (goal 0), and
   TTFT p99 from the drain's start to its end (at least 10 s: the requests it moves)
   against steady's (goal <= 1.3x). Then, for each document whose last request before
   the drain the drained engine served, its first request served elsewhere: the share
   planned as pool loads (FETCH, from the x-quillcache-* headers), the share not
   recomputed (goal >= 95%: a pool load, or a hit on an engine that held the document
   too), and its TTFT against the run's other pool loads of the same document (goal:
   within 1.5x of their median; the run's pool loads' and recomputes' medians beside);
3. scale-out: an engine is added (`LocalCluster.add_engine`, as the topology lays the
   next one out; a real vLLM server with `--engine vllm`), and watched for
   `--scale-window-s` (40 s) once it joined: seconds until its cached-token share (the
   engine's own hits plus pool loads, as it delivered them, over its last 5 requests)
   reaches the other engines' over the 10 s before (goal <= 30 s), and the plans of its
   first 20 requests for documents asked before it joined (goal: at most 5%
   recomputed; they load from the pool).

The whole run's predicted-vs-delivered figures (`live_report.prediction_errors`) are
reported beside.

With `--scale-prewarm-top N` the gateway runs `--prewarm-top N`: the new engine gets the
hot prefixes before it takes traffic (its first requests then hit its own cache).
Prints each phase as it goes, a table, the goals and a README-ready summary; writes
bench/results/scale-<UTC>.json, scale-latest.json and scale-latest.png (with
`--engine vllm`: scale-vllm-*).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from quillcache_bench.common import render_table, write_results
from quillcache_bench.live_report import plan_kind, prediction_errors
from quillcache_bench.live_workloads import Sample, Session, Target, Turn, drive

TENANTS = [f"tenant-{i}" for i in range(4)]
DOCUMENTS = 12
ZIPF = 0.8  # a document's popularity: 1 / rank^ZIPF
GOAL_FAILED = 0
GOAL_MOVED_CACHED = 0.95  # a drained engine's prefixes served from a cache, not recomputed
DRAIN_WINDOW_S = 10.0  # the drain window: its start to its end, at least this long
GOAL_DRAIN_P99 = 1.3  # drain window's TTFT p99 over steady's
GOAL_MOVED_TTFT = 1.5  # a drained engine's prefix served elsewhere over a pool load's
GOAL_CATCH_UP_S = 30.0  # until a new engine's cached share is the fleet's
GOAL_RECOMPUTE = 0.05  # a new engine's first requests for hot prefixes, recomputed
FIRST_REQUESTS = 20
SHARE_WINDOW = 5  # a new engine's requests its share is taken over
FLEET_WINDOW_S = 10.0  # the other engines' requests its share is compared with
SHARE_SLACK = 0.02


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scenario",
        choices=("cells", "scale"),
        default="cells",
        help="cells: the systems x workloads race (default); scale: drain and scale-out "
        "under load, QuillCache alone (live_scale)",
    )
    p.add_argument(
        "--scale-engines", type=int, default=3, help="scale: engines at the start (one is added)"
    )
    p.add_argument("--scale-rps", type=float, default=10.0, help="scale: requests a second")
    p.add_argument(
        "--phase-s",
        type=float,
        default=0.0,
        help="scale: seconds of the steady and the drain phase (default 60, 20 with --quick)",
    )
    p.add_argument(
        "--scale-window-s",
        type=float,
        default=40.0,
        help="scale: seconds the added engine is watched",
    )
    p.add_argument(
        "--scale-prewarm-top",
        type=int,
        default=0,
        help="scale: the gateway's --prewarm-top (0: off, the new engine loads from the pool)",
    )


# --- the workload ---------------------------------------------------------------------


def hot_docqa(
    n: int, rate_rps: float, seed: int, nonce: str, size_scale: float = 1.0
) -> list[Session]:
    """`n` one-question sessions over DOCUMENTS documents (Zipf popularity), Poisson at
    `rate_rps`; each session's id names its document. Deterministic for its arguments."""
    rng = random.Random(f"hot-docqa/{seed}")
    head = f"[{nonce}] "

    def words(low: int, high: int) -> str:
        low, high = max(1, int(low * size_scale)), max(1, int(high * size_scale))
        return " ".join(f"w{rng.randrange(5000)}" for _ in range(rng.randint(low, high)))

    instruction = {
        t: head + f"You answer {t}'s questions about documents. " + words(50, 150) for t in TENANTS
    }
    docs = [(TENANTS[i % len(TENANTS)], words(1500, 3500)) for i in range(DOCUMENTS)]
    weights = [1 / (i + 1) ** ZIPF for i in range(DOCUMENTS)]
    out, start = [], 0.0
    for _ in range(n):
        start += rng.expovariate(rate_rps)
        i = rng.choices(range(DOCUMENTS), weights)[0]
        tenant, text = docs[i]
        question = f"Document:\n{text}\n\nQuestion: {words(100, 250)}?"
        turn = Turn(question, rng.randint(40, 120), 0.0)
        out.append(Session(tenant, f"doc-{i}", start, instruction[tenant], (turn,)))
    return out


# --- figures (pure) -------------------------------------------------------------------


def _ttft_ms(samples: list[Sample]) -> np.ndarray:
    return np.array([s.ttft_s * 1000 for s in samples if s.ok and s.ttft_s is not None])


def latency(samples: list[Sample]) -> dict:
    """Requests, errors and TTFT p50/p99 (ms; None without a timed request)."""
    ttft = _ttft_ms(samples)
    return {
        "requests": len(samples),
        "errors": sum(not s.ok for s in samples),
        "ttft_p50_ms": float(np.percentile(ttft, 50)) if ttft.size else None,
        "ttft_p99_ms": float(np.percentile(ttft, 99)) if ttft.size else None,
    }


def engine_of(s: Sample) -> str:
    return s.plan.get("engine", "")


def cached_share(s: Sample) -> float | None:
    """The share of the request's prompt its engine did not compute (as it reported)."""
    delivered = (s.explain.get("delivered") or {}).get("cached_tokens")
    if not isinstance(delivered, int) or s.prompt_tokens <= 0:
        return None
    return delivered / s.prompt_tokens


def moved_prefixes(before: list[Sample], after: list[Sample], drained: str) -> list[Sample]:
    """For each document whose last request in `before` the drained engine served, the
    first request of it in `after` another engine served."""
    owner: dict[str, str] = {}
    for s in sorted(before, key=lambda s: s.sent_s):
        if s.ok:
            owner[s.session] = engine_of(s)
    firsts: dict[str, Sample] = {}
    for s in sorted(after, key=lambda s: s.sent_s):
        if owner.get(s.session) == drained and s.ok and engine_of(s) not in ("", drained):
            firsts.setdefault(s.session, s)
    return list(firsts.values())


def kind_of(s: Sample) -> str | None:
    """What the request's plan mostly did: hit, fetch or compute (live_report), or
    fallback (the gateway planned it: no conductor answered in time)."""
    if s.plan.get("plan") == "fallback":
        return "fallback"
    return plan_kind(s.plan)


def kinds(samples: list[Sample]) -> dict[str, int]:
    """Requests by `kind_of`."""
    out: dict[str, int] = {}
    for s in samples:
        kind = kind_of(s)
        if kind is not None:
            out[kind] = out.get(kind, 0) + 1
    return out


def median_ttft(samples: list[Sample]) -> float | None:
    ttft = _ttft_ms(samples)
    return float(np.median(ttft)) if ttft.size else None


def vs_pool_loads(moved: list[Sample], others: list[Sample]) -> float | None:
    """The median over `moved` of each one's TTFT over the median TTFT of the other
    pool loads (`others` planned as fetches) of the same document: documents differ in
    length, so each is held against its own; None when no moved one has such a load."""
    loads: dict[str, list[Sample]] = {}
    for s in others:
        if plan_kind(s.plan) == "fetch":
            loads.setdefault(s.session, []).append(s)
    ratios = []
    for s in moved:
        ref = median_ttft(loads.get(s.session, []))
        if ref and s.ok and s.ttft_s is not None:
            ratios.append(s.ttft_s * 1000 / ref)
    return float(np.median(ratios)) if ratios else None


def catch_up_s(samples: list[Sample], new: str, adding: float, added: float) -> float | None:
    """Seconds from `added` (every conductor sees the new engine; its start was asked
    at `adding`) until its cached share over its last SHARE_WINDOW requests reaches the
    other engines' over the FLEET_WINDOW_S before (less SHARE_SLACK); None if it never
    does. A request sent before `added` counts at `added`."""
    timed = sorted((s for s in samples if s.ok and s.sent_s >= adding), key=lambda s: s.sent_s)
    mine: list[float] = []
    for s in timed:
        if engine_of(s) != new or cached_share(s) is None:
            continue
        mine.append(cached_share(s))
        if len(mine) < min(3, SHARE_WINDOW):
            continue
        fleet = [
            cached_share(o)
            for o in timed
            if engine_of(o) != new
            and s.sent_s - FLEET_WINDOW_S <= o.sent_s <= s.sent_s
            and cached_share(o) is not None
        ]
        if not fleet or np.mean(mine[-SHARE_WINDOW:]) >= np.mean(fleet) - SHARE_SLACK:
            return round(max(0.0, s.sent_s - added), 2)
    return None


def scale_figures(samples: list[Sample], marks: dict, drained: str, new: str) -> dict:
    """The scenario's figures from its samples and its marks (perf_counter times:
    start, steady_from, drain_start, drain_end, adding (the engine's start was asked),
    added (every conductor sees it), end)."""

    def between(a: float, b: float) -> list[Sample]:
        return [s for s in samples if a <= s.sent_s < b]

    steady = between(marks["steady_from"], marks["drain_start"])
    adding = marks["adding"]
    window_end = min(max(marks["drain_end"], marks["drain_start"] + DRAIN_WINDOW_S), adding)
    window = between(marks["drain_start"], window_end)
    after_drain = between(marks["drain_start"], adding)
    moved = moved_prefixes(between(marks["start"], marks["drain_start"]), after_drain, drained)
    moved_ids = {id(s) for s in moved}
    others = [s for s in samples if id(s) not in moved_ids]
    pool = median_ttft([s for s in others if plan_kind(s.plan) == "fetch"])
    recompute = median_ttft([s for s in others if plan_kind(s.plan) == "compute"])
    moved_ttft = median_ttft(moved)
    hot = {s.session for s in samples if s.sent_s < adding}
    on_new = sorted((s for s in samples if engine_of(s) == new and s.ok), key=lambda s: s.sent_s)
    first = [s for s in on_new if s.session in hot][:FIRST_REQUESTS]
    first_kinds = kinds(first)
    steady_fig, window_fig = latency(steady), latency(window)
    p99_ratio = (
        window_fig["ttft_p99_ms"] / steady_fig["ttft_p99_ms"]
        if window_fig["ttft_p99_ms"] and steady_fig["ttft_p99_ms"]
        else None
    )
    return {
        "steady": steady_fig,
        "drain": {
            "engine": drained,
            "took_s": round(marks["drain_end"] - marks["drain_start"], 2),
            "window_s": round(window_end - marks["drain_start"], 2),
            **window_fig,
            "failed_through_drain": sum(not s.ok for s in after_drain),
            "p99_vs_steady": p99_ratio,
            "moved_prefixes": len(moved),
            "moved_kinds": kinds(moved),
            "moved_pool_load_share": kinds(moved).get("fetch", 0) / len(moved) if moved else None,
            "moved_cached_share": (1 - kinds(moved).get("compute", 0) / len(moved))
            if moved
            else None,
            "moved_ttft_median_ms": moved_ttft,
            "pool_load_ttft_median_ms": pool,
            "recompute_ttft_median_ms": recompute,
            "moved_vs_pool_load": vs_pool_loads(moved, others),
        },
        "scale_out": {
            "engine": new,
            "requests": len(on_new),
            "start_s": round(marks["added"] - adding, 2),
            "errors": sum(not s.ok for s in samples if s.sent_s >= adding),
            "catch_up_s": catch_up_s(samples, new, adding, marks["added"]),
            "first_hot_requests": len(first),
            "first_kinds": first_kinds,
            "first_recompute_share": first_kinds.get("compute", 0) / len(first) if first else None,
            "ttft_p50_ms": latency(on_new)["ttft_p50_ms"],
        },
        "prediction": prediction_errors(samples),
    }


def scale_goals(f: dict) -> list[dict]:
    """Each goal: its value, limit and verdict (met None: nothing to judge it by)."""
    d, s = f["drain"], f["scale_out"]

    def goal(name: str, value, limit: float, at_most: bool = True) -> dict:
        met = None if value is None else (value <= limit if at_most else value >= limit)
        return {"goal": name, "value": value, "limit": limit, "met": met}

    return [
        goal("requests failed through the drain", d["failed_through_drain"], GOAL_FAILED),
        goal("drain window TTFT p99 / steady's", d["p99_vs_steady"], GOAL_DRAIN_P99),
        goal(
            "drained prefixes served from the pool or a cache, not recomputed (share)",
            d["moved_cached_share"],
            GOAL_MOVED_CACHED,
            at_most=False,
        ),  # fmt: skip
        goal("drained prefixes' TTFT / a pool load's", d["moved_vs_pool_load"], GOAL_MOVED_TTFT),
        goal("new engine: seconds to the fleet's cached share", s["catch_up_s"], GOAL_CATCH_UP_S),
        goal(
            f"new engine: first {FIRST_REQUESTS} hot requests recomputed (share)",
            s["first_recompute_share"],
            GOAL_RECOMPUTE,
        ),  # fmt: skip
    ]


def _verdict(met) -> str:
    return {True: "met", False: "NOT met", None: "not judged"}[met]


def _num(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def report_text(f: dict, found: list[dict]) -> str:
    """The phases' table, the goals and a README-ready summary."""
    d, s, st = f["drain"], f["scale_out"], f["steady"]
    rows = [
        ("steady", st["requests"], st["errors"], _num(st["ttft_p50_ms"]),
         _num(st["ttft_p99_ms"]), ""),
        (f"drain {d['engine']} (took {d['took_s']:.1f} s)", d["requests"], d["errors"],
         _num(d["ttft_p50_ms"]), _num(d["ttft_p99_ms"]),
         f"{d['moved_prefixes']} prefixes moved: {d['moved_kinds']}"),
        (f"scale-out {s['engine']}", s["requests"], s["errors"], _num(s["ttft_p50_ms"]), "-",
         f"first hot requests: {s['first_kinds']}"),
    ]  # fmt: skip
    table = render_table(["phase", "requests", "errors", "TTFT p50 ms", "p99 ms", ""], rows)
    goals = "\n".join(
        f"  {g['goal']}: {_num(g['value'])} (limit {g['limit']:g}): {_verdict(g['met'])}"
        for g in found
    )
    p = f["prediction"]
    predicted = (
        f"Predicted vs delivered over the run ({p['pred_requests']} requests, "
        f"{p['pred_fallback_plans']} planned by the gateway itself): cached-token MAE "
        f"{100 * p['pred_mae_share']:.1f}% of prompt tokens ({p['pred_mae_tokens']:.0f} "
        f"tokens), |TTFT error| p50 {_num(p.get('pred_ttft_abs_err_p50_ms'))} ms, p90 "
        f"{_num(p.get('pred_ttft_abs_err_p90_ms'))} ms"
        if p.get("pred_requests")
        else "Predicted vs delivered: no explained request"
    )
    return f"{table}\n\n{predicted}\n\nGoals:\n{goals}\n\n{summary(f)}"


def summary(f: dict) -> str:
    """The scenario in two README bullets."""
    d, s, st = f["drain"], f["scale_out"], f["steady"]
    moved = d["moved_pool_load_share"]
    drain = (
        f"- **Drain under load:** {d['failed_through_drain']} requests failed; TTFT p99 "
        f"{_num(d['ttft_p99_ms'])} ms through the drain against {_num(st['ttft_p99_ms'])} ms "
        f"steady ({_num(d['p99_vs_steady'])}x); the drained engine's "
        f"{d['moved_prefixes']} hot prefixes were served elsewhere "
        + (
            f"{100 * moved:.0f}% as pool loads, {100 * d['moved_cached_share']:.0f}% not "
            f"recomputed ({_kinds_text(d['moved_kinds'])})"
            if moved is not None
            else "(none asked again)"
        )
        + f", median TTFT {_num(d['moved_ttft_median_ms'])} ms, "
        f"{_num(d['moved_vs_pool_load'])}x a pool load of the same document (the run's "
        f"pool loads {_num(d['pool_load_ttft_median_ms'])} ms, recomputes "
        f"{_num(d['recompute_ttft_median_ms'])} ms)."
    )
    share = s["first_recompute_share"]
    if not s["requests"]:
        reached = "took no request in the window"
    elif s["catch_up_s"] is None:
        reached = "did not reach the fleet's cached share in the window"
    else:
        reached = f"reached the fleet's cached share after {s['catch_up_s']:.1f} s"
    scale = (
        f"- **Scale-out under load:** the added engine {reached}"
        + f"; of its first {s['first_hot_requests']} requests for hot prefixes "
        + (f"{100 * share:.0f}% were recomputed" if share is not None else "none came")
        + (f" ({_kinds_text(s['first_kinds'])})." if s["first_kinds"] else ".")
    )
    return f"{drain}\n{scale}"


def _kinds_text(found: dict[str, int]) -> str:
    names = {"hit": "engine hits", "fetch": "pool loads", "compute": "recomputes",
             "fallback": "gateway-planned"}  # fmt: skip
    return ", ".join(f"{n} {names.get(k, k)}" for k, n in sorted(found.items()))


def plot(samples: list[Sample], marks: dict, new: str, path: Path) -> Path:
    """TTFT of every request over time by engine, the drain and the addition marked; and
    the new engine's cached share against the others'."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = marks["start"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for engine in sorted({engine_of(s) for s in samples}):
        mine = [s for s in samples if engine_of(s) == engine and s.ok and s.ttft_s is not None]
        top.plot([s.sent_s - t0 for s in mine], [s.ttft_s * 1000 for s in mine], ".",
                 markersize=3, label=engine or "(failed)")  # fmt: skip
        shares = [(s.sent_s - t0, cached_share(s)) for s in mine if cached_share(s) is not None]
        if engine == new and shares:
            bottom.plot(*zip(*shares, strict=True), "o", markersize=3, label=f"{engine} (added)")
    others = [
        (s.sent_s - t0, cached_share(s))
        for s in samples
        if engine_of(s) != new and s.ok and cached_share(s) is not None
    ]
    if others:
        bottom.plot(*zip(*others, strict=True), ".", markersize=2, alpha=0.4, label="the others")
    for ax in (top, bottom):
        for name, color in (("drain_start", "red"), ("drain_end", "red"), ("adding", "green")):
            ax.axvline(marks[name] - t0, color=color, linestyle="--", linewidth=0.8)
    top.set_yscale("log")
    top.set_ylabel("TTFT (ms, log)")
    top.set_title("bench-live --scenario scale: drain (red) and an engine added (green)")
    top.legend(fontsize=7, ncol=3)
    bottom.set_ylabel("cached share of the prompt\n(engine hits + pool loads)")
    bottom.set_xlabel("seconds into the run")
    bottom.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the run ----------------------------------------------------------------------------


def main(args) -> int:
    phase_s = args.phase_s or (20.0 if args.quick else 60.0)
    window_s = args.scale_window_s
    if phase_s <= 0 or window_s <= 0 or args.scale_rps <= 0 or args.scale_engines < 2:
        raise SystemExit(
            "quillcache bench-live --scenario scale: --phase-s, --scale-window-s and "
            "--scale-rps must be positive, --scale-engines at least 2"
        )
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        data_dir = Path(
            args.data_dir
            or stack.enter_context(tempfile.TemporaryDirectory(prefix="quillcache-scale-"))
        )
        print(f"starting {args.scale_engines} {args.engine} engines and QuillCache", flush=True)
        cluster, endpoints = _start_cluster(args, data_dir)
        stack.callback(cluster.stop)
        print(f"up in {time.monotonic() - started:.0f}s in {data_dir}", flush=True)
        found = _run(args, cluster, endpoints, phase_s, window_s)
    samples, marks, drained, new, drain_report = found
    figures = scale_figures(samples, marks, drained, new)
    goals = scale_goals(figures)
    print()
    print(report_text(figures, goals))
    t0 = marks["start"]
    payload = {
        "figures": figures,
        "goals": goals,
        "drain_report": drain_report,
        "marks_s": {k: round(v - t0, 3) for k, v in marks.items()},
        # each request: [sent at s, TTFT ms, engine, plan kind, document, answered,
        # the plan's blocks [hit, fetched, recomputed], the cached tokens delivered]
        "timeline": [
            [
                round(s.sent_s - t0, 3),
                None if s.ttft_s is None else round(s.ttft_s * 1000, 1),
                engine_of(s),
                kind_of(s),
                s.session,
                s.ok,
                [s.plan.get(f"{k}-blocks") for k in ("hit", "fetch", "recompute")],
                (s.explain.get("delivered") or {}).get("cached_tokens"),
            ]
            for s in sorted(samples, key=lambda s: s.sent_s)
        ],
        "config": {
            "quick": args.quick,
            "engine": args.engine,
            "engines": args.scale_engines,
            "rate_rps": args.scale_rps,
            "phase_s": phase_s,
            "scale_window_s": window_s,
            "prewarm_top": args.scale_prewarm_top,
            "time_scale": args.time_scale,
            "prompt_scale": _prompt_scale(args),
            "seed": args.seed,
            "documents": DOCUMENTS,
            "elapsed_s": round(time.monotonic() - started, 1),
        },
    }
    name = "scale" if args.engine == "sim" else "scale-vllm"
    path = write_results(name, payload, args.out_dir)
    png = plot(samples, marks, new, path.with_suffix(".png"))
    shutil.copy(png, png.with_name(f"{name}-latest.png"))
    print(f"\nwrote {path} and {png} (also {name}-latest.*)")
    return 0


def _prompt_scale(args) -> float:
    return args.prompt_scale or (0.12 if args.engine == "vllm" else 1.0)


def _start_cluster(args, data_dir: Path):
    from quillcache_bench.live_bench import sim_shape_args, start_live_cluster

    shape = sim_shape_args()
    # the engine added later (index scale_engines) is shaped alike
    options = (
        {i: {"sim_args": shape} for i in range(args.scale_engines + 1)}
        if args.engine == "sim"
        else {}
    )
    prewarm = ["--prewarm-top", str(args.scale_prewarm_top)] if args.scale_prewarm_top else []
    return start_live_cluster(
        args,
        data_dir,
        args.scale_engines,
        options,
        gateway_args=prewarm,
        what="bench-live --scenario scale",
        # No router runs in this scenario, so nothing needs plaintext: TLS as
        # `quillcache up` runs it, on vLLM engines too.
        insecure=False,
    )


def _run(args, cluster, endpoints, phase_s: float, window_s: float):
    """Drive the load through the phases; returns (samples, marks, drained, added,
    the drain's report)."""
    from quillcache_core.security.credentials import tenant_context

    target = Target(endpoints["gateway_url"], tenant_context(endpoints), endpoints["api_keys"],
                    cluster.model, explain=True)  # fmt: skip
    planned_s = 2 * phase_s + window_s
    # Arrivals planned past the window by what starting an engine may take (a vLLM
    # server's cold start); the load stops `window_s` after the engine joined.
    horizon_s = planned_s + (300.0 if args.engine == "vllm" else 30.0)
    nonce = hashlib.sha256(f"scale|{args.seed}".encode()).hexdigest()[:12]
    sessions = hot_docqa(
        max(4, round(args.scale_rps * horizon_s)), args.scale_rps, args.seed, nonce,
        _prompt_scale(args),
    )  # fmt: skip
    progress = _Ticker()
    found: dict[str, list[Sample]] = {}
    stop = threading.Event()
    marks = {"start": time.perf_counter()}

    def load() -> None:
        found["samples"] = asyncio.run(drive(target, sessions, on_done=progress.advance, stop=stop))

    driver = threading.Thread(target=load, name="scale-load", daemon=True)
    driver.start()
    marks["steady_from"] = marks["start"] + phase_s / 3
    _sleep_until(marks["start"] + phase_s)
    drained = _busiest(endpoints)
    print(f"\nsteady phase done; draining {drained} under load", file=sys.stderr, flush=True)
    marks["drain_start"] = time.perf_counter()
    drain_report = _drain(endpoints, drained)
    marks["drain_end"] = time.perf_counter()
    print(f"{drained} drained in {marks['drain_end'] - marks['drain_start']:.1f}s: "
          f"{drain_report}", file=sys.stderr, flush=True)  # fmt: skip
    _sleep_until(marks["start"] + 2 * phase_s)
    print("adding an engine under load", file=sys.stderr, flush=True)
    marks["adding"] = time.perf_counter()
    new = cluster.add_engine(timeout_s=300.0).name
    marks["added"] = time.perf_counter()
    print(f"{new} joined ({marks['added'] - marks['start']:.0f}s into the run); watching it "
          f"for {window_s:.0f}s", file=sys.stderr, flush=True)  # fmt: skip
    _sleep_until(marks["added"] + window_s)
    stop.set()
    driver.join()
    marks["end"] = time.perf_counter()
    return found.get("samples", []), marks, drained, new, drain_report


class _Ticker:
    """Requests answered so far, printed every few seconds (the phases are printed as
    they begin)."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.done = 0
        self.every_s = every_s
        self.began = self._last = time.monotonic()

    def advance(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            print(f"scale: {self.done} requests answered in {now - self.began:.0f}s",
                  file=sys.stderr, flush=True)  # fmt: skip


def _sleep_until(at: float) -> None:
    delay = at - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def _busiest(endpoints: dict) -> str:
    """The engine holding the most blocks in the conductor's index (the hot documents
    it served last): draining it moves the most prefixes."""
    import grpc

    from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
    from quillcache_core.security.credentials import operator_tls
    from quillcache_core.security.tls import grpc_channel

    with grpc_channel(endpoints["conductor"], operator_tls(endpoints), aio=False) as channel:
        try:
            stats = conductor_pb2_grpc.ConductorStub(channel).Stats(
                conductor_pb2.StatsRequest(), timeout=10.0
            )
        except grpc.RpcError as exc:
            raise SystemExit(f"the conductor did not answer Stats: {exc.code().name}") from None
    return max(stats.engines, key=lambda e: e.resident_blocks).engine_id


def _drain(endpoints: dict, engine_id: str) -> dict:
    """`quillcache drain ENGINE_ID` as the operator runs it (its code path, in-process)."""
    from quillcache_core.launch import drain

    args = argparse.Namespace(engine_id=engine_id, timeout_s=60.0, save_blocks=None)
    try:
        return drain.drain(endpoints, args)
    except drain.DrainFailed as exc:
        return {"engine_id": engine_id, "failed": str(exc)}
