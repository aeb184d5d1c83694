"""`quillcache bench-gateway`: the latency the gateway adds over calling an engine directly.

Starts a local cluster with one sim engine whose simulated compute is scaled to
almost nothing, then sends the same small completions (a) straight to the engine
and (b) through the gateway (tokenize, hash, Plan, proxy, Finish), alternating,
one at a time. Reports p50/p99 of time to the first byte and to the full answer,
for streaming and non-streaming requests, and the difference (the gateway's
overhead). Goal (issue 4): added p50 <= 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from quillcache_core.benchutil import Progress, render_table, write_results
from quillcache_core.cluster import LocalCluster


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quillcache bench-gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=400, help="requests per mode and path")
    parser.add_argument("--prompt-words", type=int, default=200, help="words in each prompt")
    parser.add_argument("--out-dir", default="bench/results")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="qc-gw-bench-") as tmp:
        cluster = LocalCluster(
            Path(tmp), engines=1, stores=1, time_scale=0.0001, log=lambda *_: None
        )
        endpoints = cluster.start()
        try:
            results = asyncio.run(_measure(endpoints, args))
        finally:
            cluster.stop()
    _report(results, args)
    return 0


async def _measure(endpoints: dict, args) -> dict:
    engine = endpoints["engines"][0]
    gateway = endpoints["gateway_url"]
    key = next(iter(endpoints["api_keys"].values()))
    auth = {"Authorization": f"Bearer {key}"}
    # The engine serves the gateway's tenant salt; give it the same to compare like with like.
    tenant = next(iter(endpoints["api_keys"]))
    samples: dict[str, list[tuple[float, float]]] = {}
    progress = Progress("gateway overhead", 4 * args.requests)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for stream in (False, True):
            for n in range(args.requests):
                words = " ".join(f"w{(n * 7 + i) % 997}" for i in range(args.prompt_words))
                body = {"model": "sim-model", "prompt": words, "max_tokens": 4, "stream": stream}
                for path, url, headers, extra in (
                    ("engine", engine, {}, {"cache_salt": tenant}),
                    ("gateway", gateway, auth, {}),
                ):
                    timing = await _one(
                        session, url + "/v1/completions", {**body, **extra}, headers
                    )
                    samples.setdefault(f"{path}/{'stream' if stream else 'plain'}", []).append(
                        timing
                    )
                    progress.advance()
    return samples


async def _one(session, url, body, headers) -> tuple[float, float]:
    started = time.perf_counter()
    async with session.post(url, json=body, headers=headers) as reply:
        if reply.status != 200:
            raise SystemExit(f"{url} answered {reply.status}: {await reply.text()}")
        first = None
        async for _chunk in reply.content.iter_any():
            if first is None:
                first = time.perf_counter() - started
    return first, time.perf_counter() - started


def _report(samples: dict, args) -> None:
    rows = []
    out: dict = {"config": vars(args), "modes": {}}
    for mode in ("plain", "stream"):
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
    worst = float(max(v["added_p50_ms"] for v in out["modes"].values()))
    out["goal_added_p50_le_2ms"] = bool(worst <= 2.0)
    print(
        f"goal: added p50 <= 2 ms: {'met' if worst <= 2.0 else 'NOT met'} (worst added p50 {worst:.2f} ms)"
    )
    path = write_results("gateway", out, args.out_dir)
    png = _plot(samples, path.with_suffix(".png"))
    print(f"wrote {path} and {png}")


def _plot(samples: dict, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, values in samples.items():
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
