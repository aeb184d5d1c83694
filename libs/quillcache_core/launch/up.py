"""`quillcache up`: the local cluster (`cluster.LocalCluster`) from the command line,
its endpoints printed and written to a file (mode 0600: it holds the tenants' API keys),
until Ctrl-C or SIGTERM (`quillcache` runs it under `process.stopping_on_signals`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from quillcache_core.launch import vllm_engine
from quillcache_core.launch.cluster import DEMO_TENANTS, ClusterError, LocalCluster
from quillcache_core.launch.process import Interrupted, write_private


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quillcache up",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--data-dir",
        default="",
        help="where logs, etcd, SSD tiers and the index live "
        "(default: a new temp dir, removed on exit)",
    )
    parser.add_argument("--endpoints-file", default="", help="write the endpoints as JSON here")
    parser.add_argument("--engines", type=int, default=2, help="engines to start")
    parser.add_argument(
        "--engine",
        choices=("sim", "vllm"),
        default="sim",
        help="sim engines, or real vLLM servers on CPU (needs `quillcache vllm-env` first)",
    )
    parser.add_argument(
        "--model",
        default="",
        help="with --engine vllm: the model directory to serve (default: the tiny model "
        "`quillcache vllm-env` builds)",
    )
    parser.add_argument(
        "--engine-kv-tokens",
        type=int,
        default=None,
        help="with --engine vllm: each engine's KV cache in tokens, a multiple of the block "
        f"size ({vllm_engine.VLLM_CPU_BLOCK_SIZE}); max-model-len then at most that less a "
        "block (default: the cache 1 GiB holds, the model's full context)",
    )
    parser.add_argument(
        "--engine-roles",
        default="",
        help="engines' disaggregation roles in order, e.g. 'prefill,decode' (default: both)",
    )
    parser.add_argument("--stores", type=int, default=2, help="store nodes")
    parser.add_argument(
        "--hbm-blocks", type=int, default=4096, help="KV blocks each sim engine's GPU holds"
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=0.02,
        help="sim engines' compute time multiplier (1.0 = the cost model's real time)",
    )
    parser.add_argument("--policy", default="quillcache", help="the conductor's routing policy")
    parser.add_argument(
        "--conductors",
        type=int,
        default=2,
        help="conductor replicas (each sees every store's residency and engine's events, "
        "and counts the others' reservations as its own; the gateway spreads plans over "
        "them and retries on another at once when one fails)",
    )
    parser.add_argument(
        "--lease-ttl-s", type=float, default=3.0, help="registry lease TTL of every node"
    )
    parser.add_argument(
        "--no-supervise",
        dest="supervise",
        action="store_false",
        help="do not restart processes that die (by default each is started again on "
        "its address, with backoff, and the restart logged)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="development only: plaintext everywhere, no certificates, no etcd users, no "
        "role checks (the default is mutual TLS with certificates made in <data-dir>/certs)",
    )
    return parser


def engine_roles(spec: str, engines: int) -> dict[int, dict]:
    """`--engine-roles prefill,decode` as engine_options; SystemExit on a bad role."""
    roles = [r.strip() for r in spec.split(",") if r.strip()]
    if len(roles) > engines or any(r not in ("prefill", "decode", "both") for r in roles):
        raise SystemExit(f"--engine-roles: at most {engines} of prefill/decode/both: {spec!r}")
    return {i: {"role": role} for i, role in enumerate(roles)}


def serve(cluster: LocalCluster) -> None:
    """Until a signal (`Interrupted`): without a supervisor, say which process exited."""
    while True:
        time.sleep(1.0)
        if cluster.supervisor is not None:
            continue  # it restarts what dies, and says so
        for child in cluster.dead_children():
            print(
                f"warning: {child.name} exited (code {child.proc.returncode}); "
                f"log: {child.log_path}",
                file=sys.stderr,
                flush=True,
            )
            cluster.children.remove(child)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        data_dir = args.data_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="quillcache-")
        )
        # Keys, certificates, logs and cached prompts' blocks: the owner's alone.
        Path(data_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            cluster = LocalCluster(
                Path(data_dir),
                engines=args.engines,
                stores=args.stores,
                hbm_blocks=args.hbm_blocks,
                time_scale=args.time_scale,
                policy=args.policy,
                lease_ttl_s=args.lease_ttl_s,
                engine_kind=args.engine,
                model="sim-model" if args.engine == "sim" else "tiny",
                vllm_model_dir=Path(args.model) if args.model else None,
                engine_kv_tokens=args.engine_kv_tokens,
                insecure=args.insecure,
                supervise=args.supervise,
                conductors=args.conductors,
                engine_options=engine_roles(args.engine_roles, args.engines),
                log=lambda *parts: print(*parts, flush=True),
            )
        except ValueError as exc:  # flags that clash
            parser.error(str(exc))
        print(f"starting the local cluster in {data_dir}", flush=True)
        try:
            endpoints = cluster.start()
        except ClusterError as exc:
            print(f"quillcache up: {exc}", file=sys.stderr)
            return 1
        try:
            text = json.dumps(endpoints, indent=2)
            if args.endpoints_file:
                write_private(Path(args.endpoints_file), text)
            print("\nQuillCache is up:\n" + text, flush=True)
            key = endpoints["api_keys"][DEMO_TENANTS[0]]
            cacert = f"--cacert {endpoints['tls']['ca']} " if endpoints["tls"] else ""
            print(
                f"\ntry:  curl -N {cacert}{endpoints['gateway_url']}/v1/chat/completions "
                f"-H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' "
                f'-d \'{{"model": "{cluster.model}", "stream": true, "messages": '
                '[{"role": "user", "content": "Hello"}]}\'',
                flush=True,
            )
            print("Ctrl-C stops everything.", flush=True)
            serve(cluster)
        except Interrupted as stop:
            print(f"{signal.Signals(stop.signum).name}:", end=" ", flush=True)
        finally:
            print("stopping...", flush=True)
            cluster.stop()
            print("stopped.", flush=True)
    return 0
