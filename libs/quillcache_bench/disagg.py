"""`quillcache bench-disagg`: prefill/decode disaggregation vs colocated serving, live.

The whole secure stack on loopback (etcd, conductor, two store nodes, transfer, gateway)
in front of three sim engines with the same flags each time: real-time pacing, decode
steps of `--itl-ms`, and `--prefill-stalls-decodes` (no token while a prefill runs, as
vLLM without chunked prefill). Two runs of the same decode-heavy workload (long outputs
of 0.5x to 1.5x `--output-tokens`, closed-loop clients at `--concurrency` started
`--stagger-s` apart, distinct prompts of about `--prompt-tokens`):

- colocated: the three engines are `both`; every request is prefilled and decoded where
  the conductor places it (`x-quillcache-disagg: colocated`);
- split: the same three engines as one `prefill` and two `decode`; every request is
  prefilled on the first, its KV stored, moved through the transfer service when the
  decode engine's store node is another, and loaded by the decode engine.

For each run: TTFT (from the client's request to the first token) and inter-token
latency (between a stream's successive tokens), mean and p99, and how many requests
were split or fell back. Goal: split inter-token p99 at most 0.7x colocated with mean
TTFT at most 1.1x. Writes bench/results/disagg-<stamp>.json, disagg-latest.json and
disagg-latest.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from quillcache_bench.common import WORDS, render_table, write_results
from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.security.credentials import operator_context, tenant_context

GOAL_ITL_P99 = 0.7
GOAL_TTFT_MEAN = 1.1
MODEL = "sim-model"


def inter_token_s(arrivals: Sequence[float]) -> list[float]:
    """The gaps between a stream's successive content chunks (seconds, in order)."""
    return [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]


def latency_ms(samples_s: Sequence[float]) -> dict[str, float]:
    """Mean, p50 and p99 in milliseconds of latencies in seconds (NaN when none)."""
    ms = np.asarray(samples_s, dtype=np.float64) * 1000 if len(samples_s) else np.array([np.nan])
    return {
        "mean": float(ms.mean()),
        "p50": float(np.percentile(ms, 50)),
        "p99": float(np.percentile(ms, 99)),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quillcache bench-disagg",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=48, help="requests per run")
    parser.add_argument("--concurrency", type=int, default=12, help="clients at once")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="about, per prompt")
    parser.add_argument("--output-tokens", type=int, default=160, help="max_tokens per request")
    parser.add_argument("--itl-ms", type=float, default=15.0, help="sim engines' decode step")
    parser.add_argument(
        "--prefill-us-per-token", type=int, default=45, help="sim engines' prefill cost"
    )
    parser.add_argument(
        "--stagger-s", type=float, default=0.2, help="delay between the clients' first requests"
    )
    parser.add_argument(
        "--split-roles",
        default="prefill,decode,decode",
        help="the engines' roles in the split run (the colocated run: as many `both`)",
    )
    parser.add_argument("--out", default="bench/results", help="results folder")
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    return parser


def prompt(seed: int, tokens: int) -> str:
    """Distinct per seed from its first word on (no shared prefix), about `tokens` tokens
    (the sim engines' built-in tokenizer makes about two of a word)."""
    words = [f"r{seed}"] + [
        WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(tokens // 2)
    ]
    return " ".join(words)


def engine_args(args) -> list[str]:
    return [
        "--prefill-stalls-decodes",
        "true",
        "--decode-us-per-token",
        str(int(args.itl_ms * 1000)),
        "--prefill-us-per-token",
        str(args.prefill_us_per_token),
        # Small simulated KV blocks (16 KiB): the bytes move for real, at a size this
        # shared 2-core machine keeps up with.
        "--kv-layers",
        "2",
        "--kv-heads",
        "2",
        "--head-dim",
        "64",
    ]


async def one_request(session, endpoints, context, body: dict, mode: str) -> dict:
    """Stream one completion; the client-side timings and the answer's headers."""
    import aiohttp

    headers = {
        "Authorization": f"Bearer {endpoints['api_keys']['acme']}",
        "x-quillcache-disagg": mode,
    }
    sent = time.perf_counter()
    arrivals: list[float] = []
    async with session.post(
        endpoints["gateway_url"] + "/v1/completions",
        json=body,
        headers=headers,
        ssl=context if context is not None else False,
        timeout=aiohttp.ClientTimeout(total=300),
    ) as reply:
        status = reply.status
        answer_headers = {k.lower(): v for k, v in reply.headers.items()}
        buffer = b""
        async for chunk in reply.content.iter_any():
            now = time.perf_counter()
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: {"):
                    data = json.loads(event[6:])
                    if data.get("choices") and data["choices"][0].get("text"):
                        arrivals.append(now)
    return {
        "status": status,
        "disagg": answer_headers.get("x-quillcache-disagg", ""),
        "engine": answer_headers.get("x-quillcache-engine", ""),
        "ttft_s": arrivals[0] - sent if arrivals else None,
        "itl_s": inter_token_s(arrivals),
        "tokens": len(arrivals),
        "prefill_ms": float(answer_headers.get("x-quillcache-prefill-ms", 0) or 0),
        "transfer_ms": float(answer_headers.get("x-quillcache-transfer-ms", 0) or 0),
    }


async def drive(endpoints, args, mode: str, seed0: int) -> list[dict]:
    import aiohttp

    context = tenant_context(endpoints)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(seed0 + i)
    results: list[dict] = []

    async with aiohttp.ClientSession() as session:

        async def client(n: int) -> None:
            # Staggered starts and output lengths from 0.5x to 1.5x (seeded): streams do
            # not start and end in lockstep, so new prompts arrive while others decode.
            await asyncio.sleep(n * args.stagger_s)
            while not queue.empty():
                seed = queue.get_nowait()
                spread = 0.5 + (seed * 2654435761 % 1000) / 1000
                body = {
                    "model": MODEL,
                    "prompt": prompt(seed, args.prompt_tokens),
                    "max_tokens": max(1, int(args.output_tokens * spread)),
                    "stream": True,
                }
                results.append(await one_request(session, endpoints, context, body, mode))

        await asyncio.gather(*(client(n) for n in range(args.concurrency)))
    return results


def summarize(results: list[dict]) -> dict:
    ok = [r for r in results if r["status"] == 200 and r["ttft_s"] is not None]
    kinds: dict[str, int] = {}
    for r in results:
        kind = r["disagg"].split(";", 2)
        key = kind[0] + (";" + kind[1].strip().split(":")[0] if "fallback" in r["disagg"] else "")
        kinds[key or "none"] = kinds.get(key or "none", 0) + 1
    return {
        "requests": len(results),
        "ok": len(ok),
        "ttft_ms": latency_ms([r["ttft_s"] for r in ok]),
        "itl_ms": latency_ms([g for r in ok for g in r["itl_s"]]),
        "tokens": int(sum(r["tokens"] for r in ok)),
        "plans": kinds,
        "split_prefill_ms_mean": _mean([r["prefill_ms"] for r in ok if r["prefill_ms"]]),
        "split_transfer_ms_mean": _mean([r["transfer_ms"] for r in ok if r["transfer_ms"]]),
        "engines": sorted({r["engine"] for r in ok}),
    }


def sim_stats(endpoints: dict, url: str) -> dict:
    """What one sim engine computed, hit, fetched and stored (its /sim/stats)."""
    with urllib.request.urlopen(
        url + "/sim/stats", timeout=10, context=operator_context(endpoints)
    ) as reply:
        stats = json.loads(reply.read())
    keep = ("requests", "prompt_tokens", "computed_tokens", "fetched_blocks",
            "fetch_fallback_blocks", "written_through_blocks")  # fmt: skip
    return {k: stats["engine"].get(k) for k in keep}


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0


def run_one(args, data_dir: Path, roles: tuple[str, ...], mode: str, seed0: int) -> dict:
    sim = engine_args(args)
    cluster = LocalCluster(
        data_dir,
        engines=len(roles),
        stores=2,
        time_scale=1.0,
        log=lambda *_: None,
        engine_options={i: {"role": role, "sim_args": sim} for i, role in enumerate(roles)},
    )
    endpoints = cluster.start(timeout_s=120)
    try:
        # A few requests first: connections, the transfer's channel, the bandwidth.
        warm = argparse.Namespace(**{**vars(args), "requests": 4, "concurrency": 2})
        asyncio.run(drive(endpoints, warm, mode, seed0 + 100_000))
        started = time.perf_counter()
        results = asyncio.run(drive(endpoints, args, mode, seed0))
        wall = time.perf_counter() - started
        engines = [sim_stats(endpoints, url) for url in endpoints["engines"]]
    finally:
        cluster.stop()
    summary = summarize(results)
    summary["wall_s"] = wall
    summary["engine_stats"] = engines
    summary["roles"] = list(roles)
    summary["mode"] = mode
    return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.requests, args.concurrency, args.output_tokens = 12, 6, 48
    with tempfile.TemporaryDirectory(prefix="qc-bench-disagg-") as tmp:
        print(
            f"{args.requests} requests, {args.concurrency} clients, prompts of about "
            f"{args.prompt_tokens} tokens, {args.output_tokens} output tokens, "
            f"{args.itl_ms:g} ms decode steps, prefills stall decodes",
            flush=True,
        )
        engines = len(args.split_roles.split(","))
        colocated = run_one(args, Path(tmp) / "colocated", ("both",) * engines, "colocated", 0)
        print(f"colocated: {json.dumps(colocated['plans'])}", flush=True)
        roles = tuple(r.strip() for r in args.split_roles.split(","))
        split = run_one(args, Path(tmp) / "split", roles, "auto", 0)
        print(f"split:     {json.dumps(split['plans'])}", flush=True)
    return report(args, {"colocated": colocated, "split": split}, Path(args.out))


def report(args, runs: dict[str, dict], out: Path) -> int:
    base, split = runs["colocated"], runs["split"]
    rows = []
    for name, r in runs.items():
        rows.append(
            [
                name,
                "/".join(r["roles"]),
                round(r["ttft_ms"]["mean"], 1),
                round(r["ttft_ms"]["p99"], 1),
                round(r["itl_ms"]["mean"], 2),
                round(r["itl_ms"]["p99"], 2),
                f"{r['ok']}/{r['requests']}",
            ]
        )
    print()
    print(
        render_table(
            ["run", "roles", "TTFT mean ms", "TTFT p99 ms", "ITL mean ms", "ITL p99 ms", "ok"],
            rows,
        )
    )
    itl_ratio = split["itl_ms"]["p99"] / base["itl_ms"]["p99"]
    ttft_ratio = split["ttft_ms"]["mean"] / base["ttft_ms"]["mean"]
    itl_met, ttft_met = itl_ratio <= GOAL_ITL_P99, ttft_ratio <= GOAL_TTFT_MEAN
    print(
        f"\nsplit vs colocated: inter-token p99 {itl_ratio:.2f}x (goal <= {GOAL_ITL_P99}x: "
        f"{'met' if itl_met else 'NOT met'}), mean TTFT {ttft_ratio:.2f}x (goal <= "
        f"{GOAL_TTFT_MEAN}x: {'met' if ttft_met else 'NOT met'})"
    )
    path = write_results(
        "disagg",
        {
            "workload": {
                "requests": args.requests,
                "concurrency": args.concurrency,
                "prompt_tokens": args.prompt_tokens,
                "output_tokens": args.output_tokens,
                "itl_ms": args.itl_ms,
                "prefill_us_per_token": args.prefill_us_per_token,
                "stagger_s": args.stagger_s,
            },
            "runs": runs,
            "itl_p99_ratio": itl_ratio,
            "ttft_mean_ratio": ttft_ratio,
            "goal": {"itl_p99_ratio": GOAL_ITL_P99, "ttft_mean_ratio": GOAL_TTFT_MEAN},
            "goal_met": {"itl_p99": itl_met, "ttft_mean": ttft_met},
        },
        out,
    )
    plot(runs, out / "disagg-latest.png")
    print(f"wrote {path}, disagg-latest.json and disagg-latest.png")
    return 0


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, what, title in (
        (axes[0], "ttft_ms", "TTFT (ms)"),
        (axes[1], "itl_ms", "inter-token latency (ms)"),
    ):
        x = np.arange(len(names))
        ax.bar(x - 0.2, [runs[n][what]["mean"] for n in names], 0.4, label="mean")
        ax.bar(x + 0.2, [runs[n][what]["p99"] for n in names], 0.4, label="p99")
        ax.set_xticks(x, names)
        ax.set_title(title)
        ax.legend()
    roles = runs["split"]["roles"]
    fig.suptitle(
        f"Decode-heavy load: split ({roles.count('prefill')} prefill + "
        f"{roles.count('decode')} decode) vs colocated ({len(roles)} engines)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
