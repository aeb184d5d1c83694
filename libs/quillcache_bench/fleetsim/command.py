"""`quillcache bench`: our planner against the reference routers on a simulated fleet.

Runs the same seeded workloads (multi-tenant chat, long-document QA, one hot prefix)
through the same simulated fleet once per policy (quillcache, dynamo, llm-d, sglang,
round-robin, least-loaded, and the oracle: perfect information), at several Poisson request rates given as multiples of
the fleet's saturation rate: the rate past which its prefill capacity is used up even
with a perfect cache (`Workload.saturation_rate`). Prints a table per workload and the
benchmark's goals (met / NOT met, per rate), writes bench/results/fleet-<UTC>.json,
fleet-latest.{json,png,md}.

`--live ENDPOINTS_JSON` instead drives a running `quillcache up` cluster through its
gateway (see `fleetsim.live`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path

from quillcache_bench.common import Progress, render_table, write_results
from quillcache_bench.fleetsim.figures import OURS, check_goals, summarise
from quillcache_bench.fleetsim.oracle import OraclePolicy
from quillcache_bench.fleetsim.sim import GIB, FleetConfig, FleetSim, StoreWrites
from quillcache_bench.fleetsim.workloads import (
    KV_BYTES_PER_TOKEN,
    WORKLOAD_NAMES,
    Workload,
    make_workload,
)
from quillcache_core.errors import InvalidArgument
from quillcache_core.model import CostModel, SloTarget
from quillcache_core.routing.references import POLICY_NAMES, make_policy

DEFAULT_RATES = "0.1,0.25,0.5,0.75,1.0,1.25"
# Every router of the library, plus the oracle (perfect information; simulator only).
BENCH_POLICIES = (*POLICY_NAMES, "oracle")
# The systems whose engines write every computed block through to their store node:
# every one by default. QuillCache's KV connector does; a reference's engines could run
# a connector that does (LMCache, vLLM's CPU offloading), and with every engine loading
# its own store node's blocks that helps them: the stronger reading of the references.
# `--write-through quillcache,oracle` gives the references on-eviction offload only.
DEFAULT_WRITE_THROUGH = ",".join(BENCH_POLICIES)

MODELLING_NOTES = [
    "Saturation (1.0x) = engines / (min prefill tokens per request x prefill_us_per_token), "
    "where min prefill tokens assumes a perfect unbounded cache: no policy can sustain more.",
    "Prefill: one request at a time per engine, in arrival order; the plan is executed "
    "when the prefill starts: HBM-resident blocks are hits (also unplanned ones, as an "
    "engine's own prefix cache finds them), FETCH blocks load only if the source node "
    "still holds them, the first block that is neither ends the reused prefix.",
    "Decode: concurrent; per token decode_us_per_token + (running_decode_penalty_us / "
    "decode_slowdown_divisor) per other running decode on the engine.",
    "HBM: blocks of running requests are pinned; free cached blocks evict LRU (tail "
    "blocks first) to the engine's store node DRAM, DRAM to SSD, SSD drops.",
    "Write-through (the --write-through policies' engines, as QuillCache's KV connector "
    "does): every block a prefill computes is queued as it is computed and written to the "
    "engine's store node DRAM by one writer per engine at the DRAM price per block; it "
    "reaches the store, and the index, when written; a block computed while the queue "
    "holds write_queue_bytes (256 MiB, the connector's default) is dropped and counted. "
    "Every engine, whatever the policy, can use its own store node's blocks (a FETCH its "
    "plan names); only ours and the oracle plan fetches from peer store nodes.",
    "Only prompt blocks become resident (not generated tokens); the plan's wall-clock "
    "is measured but not added to the simulated TTFT.",
    "Load: the router's in-flight count per engine (queued included), averaged over the "
    "run's span; goal uses max/mean across engines.",
    "Best reference: the best of every other policy in the run except the oracle.",
    "Oracle: knows every engine's HBM, queue and the store nodes' contents exactly and "
    "sends each request where its own TTFT is lowest (fetching from any node); greedy "
    "per request, so a limit of routing with perfect information, not of scheduling.",
    "References see only what they see in reality: Dynamo its KV events and its own "
    "active-block/prefill tracking; llm-d KV events, its speculative entries and "
    "metrics scraped every 50 ms; SGLang its tree of routed prompts and its own "
    "in-flight counts (see routing/references.py).",
    "Plan latency: wall-clock of plan_request inside a worker process; with --jobs > 1 "
    "the runs share the machine's cores, so it is an upper bound.",
    "ttft_est_mean_ms (JSON): our cost function's TTFT estimate for the chosen engine at "
    "plan time, to compare with the simulated ttft_mean_ms.",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quillcache bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--engines", type=int, default=16, help="engines, up to 256")
    fleet.add_argument("--stores", type=int, default=4, help="store nodes, up to 32 (shared)")
    fleet.add_argument("--domains", type=int, default=2, help="locality domains (racks)")
    fleet.add_argument(
        "--hbm-blocks", type=int, default=1024, help="KV blocks each engine's HBM holds"
    )
    fleet.add_argument("--dram-gib", type=float, default=8.0, help="DRAM tier per store node")
    fleet.add_argument("--ssd-gib", type=float, default=32.0, help="SSD tier per store node")
    fleet.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    fleet.add_argument(
        "--decode-slowdown-divisor",
        type=float,
        default=100.0,
        help="per-token slowdown per other running decode = running_decode_penalty_us / this",
    )
    work = parser.add_argument_group("workload")
    work.add_argument(
        "--workloads", default=",".join(WORKLOAD_NAMES), help="comma-separated workloads"
    )
    work.add_argument("--policies", default=",".join(BENCH_POLICIES), help="comma-separated")
    work.add_argument(
        "--write-through",
        default=DEFAULT_WRITE_THROUGH,
        help="policies whose engines write every computed block through to their store "
        "node (comma-separated; 'none' for none); the others offload on eviction only",
    )
    work.add_argument("--requests", type=int, default=1500, help="requests per run")
    work.add_argument(
        "--rates", default=DEFAULT_RATES, help="request rates as multiples of saturation"
    )
    work.add_argument("--seed", type=int, default=1)
    work.add_argument("--slo-ms", type=float, default=SloTarget().ttft_ms, help="TTFT SLO")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="simulations run in parallel"
    )
    parser.add_argument("--out-dir", default="bench/results")
    live = parser.add_argument_group("live mode")
    live.add_argument(
        "--live",
        metavar="ENDPOINTS_JSON",
        default="",
        help="run against a running cluster (the file `quillcache up --endpoints-file` writes)",
    )
    live.add_argument("--live-requests", type=int, default=60, help="requests in live mode")
    live.add_argument(
        "--live-rate", type=float, default=2.0, help="new conversations per second (Poisson)"
    )
    return parser


def _names(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise InvalidArgument(
            f"{flag}: unknown or empty {', '.join(unknown) or '(none)'}; "
            f"choose from {', '.join(allowed)}"
        )
    return names


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise InvalidArgument(f"--rates: not a list of numbers: {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise InvalidArgument("--rates: give positive multiples of saturation, e.g. 0.5,1.0")
    return sorted(set(rates))


def policy_fleet(config: FleetConfig, policy: str, write_through: frozenset[str]) -> FleetConfig:
    """The fleet one policy runs on: `config`, with write-through if the policy has it."""
    if policy in write_through:
        return dataclasses.replace(config, store_writes=StoreWrites.WRITE_THROUGH)
    return config


def _write_through(text: str) -> frozenset[str]:
    if text.strip() == "none":
        return frozenset()
    return frozenset(_names(text, BENCH_POLICIES, "--write-through"))


def fleet_config(args: argparse.Namespace) -> FleetConfig:
    config = FleetConfig(
        engines=args.engines,
        stores=args.stores,
        domains=args.domains,
        hbm_blocks=args.hbm_blocks,
        dram_bytes=int(args.dram_gib * GIB),
        ssd_bytes=int(args.ssd_gib * GIB),
        decode_slowdown_divisor=args.decode_slowdown_divisor,
        cost_model=CostModel(),
    )
    config.validate()
    return config


@functools.lru_cache(maxsize=4)
def _workload(name: str, requests: int, seed: int, block_size: int) -> Workload:
    return make_workload(
        name, requests, seed, block_size=block_size, kv_bytes_per_token=KV_BYTES_PER_TOKEN
    )


def _run_one(task: tuple) -> tuple:
    """One simulation (runs in a worker process); returns its key and figures."""
    workload, multiplier, rate, policy, config, requests, seed, block_size, slo_ms = task
    wl = _workload(workload, requests, seed, block_size)
    arrivals = wl.arrivals_us(rate, seed)
    run = FleetSim(
        config,
        bench_policy(policy, config.cost_model),
        wl.requests,
        arrivals,
        seed=seed,
    ).run()
    return workload, multiplier, policy, summarise(run, slo_ms)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.live:
            from quillcache_bench.fleetsim.live import run_live

            return run_live(args)
        return _simulate(args)
    except InvalidArgument as exc:
        print(f"quillcache bench: {exc}", file=sys.stderr)
        return 2


def _simulate(args: argparse.Namespace) -> int:
    started = time.monotonic()
    config = fleet_config(args)
    workloads = _names(args.workloads, WORKLOAD_NAMES, "--workloads")
    policies = _names(args.policies, BENCH_POLICIES, "--policies")
    write_through = _write_through(args.write_through)
    rates = _rates(args.rates)
    if args.requests <= 0:
        raise InvalidArgument("--requests must be positive")
    if args.block_size <= 0:
        raise InvalidArgument("--block-size must be positive")

    info: dict[str, dict] = {}
    tasks = []
    for name in workloads:
        wl = _workload(name, args.requests, args.seed, args.block_size)
        saturation = wl.saturation_rate(config.engines, config.cost_model)
        info[name] = {
            "description": wl.description,
            "requests": len(wl.requests),
            "mean_prompt_tokens": wl.mean_prompt_tokens(),
            "min_prefill_tokens": wl.min_prefill_tokens(),
            "saturation_rps": saturation,
            "blind_saturation_rps": wl.blind_saturation_rate(config.engines, config.cost_model),
            "rates_rps": {str(m): m * saturation for m in rates},
        }
        for m in rates:
            for policy in policies:
                tasks.append(
                    (
                        name,
                        m,
                        m * saturation,
                        policy,
                        policy_fleet(config, policy, write_through),
                        args.requests,
                        args.seed,
                        args.block_size,
                        args.slo_ms,
                    )
                )
    # Heaviest first (long documents, high rates) so the last job is a short one.
    weight = {n: info[n]["mean_prompt_tokens"] for n in workloads}
    tasks.sort(key=lambda t: -weight[t[0]] * (1 + t[1]))
    print(
        f"fleet: {config.engines} engines, {config.stores} store nodes in {config.domains} "
        f"domains, HBM {config.hbm_blocks} blocks x {args.block_size} tokens per engine, "
        f"DRAM {args.dram_gib:g} GiB + SSD {args.ssd_gib:g} GiB per store node; "
        f"{args.requests} requests per run, {len(tasks)} runs, {args.jobs} jobs; "
        f"write-through: {', '.join(sorted(write_through & set(policies))) or 'none'}",
        file=sys.stderr,
    )

    results: dict[str, dict[float, dict[str, dict]]] = {
        n: {m: {} for m in rates} for n in workloads
    }
    progress = Progress("fleet bench", len(tasks))
    if args.jobs <= 1:
        for task in tasks:
            name, m, policy, figures = _run_one(task)
            results[name][m][policy] = figures
            progress.advance()
    else:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            for name, m, policy, figures in pool.imap_unordered(_run_one, tasks):
                results[name][m][policy] = figures
                progress.advance()
    duration = time.monotonic() - started
    _report(args, config, info, results, workloads, policies, rates, duration)
    return 0


# --- output --------------------------------------------------------------------------


def _report(args, config, info, results, workloads, policies, rates, duration) -> None:
    headers = [
        "rate",
        "req/s",
        "policy",
        "TTFT mean ms",
        "TTFT p99 ms",
        "goodput %",
        "done req/s",
        "out tok/s",
        "hit %",
        "fetch %",
        "recompute %",
        "load max/mean",
        "served max/mean",
        "plan p50 us",
        "plan p99 us",
    ]
    goals: dict[str, dict[str, list[dict]]] = {}
    for name in workloads:
        print()
        print(f"== {name}: {info[name]['description']}")
        print(
            f"   mean prompt {info[name]['mean_prompt_tokens']:.0f} tokens, at least "
            f"{info[name]['min_prefill_tokens']:.0f} to prefill; saturation (1.0x) "
            f"{info[name]['saturation_rps']:.1f} req/s (a cache-blind fleet saturates at "
            f"{info[name]['blind_saturation_rps']:.1f})"
        )
        rows = []
        for m in rates:
            for policy in policies:
                f = results[name][m][policy]
                rows.append(
                    (
                        f"{m:g}x",
                        m * info[name]["saturation_rps"],
                        policy,
                        f["ttft_mean_ms"],
                        f["ttft_p99_ms"],
                        100 * f["goodput"],
                        f["throughput_rps"],
                        f["output_tokens_per_s"],
                        100 * f["hit_share"],
                        100 * f["fetch_share"],
                        100 * f["recompute_share"],
                        f["load_max_over_mean"],
                        f["served_max_over_mean"],
                        f["plan_p50_us"],
                        f["plan_p99_us"],
                    )
                )
        print(render_table(headers, rows))
        goals[name] = {f"{m:g}": check_goals(results[name][m]) for m in rates}

    lines = _goal_lines(goals, workloads, rates)
    print()
    if OURS in policies:
        print(f"Goals for {OURS} (computed from this run, SLO {args.slo_ms:g} ms):")
        for line in lines:
            print(line)
    else:
        print(f"Goals not evaluated: {OURS} was not among --policies.")
    print(f"\nduration: {duration:.0f} s")

    payload = {
        "config": {k: v for k, v in vars(args).items() if not k.startswith("live")},
        "fleet": {
            "engines": config.engines,
            "stores": config.stores,
            "domains": config.domains,
            "hbm_blocks": config.hbm_blocks,
            "dram_bytes": config.dram_bytes,
            "ssd_bytes": config.ssd_bytes,
            "decode_slowdown_divisor": config.decode_slowdown_divisor,
            "write_through": sorted(_write_through(args.write_through) & set(policies)),
            "write_queue_bytes": config.write_queue_bytes,
            "cost_model": {
                k: getattr(config.cost_model, k) for k in config.cost_model.__dataclass_fields__
            },
        },
        "modelling": MODELLING_NOTES,
        "workloads": info,
        "results": [
            {
                "workload": n,
                "rate_multiplier": m,
                "rate_rps": m * info[n]["saturation_rps"],
                "policy": p,
                **results[n][m][p],
            }
            for n in workloads
            for m in rates
            for p in policies
        ],
        "goals": goals,
        "goal_summary": lines,
        "duration_s": duration,
    }
    path = write_results("fleet", payload, args.out_dir)
    png = _plot(info, results, workloads, policies, rates, path.with_suffix(".png"))
    shutil.copy(png, png.with_name("fleet-latest.png"))
    md = Path(args.out_dir) / "fleet-latest.md"
    md.write_text(
        _markdown(
            args, config, info, results, workloads, policies, rates, lines, duration, path.name
        )
    )
    print(f"wrote {path}, {png}, {md}")


def _goal_lines(goals, workloads, rates) -> list[str]:
    lines = []
    for name in workloads:
        per_rate = goals[name]
        names = [g["goal"] for g in next(iter(per_rate.values()), [])]
        lines.append(f"{name}:")
        for goal in names:
            met, missed = [], []
            for m in rates:
                entry = next(g for g in per_rate[f"{m:g}"] if g["goal"] == goal)
                label = f"{m:g}x ({entry['detail']})"
                (met if entry["met"] else missed).append(label)
            lines.append(f"  {goal}:")
            lines.append(f"    met at:     {'; '.join(met) or 'no rate'}")
            lines.append(f"    NOT met at: {'; '.join(missed) or 'no rate'}")
    return lines


def _markdown(
    args, config, info, results, workloads, policies, rates, lines, duration, json_name
) -> str:
    out = [
        "# Fleet benchmark: latest run",
        "",
        f"`quillcache bench` on a simulated fleet of {config.engines} engines and "
        f"{config.stores} store nodes ({config.domains} locality domains), "
        f"{args.requests} requests per run, seed {args.seed}, TTFT SLO {args.slo_ms:g} ms; "
        f"ran in {duration:.0f} s. Rates are multiples of the perfect-cache saturation rate. "
        "Engines that write every computed block through to their store node: "
        f"{', '.join(sorted(_write_through(args.write_through) & set(policies))) or 'none'}"
        " (the others' reach it when evicted). "
        f"Full figures: `{json_name}`.",
        "",
        "![mean TTFT and goodput vs request rate](fleet-latest.png)",
        "",
    ]
    for name in workloads:
        sat = info[name]["saturation_rps"]
        out += [
            f"## {name}",
            "",
            f"{info[name]['description']}. Saturation (1.0x) = {sat:.0f} req/s.",
            "",
            "Mean TTFT in ms (goodput %), per request rate:",
            "",
            "| policy | " + " | ".join(f"{m:g}x ({m * sat:.0f}/s)" for m in rates) + " |",
            "|---|" + "---:|" * len(rates),
        ]
        for p in policies:
            cells = [
                f"{results[name][m][p]['ttft_mean_ms']:,.0f} ({100 * results[name][m][p]['goodput']:.0f}%)"
                for m in rates
            ]
            out.append(f"| {p} | " + " | ".join(cells) + " |")
        out.append("")
    out += ["## Goals (ours vs the others, per rate)", "", "```", *lines, "```", ""]
    return "\n".join(out)


def _plot(info, results, workloads, policies, rates, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = len(workloads)
    fig, axes = plt.subplots(2, cols, figsize=(4.6 * cols, 7.2), squeeze=False, sharex="col")
    for c, name in enumerate(workloads):
        sat = info[name]["saturation_rps"]
        x = [m * sat for m in rates]
        top, bottom = axes[0][c], axes[1][c]
        for p in policies:
            style = {"linewidth": 2.6, "color": "black"} if p == OURS else {"linewidth": 1.3}
            top.plot(
                x,
                [results[name][m][p]["ttft_mean_ms"] for m in rates],
                marker="o",
                label=p,
                **style,
            )
            bottom.plot(
                x,
                [100 * results[name][m][p]["goodput"] for m in rates],
                marker="o",
                label=p,
                **style,
            )
        top.set_yscale("log")
        top.set_title(name)
        top.set_ylabel("mean TTFT (ms, log)")
        bottom.set_ylabel("goodput (% within SLO)")
        bottom.set_xlabel("request rate (req/s)")
        bottom.set_ylim(-3, 103)
        for ax in (top, bottom):
            ax.axvline(sat, color="grey", linestyle=":", linewidth=1)
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Simulated fleet: TTFT and goodput vs request rate (dotted: saturation)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bench_policy(name: str, cost_model: CostModel):
    """A fresh policy for one simulation: a library router by name, or the oracle."""
    if name == "oracle":
        return OraclePolicy(cost_model)
    return make_policy(name, _router_cost_model(name, cost_model))


def _router_cost_model(policy: str, cost_model):
    """Ours prices queueing at prefill speed, as the conductor does by default."""
    return cost_model.queue_at_prefill_speed() if policy == "quillcache" else cost_model
