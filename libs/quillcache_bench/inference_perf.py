"""`quillcache bench-inference-perf`: the capacity race's docqa shape driven by an
independent load generator, inference-perf 0.7.0 (`bench/inference-perf/
capacity-docqa.yml`), against QuillCache's gateway and SMG 1.13 cache_aware, in front of
the same two capped vLLM engines, as `bench-live --workloads capacity-docqa` starts
them.

inference-perf needs Python 3.12 or newer: it is installed once into
`~/.cache/quillcache/inference-perf-0.7.0` from PyPI with a Python 3.12 found on the
machine (`--python`, default `python3.12`, then pyenv's). Its own figures are read from
its `summary_lifecycle_metrics.json`; the engines' hit shares from vLLM's counters, as in
our own race. Results: `bench/results/inference-perf-capacity-latest.{json,png}`.

Each system gets empty engine caches and the same generated prompts (inference-perf's
seed); QuillCache's conductors are calibrated first, as in `bench-live`; our processes
are stopped (SIGSTOP) while SMG runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quillcache_bench.common import render_table, write_results
from quillcache_bench.live_systems import paused

VERSION = "0.7.0"
CONFIG = Path(__file__).resolve().parents[2] / "bench" / "inference-perf" / "capacity-docqa.yml"
SYSTEMS = ("quillcache", "smg-cache_aware")


def venv_dir() -> Path:
    return Path.home() / ".cache" / "quillcache" / f"inference-perf-{VERSION}"


def ensure(python: str) -> Path:
    """The `inference-perf` command, installed into its virtualenv if it is not yet."""
    command = venv_dir() / "bin" / "inference-perf"
    if command.exists():
        return command
    found = shutil.which(python) or next(
        (str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.1[2-9]*/bin/python"))), None
    )
    if found is None:
        raise SystemExit(f"inference-perf {VERSION} needs Python >= 3.12: none found ({python})")
    print(f"installing inference-perf {VERSION} into {venv_dir()} with {found}", flush=True)
    subprocess.run([found, "-m", "venv", str(venv_dir())], check=True)
    pip = [str(venv_dir() / "bin" / "pip"), "install", "--quiet"]
    subprocess.run([*pip, f"inference-perf=={VERSION}"], check=True)
    return command


def drive(command: Path, base_url: str, api_key: str, tokenizer: Path, out: Path) -> dict:
    """One inference-perf run against `base_url`; its summary (TTFT in ms)."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [str(command), "-c", str(CONFIG), "--server.base_url", base_url,
            "--tokenizer.pretrained_model_name_or_path", str(tokenizer),
            "--storage.local_storage.path", str(out)]  # fmt: skip
    if api_key:
        argv += ["--server.api_key", api_key]
    started = time.monotonic()
    with open(out / "inference-perf.log", "wb") as log:
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    summary = next(out.rglob("summary_lifecycle_metrics.json"), None)
    if code != 0 or summary is None:
        tail = (out / "inference-perf.log").read_text(errors="replace")[-2000:]
        raise SystemExit(f"inference-perf failed ({code}):\n{tail}")
    return figures(json.loads(summary.read_text()), time.monotonic() - started)


def figures(summary: dict, elapsed_s: float) -> dict:
    """TTFT mean/p50/p90/p99 in ms, successes and failures, from inference-perf's
    summary (its times are seconds)."""
    ok = summary.get("successes") or {}
    ttft = ((ok.get("latency") or {}).get("time_to_first_token")) or {}
    failures = summary.get("failures") or {}

    def ms(key: str) -> float:
        value = ttft.get(key)
        return float(value) * 1000 if value is not None else float("nan")

    return {
        "ttft_mean_ms": ms("mean"),
        "ttft_p50_ms": ms("median"),
        "ttft_p90_ms": ms("p90"),
        "ttft_p99_ms": ms("p99"),
        "requests": int(ok.get("count") or 0),
        "errors": int(failures.get("count") or 0),
        "elapsed_s": round(elapsed_s, 1),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quillcache bench-inference-perf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--engine-kv-tokens", type=int, default=12288, help="each engine's KV cache")
    p.add_argument("--conductors", type=int, default=2, help="QuillCache's conductor replicas")
    p.add_argument("--python", default="python3.12", help="a Python >= 3.12 to install it with")
    p.add_argument("--data-dir", default="", help="cluster data and logs (default: a temp dir)")
    p.add_argument("--out-dir", default="bench/results")
    return p


def main(argv: list[str] | None = None) -> int:
    from quillcache_bench import live_capacity
    from quillcache_core.launch import vllm_env

    args = build_parser().parse_args(argv)
    args.engines = 2
    command = ensure(args.python)
    model_dir = vllm_env.ensure_bench_model(vllm_env.ensure(log=print), log=print)
    results: dict[str, dict] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="qc-inference-perf-") as tmp:
        with live_capacity.capacity_cluster(args, 2.0) as (cluster, endpoints, engines, systems):
            count = live_capacity.token_counter(cluster.vllm_model_dir)
            ours = live_capacity.Target(endpoints["gateway_url"], None, endpoints["api_keys"],
                                        cluster.model)  # fmt: skip
            live_capacity.calibrate(ours, count)
            others = [c.proc.pid for c in cluster.children
                      if c.proc is not None and not c.name.startswith("engine")]  # fmt: skip
            for system in SYSTEMS:
                with systems.start(system) as found:
                    if found is None:
                        results[system] = {"unavailable": systems.unavailable.get(system, "")}
                        continue
                    target, _ = found
                    for engine in engines:
                        engine.reset_cache()
                    before = [e.counters() for e in engines]
                    url = endpoints["gateway_url"] if target is None else target.url
                    key = next(iter(endpoints["api_keys"].values())) if target is None else ""
                    print(f"inference-perf against {system} ({url})", flush=True)
                    hold = (
                        paused(others, 5.0) if system != "quillcache" else contextlib.nullcontext()
                    )
                    with hold:
                        got = drive(command, url, key, model_dir, Path(tmp) / system)
                    served = [e.counters().minus(b) for e, b in zip(engines, before, strict=True)]
                    prompt = sum(c.prompt_tokens for c in served) or 1
                    got["engine_hit_share"] = sum(c.cached_tokens for c in served) / prompt
                    got["pool_hit_share"] = sum(c.external_tokens for c in served) / prompt
                    results[system] = got
                    print(f"{system}: mean TTFT {got['ttft_mean_ms']:.0f} ms, "
                          f"p99 {got['ttft_p99_ms']:.0f}, errors {got['errors']}", flush=True)  # fmt: skip
    return report(args, results, time.monotonic() - started)


def report(args, results: dict, elapsed_s: float) -> int:
    ours, smg = results.get("quillcache", {}), results.get("smg-cache_aware", {})
    ratios = {}
    if "ttft_mean_ms" in ours and "ttft_mean_ms" in smg:
        ratios = {f"{k}_vs_smg": ours[k] / smg[k] for k in ("ttft_mean_ms", "ttft_p99_ms")}
    rows = [[name, f"{r.get('ttft_mean_ms', float('nan')):.0f}", f"{r.get('ttft_p50_ms', float('nan')):.0f}",
             f"{r.get('ttft_p99_ms', float('nan')):.0f}", str(r.get("requests", "-")), str(r.get("errors", "-")),
             f"{100 * r.get('engine_hit_share', 0):.0f}%", f"{100 * r.get('pool_hit_share', 0):.0f}%"]
            for name, r in results.items()]  # fmt: skip
    print(render_table(["system", "mean TTFT ms", "p50", "p99", "requests", "errors",
                        "engine hits", "pool hits"], rows))  # fmt: skip
    for name, value in ratios.items():
        print(f"{name}: {value:.3f}x")
    payload = {"driver": f"inference-perf {VERSION}", "config": str(CONFIG.name),
               "systems": results, "ratios": ratios, "elapsed_s": round(elapsed_s, 1),
               "python": sys.version.split()[0], "cpus": os.cpu_count()}  # fmt: skip
    path = write_results("inference-perf-capacity", payload, args.out_dir)
    png = _plot(results, path.with_suffix(".png"))
    shutil.copy(png, png.with_name("inference-perf-capacity-latest.png"))
    print(f"wrote {path} and {png} (also inference-perf-capacity-latest.*)")
    return 0


def _plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in results.items() if "ttft_mean_ms" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, [results[n]["ttft_mean_ms"] for n in names], color=["#2a7", "#888"][: len(names)])
    ax.set_yscale("log")
    ax.set_ylabel("mean TTFT, ms")
    ax.set_title("capacity docqa W/C 2, driven by inference-perf")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
