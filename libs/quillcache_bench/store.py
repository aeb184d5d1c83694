"""`quillcache bench-store`: store and transfer throughput against their baselines.

One run measures, with 2 MiB blocks (default):

- baselines: raw loopback TCP streaming (sendall / recv_into; one cache-hot buffer
  sent again and again, and, paired with the peer passes, also 128 distinct buffers on
  each side as a pool has, which is slower), a bare gRPC raw-bytes
  stream (one call; and one call per block, down and up: the same RPC shapes as Get and
  Put, with no store behind them), and a raw sequential file write of the same bytes
  followed by fdatasync;
- the store over gRPC (real `quillcache store` process, `--clients` concurrent
  clients): put into DRAM (a fresh pool, whose pages fault in, and a warm pool, whose
  buffers are reused), get from DRAM, put to and get from SSD, and durable puts from
  `--durable-clients` clients (SSD commit before the ack; concurrent puts share commits)
  to new keys, each round of them right after a raw fsync'd write pass (the disk's
  speed drifts): to the SSD tier through the store's block-data port (raw TCP puts,
  `StoreClient(data_address=...)`), the same keeping a DRAM copy too (a durable put's
  default tier), and to the SSD tier over gRPC;
- peer fetch between two store processes (real etcd, conductor, transfer): bulk
  Transfer.Copy A -> B over the block data path (B pulls from A's raw TCP data port,
  the transfer service orchestrating), the same Copy over the gRPC path (a second
  transfer service with `--data-path false`: Get streamed into Put through it), a
  Store.Pull on B called directly (the data path without the transfer service), and
  get(allow_remote) on B of blocks held by A (B pulls them over the data path; the
  bytes then reach the client over gRPC). Each pass follows a raw TCP pass.

Each figure is the median of `--repeat` passes. Goals checked: peer fetch (Copy) >= 50%
of raw TCP; durable puts to SSD (through the data port) >= 60% of the raw fsync'd write.
Results go to bench/results/store-<stamp>.json and .png (and store-latest.*).

The durable goal compares like with like: the raw pass writes the bytes to a new file
and syncs them; a durable SSD put receives them, verifies them, writes them to LMDB and
syncs. On this VM both are bound by the CPU cost of page-cache pages touched for the
first time (a raw pass into fresh pages: 0.25-0.3 GB/s, 0.85-1.0 s of CPU per 256 MiB;
into pages another file just freed: 0.65-1.9 GB/s, 0.06-0.3 s), so each raw file is
kept until the last durable round: deleted, it would hand its pages to the durable
pass that follows it. A durable put that also keeps a DRAM copy (its own row, no goal)
does all that and fills the DRAM tier too: while the bench fills the store, each copy
lands in new memory as well, so that row pays first-touch costs twice.

The QuillCache processes run as a secure cluster does (certificates made in the run's
temp dir, `--tls-dir`): every gRPC call and every block-data connection is mutual TLS,
with the role that makes it in a deployment: puts, gets, deletes and data-port puts as
`engine` (the KV connector's role), Store.Pull as `transfer` (the only role allowed
it), Transfer.Copy and Locate as `operator`; the stores pull from each other as
`store`. So TLS is part of every store and peer figure. The baselines (raw TCP, the
bare gRPC server, raw fsync'd writes) are not QuillCache processes and stay plaintext:
the ratios against them, goals included, include the cost of TLS. One more paired
row, raw TLS loopback (the raw TCP stream over mutual TLS with a store's certificate,
no goal), shows what TLS alone costs. `--insecure` measures the plaintext stack
instead (no certificates anywhere, no raw TLS row).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

from quillcache_bench.baselines import (
    bare_grpc,
    bare_grpc_server,
    distinct_buffers,
    raw_fsync_write,
    raw_tcp,
)
from quillcache_bench.common import Progress, render_table, write_results
from quillcache_bench.secure import INSECURE_HELP, bench_certs
from quillcache_core.launch.process import ManagedProcess, ProcessFailed
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.process.malloc import tune_malloc_for_large_values
from quillcache_core.security.credentials import role_tls, security_args

MIB = 1024 * 1024
DURABLE = "durable put to SSD, data port (group commit)"
DURABLE_CACHED = "durable put to SSD + DRAM copy, data port"
DURABLE_GRPC = "durable put to SSD, gRPC (group commit)"
RAW_TLS = "raw TLS loopback (paired)"
GOALS = (
    ("peer fetch: transfer Copy A->B", "raw TCP loopback (paired)", 0.50),
    (DURABLE, "raw write + fdatasync", 0.60),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quillcache bench-store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--blocks", type=int, default=128, help="blocks per pass")
    parser.add_argument("--block-bytes", type=int, default=2 * MIB)
    parser.add_argument("--clients", type=int, default=4, help="concurrent store clients")
    parser.add_argument(
        "--durable-clients",
        type=int,
        default=8,
        help="concurrent clients of the durable-put figure (group commit shares their syncs)",
    )
    parser.add_argument("--window", type=int, default=8, help="transfer window (blocks)")
    parser.add_argument("--repeat", type=int, default=3, help="passes per figure (median)")
    parser.add_argument("--data-dir", default="", help="where stores write (default: a temp dir)")
    parser.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
    parser.add_argument("--out-dir", default="bench/results")
    return parser


# --- helpers ------------------------------------------------------------------------------


def _key(i: int, chain: str) -> KvBlockKey:
    return KvBlockKey("bench-model", "bench-tok", None, "bench", "root", f"{chain}{i:08d}", i, 16)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


class _Service:
    """A `quillcache <service>` child process; waits for its READY line."""

    def __init__(self, service: str, args: list[str], log: Path) -> None:
        self.proc = ManagedProcess(
            [sys.executable, "-m", "quillcache_core.launch.cli", service, *args],
            log_path=log,
            name=service,
            stop_grace_s=10.0,
        )
        self.proc.start()
        try:
            self.proc.wait_ready(lambda: self.proc.ready_fields() is not None, timeout_s=30)
        except ProcessFailed as exc:
            self.proc.stop()
            raise RuntimeError(f"{service} did not start: {exc}") from None
        self.fields: dict[str, str] = self.proc.ready_fields() or {}

    @property
    def address(self) -> str:
        return self.fields["grpc"]

    def stop(self) -> None:
        self.proc.stop()


# --- store and transfer -------------------------------------------------------------------


async def _timed(clients, blocks: int, op: Callable[[object, int], Awaitable[None]]) -> float:
    """Seconds for `blocks` operations split over the clients (each sequential)."""

    async def run(c: int) -> None:
        for i in range(c, blocks, len(clients)):
            await op(clients[c], i)

    start = time.perf_counter()
    await asyncio.gather(*(run(c) for c in range(len(clients))))
    return time.perf_counter() - start


async def store_figures(
    address: str, args, payloads, scratch: Path, progress: Progress, certs: Path | None = None
) -> dict[str, list[float]]:
    from quillcache_core.storeclient.client import StoreClient

    n, size = args.blocks, args.block_bytes
    engine = role_tls(certs, "engine")  # who puts and gets blocks: the KV connector
    clients = [StoreClient(address, timeout_s=60, tls=engine) for _ in range(args.clients)]
    out: dict[str, list[float]] = {}

    def payload(i: int) -> bytes:
        return payloads[i % len(payloads)]

    async def measure(name: str, op, passes: int = args.repeat) -> None:
        out[name] = []
        for r in range(passes):
            seconds = await _timed(clients, n, lambda c, i, r=r: op(c, i, r))
            out[name].append(_gbps(n * size, seconds))
        progress.advance()

    writers = clients + [
        StoreClient(address, timeout_s=60, tls=engine)
        for _ in range(args.durable_clients - len(clients))
    ]
    data_address = (await clients[0].stats())["data_address"]
    pushers = [
        StoreClient(address, timeout_s=60, data_address=data_address, tls=engine)
        for _ in range(args.durable_clients)
    ]
    try:
        await clients[0].stats()
        # A fresh pool pays its page faults once; rewriting the same keys with other bytes
        # reuses the buffers (the steady state of a full tier).
        await measure(
            "put DRAM (fresh pool)", lambda c, i, r: c.put(_key(i, "dram"), payload(i)), passes=1
        )
        await measure(
            "put DRAM (warm pool)", lambda c, i, r: c.put(_key(i, "dram"), payload(i + r + 1))
        )
        await measure("get DRAM", lambda c, i, r: c.get(_key(i, "dram")))
        await measure(
            "put SSD",
            lambda c, i, r: c.put(_key(i, f"ssd{r}"), payload(i), tier=CacheTier.LOCAL_SSD),
        )
        await measure("get SSD (promotes)", lambda c, i, r: c.get(_key(i, f"ssd{r}")))
        # The disk's throughput drifts (burst credits, other tenants): each round of
        # durable passes runs right after a raw write + fdatasync pass of the same bytes.
        # The raw files stay until the last round, so every pass writes into as many
        # new page-cache pages as its raw pass did (see the module docstring).
        raw = out["raw write + fdatasync"] = []
        passes = (
            (DURABLE, "durable", pushers, CacheTier.LOCAL_SSD),
            (DURABLE_CACHED, "durable-cached", pushers, CacheTier.CPU_DRAM),
            (DURABLE_GRPC, "durable-grpc", writers[: args.durable_clients], CacheTier.LOCAL_SSD),
        )
        for name, *_ in passes:
            out[name] = []
        raw_files = [scratch / f"raw-{r}.bin" for r in range(args.repeat)]
        try:
            for r, raw_file in enumerate(raw_files):
                raw_s = await asyncio.to_thread(raw_fsync_write, raw_file, n, size)
                raw.append(_gbps(n * size, raw_s))
                for name, chain, group, tier in passes:
                    seconds = await _timed(
                        group,
                        n,
                        lambda c, i, r=r, chain=chain, tier=tier: c.put(
                            _key(i, f"{chain}{r}"), payload(i), durable=True, tier=tier
                        ),
                    )
                    out[name].append(_gbps(n * size, seconds))
                progress.advance()
        finally:
            for raw_file in raw_files:
                raw_file.unlink(missing_ok=True)
    finally:
        for client in writers + pushers:
            await client.close()
    return out


async def _wait_indexed(
    conductor: str, key: KvBlockKey, node: str, certs: Path | None, timeout_s: float = 20
) -> None:
    from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
    from quillcache_core.security.tls import grpc_channel
    from quillcache_core.storeclient import wire

    async with grpc_channel(conductor, role_tls(certs, "operator")) as channel:
        stub = conductor_pb2_grpc.ConductorStub(channel)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reply = await stub.Locate(
                conductor_pb2.LocateRequest(
                    identity=wire.identity_of(key), block_hashes=[key.block_hash]
                ),
                timeout=5,
            )
            if any(loc.node_id == node for loc in reply.blocks[0].locations):
                return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"block {key.block_hash} never indexed on {node}")


async def peer_figures(
    a: str,
    b: str,
    transfer: str,
    transfer_grpc: str,
    conductor: str,
    args,
    payloads,
    progress: Progress,
    certs: Path | None = None,
) -> dict[str, list[float]]:
    from quillcache.v1 import transfer_pb2, transfer_pb2_grpc
    from quillcache_core.security.tls import grpc_channel
    from quillcache_core.storeclient import wire
    from quillcache_core.storeclient.client import StoreClient

    n, size = args.blocks, args.block_bytes
    keys = [_key(i, "peer") for i in range(n)]
    engine = role_tls(certs, "engine")
    source = StoreClient(a, timeout_s=60, tls=engine)
    dest = [StoreClient(b, timeout_s=60, tls=engine) for _ in range(args.clients)]
    # Only the transfer service may ask a node to pull (Store.Pull).
    puller = StoreClient(b, timeout_s=60, tls=role_tls(certs, "transfer"))
    operator = role_tls(certs, "operator")
    paired = "raw TCP loopback (paired)"
    distinct = "raw TCP loopback, distinct buffers (paired)"
    # The same stream over TLS with a store's certificate (as peers pull): what TLS
    # itself costs, beside the plaintext baseline of the goal.
    peer_tls = role_tls(certs, "store")
    buffers = distinct_buffers(min(n, 128), size)
    copy, pull, copy_grpc = (
        "peer fetch: transfer Copy A->B",
        "peer fetch: Store.Pull on B (no transfer service)",
        "peer fetch: transfer Copy A->B (gRPC path)",
    )
    remote_get = "peer fetch: get(allow_remote) on B"
    out: dict[str, list[float]] = {
        paired: [],
        distinct: [],
        **({RAW_TLS: []} if peer_tls else {}),
        copy: [],
        pull: [],
        copy_grpc: [],
        remote_get: [],
    }

    def get_remote(client, i: int):
        return client.get(keys[i], allow_remote=True)

    request = transfer_pb2.TransferRequest(
        source_node="store-a",
        destination_node="store-b",
        keys=[wire.key_to_proto(k) for k in keys],
        window=args.window,
    )

    async def run_copy(address: str) -> float:
        async with grpc_channel(address, operator) as channel:
            stub = transfer_pb2_grpc.TransferStub(channel)
            start = time.perf_counter()
            final = None
            async for message in stub.Copy(request, timeout=300):
                final = message
            seconds = time.perf_counter() - start
        if final is None or final.blocks_failed:
            raise RuntimeError(f"transfer failed: {final}")
        return seconds

    async def run_pull() -> float:
        start = time.perf_counter()
        pulled = puller.open_pull("store-a", a_data, keys, timeout_s=300)
        results = [r async for batch in pulled for r in batch]
        seconds = time.perf_counter() - start
        if len(results) != n or not all(r.ok for r in results):
            raise RuntimeError(f"pull failed: {[r for r in results if not r.ok][:1]}")
        return seconds

    try:
        await _timed([source], n, lambda c, i: c.put(keys[i], payloads[i % len(payloads)]))
        await _wait_indexed(conductor, keys[-1], "store-a", certs)
        a_data = (await source.stats())["data_address"]
        # The first pass warms B's buffer pool; its figures are not kept. Each pass
        # follows a raw TCP pass: the machine's speed drifts (other tenants).
        for r in range(args.repeat + 1):
            if r:
                raw_s = await asyncio.to_thread(raw_tcp, n, size)
                out[paired].append(_gbps(n * size, raw_s))
                raw_s = await asyncio.to_thread(raw_tcp, n, size, buffers)
                out[distinct].append(_gbps(n * size, raw_s))
                if peer_tls is not None:
                    raw_s = await asyncio.to_thread(raw_tcp, n, size, None, peer_tls)
                    out[RAW_TLS].append(_gbps(n * size, raw_s))
            for name, measure in (
                (copy, lambda: run_copy(transfer)),
                (pull, run_pull),
                (copy_grpc, lambda: run_copy(transfer_grpc)),
                (remote_get, lambda: _timed(dest, n, get_remote)),
            ):
                seconds = await measure()
                if r:
                    out[name].append(_gbps(n * size, seconds))
                await dest[0].delete(keys)
            progress.advance()
    finally:
        for client in [source, *dest, puller]:
            await client.close()
    return out


# --- the run --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.blocks < max(args.clients, args.durable_clients) or args.repeat < 1:
        raise SystemExit("--blocks must be >= the client counts and --repeat >= 1")
    tune_malloc_for_large_values()
    n, size = args.blocks, args.block_bytes
    rng = np.random.default_rng(7)
    payloads = [
        rng.standard_normal(size // 2, dtype=np.float32).astype(np.float16).tobytes()
        for _ in range(4)
    ]
    figures: dict[str, list[float]] = {}
    steps = 4 * args.repeat + 6
    progress = Progress("bench-store", steps)
    tmp = Path(tempfile.mkdtemp(prefix="qc-bench-", dir=args.data_dir or None))
    services: list[_Service] = []
    etcd = None
    started = time.monotonic()
    try:
        figures["raw TCP loopback"] = []
        for _ in range(args.repeat):
            figures["raw TCP loopback"].append(_gbps(n * size, raw_tcp(n, size)))
            progress.advance()

        ctx = multiprocessing.get_context("spawn")
        port_queue = ctx.Queue()
        bare = ctx.Process(target=bare_grpc_server, args=(port_queue, size, MIB), daemon=True)
        bare.start()
        try:
            address = f"127.0.0.1:{port_queue.get(timeout=30)}"
            for name in (
                "bare gRPC stream (1 call)",
                "bare gRPC per-block down",
                "bare gRPC per-block up",
            ):
                figures[name] = []
            for _ in range(args.repeat):
                stream_s, down_s, up_s = asyncio.run(bare_grpc(address, n, size, MIB, args.clients))
                figures["bare gRPC stream (1 call)"].append(_gbps(n * size, stream_s))
                figures["bare gRPC per-block down"].append(_gbps(n * size, down_s))
                figures["bare gRPC per-block up"].append(_gbps(n * size, up_s))
                progress.advance()
        finally:
            bare.terminate()
            bare.join(5)

        from quillcache_core.launch.etcd_server import EtcdServer

        certs = bench_certs(tmp, args.insecure)
        etcd = EtcdServer(tmp / "etcd", tls_dir=certs).start()
        registry = ["--registry", etcd.client_url, *security_args(certs)]
        capacity = [
            "--dram-capacity-bytes",
            str(max(2048 * MIB, 10 * n * size)),
            "--ssd-capacity-bytes",
            str(max(4096 * MIB, 2 * (4 * args.repeat + 1) * n * size)),
        ]
        conductor = _Service("conductor", registry, tmp / "conductor.log")
        services.append(conductor)
        store_a = _Service(
            "store",
            [*registry, "--node-id", "store-a", "--data-dir", str(tmp / "a"), *capacity],
            tmp / "store-a.log",
        )
        services.append(store_a)
        store_b = _Service(
            "store",
            [*registry, "--node-id", "store-b", "--data-dir", str(tmp / "b"), *capacity],
            tmp / "store-b.log",
        )
        services.append(store_b)
        transfer = _Service("transfer", registry, tmp / "transfer.log")
        services.append(transfer)
        transfer_grpc = _Service(
            "transfer",
            [*registry, "--node-id", "transfer-grpc", "--data-path", "false"],
            tmp / "transfer-grpc.log",
        )
        services.append(transfer_grpc)

        figures.update(
            asyncio.run(store_figures(store_a.address, args, payloads, tmp, progress, certs))
        )
        figures.update(
            asyncio.run(
                peer_figures(
                    store_a.address,
                    store_b.address,
                    transfer.address,
                    transfer_grpc.address,
                    conductor.address,
                    args,
                    payloads,
                    progress,
                    certs,
                )
            )
        )
    finally:
        for service in reversed(services):
            service.stop()
        if etcd is not None:
            etcd.close()
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.monotonic() - started
    return _report(args, figures, elapsed)


BASELINE_OF = {
    "bare gRPC stream (1 call)": "raw TCP loopback",
    "bare gRPC per-block down": "raw TCP loopback",
    "bare gRPC per-block up": "raw TCP loopback",
    "put DRAM (fresh pool)": "bare gRPC per-block up",
    "put DRAM (warm pool)": "bare gRPC per-block up",
    "get DRAM": "bare gRPC per-block down",
    "put SSD": "bare gRPC per-block up",
    "get SSD (promotes)": "bare gRPC per-block down",
    DURABLE: "raw write + fdatasync",
    DURABLE_CACHED: "raw write + fdatasync",
    DURABLE_GRPC: "raw write + fdatasync",
    "raw TCP loopback, distinct buffers (paired)": "raw TCP loopback (paired)",
    RAW_TLS: "raw TCP loopback (paired)",
    "peer fetch: transfer Copy A->B": "raw TCP loopback (paired)",
    "peer fetch: Store.Pull on B (no transfer service)": "raw TCP loopback (paired)",
    "peer fetch: transfer Copy A->B (gRPC path)": "raw TCP loopback (paired)",
    "peer fetch: get(allow_remote) on B": "raw TCP loopback (paired)",
}


PAIRED = {
    DURABLE,
    DURABLE_CACHED,
    DURABLE_GRPC,
    "raw TCP loopback, distinct buffers (paired)",
    RAW_TLS,
    "peer fetch: transfer Copy A->B",
    "peer fetch: Store.Pull on B (no transfer service)",
    "peer fetch: transfer Copy A->B (gRPC path)",
    "peer fetch: get(allow_remote) on B",
}


def _report(args, figures: dict[str, list[float]], elapsed: float) -> int:
    median = {name: statistics.median(values) for name, values in figures.items()}
    rows, results = [], {}
    for name, value in median.items():
        base = BASELINE_OF.get(name)
        ratio = value / median[base] if base and median.get(base) else None
        if name in PAIRED and base in figures:
            # Interleaved passes: the median of per-pass ratios cancels the disk's drift.
            ratio = statistics.median(
                v / b for v, b in zip(figures[name], figures[base], strict=True) if b > 0
            )
        spread = f"{min(figures[name]):.2f}-{max(figures[name]):.2f}"
        rows.append(
            (
                name,
                value,
                spread,
                base or "(baseline)",
                f"{ratio:.0%}" if ratio is not None else "-",
            )
        )
        results[name] = {
            "gbps": value,
            "passes_gbps": figures[name],
            "baseline": base,
            "ratio": ratio,
        }
    print()
    print(
        f"Store throughput: {args.blocks} blocks of {args.block_bytes / MIB:g} MiB per pass, "
        f"{args.clients} clients ({args.durable_clients} for durable puts), transfer window "
        f"{args.window}, median of {args.repeat} "
        f"passes ({os.cpu_count()} CPUs, {elapsed:.0f}s), "
        + ("plaintext (--insecure)" if args.insecure else "mutual TLS to every QuillCache port")
    )
    print(render_table(["measurement", "GB/s", "range", "vs", "ratio"], rows))
    if not args.insecure:
        print(
            "(the baselines are plaintext, no QuillCache process on their path: the ratios "
            f"include the cost of TLS; '{RAW_TLS}' is that stream over TLS alone)"
        )
    print()
    goals = []
    for name, base, target in GOALS:
        ratio = results[name]["ratio"] or 0.0
        met = ratio >= target
        goals.append(
            {"measurement": name, "baseline": base, "target": target, "ratio": ratio, "met": met}
        )
        verdict = "met" if met else "NOT MET"
        print(f"goal {name} >= {target:.0%} of {base}: {ratio:.0%} -> {verdict}")
    payload = {
        "config": vars(args),
        "tls": not args.insecure,
        "results": results,
        "goals": goals,
        "elapsed_s": elapsed,
    }
    path = write_results("store", payload, args.out_dir)
    png = _plot(median, path.with_suffix(".png"))
    shutil.copy(png, png.with_name("store-latest.png"))
    print(f"\nwrote {path} and {png}")
    return 0


def _plot(median: dict[str, float], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(median)
    colors = [
        "tab:gray"
        if n not in BASELINE_OF or n.startswith(("bare", "raw"))
        else ("tab:green" if n.startswith("peer") else "tab:blue")
        for n in names
    ]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    y = np.arange(len(names))
    ax.barh(y, [median[n] for n in names], color=colors)
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (median)")
    ax.set_title("QuillCache store and transfer vs baselines (2 MiB blocks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
