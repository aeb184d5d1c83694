"""The benchmark's figures for one run, and the goals checked across policies.

Pure arithmetic over a `RunResult`; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from quillcache_bench.fleetsim.sim import RunResult

OURS = "quillcache"
BASELINE = "round-robin"
ORACLE = "oracle"

# The fleet goals, with their thresholds.
TTFT_VS_ROUND_ROBIN = 1 / 3
TTFT_VS_BEST_REFERENCE = 0.8
TTFT_VS_ORACLE = 1.3
GOODPUT_MARGIN = 0.10
MAX_LOAD_RATIO = 1.5


def summarise(run: RunResult, slo_ms: float) -> dict[str, float | int]:
    """The figures of one run (times in ms unless the name says otherwise).

    - ttft: arrival to first token; goodput: share of requests with TTFT <= slo_ms.
    - throughput: completed requests and generated tokens per second of the run's
      span (first arrival to last completion).
    - hit/fetch/recompute shares: of all prompt tokens, as the engines executed them.
    - load: per engine, in-flight requests averaged over the span (the router's own
      count, queued requests included) and requests served; max over mean.
    - plan latency: wall-clock of `plan_request`, µs.
    """
    ttft_ms = (run.first_token_us - run.arrival_us) / 1000.0
    span_s = max((float(np.nanmax(run.done_us)) - float(run.arrival_us.min())) / 1e6, 1e-9)
    prompt = int(run.prompt_tokens.sum())
    load_mean = float(run.load_avg.mean())
    served_mean = float(run.served.mean())
    plan_us = run.plan_s * 1e6
    return {
        "requests": int(len(run.arrival_us)),
        "completed": int(run.completed),
        "ttft_mean_ms": float(np.mean(ttft_ms)),
        "ttft_p50_ms": float(np.percentile(ttft_ms, 50)),
        "ttft_p99_ms": float(np.percentile(ttft_ms, 99)),
        # Our cost function's estimate for the chosen engine at plan time (any policy):
        # how well the CostModel predicts the simulated TTFT.
        "ttft_est_mean_ms": float(np.mean(run.est_ttft_us)) / 1000.0,
        "goodput": float(np.mean(ttft_ms <= slo_ms)),
        "throughput_rps": run.completed / span_s,
        "output_tokens_per_s": float(run.output_tokens.sum()) / span_s,
        "prompt_tokens_per_s": prompt / span_s,
        "span_s": span_s,
        "hit_share": float(run.hit_tokens.sum()) / prompt,
        "fetch_share": float(run.fetch_tokens.sum()) / prompt,
        "recompute_share": float(run.recompute_tokens.sum()) / prompt,
        "load_max_over_mean": float(run.load_avg.max()) / load_mean if load_mean > 0 else 1.0,
        "load_mean_inflight": load_mean,
        "served_max_over_mean": float(run.served.max()) / served_mean if served_mean else 1.0,
        "plan_p50_us": float(np.percentile(plan_us, 50)),
        "plan_p99_us": float(np.percentile(plan_us, 99)),
        "stale_hit_blocks": int(run.stale_hits),
        "stale_fetch_blocks": int(run.stale_fetches),
        "unplanned_hit_blocks": int(run.unplanned_hits),
        "unplanned_fetch_blocks": int(run.unplanned_fetches),
        "hbm_overcommits": int(run.overcommits),
        "written_through_blocks": int(run.written_through),
        "write_through_drops": int(run.write_drops),
    }


def check_goals(by_policy: Mapping[str, Mapping[str, float]]) -> list[dict]:
    """The fleet benchmark's goals for one workload and rate, from each policy's figures.

    "Best reference" is the best of every other policy in the run (the reference
    routers and the floor baselines alike) except the oracle, which has a goal of its
    own (ours within 1.3x of it, when it ran). A goal whose comparison policy is
    missing from the run is reported as not evaluated (met=None).
    """
    ours = by_policy.get(OURS)
    if ours is None:
        return []
    # Sorted, so ties resolve the same way whatever order the runs finished in.
    others = {name: by_policy[name] for name in sorted(by_policy) if name not in (OURS, ORACLE)}
    goals: list[dict] = []

    rr = by_policy.get(BASELINE)
    ratio = ours["ttft_mean_ms"] / rr["ttft_mean_ms"] if rr else None
    goals.append(
        _goal(
            "mean TTFT <= 1/3 of round robin",
            ratio,
            ratio is not None and ratio <= TTFT_VS_ROUND_ROBIN,
            f"{ratio:.2f}x round robin" if ratio is not None else "round robin not run",
        )
    )
    if others:
        best_name = min(others, key=lambda n: others[n]["ttft_mean_ms"])
        ratio = ours["ttft_mean_ms"] / others[best_name]["ttft_mean_ms"]
        goals.append(
            _goal(
                "mean TTFT <= 0.8x best reference",
                ratio,
                ratio <= TTFT_VS_BEST_REFERENCE,
                f"{ratio:.2f}x {best_name}",
            )
        )
        best_name = max(others, key=lambda n: others[n]["goodput"])
        margin = ours["goodput"] - others[best_name]["goodput"]
        ceiling = others[best_name]["goodput"] + GOODPUT_MARGIN > 1.0
        goals.append(
            _goal(
                "goodput >= best reference + 10 points",
                margin,
                margin >= GOODPUT_MARGIN - 1e-12,
                f"{100 * margin:+.1f} points vs {best_name}"
                + (" (unreachable: the best reference is above 90%)" if ceiling else ""),
            )
        )
    else:
        for name in ("mean TTFT <= 0.8x best reference", "goodput >= best reference + 10 points"):
            goals.append(_goal(name, None, False, "no reference policy run"))
    oracle = by_policy.get(ORACLE)
    if oracle is not None:
        ratio = ours["ttft_mean_ms"] / oracle["ttft_mean_ms"]
        goals.append(
            _goal(
                "mean TTFT <= 1.3x oracle",
                ratio,
                ratio <= TTFT_VS_ORACLE,
                f"{ratio:.2f}x oracle",
            )
        )
    load = ours["load_max_over_mean"]
    goals.append(
        _goal("max/mean load <= 1.5", load, load <= MAX_LOAD_RATIO, f"{load:.2f} max/mean")
    )
    return goals


def _goal(name: str, value: float | None, met: bool, detail: str) -> dict:
    return {
        "goal": name,
        "value": value,
        "met": bool(met) if value is not None else None,
        "detail": detail,
    }
