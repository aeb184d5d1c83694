"""`quillcache bench-index`: every residency-index backend on the same traces.

Traces (index_traces.py), built once and replayed unchanged against memory, lmdb,
rocksdb, fs and art: the fleet simulator's chat and docqa workloads recorded under our
policy (every KV event the simulated engines and store nodes report, and every plan's
prefix lookup, in order), and a synthetic churn trace (puts and LRU evictions at a
steady resident size, lookups, worker restarts).

Per backend, in one run (index_replay.py, index_conductor.py):

- `puts_per_s`: records put / time in the trace's write ops and flushes (the durable
  backend opened as the conductor opens it, `sync_commits=False`, flushed every
  --flush-every write ops);
- `locate_p99_us`: one lookup of a prompt's hash chain (`locate_prefix`, what Plan
  reads), p99 over every lookup of every trace; `prefix_scan_p99_us`: a `prefix_scan`
  of the deepest block found, p99;
- `bytes_written`: bytes the storage layer was asked to write during the replays
  (/proc/self/io write_bytes - cancelled_write_bytes of the child process that ran
  them: journal, pages, WAL, SSTs, compactions and the file system's own metadata);
  `write_amplification` = bytes_written / logical bytes put, the logical size of a
  record being its msgpack encoding as one flat array of its 14 fields (the 8 key
  fields, worker, tier, bytes, last_access_ms, ref_count, pinned: about 130 bytes);
- `recovery_s`: kill -9 mid-write, then reopen until a locate is answered (null for
  memory); `records_lost`: acknowledged (flushed) records missing after that crash;
  `recovery_conductor_s`: the same crashed directory opened behind the conductor's
  in-memory mirror (everything loaded before it serves);
- `resident_bytes`: the KV bytes the index says are resident at the end of each trace
  (IndexMetrics, summed over the traces: the same for every backend when all of them
  ended in the same state, which `state_matches_memory` checks), and beside it what
  the backend costs: `disk_bytes` (its directory at the end of the largest trace);
- `conductor_plan_p99_us`: a real conductor process with `--index-backend NAME`
  (mirror, flush thread every second), fed the recorded traces' events as KV event
  batches and timed on Plan over the plan port as the `gateway` role; pooled over
  --conductor-rounds runs per backend; `conductor_rss_peak_bytes`: that process's
  peak resident set (VmHWM).

Prints a table and ratios to the memory backend and to lmdb (the memory-mapped backend
that reopens at once); writes bench/results/index-<UTC>.json and .png, index-latest.*.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from quillcache_bench.common import render_table, write_results
from quillcache_bench.index_conductor import (
    Feed,
    register_fleet,
    run_conductor,
    trace_nodes,
)
from quillcache_bench.index_replay import crash_and_recover, in_child, replay_backend
from quillcache_bench.index_traces import (
    ChurnConfig,
    FleetTraceConfig,
    Trace,
    churn_trace,
    record_fleet,
)
from quillcache_bench.secure import INSECURE_HELP, bench_certs
from quillcache_core.index import BACKENDS
from quillcache_core.launch.etcd_server import EtcdServer

BASELINE, PERSISTENT_DEFAULT = "memory", "lmdb"

# chat requests, docqa requests, churn resident, churn records put, timed Plans per
# trace and round, conductor rounds
SIZES = {
    "quick": (1500, 450, 30_000, 90_000, 600, 2),
    "full": (4000, 1200, 150_000, 450_000, 2000, 3),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quillcache bench-index",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller traces, 2 crashes per backend, 2 conductor rounds (~3 min)",
    )
    parser.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help="comma-separated, from: " + ", ".join(BACKENDS),
    )
    parser.add_argument(
        "--flush-every",
        type=int,
        default=1000,
        help="write ops between two flush() calls in the replays (the conductor flushes once "
        "a second: a fleet reporting this many events a second)",
    )
    parser.add_argument(
        "--crash-runs", type=int, default=0, help="kill -9 runs per backend (0: 2 quick, 3 full)"
    )
    parser.add_argument(
        "--conductor-plans",
        type=int,
        default=-1,
        help="timed Plans per recorded trace and round in the conductor runs (-1: the "
        "size's default; lookups past it are spread evenly and skipped; 0: no conductor run)",
    )
    parser.add_argument(
        "--conductor-rounds",
        type=int,
        default=0,
        help="conductor runs per backend, the backends' order reversed every other round "
        "(0: 2 quick, 3 full); the Plan samples of every round are pooled",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
    parser.add_argument("--out-dir", default="bench/results")
    return parser


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        print(f"quillcache bench-index: unknown backends {unknown}", file=sys.stderr)
        return 2
    if args.flush_every <= 0:
        print("quillcache bench-index: --flush-every must be positive", file=sys.stderr)
        return 2
    size = "quick" if args.quick else "full"
    chat_n, docqa_n, churn_resident, churn_put, plans, rounds = SIZES[size]
    if args.conductor_plans >= 0:
        plans = args.conductor_plans
    rounds = args.conductor_rounds or rounds
    crash_runs = args.crash_runs or (2 if args.quick else 3)
    started = time.monotonic()

    log(f"bench-index ({size}): recording traces")
    fleet = [
        record_fleet(name, FleetTraceConfig(requests=n, seed=args.seed))
        for name, n in (("chat", chat_n), ("docqa", docqa_n))
    ]
    churn = churn_trace(ChurnConfig(resident=churn_resident, records_put=churn_put, seed=args.seed))
    traces = [*fleet, churn]
    summaries = {t.name: t.summary() for t in traces}
    for t in traces:
        s = summaries[t.name]
        log(
            f"  {t.name}: {s['records_put']:,} records put, {s['removes']:,} removes, "
            f"{s['clears']} clears, {s['lookups']:,} lookups, {s['resident_records_end']:,} "
            f"resident at the end ({time.monotonic() - started:.0f} s)"
        )

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="qc-bench-index-") as tmp_name:
        tmp = Path(tmp_name)
        for name in backends:
            t = time.monotonic()
            log(f"replaying {len(traces)} traces on {name} ...")
            directory = tmp / f"replay-{name}"
            directory.mkdir()
            replay = in_child(replay_backend, name, str(directory), traces, args.flush_every)
            results[name] = {"replay": replay}
            log(f"  {name}: replays done in {time.monotonic() - t:.1f} s")
        rng = random.Random(args.seed)
        for name in backends:
            if name == "memory":
                results[name]["crash"] = []
                continue
            runs = []
            for run in range(crash_runs):
                t = time.monotonic()
                directory = tmp / f"crash-{name}-{run}"
                directory.mkdir()
                runs.append(
                    crash_and_recover(name, str(directory), churn, args.flush_every, 0.6, rng)
                )
                log(
                    f"  {name}: kill -9 run {run + 1}/{crash_runs}: {runs[-1]['acked_ops']:,} "
                    f"ops acked, {runs[-1]['records_lost']} lost, recovery "
                    f"{runs[-1]['recovery_s'] * 1000:.1f} ms ({time.monotonic() - t:.1f} s)"
                )
            results[name]["crash"] = runs
        if plans > 0:
            conductor = asyncio.run(_conductor_phase(args, backends, fleet, tmp, plans, rounds))
            for name in backends:
                results[name]["conductor"] = conductor[name]
        else:
            for name in backends:
                results[name]["conductor"] = None

    figures = {name: _figures(results[name], summaries, traces) for name in backends}
    duration = time.monotonic() - started
    _report(args, size, backends, figures, summaries, crash_runs, plans, rounds, duration)
    return 0


async def _conductor_phase(
    args, backends, traces: list[Trace], tmp: Path, plans: int, rounds: int
) -> dict:
    """`rounds` conductor runs per backend (order reversed every other round, so drift
    in the machine's load does not favour one end of the list); per backend the runs'
    results in a list."""
    feeds = [Feed(trace, plans) for trace in traces]
    engines, stores = trace_nodes(traces)
    out: dict[str, list] = {name: [] for name in backends}
    certs = bench_certs(tmp, args.insecure)
    with EtcdServer(tmp / "etcd", tls_dir=certs) as etcd:
        as_engine, as_store, nodes = await register_fleet(etcd.client_url, certs, engines, stores)
        try:
            for r in range(rounds):
                order = backends if r % 2 == 0 else backends[::-1]
                for name in order:
                    t = time.monotonic()
                    run = await run_conductor(
                        name,
                        tmp / f"conductor-index-{name}-{r}",
                        tmp,
                        certs,
                        etcd.client_url,
                        feeds,
                        nodes,
                        len(engines),
                    )
                    out[name].append(run)
                    p99 = np.percentile(np.asarray(run["plan_s"]) * 1e6, 99)
                    log(
                        f"  {name}: conductor round {r + 1}/{rounds} fed and planned in "
                        f"{time.monotonic() - t:.1f} s, Plan p99 {p99:,.0f} us"
                    )
        finally:
            await as_engine.close()
            await as_store.close()
    return out


def _p(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples, dtype=np.float64) * 1e6, q))


def _figures(result: dict, summaries: dict, traces: list[Trace]) -> dict:
    """The per-backend figures (the JSON's backends.NAME) from its raw measurements."""
    replay = result["replay"]
    names = [t.name for t in traces]
    put = sum(replay[n]["records_put"] for n in names)
    write_s = sum(replay[n]["write_s"] for n in names)
    locate = [s for n in names for s in replay[n]["locate_s"]]
    scan = [s for n in names for s in replay[n]["prefix_scan_s"]]
    written = sum(replay[n]["bytes_written_storage"] for n in names)
    logical = sum(summaries[n]["logical_bytes"] for n in names)
    per_trace = {}
    for n in names:
        r = replay[n]
        per_trace[n] = {
            "puts_per_s": r["records_put"] / r["write_s"] if r["write_s"] else None,
            "write_ops": r["write_ops"],
            "write_s": r["write_s"],
            "put_s": r["put_s"],
            "remove_s": r["remove_s"],
            "flush_s": r["flush_s"],
            "locate_p50_us": _p(r["locate_s"], 50),
            "locate_p99_us": _p(r["locate_s"], 99),
            "prefix_scan_p50_us": _p(r["prefix_scan_s"], 50),
            "prefix_scan_p99_us": _p(r["prefix_scan_s"], 99),
            "bytes_written": r["bytes_written_storage"],
            "bytes_written_syscalls": r["bytes_written_syscalls"],
            "bytes_written_reported": r["bytes_written_reported"],
            "logical_bytes": summaries[n]["logical_bytes"],
            "write_amplification": r["bytes_written_storage"] / summaries[n]["logical_bytes"],
            "resident_blocks": r["resident_blocks"],
            "resident_bytes": r["resident_bytes"],
            "state_matches_memory": tuple(r["fingerprint"]) == summaries[n]["fingerprint"],
            "disk_bytes": r["disk_bytes"],
        }
    crash = result["crash"]
    out = {
        "puts_per_s": put / write_s if write_s else None,
        "put_only_records_per_s": (
            put / sum(replay[n]["put_s"] for n in names)
            if sum(replay[n]["put_s"] for n in names)
            else None
        ),
        "write_s_split": {
            k: sum(replay[n][k] for n in names) for k in ("put_s", "remove_s", "flush_s")
        },
        "locate_p99_us": _p(locate, 99),
        "locate_p50_us": _p(locate, 50),
        "prefix_scan_p99_us": _p(scan, 99),
        "prefix_scan_p50_us": _p(scan, 50),
        "bytes_written": written,
        "logical_bytes": logical,
        "write_amplification": written / logical,
        "bytes_written_syscalls": sum(replay[n]["bytes_written_syscalls"] for n in names),
        "bytes_written_reported": sum(replay[n]["bytes_written_reported"] for n in names),
        "recovery_s": float(np.median([c["recovery_s"] for c in crash])) if crash else None,
        "recovery_conductor_s": (
            float(np.median([c["recovery_conductor_s"] for c in crash])) if crash else None
        ),
        "records_lost": sum(c["records_lost"] for c in crash) if crash else None,
        "resident_bytes": sum(replay[n]["resident_bytes"] for n in names),
        "resident_blocks": sum(replay[n]["resident_blocks"] for n in names),
        "state_matches_memory": all(per_trace[n]["state_matches_memory"] for n in names),
        "disk_bytes": max(replay[n]["disk_bytes"] for n in names),
        "conductor_plan_p99_us": None,
        "conductor_rss_peak_bytes": None,
        "traces": per_trace,
        "crash_runs": crash,
    }
    runs = result.get("conductor")
    if runs:
        plan_s = [s for run in runs for s in run["plan_s"]]
        inside = [s for run in runs for s in run["plan_in_conductor_s"]]
        out["conductor_plan_p99_us"] = _p(plan_s, 99)
        out["conductor_plan_p50_us"] = _p(plan_s, 50)
        out["conductor_plan_in_conductor_p99_us"] = _p(inside, 99)
        out["conductor_plan_p99_us_rounds"] = [_p(run["plan_s"], 99) for run in runs]
        out["conductor_rss_peak_bytes"] = max(run["rss"]["VmHWM"] for run in runs)
        out["conductor"] = [
            {
                "elapsed_s": run["elapsed_s"],
                "index_backend_reported": run["index_backend_reported"],
                "rss": run["rss"],
                "plan_p99_us": _p(run["plan_s"], 99),
                "traces": {
                    n: {
                        "plans": c["plans"],
                        "plan_p50_us": _p(c["plan_s"], 50),
                        "plan_p99_us": _p(c["plan_s"], 99),
                        "plan_in_conductor_p99_us": _p(c["plan_in_conductor_s"], 99),
                        "ingest_s": c["ingest_s"],
                        "events_rejected": c["events_rejected"],
                        "resident_records": c["resident_records"],
                        "expected_records": c["expected_records"],
                    }
                    for n, c in run["traces"].items()
                },
            }
            for run in runs
        ]
    return out


def _ratio(value, base) -> str:
    if value is None or base is None or not base:
        return "-"
    return f"{value / base:.2f}x"


def _mb(n) -> float:
    return n / 1e6


def _report(args, size, backends, figures, summaries, crash_runs, plans, rounds, duration) -> None:
    print()
    print(
        f"Index backends on the same traces ({size}): "
        + "; ".join(
            f"{n} {s['records_put']:,} puts / {s['removes']:,} removes / {s['lookups']:,} lookups"
            for n, s in summaries.items()
        )
    )
    rows = []
    for name in backends:
        f = figures[name]
        rows.append(
            (
                name,
                f["puts_per_s"],
                f["locate_p99_us"],
                f["prefix_scan_p99_us"],
                _mb(f["bytes_written"]),
                f["write_amplification"],
                "-" if f["recovery_s"] is None else f"{f['recovery_s'] * 1000:.1f}",
                "-"
                if f["recovery_conductor_s"] is None
                else f"{f['recovery_conductor_s'] * 1000:.0f}",
                "-" if f["records_lost"] is None else f["records_lost"],
                _mb(f["disk_bytes"]),
                "-"
                if f["conductor_rss_peak_bytes"] is None
                else _mb(f["conductor_rss_peak_bytes"]),
                "-" if f["conductor_plan_p99_us"] is None else f["conductor_plan_p99_us"],
                "-"
                if f["conductor_plan_p99_us"] is None
                else " / ".join(f"{v:,.0f}" for v in f["conductor_plan_p99_us_rounds"]),
            )
        )
    print(
        render_table(
            [
                "backend",
                "puts/s",
                "locate p99 us",
                "scan p99 us",
                "MB written",
                "write amp",
                "recovery ms",
                "mirror load ms",
                "lost",
                "disk MB",
                "conductor RSS MB",
                "conductor Plan p99 us",
                "(per round)",
            ],
            rows,
        )
    )
    for base in (BASELINE, PERSISTENT_DEFAULT):
        if base not in figures:
            continue
        b = figures[base]
        ratio_rows = []
        for name in backends:
            f = figures[name]
            ratio_rows.append(
                (
                    name,
                    _ratio(f["puts_per_s"], b["puts_per_s"]),
                    _ratio(f["locate_p99_us"], b["locate_p99_us"]),
                    _ratio(f["prefix_scan_p99_us"], b["prefix_scan_p99_us"]),
                    _ratio(f["bytes_written"], b["bytes_written"]),
                    _ratio(f["recovery_s"], b["recovery_s"]),
                    _ratio(f["recovery_conductor_s"], b["recovery_conductor_s"]),
                    _ratio(f["conductor_plan_p99_us"], b["conductor_plan_p99_us"]),
                    _ratio(f["conductor_rss_peak_bytes"], b["conductor_rss_peak_bytes"]),
                )
            )
        print()
        print(f"Ratios to {base} (same run):")
        print(
            render_table(
                [
                    "backend",
                    "puts/s",
                    "locate p99",
                    "scan p99",
                    "bytes written",
                    "recovery",
                    "mirror load",
                    "conductor Plan p99",
                    "conductor RSS",
                ],
                ratio_rows,
            )
        )
    same = all(figures[n]["state_matches_memory"] for n in backends)
    print()
    print(
        "every backend ended every trace in the memory backend's state (records, resident "
        f"bytes, records per worker): {'yes' if same else 'NO'}"
    )
    print(
        f"puts/s: records put / time in write ops + flush() every {args.flush_every} write ops "
        "(sync_commits=False, as the conductor); locate: locate_prefix of a prompt's chain; "
        "scan: prefix_scan of the deepest block found"
    )
    print(
        "MB written: the storage layer's write_bytes during the replays; write amp: that / "
        "the records' msgpack size; recovery: kill -9 mid-write -> reopen -> first locate "
        f"(median of {crash_runs}); mirror load: the conductor's reopen (all records into "
        "memory); lost: acknowledged records missing after the crash"
    )
    if plans > 0:
        print(
            "conductor Plan p99: a conductor process per backend (its mirror, flushed every "
            "second), fed the chat and docqa traces' events as KV event batches, Plan over "
            f"the plan port{'' if args.insecure else ' with TLS'}, up to {plans} timed Plans "
            f"per trace and round, {rounds} rounds pooled (order reversed every other round)"
        )
    print(f"\nduration: {duration:.0f} s")

    payload = {
        "config": {
            **vars(args),
            "size": size,
            "crash_runs": crash_runs,
            "conductor_plans": plans,
            "conductor_rounds": rounds,
        },
        "traces": {
            n: {k: v for k, v in s.items() if k != "fingerprint"} for n, s in summaries.items()
        },
        "definitions": {
            "puts_per_s": "records put / seconds in the trace's write ops (puts, removals, "
            f"clears) and flushes (sync_commits=False, flush() every {args.flush_every} "
            "write ops); put_only_records_per_s: records put / seconds in put ops alone; "
            "write_s_split: where the write time went",
            "locate_p99_us": "p99 of one lookup of a prompt's hash chain (locate_prefix), "
            "read from the backend itself",
            "prefix_scan_p99_us": "p99 of prefix_scan(scope, deepest block found)",
            "bytes_written": "/proc/self/io write_bytes - cancelled_write_bytes of the "
            "process that ran the replays (storage-layer bytes, file system metadata "
            "included); bytes_written_syscalls: wchar; bytes_written_reported: "
            "IndexMetrics.bytes_written (each backend's own definition)",
            "logical_bytes": "sum over records put of len(msgpack.packb(the record's 14 "
            "fields as one flat array))",
            "write_amplification": "bytes_written / logical_bytes",
            "recovery_s": "kill -9 mid-write (past 60% of the churn trace's writes), reopen, "
            "until a locate is answered; median over the runs; page cache warm",
            "recovery_conductor_s": "the same crashed directory opened behind the "
            "conductor's in-memory mirror (open_index(mirror=True)) until a locate",
            "records_lost": "records of the acknowledged (flushed) state missing after the "
            "crash and removed by no later op, summed over the runs",
            "resident_bytes": "IndexMetrics.resident_bytes at the end of each trace, summed",
            "conductor_rss_peak_bytes": "VmHWM of the conductor process after its feed "
            "(max over rounds)",
            "disk_bytes": "allocated bytes of the index directory (largest trace)",
            "conductor_plan_p99_us": "p99 of Plan over the plan port (TLS, gateway role) "
            "from this client, a conductor process with --index-backend NAME fed the "
            "recorded traces' events (IngestKvEvents, store role)",
        },
        "duration_s": duration,
        "backends": figures,
    }
    path = write_results("index", payload, args.out_dir)
    png = _plot(backends, figures, path.with_suffix(".png"))
    shutil.copy(png, png.with_name("index-latest.png"))
    print(f"wrote {path} and {png}")


def _plot(backends, figures, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    x = np.arange(len(backends))
    colors = ["tab:gray" if n == BASELINE else "tab:blue" for n in backends]

    def bars(ax, values, title, ylabel, log=False, color=None):
        vals = [0 if v is None else v for v in values]
        ax.bar(x, vals, color=color or colors)
        ax.set_xticks(x, backends)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if log and any(v > 0 for v in vals):
            ax.set_yscale("log")
        for i, v in enumerate(values):
            ax.annotate(
                "n/a" if v is None else f"{v:,.3g}",
                (i, vals[i]),
                ha="center",
                va="bottom",
                fontsize=8,
            )

    f = [figures[n] for n in backends]
    bars(axes[0, 0], [g["puts_per_s"] for g in f], "writes: records put per second", "puts/s", True)
    ax = axes[0, 1]
    ax.bar(x - 0.2, [g["locate_p99_us"] for g in f], 0.4, label="locate_prefix p99")
    ax.bar(x + 0.2, [g["prefix_scan_p99_us"] for g in f], 0.4, label="prefix_scan p99")
    ax.set_xticks(x, backends)
    ax.set_yscale("log")
    ax.set_ylabel("us")
    ax.set_title("reads from the backend (p99)")
    ax.legend(fontsize=8)
    bars(
        axes[0, 2],
        [g["write_amplification"] or None for g in f],
        "write amplification (storage bytes / logical bytes)",
        "x (log)",
        True,
    )
    ax = axes[1, 0]
    for offset, key, label in (
        (-0.2, "recovery_s", "reopen -> first locate"),
        (0.2, "recovery_conductor_s", "behind the conductor's mirror"),
    ):
        values = [None if g[key] is None else g[key] * 1000 for g in f]
        ax.bar(x + offset, [v or 0 for v in values], 0.4, label=label)
        for i, v in enumerate(values):
            if v is not None:
                ax.annotate(f"{v:,.3g}", (i + offset, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, backends)
    ax.set_yscale("log")
    highest = max([g[k] or 0 for g in f for k in ("recovery_s", "recovery_conductor_s")] + [0])
    if highest:
        ax.set_ylim(top=highest * 1000 * 20)  # room for the legend
    ax.set_ylabel("ms (log)")
    ax.set_title("recovery after kill -9 (memory: n/a)")
    ax.legend(fontsize=8, loc="upper left")
    ax = axes[1, 1]
    bars(
        ax,
        [g["conductor_plan_p99_us"] for g in f],
        "conductor Plan p99 over the plan port (dots: rounds)",
        "us",
        color="tab:purple",
    )
    for i, g in enumerate(f):
        rounds = g.get("conductor_plan_p99_us_rounds") or []
        ax.plot([i] * len(rounds), rounds, "k.", markersize=8)
    ax = axes[1, 2]
    ax.bar(x - 0.2, [g["disk_bytes"] / 1e6 for g in f], 0.4, label="disk")
    ax.bar(
        x + 0.2,
        [(g["conductor_rss_peak_bytes"] or 0) / 1e6 for g in f],
        0.4,
        label="conductor peak RSS",
    )
    ax.set_xticks(x, backends)
    ax.set_ylabel("MB")
    ax.set_title("footprint")
    ax.legend(fontsize=8)
    fig.suptitle("Residency index backends on the same traces (fleet chat, docqa; churn)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
