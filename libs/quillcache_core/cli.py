"""`quillcache`: one command fronting every QuillCache process and tool.

Each subcommand lives in its own module and is imported only when called, so
`quillcache --help` stays fast and one process never imports another's code.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module with a `main(argv) -> int`, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": (
        "quillcache_core.cluster",
        "the local cluster: etcd, conductor, stores, transfer, sim engines, gateway",
    ),
    "conductor": (
        "quillcache_conductor.__main__",
        "the control plane: plans, load, residency, KV events (gRPC)",
    ),
    "gateway": (
        "quillcache_gateway.__main__",
        "the OpenAI-compatible proxy: hash, plan, stream with x-quillcache-* headers",
    ),
    "store": (
        "quillcache_store.__main__",
        "a store node: DRAM + SSD tiers of KV blocks, peer fetch, residency events (gRPC)",
    ),
    "transfer": (
        "quillcache_transfer.__main__",
        "copy, move and prefetch blocks between store nodes (gRPC)",
    ),
    "sim-engine": (
        "quillcache_simengine.__main__",
        "a stand-in for vLLM: OpenAI API, paged KV cache, vLLM KV events, offload/FETCH",
    ),
    "bench-store": (
        "quillcache_store.bench",
        "store and transfer throughput against raw TCP, bare gRPC and fsync'd writes",
    ),
    "bench-conductor": (
        "quillcache_conductor.bench",
        "Plan over gRPC (latency, plans/s) and KV-event ingest, in-process and over ZMQ",
    ),
    "bench-gateway": (
        "quillcache_gateway.bench",
        "latency the gateway adds over calling an engine directly (p50/p99)",
    ),
    "demo": (
        "quillcache_core.demo",
        "start a real etcd, register a small fleet, plan requests with every policy",
    ),
    "bench-planner": (
        "quillcache_core.bench_planner",
        "planner latency per policy and index put/locate rates at 1M resident blocks",
    ),
    "bench": (
        "quillcache_core.fleetsim.command",
        "our planner vs Dynamo, llm-d, SGLang, round robin, least-loaded on a simulated fleet",
    ),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: quillcache <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "Run `quillcache <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    entry = COMMANDS.get(args[0])
    if entry is None:
        print(f"quillcache: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(entry[0])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
