"""`quillcache bench-gateway`: the latency the gateway adds over calling an engine directly.

Starts only what a request's path needs: etcd, the conductor, sim engines (no store
nodes, no transfer service) whose simulated compute is scaled to almost nothing, and
the gateway. Then one client (one aiohttp session, kept-alive connections) sends the
same small completions (a) straight to an engine and (b) through the gateway
(tokenize, hash, Plan, proxy, Finish), as pairs in a random order, with the same
number of pairs in flight on both paths (--concurrency). Reports p50/p99 of what a
user sees, the time to the first body byte and to the full answer, for streaming and
non-streaming requests, and of the per-pair difference (the gateway's overhead).
Warm-up pairs are not counted. Goals: added p50 <= 1 ms, added p99 <= 3 ms.

The cluster is secure as `quillcache up` runs it (certificates in its temp dir,
mutual TLS between the processes, etcd with its roles). The client calls each path
with the credentials it takes in a deployment: the gateway over HTTPS as a tenant (its
API key, the CA to verify the gateway by), the engine over HTTPS as the gateway does
(the gateway's certificate and the engine credential, and the tenant's cache salt as
the gateway derives it), the gateway's /metrics as the operator. Both paths pay TLS;
the gateway's adds its own hops (the plan port to the conductor, HTTPS to the
engine). `--insecure` measures the plaintext stack instead.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from quillcache_bench.common import Progress, render_table, write_results
from quillcache_bench.secure import INSECURE_HELP
from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.security.credentials import (
    as_gateway,
    operator_context,
    role_tls,
    tenant_context,
)
from quillcache_core.security.tenants import tenant_salt

MODES = ("plain", "stream")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quillcache bench-gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=400, help="measured pairs per mode")
    parser.add_argument("--warmup", type=int, default=50, help="uncounted pairs per mode")
    parser.add_argument("--concurrency", type=int, default=1, help="pairs in flight")
    parser.add_argument("--engines", type=int, default=1, help="sim engines")
    parser.add_argument("--prompt-words", type=int, default=200, help="words in each prompt")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens in each answer")
    parser.add_argument(
        "--index-backend",
        default="memory",
        choices=("memory", "lmdb"),
        help="the conductor's index: its default (memory) or lmdb, as `quillcache up` runs it",
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the pair order")
    parser.add_argument(
        "--hold-s",
        type=float,
        default=0.0,
        help="keep the cluster up this long before measuring (to attach a profiler)",
    )
    parser.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
    parser.add_argument("--out-dir", default="bench/results")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.warmup < 0:
        raise SystemExit("--requests and --concurrency must be positive, --warmup >= 0")
    with tempfile.TemporaryDirectory(prefix="qc-gw-bench-") as tmp:
        # Only what a request's path crosses: no store nodes, no transfer service.
        cluster = LocalCluster(
            Path(tmp),
            engines=args.engines,
            stores=0,
            time_scale=0.0001,
            index_backend=args.index_backend,
            log=lambda *_: None,
            insecure=args.insecure,
        )
        endpoints = cluster.start()
        endpoints["certs_dir"] = None if args.insecure else str(cluster.certs_dir)
        try:
            if args.hold_s > 0:
                pids = {c.name: c.proc.pid for c in cluster.children if c.proc is not None}
                print(f"cluster up: {pids}", flush=True)
                time.sleep(args.hold_s)
            samples = asyncio.run(_measure(endpoints, args))
        finally:
            cluster.stop()
    _report(samples, args)
    return 0


async def _measure(endpoints: dict, args) -> dict:
    tenant, key = next(iter(endpoints["api_keys"].items()))
    certs = endpoints["certs_dir"]
    # The engine is called as the gateway calls it (its certificate, the engine
    # credential) with the gateway's cache salt for the tenant, to compare like with like.
    engine_ssl, engine_auth = as_gateway(certs)
    gateway_tls = role_tls(certs, "gateway")
    salt = tenant_salt(gateway_tls.secret(), tenant) if gateway_tls else tenant
    targets = {
        "gateway": (
            endpoints["gateway_url"],
            {"Authorization": f"Bearer {key}"},
            {},
            tenant_context(endpoints),
        ),
        **{
            f"engine-{i}": (url, engine_auth, {"cache_salt": salt}, engine_ssl)
            for i, url in enumerate(endpoints["engines"])
        },
    }
    metrics_ssl = operator_context(endpoints)
    rng = random.Random(args.seed)
    progress = Progress("gateway overhead", 2 * (args.warmup + args.requests))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def pairs(mode: str, first: int, count: int) -> list:
            queue = list(range(first, first + count))
            done: list[tuple[int, tuple, tuple]] = []

            async def worker() -> None:
                while queue:
                    n = queue.pop(0)
                    words = " ".join(f"w{(n * 7 + i) % 997}" for i in range(args.prompt_words))
                    body = {
                        "model": "sim-model",
                        "prompt": f"{mode} {n} {words}",
                        "max_tokens": args.max_tokens,
                        "stream": mode == "stream",
                    }
                    engine = f"engine-{n % len(endpoints['engines'])}"
                    order = ["gateway", engine]
                    rng.shuffle(order)
                    got = {}
                    for path in order:
                        url, headers, extra, context = targets[path]
                        got[path] = await _one(
                            session, url + "/v1/completions", {**body, **extra}, headers, context
                        )
                    done.append((n, got[engine], got["gateway"]))
                    progress.advance()

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            return done

        for mode in MODES:
            await pairs(mode, 0, args.warmup)
        before = await _gateway_metrics(session, endpoints["gateway_url"], metrics_ssl)
        samples: dict = {}
        for mode in MODES:
            measured = await pairs(mode, args.warmup, args.requests)
            samples[f"engine/{mode}"] = [p[1][:2] for p in measured]
            samples[f"gateway/{mode}"] = [p[2][:2] for p in measured]
            samples[f"plan_us/{mode}"] = [p[2][2] for p in measured]
        after = await _gateway_metrics(session, endpoints["gateway_url"], metrics_ssl)
    samples["stages"] = _stages(before, after)
    return samples


async def _gateway_metrics(session, url: str, context) -> dict[str, float]:
    async with session.get(url + "/metrics", ssl=_ssl(context)) as reply:
        text = await reply.text()
    out: dict[str, float] = {}
    for line in text.splitlines():  # each name's samples summed over their labels
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            name = series.partition("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def _stages(before: dict, after: dict) -> dict[str, float]:
    """Mean microseconds of the gateway's stages over the measured requests."""

    def mean_us(stage: str, count: str) -> float:
        n = after.get(count, 0.0) - before.get(count, 0.0)
        total = after.get(stage, 0.0) - before.get(stage, 0.0)
        return 1e6 * total / n if n else float("nan")

    p = "quillcache_gateway_"
    return {
        "prepare_us": mean_us(p + "prepare_seconds_sum", p + "plan_seconds_count"),
        "plan_call_us": mean_us(p + "plan_seconds_sum", p + "plan_seconds_count"),
        "engine_head_us": mean_us(p + "engine_head_seconds_sum", p + "engine_head_seconds_count"),
        "first_byte_us": mean_us(p + "ttft_seconds_sum", p + "ttft_seconds_count"),
    }


def _ssl(context):
    """aiohttp's `ssl` argument: the context, or its default for plain HTTP."""
    return context if context is not None else True


async def _one(session, url, body, headers, context) -> tuple[float, float, int]:
    """Seconds to the first body byte and to the end of the answer; the plan's time (us)."""
    started = time.perf_counter()
    async with session.post(url, json=body, headers=headers, ssl=_ssl(context)) as reply:
        if reply.status != 200:
            raise SystemExit(f"{url} answered {reply.status}: {await reply.text()}")
        first = None
        async for _chunk in reply.content.iter_any():
            if first is None:
                first = time.perf_counter() - started
        plan_us = int(reply.headers.get("x-quillcache-plan-us", "0"))
    return first, time.perf_counter() - started, plan_us


def _report(samples: dict, args) -> None:
    rows = []
    out: dict = {"config": vars(args), "tls": not args.insecure, "modes": {}}
    for mode in MODES:
        engine = np.array(samples[f"engine/{mode}"]) * 1000
        gateway = np.array(samples[f"gateway/{mode}"]) * 1000
        for col, name in ((0, "first byte"), (1, "full answer")):
            e50, e99 = np.percentile(engine[:, col], [50, 99])
            g50, g99 = np.percentile(gateway[:, col], [50, 99])
            added = gateway[:, col] - engine[:, col]
            a50, a99 = np.percentile(added, [50, 99])
            rows.append((f"{mode}: {name}", e50, e99, g50, g99, a50, a99, g50 / e50))
            out["modes"][f"{mode}/{name}"] = {
                "engine_p50_ms": e50,
                "engine_p99_ms": e99,
                "gateway_p50_ms": g50,
                "gateway_p99_ms": g99,
                "added_p50_ms": a50,
                "added_p99_ms": a99,
            }
    print()
    print(
        "plaintext (--insecure)"
        if args.insecure
        else "HTTPS on both paths (the gateway's: a tenant's; the engine's: mutual TLS as the "
        "gateway), mutual TLS between the gateway and the conductor"
    )
    print(
        render_table(
            [
                "request",
                "engine p50 ms",
                "engine p99 ms",
                "gateway p50 ms",
                "gateway p99 ms",
                "added p50 ms",
                "added p99 ms",
                "p50 ratio",
            ],
            rows,
        )
    )
    stages = samples["stages"]
    plan_us = np.array(samples["plan_us/plain"] + samples["plan_us/stream"])
    stages["conductor_plan_p50_us"] = float(np.percentile(plan_us, 50))
    out["gateway_stages_us"] = stages
    print(
        "inside the gateway (means, us): prepare (read, validate, tokenize, hash) "
        f"{stages['prepare_us']:.0f}, Plan call {stages['plan_call_us']:.0f} "
        f"(the conductor's own plan time p50 {stages['conductor_plan_p50_us']:.0f}), "
        f"engine call to its answer's head {stages['engine_head_us']:.0f}, "
        f"arrival to first byte out {stages['first_byte_us']:.0f}"
    )
    worst = float(max(v["added_p50_ms"] for v in out["modes"].values()))
    worst99 = float(max(v["added_p99_ms"] for v in out["modes"].values()))
    out["goals"] = {"added p50 <= 1 ms": worst <= 1.0, "added p99 <= 3 ms": worst99 <= 3.0}
    for goal, value in (("added p50 <= 1 ms", worst), ("added p99 <= 3 ms", worst99)):
        met = "met" if out["goals"][goal] else "NOT met"
        print(f"goal: {goal}: {met} (worst {value:.2f} ms)")
    path = write_results("gateway", out, args.out_dir)
    png = _plot(samples, path.with_suffix(".png"))
    print(f"wrote {path} and {png}")


def _plot(samples: dict, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, values in samples.items():
        if not name.startswith(("engine/", "gateway/")):
            continue
        first = np.sort(np.array(values)[:, 0] * 1000)
        ax.plot(first, np.linspace(0, 1, len(first)), label=name)
    ax.set_xlabel("time to first byte (ms)")
    ax.set_ylabel("share of requests")
    ax.set_title("Gateway overhead: direct to the engine vs through the gateway")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
