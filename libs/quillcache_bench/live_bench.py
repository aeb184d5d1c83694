"""`quillcache bench-live [--quick]`: QuillCache against the real sglang-router and
vllm-router, live, in front of the same engines.

One set of engines runs for the whole benchmark: the local cluster as `quillcache up`
starts it (etcd, conductor, two store nodes, transfer, gateway; mutual TLS, the engine
credential), with 4 sim engines (or, with `--engine vllm`, real vLLM servers on CPU).
Each system in turn gets the same seeded workloads (chat, docqa, mix, decode; see
`live_workloads`) at a light and a heavy request rate:

- `quillcache`: the cluster's gateway (HTTPS, tenants' API keys), as deployed (every
  engine `both`: colocated);
- `quillcache-split` (decode workload only): the same gateway and engines, the engines
  given prefill/decode roles in place (`--split-roles`): disaggregated;
- `smg-cache_aware`: SMG 1.13.0 (`smg launch --policy cache_aware`, PyPI `smg`, the
  SGLang model gateway), its defaults;
- `sglang-router-cache_aware`, `sglang-router-round_robin`: the real sglang-router
  0.3.2 with its defaults (cache threshold 0.3, balance thresholds 64 and 1.5, ...);
- `vllm-router-cache_aware`, `vllm-router-consistent_hash`: the real vllm-router 0.1.17,
  defaults likewise; consistent_hash keys on the `X-Session-ID` header every request
  carries (the conversation, or the document asked about);
- `round-robin`: vllm-router's round_robin.

The routers speak plain HTTP to workers; vllm-router has no client-certificate or CA
flags, so no router is given the engines' mutual-TLS port (SMG could speak it; plain
HTTP costs it less, the stronger reading): each sim engine opens a
second, plain listener (`--plain-http-port`, loopback, no credential) that the routers
use, while the gateway keeps using the engines' TLS port. Same engines, same caches,
same counters. With `--engine vllm` (vLLM has one port) the whole cluster runs
`--insecure` for everyone.

The sim engines run with 16 KiB KV blocks on every workload (`KV_SHAPE`), and save what
they compute to their store nodes (`--store-writes computed`, as QuillCache's KV
connector does) only in QuillCache's rows; behind a router they write nothing there.
Likewise real vLLM engines bypass their KV connector while a router's rows run (its
`bypass_file`): no pool lookup, load or save, as vLLM without it.
Before each run every engine's prefix cache is emptied, and every prompt of a run opens
with a nonce of that run, so no system inherits another's cache (the stores included).
Real vLLM engines are warmed up first, before any system runs (`--engine-warmup-s`: every
workload straight to the engines in turn), so the first system does not pay for it.
Per run: TTFT (send to first content chunk, streaming) mean/p50/p99, completed
requests per second, errors, the engines' served requests max/mean and cached prompt
token share (from the engines' own counters), and the control path's CPU seconds
(gateway + conductor for QuillCache, the router process for the others; /proc).
QuillCache's rows add its plans against what the engines delivered, request by request
(`x-quillcache-explain: 1`): the cached-token MAE (tokens, and as a share of prompt
tokens) and the TTFT prediction's absolute error (median, p90), judged against "MAE <
5% of prompt tokens" where the cell's working set fits the fleet's caches (W/C <= 1:
estimated from the cell's distinct text, in the vLLM model's own tokens on vLLM, over
the engines' KV capacity as they publish it).
`--scenario scale` runs `live_scale` instead: drain and scale-out under load.
The decode workload (long outputs) runs with the sim engines switched in place to a
decode-heavy shape for every system alike (`DECODE_SETTINGS`: `--decode-step-ms`
decode steps, prefills stalling decodes as in vLLM without chunked prefill), at
`--decode-rps`; its figures add inter-token latency
(mean, p50, p99 over every gap between a stream's content chunks) and the disaggregation
goal (split ITL p99 <= 0.7x colocated, mean TTFT <= 1.1x). With `--quick` it runs
only QuillCache's two rows and sglang-router cache_aware.
Writes bench/results/live-<UTC>.json, live-latest.json and live-latest.png (with
`--engine vllm`: live-vllm-<UTC>.json, live-vllm-latest.json and live-vllm-latest.png).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from statistics import mean

from quillcache_bench import live_capacity, live_peers, live_scale
from quillcache_bench.capacity_workloads import WORKLOADS as CAPACITY_WORKLOADS
from quillcache_bench.common import Progress, write_results
from quillcache_bench.live_counters import (
    LOOKUPS,
    connector_lookups,
    gateway_counters,
    learned,
    plan_fallbacks,
    stage_means,
)
from quillcache_bench.live_report import (
    SPLIT,
    by_plan_kind,
    goals,
    goals_text,
    itl_table,
    plot,
    prediction_goals,
    prediction_text,
    split_goals,
    split_goals_text,
    summarise,
    table,
)
from quillcache_bench.live_systems import (
    ROUTERS,
    SMG,
    SYSTEMS,
    Engine,
    RouterError,
    paused,
    start_router,
    trees_cpu_s,
)
from quillcache_bench.live_workloads import (
    ITL_WORKLOADS,
    WORKLOADS,
    Target,
    drive,
    make_sessions,
    working_set_tokens,
)
from quillcache_core.errors import InvalidArgument
from quillcache_core.security.credentials import tenant_context

LOADS = ("light", "heavy")
ALL_WORKLOADS = (*WORKLOADS, *CAPACITY_WORKLOADS)
TENANTS = [f"tenant-{i}" for i in range(8)]
# After a router's runs: what QuillCache's continued processes need to renew their leases
# and connections before they are measured again.
RESUME_SETTLE_S = 5.0
QUICK_ITL_SYSTEMS = ("quillcache", SPLIT, SMG, "sglang-router-cache_aware")
# The sim engines' KV block shape on every workload, the same for every system: 16 KiB
# blocks (2 layers x K,V x 16 tokens x 2 heads x 64 dims x fp16). On a GPU node a block
# loads from host DRAM about ten times faster than it prefills (2 MiB at tens of GB/s
# against 16 tokens at 45 us each); this machine moves 1 MiB blocks through its stores
# slower than it simulates their prefill, 16 KiB ones about as a GPU node does. The
# gateway and the conductors are told the same size (--block-bytes), as an operator
# configures them for the model.
KV_SHAPE = {"kv_layers": 2, "kv_heads": 2, "head_dim": 64}
BLOCK_BYTES = KV_SHAPE["kv_layers"] * 2 * 16 * KV_SHAPE["kv_heads"] * KV_SHAPE["head_dim"] * 2
# The decode workload's timing, the same for every system (the step is added from
# --decode-step-ms).
DECODE_SETTINGS = {"prefill_stalls_decodes": True, **KV_SHAPE}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="quillcache bench-live",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="short runs: under 6 minutes on 2 cores")
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim", help="the engines")
    p.add_argument(
        "--engines", type=int, default=0, help="engines (default 4; 2 on the capacity workloads)"
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="sim engines' compute time multiplier: 1.0 = the cost model's real time "
        "(45 us a prompt token, 80 us an output token); `quillcache up` uses 0.02",
    )
    p.add_argument(
        "--systems",
        default="",
        help=f"comma-separated systems (default {','.join(SYSTEMS)}; on the capacity "
        f"workloads {','.join(live_capacity.SYSTEMS)}, with --quick "
        f"{','.join(live_capacity.QUICK_SYSTEMS)})",
    )
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated: {', '.join(WORKLOADS)}, or the capacity workloads "
        f"{', '.join(CAPACITY_WORKLOADS)} (live_capacity: real vLLM, the working set "
        "outgrowing the engines' caches)",
    )
    p.add_argument("--loads", default=",".join(LOADS), help="comma-separated: light, heavy")
    p.add_argument("--light-rps", type=float, default=4.0, help="light load, requests/s")
    p.add_argument("--heavy-rps", type=float, default=24.0, help="heavy load, requests/s")
    p.add_argument(
        "--duration-s",
        type=float,
        default=0.0,
        help="seconds of arrivals per run (default 30, 4 with --quick)",
    )
    p.add_argument(
        "--conductors",
        type=int,
        default=0,
        help="QuillCache's conductor replicas (default: as many as `quillcache up` starts)",
    )
    p.add_argument(
        "--prompt-scale",
        type=float,
        default=0.0,
        help="multiplies every prompt's length (default 1, 0.12 with --engine vllm: the "
        "tiny model's context is 2,048 tokens)",
    )
    p.add_argument(
        "--decode-rps",
        default="1,4",
        help="the decode workload's light and heavy request rates (its streams are long)",
    )
    p.add_argument(
        "--decode-duration-s",
        type=float,
        default=0.0,
        help="seconds of arrivals per decode run (default: --duration-s's, at least 8)",
    )
    p.add_argument(
        "--decode-step-ms", type=float, default=25.0, help="decode step on the decode workload"
    )
    p.add_argument(
        "--split-roles",
        default="prefill,prefill,decode,decode",
        help="engines' roles for quillcache-split, in engine order (engine i uses store "
        "i %% 2: the default pairs each decode engine with a prefill engine on its store)",
    )
    p.add_argument(
        "--engine-warmup-s",
        type=float,
        default=-1.0,
        help="before the first system: seconds of every workload at the heavy rate sent "
        "straight to the engines in turn, unmeasured (default: 30 with --engine vllm, "
        "whose first minutes are slow, else 0)",
    )
    live_capacity.add_arguments(p)
    live_scale.add_arguments(p)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--data-dir", default="", help="cluster data and logs (default: a temp dir)")
    return p


def _names(text: str, known, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise InvalidArgument(f"--{what}: unknown {unknown}; choose from {', '.join(known)}")
    return names


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.scenario == "scale":
        return live_scale.main(args)
    if live_capacity.is_capacity(_names(args.workloads, ALL_WORKLOADS, "workloads")):
        return live_capacity.main(args)
    args.engines = args.engines or 4
    args.systems = args.systems or ",".join(SYSTEMS)
    systems = _names(args.systems, SYSTEMS, "systems")
    workloads = _names(args.workloads, WORKLOADS, "workloads")
    loads = _names(args.loads, LOADS, "loads")
    duration = args.duration_s or (4.0 if args.quick else 30.0)
    rates = {"light": args.light_rps, "heavy": args.heavy_rps}
    decode_rates = dict(zip(LOADS, (float(r) for r in args.decode_rps.split(",")), strict=True))
    cells = [(w, load) for w in workloads for load in loads]
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        data_dir = Path(
            args.data_dir
            or stack.enter_context(tempfile.TemporaryDirectory(prefix="quillcache-live-"))
        )
        print(f"starting {args.engines} {args.engine} engines and QuillCache", flush=True)
        cluster, endpoints = _start_cluster(args, data_dir)
        stack.callback(cluster.stop)
        engines = _engines(cluster, args.engine)
        count = _token_count(args, cluster)
        model = cluster.model
        live = [c for c in cluster.children if c.proc is not None]
        # Our control path: the gateway and every conductor replica.
        ours = [c.proc.pid for c in live if c.service in ("gateway", "conductor")]
        everything_ours = {c.name: c.proc.pid for c in live if not c.name.startswith("engine")}
        quillcache = Target(
            endpoints["gateway_url"],
            tenant_context(endpoints),
            endpoints["api_keys"],
            model,
            explain=True,
        )
        warm_s = args.engine_warmup_s
        if warm_s < 0:
            warm_s = args.engine_warmup_s = 30.0 if args.engine == "vllm" else 0.0
        if warm_s > 0:
            print(f"warming the engines up: {warm_s:.0f}s of each workload", flush=True)
            _engine_warm_up(args, engines, workloads, model, warm_s)
        print(
            f"{args.engines} {args.engine} engines and QuillCache ({args.conductors} "
            f"conductors) up in {time.monotonic() - started:.0f}s in {data_dir}; "
            f"{len(systems)} systems x {len(cells)} runs"
        )
        results: dict[tuple[str, str], dict] = {}
        details: dict[tuple[str, str], dict] = {}
        total = sum(len(_cells(args, system, cells)) for system in systems)
        done = 0
        baseline = [e.settings() for e in engines] if args.engine == "sim" else []
        for system in systems:
            router = None
            routed = system not in ("quillcache", SPLIT)
            if args.engine == "vllm":
                # A router's deployment has no pool: behind one the vLLM engines run as
                # without the connector (no lookups, loads or saves), the stronger reference.
                _bypass_connector(data_dir, routed)
            if routed:
                router = _router(system, [e.url for e in engines], data_dir / "logs")
                if router is None:
                    done += len(_cells(args, system, cells))
                    continue
            hold = contextlib.ExitStack()
            if routed:  # ours stand still while a router is measured
                hold.enter_context(paused(list(everything_ours.values()), RESUME_SETTLE_S))
            try:
                target = quillcache if router is None else Target(router.url, None, {}, model)
                pids = ours if router is None else [router.proc.pid]
                for workload, load in _cells(args, system, cells):
                    done += 1
                    label = f"[{done}/{total}] {system} {workload}/{load}"
                    gateway0 = gateway_counters(endpoints) if router is None else {}
                    _shape(args, engines, baseline, system, workload)
                    timed = workload in ITL_WORKLOADS
                    rate = decode_rates[load] if timed else rates[load]
                    seconds = _decode_seconds(args, duration) if timed else duration
                    figures, detail = _run(
                        args, system, workload, load, rate, seconds, target, engines,
                        pids, everything_ours, label, endpoints, count,
                    )  # fmt: skip
                    if router is None:
                        gateway1 = gateway_counters(endpoints)
                        detail["gateway_plan_fallbacks"] = plan_fallbacks(gateway0, gateway1)
                        detail["conductors_learned"] = learned(endpoints)
                        detail["gateway_stages_ms"] = stage_means(gateway0, gateway1)
                    results.setdefault((workload, load), {})[system] = figures
                    details.setdefault((workload, load), {})[system] = detail
                    itl = (
                        f", ITL mean {figures['itl_mean_ms']:.1f} p99 "
                        f"{figures['itl_p99_ms']:.1f} ms"
                        if "itl_p99_ms" in figures
                        else ""
                    )
                    print(
                        f"{label}: TTFT mean {figures['ttft_mean_ms']:.1f} ms{itl}, "
                        f"errors {figures['errors']}, load max/mean "
                        f"{figures['load_max_over_mean']:.2f}, cached "
                        f"{100 * figures['cached_token_share']:.0f}%, CPU "
                        f"{figures['control_cpu_s']:.2f} s"
                        + (
                            f", {detail['gateway_plan_fallbacks']:.0f} plan fallbacks"
                            if "gateway_plan_fallbacks" in detail
                            else ""
                        )
                        + f" ({time.monotonic() - started:.0f}s)",
                        file=sys.stderr,
                        flush=True,
                    )
            finally:
                if router is not None:
                    router.stop()
                hold.close()
        if baseline:
            _restore(engines, baseline)
        capacity = _fleet_kv_tokens(args, cluster, engines)
    runs = [
        {
            "workload": w,
            "load": load,
            "rate_rps": (decode_rates if w in ITL_WORKLOADS else rates)[load],
            "systems": results[(w, load)],
            "w_over_c": _w_over_c(details.get((w, load), {}), capacity),
        }
        for w, load in cells
        if (w, load) in results
    ]
    _report(args, runs, details, rates, decode_rates, duration, time.monotonic() - started)
    return 0


def _warm_up(target: Target, workload: str, system: str, scale: float) -> None:
    """A few short requests of the workload through `system` first (unmeasured): its
    connections, and on a split the engines' data-port connections, are up before the
    measured run, so a run's first seconds measure no handshakes. Every system alike:
    before each decode run, and before every run on real vLLM engines."""
    sessions = make_sessions(workload, 8, 8.0, 0, f"warm-{system}", size_scale=scale)
    short = [replace(s, turns=tuple(replace(t, max_tokens=8) for t in s.turns)) for s in sessions]
    asyncio.run(drive(target, short, cutoff_s=20.0))


def _prompt_scale(args) -> float:
    """Prompt lengths' multiplier: --prompt-scale, else 0.12 on real vLLM (the tiny
    model's 2,048-token context), 1 on the sim engines."""
    return args.prompt_scale or (0.12 if args.engine == "vllm" else 1.0)


def _engine_warm_up(args, engines, workloads, model: str, seconds: float) -> None:
    """Every workload at the heavy rate for `seconds`, straight to the engines in turn
    (unmeasured), before any system runs. On real vLLM a run's figures improved through
    the whole benchmark, whichever system ran first: sglang-router cache_aware's chat
    light mean TTFT was 30-33 ms run after QuillCache and 54 ms run first, so the first
    system paid for the engines' warming (`_warm_up`, 8 requests, was not enough)."""
    scale = _prompt_scale(args)
    rate = float(args.heavy_rps)
    for workload in [w for w in workloads if w not in ITL_WORKLOADS]:
        n = max(len(engines), round(rate * seconds))
        sessions = make_sessions(workload, n, rate, 0, "engine-warm-up", size_scale=scale)

        async def every_engine(sessions=sessions):
            shares = [sessions[i :: len(engines)] for i in range(len(engines))]
            await asyncio.gather(
                *(
                    drive(Target(engine.url, None, {}, model), share, cutoff_s=seconds)
                    for engine, share in zip(engines, shares, strict=True)
                    if share
                )
            )

        asyncio.run(every_engine())


def _router(system: str, workers: list[str], log_dir: Path):
    """The router started (a second try on a failed start: its free ports may have
    been taken meanwhile by another process), or None: the bench goes on without it."""
    for attempt in (1, 2):
        try:
            if system == SMG:
                return live_peers.start_smg(workers, log_dir)
            return start_router(system, workers, log_dir)
        except (RouterError, live_peers.PeerUnavailable) as exc:
            print(f"{system} did not start (try {attempt}): {exc}", file=sys.stderr, flush=True)
    return None


def _decode_seconds(args, duration: float) -> float:
    """Arrivals of a decode run: --decode-duration-s, else --duration-s's but at least
    8 s (a stream lasts 5-10 s; the stalls show once streams overlap steadily); 6 s
    with --quick (a smoke test: the quick run stays under 6 minutes)."""
    return args.decode_duration_s or (6.0 if args.quick else max(duration, 8.0))


def _cells(args, system: str, cells: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The runs `system` takes part in: quillcache-split only the timed workloads (with
    sim engines); with --quick those only QUICK_ITL_SYSTEMS."""
    out = []
    for workload, load in cells:
        timed = workload in ITL_WORKLOADS
        if system == SPLIT and (not timed or args.engine != "sim"):
            continue
        if timed and args.quick and system not in QUICK_ITL_SYSTEMS:
            continue
        out.append((workload, load))
    return out


def _shape(args, engines: list[Engine], baseline: list[dict], system: str, workload: str):
    """Put the sim engines in the shape of this run: the decode workload's (and for
    quillcache-split its roles), else the shape they started with; saving computed
    blocks to the stores only for QuillCache's rows."""
    if not baseline:
        return
    # QuillCache's KV connector saves what an engine computes to its store node; an
    # engine behind a router has no such connector (and pays nothing for it).
    ours = {"store_writes": "computed" if system in ("quillcache", SPLIT) else "none"}
    if workload in ITL_WORKLOADS:
        roles = [r.strip() for r in args.split_roles.split(",")] if system == SPLIT else []
        step_us = int(args.decode_step_ms * 1000 / max(args.time_scale, 1e-9))
        wanted = [
            {**DECODE_SETTINGS, "decode_us_per_token": step_us, **ours,
             "role": roles[i] if i < len(roles) else "both"}
            for i in range(len(engines))
        ]  # fmt: skip
    else:
        wanted = [{**b, **ours} for b in baseline]
    changed = False
    for engine, want in zip(engines, wanted, strict=True):
        now = engine.settings()
        if any(now[k] != v for k, v in want.items()):
            engine.settings(want)
            changed = changed or now["role"] != want.get("role", now["role"])
    if changed:
        time.sleep(1.5)  # the conductors see the engines' new records (roles)


def _restore(engines: list[Engine], baseline: list[dict]) -> None:
    for engine, want in zip(engines, baseline, strict=True):
        with contextlib.suppress(OSError, ValueError):
            engine.settings(want)


def _bypass_file(data_dir: Path) -> Path:
    """While this file exists the vLLM engines' KV connector is bypassed: requests are
    served as by vLLM without it (no pool lookup, load or save), as behind a router."""
    return data_dir / "connector-bypass"


def _bypass_connector(data_dir: Path, bypass: bool) -> None:
    path = _bypass_file(data_dir)
    if bypass:
        path.touch()
    else:
        path.unlink(missing_ok=True)


def _start_cluster(args, data_dir: Path):
    shape = sim_shape_args()
    options = (
        {i: {"sim_args": ["--plain-http-port", "0", *shape]} for i in range(args.engines)}
        if args.engine == "sim"
        else {
            i: {"connector_bypass_file": str(_bypass_file(data_dir))} for i in range(args.engines)
        }
    )
    return start_live_cluster(args, data_dir, args.engines, options, what="bench-live")


def sim_shape_args() -> list[str]:
    """The sim engines' KV shape (KV_SHAPE) as their flags."""
    return [
        a for name, value in KV_SHAPE.items() for a in (f"--{name.replace('_', '-')}", str(value))
    ]


def start_live_cluster(
    args,
    data_dir: Path,
    engines: int,
    engine_options: dict,
    *,
    gateway_args=(),
    what: str,
    insecure: bool | None = None,
):
    """The cluster every live run drives: `engines` engines of `args.engine`, two store
    nodes, the conductor replicas of `args.conductors` (default: as `quillcache up`
    starts), the tenants' API keys, sim-sized blocks on sim engines; (cluster, endpoints).
    `insecure` None: plaintext with vLLM engines only (the races' rule, below)."""
    from quillcache_core.launch.cluster import ClusterError, LocalCluster
    from quillcache_core.launch.up import build_parser as up_parser

    args.conductors = args.conductors or int(up_parser().get_default("conductors"))
    sized = ["--block-bytes", str(BLOCK_BYTES)] if args.engine == "sim" else []
    cluster = LocalCluster(
        data_dir,
        engines=engines,
        stores=2,
        time_scale=args.time_scale,
        engine_kind=args.engine,
        model="sim-model" if args.engine == "sim" else "tiny",
        engine_options=engine_options,
        # Real vLLM has one port, and the routers cannot present client certificates:
        # with vLLM every system, ours included, runs in plaintext.
        insecure=args.engine == "vllm" if insecure is None else insecure,
        conductors=args.conductors,
        extra_args={"gateway": [*sized, *gateway_args], "conductor": sized},
        log=lambda *_: None,
    )
    cluster.api_keys = {t: f"qc-{t}-{hashlib.sha256(t.encode()).hexdigest()[:12]}" for t in TENANTS}
    try:
        endpoints = cluster.start(timeout_s=120.0)
    except ClusterError as exc:
        raise SystemExit(f"quillcache {what}: the cluster did not start: {exc}") from None
    return cluster, endpoints


def _engines(cluster, kind: str) -> list[Engine]:
    out = []
    for child in cluster.children:
        if not child.name.startswith("engine-") or child.name.endswith("-registration"):
            continue
        if kind == "sim":
            out.append(Engine(child.name, child.fields["plain_http"], "sim"))
        else:
            out.append(Engine(child.name, child.fields["http"], "vllm"))
    return out


def _run(
    args, system, workload, load, rate, duration, target, engines, pids, ours_all, label,
    endpoints, count=None,
) -> tuple[dict, dict]:  # fmt: skip
    scale = _prompt_scale(args)
    # Real vLLM engines are slow for their first requests after a start: without this,
    # the first system's first run (QuillCache's) would pay for everyone.
    if workload in ITL_WORKLOADS or args.engine == "vllm":
        _warm_up(target, workload, system, scale)
    for engine in engines:
        engine.reset_cache()
    time.sleep(0.3)  # the conductor applies the engines' AllBlocksCleared
    cell = f"{workload}/{load}/{args.seed}"
    nonce = hashlib.sha256(f"{system}|{cell}".encode()).hexdigest()[:12]
    seed = int(hashlib.sha256(cell.encode()).hexdigest()[:8], 16)
    n = max(4, round(rate * duration))
    sessions = make_sessions(workload, n, rate, seed, nonce, size_scale=scale)
    before = [e.counters() for e in engines]
    lookups0 = connector_lookups(endpoints)
    groups = {"": pids} | {name: [pid] for name, pid in ours_all.items()}
    cpu0 = trees_cpu_s(groups)  # "": the measured system's; by name: each of ours
    progress = Progress(label, n)
    samples = asyncio.run(
        drive(target, sessions, on_done=progress.advance, cutoff_s=max(3 * duration, 20.0))
    )
    cpu1 = trees_cpu_s(groups)
    each = {name: round(cpu1[name] - cpu0[name], 3) for name in ours_all}
    lookups1 = connector_lookups(endpoints)
    served = [e.counters().minus(b) for e, b in zip(engines, before, strict=True)]
    figures = summarise(samples, served, cpu1[""] - cpu0[""], itl=workload in ITL_WORKLOADS)
    detail = {
        "requests": len(samples),
        "working_set_tokens": working_set_tokens(sessions, count=count),
        "served_per_engine": [c.requests for c in served],
        "fetched_blocks": sum(c.fetched_blocks for c in served),
        "quillcache_processes_cpu_s": round(sum(each.values()), 3),
        # each QuillCache process's CPU seconds over the run, whichever system it was
        "quillcache_cpu_s_by_process": each,
        "first_errors": [s.error for s in samples if s.error][:3],
    }
    for field in LOOKUPS:
        if field in lookups0 and field in lookups1:
            detail[field] = round(lookups1[field] - lookups0[field], 3)
    detail["slowest"] = _slowest(samples)
    kinds = by_plan_kind(samples)
    if kinds:
        detail["ttft_by_plan_kind"] = kinds
    plans = Counter(s.disagg for s in samples if s.disagg)
    if plans:  # how QuillCache carried the requests out: split, colocated, fallback
        detail["disagg_plans"] = dict(plans)
    split = [s for s in samples if s.ok and s.prefill_ms and s.ttft_s is not None]
    if split:  # where a split's TTFT went: the prefill call, then the decode call
        detail["split_requests"] = len(split)
        detail["split_prefill_call_ms_mean"] = round(mean(s.prefill_ms for s in split), 1)
        detail["split_after_prefill_ms_mean"] = round(
            mean(s.ttft_s * 1000 - s.prefill_ms for s in split), 1
        )
    return figures, detail


def _slowest(samples: list, count: int = 3) -> list[dict]:
    """The run's slowest first tokens: when each was sent (seconds into the run), its
    TTFT, and for QuillCache the plan's headers (engine, hit, fetch and recompute blocks,
    estimated TTFT): what a mean dominated by a few seconds-long TTFTs is made of."""
    timed = [s for s in samples if s.ok and s.ttft_s is not None]
    if not timed:
        return []
    start = min(s.sent_s for s in samples)
    return [
        {
            "sent_at_s": round(s.sent_s - start, 2),
            "ttft_ms": round(s.ttft_s * 1000, 1),
            **s.plan,
        }
        for s in sorted(timed, key=lambda s: s.ttft_s, reverse=True)[:count]
    ]


def _fleet_kv_tokens(args, cluster, engines: list[Engine]) -> int | None:
    """The engines' KV capacity in tokens: the sim engines' HBM blocks of 16 tokens, or
    what each vLLM engine publishes of its cache (None when one does not)."""
    if args.engine == "sim":
        return args.engines * cluster.hbm_blocks * 16
    found = [e.kv_tokens() for e in engines]
    return None if None in found else sum(found)


def _token_count(args, cluster):
    """How many tokens a paragraph is to the cluster's engines: None on sim engines
    (their built-in tokenizer: 2 a word), else the vLLM model's own tokenizer."""
    if args.engine == "sim":
        return None
    from quillcache_core.identity.tokenize import ModelTokenizer
    from quillcache_core.launch import vllm_env

    env = vllm_env.find(build_model=False)
    directory = cluster.vllm_model_dir or (env.model_dir if env is not None else None)
    if directory is None:
        return None
    tokenizer = ModelTokenizer(directory)
    return lambda text: len(tokenizer.encode(text))


def _w_over_c(systems: dict, capacity: int | None) -> float | None:
    """A cell's working set over the fleet's KV capacity (QuillCache's run of it)."""
    working = systems.get("quillcache", {}).get("working_set_tokens")
    if not working or not capacity:
        return None
    return round(working / capacity, 3)


def _report(args, runs, details, rates, decode_rates, duration, elapsed) -> None:
    print()
    print(table(runs))
    found = goals(runs)
    print()
    print(goals_text(found))
    predicted = prediction_goals([{**r, "cell": f"{r['workload']}/{r['load']}"} for r in runs])
    if predicted:
        print()
        print(prediction_text(predicted))
    timed = itl_table(runs)
    split_found = split_goals(runs)
    if timed:
        print()
        print(timed)
    if split_found:
        print()
        print(split_goals_text(split_found))
    payload = {
        "runs": runs,
        "goals": found,
        "split_goals": split_found,
        "prediction_goals": predicted,
        "details": [
            {"workload": w, "load": load, "systems": systems}
            for (w, load), systems in details.items()
        ],
        "config": {
            "quick": args.quick,
            "engine": args.engine,
            "engines": args.engines,
            "conductors": args.conductors,
            "time_scale": args.time_scale,
            "engine_warmup_s": args.engine_warmup_s,
            "systems_in_run_order": _names(args.systems, SYSTEMS, "systems"),
            "rates_rps": rates,
            "decode_rates_rps": decode_rates,
            "decode_step_ms": args.decode_step_ms,
            "decode_duration_s": _decode_seconds(args, duration),
            "decode_engine_settings": DECODE_SETTINGS,
            "split_roles": args.split_roles.split(","),
            "duration_s": duration,
            "seed": args.seed,
            "routers": {name: list(spec) for name, spec in ROUTERS.items()},
            "elapsed_s": round(elapsed, 1),
        },
    }
    # Real vLLM's runs keep their own name: live-latest is the sim engines' run.
    name = "live" if args.engine == "sim" else "live-vllm"
    path = write_results(name, payload, args.out_dir)
    png = plot(runs, path.with_suffix(".png"))
    shutil.copy(png, png.with_name(f"{name}-latest.png"))
    print(f"\nwrote {path} and {png} (also {name}-latest.*) in {elapsed:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
