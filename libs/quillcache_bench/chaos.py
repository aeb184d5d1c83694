"""`quillcache chaos`: load through the gateway while one process at a time is killed
(kill -9) or stalled (SIGSTOP, then SIGCONT), at random, at intervals.

    quillcache chaos [--kill conductor|store|engine|transfer|etcd|gateway-upstream|any]
                     [--duration 60] [--rps 40] [--interval 8] [--fault kill|stall|both]
                     [--endpoints FILE]

Without --endpoints it starts a supervised `quillcache up` cluster (two conductors) in
a temp dir; with it, it uses that cluster (the file `quillcache up --endpoints-file`
wrote) and finds each process by the port it listens on (it must run on the same host,
as the same user; whoever started the cluster restarts what dies).

`gateway-upstream` stalls an engine (SIGSTOP): the gateway's upstream hangs instead of
refusing, the hardest case for its timeouts. A kill is -9, never a clean stop.

Measured: requests sent, failed (an HTTP status other than 200, or no answer), failed
more than 1 s after the latest fault began ("late": what retries and failover did not
hide), the time each killed process took to answer on its address again, and blocks
lost: during the run a writer puts small blocks durably to the stores (the store
acknowledges only once its SSD commit is done), and at the end every acknowledged block
is looked up on its store; one not found is lost. Each store's block counts before and
after are reported beside. Results: a table, bench/results/chaos-latest.json and
chaos-latest.png (requests per second, failures and the faults on one time line).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import ssl
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from quillcache_bench.common import render_table, write_results

KINDS = ("conductor", "store", "engine", "transfer", "etcd", "gateway-upstream")
MODEL_DEFAULT = "sim-model"
LATE_S = 1.0
FAMILIES = [f"You are assistant {n} of the QuillCache chaos drill. " * 10 for n in range(8)]


@dataclass
class Fault:
    t_s: float  # since the run's start
    kind: str
    name: str
    action: str  # kill or stall
    pid: int
    recovered_s: float | None = None  # kill: until its port answers again; stall: resumed


@dataclass
class Target:
    kind: str
    name: str
    address: str  # host:port it listens on
    pid_of: object = field(repr=False, default=None)  # () -> pid (started cluster)


# --- processes by port (an endpoints file's cluster) ---------------------------------------


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f)
            for line in f:
                parts = line.split()
                local, state, inode = parts[1], parts[3], parts[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    inodes.add(inode)
    return inodes


def pid_listening_on(port: int) -> int | None:
    """The pid of this user's process listening on TCP `port` (/proc), or None."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fd_dir = f"/proc/{entry}/fd"
        with contextlib.suppress(OSError):
            for fd in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"{fd_dir}/{fd}")
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        return int(entry)
    return None


def _port(address: str) -> int:
    if "://" in address:
        return urlparse(address).port or 0
    return int(address.rsplit(":", 1)[1])


def _answers(address: str) -> bool:
    host = urlparse(address).hostname if "://" in address else address.rsplit(":", 1)[0]
    try:
        with socket.create_connection((host, _port(address)), timeout=0.5):
            return True
    except OSError:
        return False


def targets_from_endpoints(endpoints: dict, cluster=None) -> list[Target]:
    """Every process a fault may hit. With `cluster` (a started LocalCluster) pids come
    from its children (and its etcd); else from the listening ports."""
    out: list[Target] = []
    conductors = endpoints.get("conductors") or [endpoints["conductor"]]
    for i, address in enumerate(conductors):
        out.append(Target("conductor", "conductor" if i == 0 else f"conductor-{i}", address))
    for i, address in enumerate(endpoints["stores"]):
        out.append(Target("store", f"store-{i}", address))
    for i, url in enumerate(endpoints["engines"]):
        out.append(Target("engine", f"engine-{i}", url))
        out.append(Target("gateway-upstream", f"engine-{i}", url))
    out.append(Target("transfer", "transfer", endpoints["transfer"]))
    out.append(Target("etcd", "etcd", endpoints["etcd"]))
    for target in out:
        if cluster is not None and target.kind == "etcd":
            target.pid_of = lambda: cluster.etcd.pid
        elif cluster is not None:
            target.pid_of = _child_pid(cluster, target.name)
        else:
            target.pid_of = lambda address=target.address: pid_listening_on(_port(address))
    return out


def _child_pid(cluster, name: str):
    def pid() -> int | None:
        with cluster.lock:
            child = next((c for c in cluster.children if c.name == name), None)
            return child.proc.pid if child is not None and child.proc is not None else None

    return pid


# --- load -------------------------------------------------------------------------------------


class Load(threading.Thread):
    """`rps` chat requests a second through the gateway, each on its own (as clients
    send them); records (start since t0, latency, error or None)."""

    def __init__(self, endpoints: dict, rps: float, t0: float, model: str) -> None:
        super().__init__(daemon=True, name="chaos-load")
        self.endpoints = endpoints
        self.rps = rps
        self.t0 = t0
        self.model = model
        self.results: list[tuple[float, float, str | None]] = []
        self._done = threading.Event()

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        import aiohttp

        url = self.endpoints["gateway_url"] + "/v1/chat/completions"
        key = next(iter(self.endpoints["api_keys"].values()))
        headers = {"Authorization": f"Bearer {key}"}
        ssl_context = None  # a tenant's view: the CA to verify the gateway by
        if self.endpoints.get("tls"):
            ssl_context = ssl.create_default_context(cafile=self.endpoints["tls"]["ca"])
        connector = aiohttp.TCPConnector(limit=0, ssl=ssl_context if ssl_context else False)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            tasks: set[asyncio.Task] = set()
            n = 0
            start = time.monotonic()
            while not self._done.is_set():
                n += 1
                task = asyncio.create_task(self._one(session, url, headers, n))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await asyncio.sleep(max(0.0, start + n / self.rps - time.monotonic()))
            if tasks:
                await asyncio.gather(*tasks)

    async def _one(self, session, url: str, headers: dict, n: int) -> None:
        import aiohttp

        body = {
            "model": self.model,
            "max_tokens": 4,
            "messages": [
                {"role": "system", "content": FAMILIES[n % len(FAMILIES)]},
                {"role": "user", "content": f"question {n % 97}: " + "x " * 30},
            ],
        }
        started = time.monotonic()
        try:
            async with session.post(url, json=body, headers=headers) as reply:
                await reply.read()
                error = None if reply.status == 200 else f"HTTP {reply.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = type(exc).__name__
        self.results.append((started - self.t0, time.monotonic() - started, error))

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=60)


class Canaries(threading.Thread):
    """Durable puts of small blocks to the stores, in turn, every `interval_s`; the
    acknowledged ones are checked at the end (`lost`)."""

    def __init__(self, endpoints: dict, interval_s: float = 0.1) -> None:
        super().__init__(daemon=True, name="chaos-canaries")
        self.endpoints = endpoints
        self.interval_s = interval_s
        self.acked: dict[str, list] = {address: [] for address in endpoints["stores"]}
        self.refused = 0
        self._done = threading.Event()
        self.run_id = f"chaos{random.randrange(1 << 30):08x}"

    def _tls(self):
        from quillcache_core.security.tls import Tls

        tls = self.endpoints.get("tls")
        return Tls.from_dir(Path(tls["ca"]).parent, "engine") if tls else None

    def key(self, n: int):
        from quillcache_core.model import KvBlockKey

        return KvBlockKey(
            MODEL_DEFAULT, "builtin-v1", None, "chaos", "root", f"{self.run_id}-{n:07d}", 0, 16
        )

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        from quillcache_core.storeclient.client import StoreClient

        tls = self._tls()
        clients = {a: StoreClient(a, tls=tls, timeout_s=2.0) for a in self.acked}
        n = 0
        try:
            while not self._done.is_set():
                for address, client in clients.items():
                    n += 1
                    key = self.key(n)
                    try:
                        await client.put(key, os.urandom(4096), durable=True)
                    except Exception:  # noqa: BLE001 - not acknowledged: not counted
                        self.refused += 1
                        continue
                    self.acked[address].append(key)
                await asyncio.sleep(self.interval_s)
        finally:
            for client in clients.values():
                with contextlib.suppress(Exception):
                    await client.close()

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=30)


async def _store_counts(endpoints: dict, tls) -> dict[str, dict]:
    from quillcache_core.storeclient.client import StoreClient

    out = {}
    for address in endpoints["stores"]:
        async with StoreClient(address, tls=tls, timeout_s=5.0) as client:
            stats = await client.stats()
        out[address] = {"dram_blocks": stats["dram_blocks"], "ssd_blocks": stats["ssd_blocks"]}
    return out


async def _lost(canaries: Canaries, tls) -> dict[str, int]:
    from quillcache_core.storeclient.client import StoreClient

    lost = {}
    for address, keys in canaries.acked.items():
        async with StoreClient(address, tls=tls, timeout_s=10.0) as client:
            missing = 0
            for i in range(0, len(keys), 500):
                found = await client.exists(keys[i : i + 500])
                missing += sum(1 for tier in found if tier is None)
        lost[address] = missing
    return lost


async def _settle(endpoints: dict, tls, timeout_s: float = 60.0) -> None:
    """Wait until every store answers Stats (all restarted processes back)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await _store_counts(endpoints, tls)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


# --- faults -------------------------------------------------------------------------------


class Chaos:
    def __init__(
        self,
        targets: list[Target],
        kinds: list[str],
        *,
        interval_s: float,
        fault: str,
        stall_s: float,
        rng: random.Random,
        t0: float,
    ) -> None:
        self.targets = [t for t in targets if t.kind in kinds]
        if not self.targets:
            raise SystemExit(f"no process of kind {', '.join(kinds)} to hit")
        self.kinds = sorted({t.kind for t in self.targets})
        self.interval_s = interval_s
        self.fault = fault
        self.stall_s = stall_s
        self.rng = rng
        self.t0 = t0
        self.faults: list[Fault] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="chaos-faults")

    def start(self, first_after_s: float) -> None:
        self._first_after_s = first_after_s
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        if self._done.wait(self._first_after_s):
            return
        order: list[str] = []
        while not self._done.is_set():
            if not order:  # every kind once per round, in a random order
                order = self.rng.sample(self.kinds, len(self.kinds))
            kind = order.pop()
            target = self.rng.choice([t for t in self.targets if t.kind == kind])
            action = "stall" if kind == "gateway-upstream" else self.fault
            if action == "both":
                action = self.rng.choice(("kill", "stall"))
            self._hit(target, action)
            self._done.wait(self.interval_s)

    def _hit(self, target: Target, action: str) -> None:
        pid = target.pid_of()
        if not pid:
            return
        fault = Fault(round(time.monotonic() - self.t0, 3), target.kind, target.name, action, pid)
        self.faults.append(fault)
        began = time.monotonic()
        print(f"  t={fault.t_s:7.2f}s  {action:5s} {target.name} (pid {pid})", flush=True)
        try:
            if action == "kill":
                os.kill(pid, signal.SIGKILL)
                deadline = began + 60
                while time.monotonic() < deadline:
                    new_pid = target.pid_of()
                    if new_pid and new_pid != pid and _answers(target.address):
                        fault.recovered_s = round(time.monotonic() - began, 3)
                        break
                    time.sleep(0.05)
            else:
                os.kill(pid, signal.SIGSTOP)
                try:
                    time.sleep(self.stall_s)
                finally:
                    os.kill(pid, signal.SIGCONT)
                fault.recovered_s = round(time.monotonic() - began, 3)
        except ProcessLookupError:
            pass


# --- the report ----------------------------------------------------------------------------


def summarize(results: list, faults: list[Fault]) -> dict:
    starts = sorted(f.t_s for f in faults)
    failed = [r for r in results if r[2] is not None]

    def late(t: float) -> bool:
        before = [s for s in starts if s <= t]
        return not before or t - before[-1] > LATE_S

    late_failures = [r for r in failed if late(r[0])]
    sent = len(results)
    return {
        "sent": sent,
        "failed": len(failed),
        "failed_pct": 100.0 * len(failed) / sent if sent else 0.0,
        "late_failures": len(late_failures),
        "errors": sorted({r[2] for r in failed}),
        "late_examples": [list(r) for r in late_failures[:10]],
    }


def plot(path: Path, results: list, faults: list[Fault], duration_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = max(1, int(duration_s) + 1)
    ok = [0] * bins
    bad = [0] * bins
    slowest = [0.0] * bins
    for t, latency, error in results:
        i = min(bins - 1, max(0, int(t)))
        (bad if error else ok)[i] += 1
        slowest[i] = max(slowest[i], latency)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    xs = list(range(bins))
    ax.bar(xs, ok, width=1.0, color="#4c9f70", label="served")
    ax.bar(xs, bad, width=1.0, bottom=ok, color="#d1495b", label="failed")
    colors = {"kill": "#222222", "stall": "#e09f3e"}
    for f in faults:
        ax.axvline(f.t_s, color=colors[f.action], linestyle="--", linewidth=0.8)
        ax.text(f.t_s + 0.3, 1, f"{f.action} {f.name}", rotation=90, fontsize=7, va="bottom")
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests started per second")
    ax.set_title("quillcache chaos: requests and faults (dashed: kill -9 black, SIGSTOP orange)")
    ax.set_ylim(0, max([*ok, 1]) * 1.25)
    ax.legend(loc="upper left")
    twin = ax.twinx()
    twin.plot([x + 0.5 for x in xs], slowest, color="#2e4057", linewidth=0.9, label="slowest")
    twin.set_ylabel("slowest request started that second (s)")
    twin.set_ylim(bottom=0)
    twin.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quillcache chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--kill", default="any", choices=(*KINDS, "any"), help="what to hit")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--rps", type=float, default=40.0, help="requests per second")
    parser.add_argument(
        "--interval", type=float, default=8.0, help="seconds between one fault's end and the next"
    )
    parser.add_argument(
        "--fault",
        default="both",
        choices=("kill", "stall", "both"),
        help="kill -9, SIGSTOP for --stall-s then SIGCONT, or either at random",
    )
    parser.add_argument("--stall-s", type=float, default=3.0, help="how long a stall lasts")
    parser.add_argument("--endpoints", default="", help="use this cluster's endpoints file")
    parser.add_argument("--seed", type=int, default=0, help="random seed (0 = from the OS)")
    parser.add_argument("--out", default="bench/results", help="where the results go")
    parser.add_argument(
        "--settle-s", type=float, default=5.0, help="load before the first fault, seconds"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rng = random.Random(args.seed or None)
    kinds = list(KINDS) if args.kill == "any" else [args.kill]
    with contextlib.ExitStack() as stack:
        cluster = None
        if args.endpoints:
            endpoints = json.loads(Path(args.endpoints).read_text())
        else:
            from quillcache_core.launch.cluster import LocalCluster

            data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="qc-chaos-"))
            cluster = LocalCluster(
                Path(data_dir), supervise=True, conductors=2, lease_ttl_s=2.0, log=print
            )
            print(f"starting a supervised cluster in {data_dir}", flush=True)
            endpoints = cluster.start()
            stack.callback(cluster.stop)
        report = run(args, endpoints, cluster, kinds, rng)
    results = report.pop("_results")
    print_report(report)
    out = Path(args.out)
    path = write_results("chaos", report, out)
    png = out / "chaos-latest.png"
    plot(png, results, [Fault(**f) for f in report["faults"]], args.duration)
    path.with_suffix(".png").write_bytes(png.read_bytes())
    print(f"\nwrote {path} and {png}")
    return 0


def run(args, endpoints: dict, cluster, kinds: list[str], rng: random.Random) -> dict:
    from quillcache_core.security.tls import Tls

    tls = None
    if endpoints.get("tls"):
        tls = Tls.from_dir(Path(endpoints["tls"]["ca"]).parent, "engine")
    model = MODEL_DEFAULT if cluster is None else cluster.model
    counts_before = asyncio.run(_store_counts(endpoints, tls))
    t0 = time.monotonic()
    load = Load(endpoints, args.rps, t0, model)
    canaries = Canaries(endpoints)
    chaos = Chaos(
        targets_from_endpoints(endpoints, cluster),
        kinds,
        interval_s=args.interval,
        fault=args.fault,
        stall_s=args.stall_s,
        rng=rng,
        t0=t0,
    )
    load.start()
    canaries.start()
    chaos.start(first_after_s=args.settle_s)
    try:
        time.sleep(args.duration)
    finally:
        chaos.stop()
        load.stop()
        canaries.stop()
    asyncio.run(_settle(endpoints, tls))
    lost = asyncio.run(_lost(canaries, tls))
    counts_after = asyncio.run(_store_counts(endpoints, tls))
    summary = summarize(load.results, chaos.faults)
    restarts = [f.recovered_s for f in chaos.faults if f.action == "kill"]
    return {
        "config": {k: v for k, v in vars(args).items()},
        "kinds": kinds,
        **summary,
        "faults": [asdict(f) for f in chaos.faults],
        "kill_recovery_s_max": max((r for r in restarts if r is not None), default=None),
        "kills_not_recovered": sum(1 for r in restarts if r is None),
        "blocks_acknowledged": sum(len(v) for v in canaries.acked.values()),
        "blocks_refused": canaries.refused,
        "blocks_lost": sum(lost.values()),
        "blocks_lost_by_store": lost,
        "store_blocks_before": counts_before,
        "store_blocks_after": counts_after,
        "_results": load.results,
    }


def print_report(report: dict) -> None:
    faults = report["faults"]
    rows = []
    for kind in sorted({f["kind"] for f in faults}):
        mine = [f for f in faults if f["kind"] == kind]
        kills = [f for f in mine if f["action"] == "kill"]
        back = [f["recovered_s"] for f in kills if f["recovered_s"] is not None]
        rows.append(
            [
                kind,
                len(kills),
                len(mine) - len(kills),
                max(back) if back else "-",
                len(kills) - len(back),
            ]
        )
    print()
    print(render_table(["process", "kills", "stalls", "back after (max s)", "not back"], rows))
    print()
    print(
        render_table(
            [
                "requests sent",
                "failed",
                "failed %",
                "failed > 1 s after a fault",
                "blocks acked",
                "blocks lost",
            ],
            [
                [
                    report["sent"],
                    report["failed"],
                    f"{report['failed_pct']:.3f}",
                    report["late_failures"],
                    report["blocks_acknowledged"],
                    report["blocks_lost"],
                ]
            ],
        )  # fmt: skip
    )
    if report["errors"]:
        print("errors seen:", ", ".join(report["errors"]))
    for address, before in report["store_blocks_before"].items():
        after = report["store_blocks_after"].get(address, {})
        print(f"store {address}: blocks before {before}, after {after}")
