"""`quillcache bench-planner`: planner latency per policy and residency-index rates.

Builds an index of about 1M resident blocks over 64 engines (HBM) and their store
nodes (DRAM), then times complete routing decisions (locate the prompt's blocks,
audit them, run the policy) for 128-block prompts that share a random prefix with a
resident chain. The baseline, run in the same command, is the lookup alone (locate +
guard); each policy's latency is also shown as a ratio to it. Index put and
locate_hash rates are measured on the memory backend at full size and on the lmdb
backend with a smaller batch.
"""

from __future__ import annotations

import argparse
import gc
import random
import shutil
import tempfile
import time

import numpy as np

from quillcache_bench.common import Progress, percentiles_us, render_table, write_results
from quillcache_core.identity.keys import request_blocks
from quillcache_core.index import LmdbIndex, MemoryIndex
from quillcache_core.model import (
    MIB,
    CacheResidency,
    CacheTier,
    CostModel,
    RequestShape,
    WorkerState,
)
from quillcache_core.routing.decide import plan_request
from quillcache_core.routing.guard import audit_reuse
from quillcache_core.routing.policy import Fleet
from quillcache_core.routing.references import POLICY_NAMES, make_policy

MODEL, TOKENIZER = "llama-3-8b", "llama-3"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quillcache bench-planner", description=__doc__)
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--stores", type=int, default=16, help="store nodes (engines share them)")
    parser.add_argument("--domains", type=int, default=4, help="locality domains (racks)")
    parser.add_argument(
        "--resident-blocks",
        type=int,
        default=1_000_000,
        help="residency records to load into the index",
    )
    parser.add_argument("--prompt-blocks", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--plans", type=int, default=2000, help="timed plans per policy")
    parser.add_argument(
        "--lmdb-blocks", type=int, default=100_000, help="records for the lmdb put/locate rates"
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out-dir", default="bench/results")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rng = random.Random(args.seed)
    nprng = np.random.default_rng(args.seed)
    bs, pb = args.block_size, args.prompt_blocks

    engines = [
        WorkerState(
            id=f"e{i:03d}",
            locality_domain=f"rack-{i % args.domains}",
            store_node_id=f"s{i % args.stores:02d}",
            hbm_capacity_bytes=64 * 1024 * MIB,
        )
        for i in range(args.engines)
    ]
    store_domains = {f"s{j:02d}": f"rack-{j % args.domains}" for j in range(args.stores)}
    fleet = Fleet(engines, store_domains)

    # Each chain is one conversation prefix resident on one engine; a third also sit
    # in a store node's DRAM. 4 records per 3 blocks gives the requested total.
    chains = max(1, int(args.resident_blocks * 3 / 4 / pb))
    chain_tokens = nprng.integers(0, 32000, size=(chains, pb * bs), dtype=np.int64)
    index = MemoryIndex()
    progress = Progress("loading index", chains)
    put_seconds = 0.0
    records = 0
    tenants = [f"tenant-{t}" for t in range(8)]
    chain_tenant = []
    for c in range(chains):
        tenant = tenants[c % len(tenants)]
        chain_tenant.append(tenant)
        keys = request_blocks(
            chain_tokens[c].tolist(),
            bs,
            model_id=MODEL,
            tokenizer_id=TOKENIZER,
            adapter_id=None,
            tenant_id=tenant,
        )
        owner = engines[c % len(engines)]
        batch = [CacheResidency(k, owner.id, CacheTier.HBM, 2 * MIB) for k in keys]
        if c % 3 == 0:
            node = f"s{rng.randrange(args.stores):02d}"
            batch += [CacheResidency(k, node, CacheTier.CPU_DRAM, 2 * MIB) for k in keys]
        start = time.perf_counter()
        index.put_many(batch)
        put_seconds += time.perf_counter() - start
        records += len(batch)
        progress.advance()
    for worker in engines:
        worker.resident_blocks = index.worker_block_count(worker.id)
        worker.hbm_used_bytes = worker.resident_blocks * 2 * MIB
        worker.inflight_requests = rng.randrange(0, 8)
        worker.running_decodes = worker.inflight_requests
        worker.queued_prefill_tokens = rng.randrange(0, 4000)
        worker.inflight_blocks = worker.inflight_requests * pb

    # As the conductor does once its index is loaded (HeapSettler): freeze the
    # long-lived records, so no collection walks a million of them inside a plan.
    gc.collect()
    gc.freeze()

    all_hashes = [r.key.block_hash for r in _sample_records(index, 200_000, rng)]
    start = time.perf_counter()
    for block_hash in all_hashes:
        index.locate_hash(block_hash)
    locate_rate = len(all_hashes) / (time.perf_counter() - start)

    requests = []
    for n in range(args.plans):
        c = rng.randrange(chains)
        shared = rng.randrange(0, pb + 1)
        tokens = chain_tokens[c].tolist()
        tokens[shared * bs :] = nprng.integers(0, 32000, size=(pb - shared) * bs).tolist()
        keys = request_blocks(
            tokens,
            bs,
            model_id=MODEL,
            tokenizer_id=TOKENIZER,
            adapter_id=None,
            tenant_id=chain_tenant[c],
        )
        requests.append(
            RequestShape(
                id=f"r{n}",
                model_id=MODEL,
                tokenizer_id=TOKENIZER,
                adapter_id=None,
                tenant_id=chain_tenant[c],
                blocks=tuple(keys),
                estimated_decode_tokens=128,
                prompt_tokens=len(tokens),
            )
        )

    results: dict[str, dict[str, float]] = {}
    progress = Progress("timing plans", args.plans * (len(POLICY_NAMES) + 1))
    samples = []
    for request in requests:
        start = time.perf_counter()
        located = index.locate_hashes([k.block_hash for k in request.blocks])
        audit_reuse(request.scope(), located)
        samples.append(time.perf_counter() - start)
        progress.advance()
    results["lookup only (baseline)"] = percentiles_us(samples)
    for name in POLICY_NAMES:
        policy = make_policy(name, CostModel())
        samples = []
        for request in requests:
            start = time.perf_counter()
            plan_request(index, policy, request, fleet, rng)
            samples.append(time.perf_counter() - start)
            progress.advance()
        results[name] = percentiles_us(samples)

    lmdb_put_rate, lmdb_locate_rate = _lmdb_rates(index, args.lmdb_blocks, rng)

    base = results["lookup only (baseline)"]
    rows = [
        (
            name,
            r["p50_us"],
            r["p99_us"],
            r["mean_us"],
            r["p50_us"] / base["p50_us"],
            1e6 / r["mean_us"],
        )
        for name, r in results.items()
    ]
    print()
    print(
        f"Planner: {len(engines)} engines, {args.stores} store nodes, {len(index):,} resident "
        f"records, {pb}-block prompts, {args.plans} plans per policy"
    )
    print(
        render_table(["policy", "p50 us", "p99 us", "mean us", "p50 x baseline", "plans/s"], rows)
    )
    index_rows = [
        ("memory", records / put_seconds, locate_rate, len(index)),
        ("lmdb", lmdb_put_rate, lmdb_locate_rate, args.lmdb_blocks),
    ]
    print()
    print(render_table(["index", "puts/s", "locate_hash/s", "records"], index_rows))
    payload = {
        "config": vars(args),
        "resident_records": len(index),
        "plan_latency": results,
        "index": {
            "memory": {"puts_per_s": records / put_seconds, "locate_per_s": locate_rate},
            "lmdb": {"puts_per_s": lmdb_put_rate, "locate_per_s": lmdb_locate_rate},
        },
    }
    path = write_results("planner", payload, args.out_dir)
    png = _plot(results, path.with_suffix(".png"))
    shutil.copy(png, png.with_name("planner-latest.png"))
    print(f"\nwrote {path} and {png}")
    return 0


def _sample_records(index: MemoryIndex, n: int, rng: random.Random) -> list[CacheResidency]:
    snapshot = index.snapshot()
    return [snapshot[rng.randrange(len(snapshot))] for _ in range(min(n, len(snapshot)))]


def _lmdb_rates(source: MemoryIndex, n: int, rng: random.Random) -> tuple[float, float]:
    records = _sample_records(source, n, rng)
    with tempfile.TemporaryDirectory() as tmp:
        index = LmdbIndex(tmp)
        try:
            start = time.perf_counter()
            for i in range(0, len(records), 1000):
                index.put_many(records[i : i + 1000])
            put_rate = len(records) / (time.perf_counter() - start)
            probes = [r.key.block_hash for r in records[: min(50_000, len(records))]]
            start = time.perf_counter()
            for block_hash in probes:
                index.locate_hash(block_hash)
            locate_rate = len(probes) / (time.perf_counter() - start)
        finally:
            index.close()
    return put_rate, locate_rate


def _plot(results: dict[str, dict[str, float]], path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar(x - 0.2, [results[n]["p50_us"] for n in names], 0.4, label="p50")
    ax.bar(x + 0.2, [results[n]["p99_us"] for n in names], 0.4, label="p99")
    ax.set_xticks(x, names, rotation=20, ha="right")
    ax.set_ylabel("plan latency (us)")
    ax.set_title("Routing decision latency, 128-block prompt, 1M resident blocks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
