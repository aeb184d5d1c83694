"""`quillcache bench-idle`: what the control plane burns with nothing to do.

Starts the local cluster as `quillcache up` does (etcd, two conductor replicas, two
store nodes, transfer, two sim engines registered, the gateway; mutual TLS), lets it
settle, then reads every process's CPU time from /proc over `--seconds` (60) with no
request sent. The goal counts the control plane a request crosses, the gateway and every
conductor replica: under 2% of one core together. The rest (stores, transfer, engines)
is shown beside it. Writes bench/results/idle-<UTC>.json, idle-latest.json and
idle-latest.png.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from quillcache_bench.common import Progress, render_table, write_results
from quillcache_bench.live_systems import trees_cpu_s
from quillcache_core.launch.cluster import LocalCluster

GOAL_SHARE = 0.02  # of one core, the gateway and every conductor replica together
CONTROL = ("gateway", "conductor")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quillcache bench-idle", description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0, help="the idle window")
    parser.add_argument("--settle-s", type=float, default=5.0, help="after start, unmeasured")
    parser.add_argument("--conductors", type=int, default=2)
    parser.add_argument("--out-dir", default="bench/results")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="qc-idle-") as tmp:
        cluster = LocalCluster(Path(tmp), conductors=args.conductors, log=lambda _line: None)
        cluster.start()
        try:
            time.sleep(args.settle_s)
            groups = {c.name: [c.proc.pid] for c in cluster.children if c.proc is not None}
            groups["etcd"] = [cluster.etcd.pid] if cluster.etcd and cluster.etcd.pid else []
            services = {c.name: c.service for c in cluster.children}
            before = trees_cpu_s(groups)
            progress = Progress("idle", int(args.seconds))
            for _ in range(int(args.seconds)):
                time.sleep(1.0)
                progress.advance()
            time.sleep(args.seconds - int(args.seconds))
            after = trees_cpu_s(groups)
        finally:
            cluster.stop()
    share = {name: (after[name] - before[name]) / args.seconds for name in groups}
    control = sum(v for name, v in share.items() if services.get(name) in CONTROL)
    rows = [
        (name, services.get(name, name), f"{100 * v:.2f}%")
        for name, v in sorted(share.items(), key=lambda kv: -kv[1])
    ]
    print(render_table(["process", "service", "CPU, % of one core"], rows))
    met = control < GOAL_SHARE
    print(
        f"\ngateway + {args.conductors} conductor replicas: {100 * control:.2f}% of one core "
        f"over {args.seconds:.0f} s idle; goal < {100 * GOAL_SHARE:.0f}%: "
        + ("met" if met else "NOT met")
    )
    path = write_results(
        "idle",
        {
            "seconds": args.seconds,
            "share_of_a_core": share,
            "services": services,
            "control_share": control,
            "goal_share": GOAL_SHARE,
            "met": met,
        },
        args.out_dir,
    )
    _plot(share, services, Path(args.out_dir) / "idle-latest.png")
    print(f"wrote {path} and idle-latest.png")
    return 0


def _plot(share: dict[str, float], services: dict[str, str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(share, key=lambda n: -share[n])
    colours = ["tab:red" if services.get(n) in CONTROL else "tab:gray" for n in names]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(names, [100 * share[n] for n in names], color=colours)
    ax.set_ylabel("CPU, % of one core (idle)")
    ax.set_title("Idle CPU by process (red: the gateway and conductors)")
    ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
