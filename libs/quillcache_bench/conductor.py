"""`quillcache bench-conductor`: Plan over gRPC and KV-event ingest, against a real conductor.

Starts etcd and a conductor process, registers 64 engines and 16 store nodes,
loads about 1M resident blocks (Observe for HBM, store events for DRAM), then
measures, in one run:

- Plan latency p50/p99 from one client (128-block prompts sharing a random prefix
  with a resident chain), with a health Check's latency as the baseline;
- Plan throughput with concurrent clients (plans/s), each client finishing its plan
  before its next one as a gateway does (at most --concurrency reservations open;
  Plans left open by the thousand would pile optimistic copies of the same prefixes
  onto every engine, a state no fleet reaches);
- KV-event ingest in-process (decode + translate of vLLM-encoded batches into an
  index; the median of three passes), with msgpack decoding alone as the baseline,
  for tagged-array events (the goal's row) and again for vLLM's map form;
- KV-event ingest over ZMQ into the conductor process (block events/s until the
  conductor's index holds them all).

- Plan latency over the plan port again while another engine's KV events arrive over
  ZMQ at --ingest-rate (50k block events/s), paced from a thread of their own. The
  stream is a full engine cache turning over, as vLLM reports one: each batch stores a
  new 32-block prompt chain and removes the chain stored 1,000 batches before (the
  engine's cache holds 32,000 blocks, filled before the plans start).

Goals: Plan p99 <= 3 ms, >= 2,000 plans/s, >= 500k block events/s
in-process, >= 200k over ZMQ, Plan p99 <= 2 ms over the plan port under 50k block
events/s. The table says which are met.

Everything runs as a secure cluster does (certificates made in the run's temp dir):
etcd with client certificates and its roles, the conductor with mutual TLS on its
gRPC and plan ports, and each call with the role that makes it in a deployment:
engines' records, Observe and the ZMQ engine's record as `engine`, store records
and store events as `store`, Plan/Finish (gRPC and the plan port) and the health
Check baseline as `gateway`. The TLS cost is thus part of every figure but the
in-process ingest; `--insecure` measures the plaintext stack instead.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from quillcache.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from quillcache_bench.common import Progress, percentiles_us, render_table, write_results
from quillcache_bench.secure import INSECURE_HELP, bench_certs
from quillcache_core.identity.keys import request_blocks
from quillcache_core.index import MemoryIndex
from quillcache_core.kvevents.bulk_decode import decode_bulk
from quillcache_core.kvevents.translate import EngineEventTranslator
from quillcache_core.launch.etcd_server import EtcdServer, free_port
from quillcache_core.launch.process import ManagedProcess, ProcessFailed
from quillcache_core.process.heap import HeapSettler
from quillcache_core.registry import NodeRecord, open_registry
from quillcache_core.rpc.plan_client import PlanClient
from quillcache_core.rpc.plan_port import PlanPortClient
from quillcache_core.security.credentials import role_tls, security_args
from quillcache_core.security.tls import grpc_channel
from quillcache_core.wire.plan import pack_hashes

MODEL, TOKENIZER, BS = "bench-model", "builtin-v1", 16
# The conductor's goals, judged in the table and drawn in the plot.
GOAL_P99_US, GOAL_PLANS_PER_S = 3000, 2000
GOAL_EVENTS_IN_PROCESS, GOAL_EVENTS_ZMQ = 500_000, 200_000
GOAL_P99_UNDER_INGEST_US = 2000  # over the plan port, while --ingest-rate events arrive


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quillcache bench-conductor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--stores", type=int, default=16)
    parser.add_argument("--resident-blocks", type=int, default=1_000_000)
    parser.add_argument("--prompt-blocks", type=int, default=128)
    parser.add_argument("--plans", type=int, default=2000, help="sequential plans for latency")
    parser.add_argument(
        "--ingest-rate",
        type=float,
        default=50_000,
        help="block events a second arriving over ZMQ while plan latency is measured again",
    )
    parser.add_argument(
        "--concurrency", type=int, default=32, help="clients for the throughput run"
    )
    parser.add_argument("--throughput-plans", type=int, default=4000)
    parser.add_argument(
        "--event-blocks", type=int, default=200_000, help="block events per ingest run"
    )
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
    parser.add_argument("--out-dir", default="bench/results")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return asyncio.run(_main(args))


async def _main(args) -> int:
    results: dict = {"config": vars(args), "tls": not args.insecure}
    with tempfile.TemporaryDirectory(prefix="qc-bench-") as tmp:
        certs = bench_certs(Path(tmp), args.insecure)
        with EtcdServer(Path(tmp) / "etcd", tls_dir=certs) as etcd:
            await _run_conductor(args, Path(tmp), certs, etcd, results)
    _report(args, results)
    return 0


async def _run_conductor(args, tmp: Path, certs: Path | None, etcd, results) -> None:
    """The conductor process (with the run's certificates), benched, then stopped."""
    argv = [sys.executable, "-m", "quillcache_core.launch.cli", "conductor",
            "--registry", etcd.client_url, "--log-level", "WARNING",
            "--reservation-ttl-s", "3600", *security_args(certs)]  # fmt: skip
    with ManagedProcess(argv, log_path=tmp / "conductor.log", name="conductor") as proc:
        try:
            await proc.wait_ready_async(lambda: proc.ready_fields() is not None, timeout_s=30)
        except ProcessFailed as exc:
            raise SystemExit(f"conductor did not start: {exc}") from None
        await _bench(args, etcd, proc.ready_fields()["grpc"], certs, results)


async def _bench(args, etcd, address, certs, results) -> None:
    rng = random.Random(args.seed)
    nprng = np.random.default_rng(args.seed)
    # etcd lets each role write only its own kind of record: engines' as `engine`,
    # stores' as `store`.
    registry = open_registry(etcd.client_url, role_tls(certs, "engine"))
    store_registry = open_registry(etcd.client_url, role_tls(certs, "store"))
    engine_ids = [f"e{i:03d}" for i in range(args.engines)]
    store_ids = [f"s{j:02d}" for j in range(args.stores)]
    zmq_port = free_port()
    for i, eid in enumerate(engine_ids):
        await registry.register(
            NodeRecord(
                kind="engine",
                id=eid,
                address="",
                locality_domain=f"rack-{i % 4}",
                base_url=f"http://127.0.0.1:1/{eid}",
                model=MODEL,
                tokenizer=TOKENIZER,
                store_node=store_ids[i % len(store_ids)],
            ),
            30,
        )
    for j, sid in enumerate(store_ids):
        await store_registry.register(
            NodeRecord(
                kind="store",
                id=sid,
                address=f"127.0.0.1:{1000 + j}",
                locality_domain=f"rack-{j % 4}",
            ),
            30,
        )
    # One channel per caller role: the gateway plans (and reads Stats), engines
    # observe, stores report their blocks.
    options = [("grpc.max_send_message_length", 64 << 20)]
    gateway_tls = role_tls(certs, "gateway")
    channel = grpc_channel(address, gateway_tls, options)
    engine_channel = grpc_channel(address, role_tls(certs, "engine"), options)
    store_channel = grpc_channel(address, role_tls(certs, "store"), options)
    stub = conductor_pb2_grpc.ConductorStub(channel)
    as_engine = conductor_pb2_grpc.ConductorStub(engine_channel)
    as_store = conductor_pb2_grpc.ConductorStub(store_channel)
    await _wait(lambda: _engines(stub), args.engines)

    # --- load ~1M residency records ---
    pb = args.prompt_blocks
    chains = max(1, int(args.resident_blocks * 3 / 4 / pb))
    chain_tokens = nprng.integers(0, 32000, size=(chains, pb * BS))
    tenants = [f"tenant-{t}" for t in range(8)]
    progress = Progress("loading residency", chains)
    sem = asyncio.Semaphore(16)
    started = time.perf_counter()

    async def load(c: int) -> None:
        tenant = tenants[c % len(tenants)]
        keys = request_blocks(
            chain_tokens[c].tolist(),
            BS,
            model_id=MODEL,
            tokenizer_id=TOKENIZER,
            adapter_id=None,
            tenant_id=tenant,
            cache_salt=tenant,
        )
        refs = [common_pb2.BlockRef(block_hash=k.block_hash, token_count=BS) for k in keys]
        ident = common_pb2.Identity(model_id=MODEL, tokenizer_id=TOKENIZER, tenant_id=tenant)
        async with sem:
            await as_engine.Observe(
                conductor_pb2.ObserveRequest(
                    engine_id=engine_ids[c % len(engine_ids)], identity=ident, blocks=refs
                ),
                timeout=30,
            )
            if c % 3 == 0:
                batch = conductor_pb2.KvEventBatch(
                    engine_id=store_ids[c % len(store_ids)],
                    source_kind="store",
                    identity=ident,
                    bytes_per_block=2 << 20,
                )
                batch.events.add().stored.CopyFrom(
                    conductor_pb2.BlockStored(
                        block_hashes=[k.block_hash for k in keys], block_size=BS, medium="cpu_dram"
                    )
                )
                await as_store.IngestKvEvents(batch, timeout=30)
        progress.advance()

    await asyncio.gather(*(load(c) for c in range(chains)))
    stats = await stub.Stats(conductor_pb2.StatsRequest(), timeout=30)
    results["resident_records"] = stats.resident_records
    results["load_s"] = time.perf_counter() - started

    def request(n: int) -> conductor_pb2.PlanRequest:
        c = rng.randrange(chains)
        tenant = tenants[c % len(tenants)]
        shared = rng.randrange(0, pb + 1)
        tokens = chain_tokens[c].tolist()
        tokens[shared * BS :] = nprng.integers(0, 32000, size=(pb - shared) * BS).tolist()
        keys = request_blocks(
            tokens,
            BS,
            model_id=MODEL,
            tokenizer_id=TOKENIZER,
            adapter_id=None,
            tenant_id=tenant,
            cache_salt=tenant,
        )
        # What the gateway sends: packed hashes, action runs and no other engines in the reply.
        return conductor_pb2.PlanRequest(
            request_id=f"r{n}",
            identity=common_pb2.Identity(model_id=MODEL, tokenizer_id=TOKENIZER, tenant_id=tenant),
            packed_hashes=pack_hashes([k.block_hash for k in keys]),
            block_tokens=BS,
            action_runs=True,
            max_others=0,
            prompt_tokens=len(tokens),
            expected_decode_tokens=128,
        )

    requests = [request(n) for n in range(max(args.plans, args.throughput_plans))]

    # --- latency: baseline health check, then Plan (+Finish, untimed) from one client,
    # unary and over PlanStream (the gateway's path) ---
    health = health_pb2_grpc.HealthStub(channel)
    plans = PlanClient(channel)

    async def plan_address() -> str:
        return (await stub.Stats(conductor_pb2.StatsRequest(), timeout=5)).plan_address

    port = PlanPortClient(plan_address, gateway_tls)
    progress = Progress("plan latency", 4 * args.plans)
    base = []
    for _ in range(args.plans):
        t = time.perf_counter()
        await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        base.append(time.perf_counter() - t)
        progress.advance()
    for name, plan_call, finish_call in (
        ("plan_unary", stub.Plan, stub.Finish),
        ("plan", plans.plan, plans.finish),
        ("plan_port", port.plan, port.finish),
    ):
        lat, inside = [], []
        for req in requests[: args.plans]:
            t = time.perf_counter()
            reply = await plan_call(req, timeout=5)
            lat.append(time.perf_counter() - t)
            inside.append(reply.plan_us / 1e6)
            await finish_call(
                conductor_pb2.FinishRequest(
                    reservation_id=reply.reservation_id,
                    outcome=conductor_pb2.FinishRequest.CANCELLED,
                ),
                timeout=5,
            )
            progress.advance()
        results[name] = percentiles_us(lat)
        results[name + "_in_conductor"] = percentiles_us(inside)
    results["health_check"] = percentiles_us(base)

    # --- throughput: concurrent clients, each Plan finished before the client's next one,
    # as a gateway does (cancelled, so the fleet's state stays at the loaded records) ---
    for name, plan_call, finish_call in (
        ("plans_per_s_unary", stub.Plan, stub.Finish),
        ("plans_per_s", plans.plan, plans.finish),
        ("plans_per_s_port", port.plan, port.finish),
    ):
        queue = list(requests[: args.throughput_plans])
        progress = Progress(f"plan throughput ({name})", len(queue))

        async def client(
            plan_call=plan_call, finish_call=finish_call, queue=queue, progress=progress
        ) -> None:
            while queue:
                reply = await plan_call(queue.pop(), timeout=30)
                await finish_call(
                    conductor_pb2.FinishRequest(
                        reservation_id=reply.reservation_id,
                        outcome=conductor_pb2.FinishRequest.CANCELLED,
                    ),
                    timeout=30,
                )
                progress.advance()

        t = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        results[name] = args.throughput_plans / (time.perf_counter() - t)
    await plans.close()
    await port.close()

    # --- KV events ---
    payloads = _vllm_payloads(args.event_blocks, nprng)
    results["events_in_process"] = _ingest_in_process(payloads)
    # The same events as vLLM encodes them since its map form (no goal of its own).
    map_payloads = _vllm_payloads(args.event_blocks, np.random.default_rng(args.seed), maps=True)
    results["events_in_process_map"] = _ingest_in_process(map_payloads, "map form")
    results["events_zmq"] = await _ingest_zmq(payloads, registry, stub, zmq_port)
    port = PlanPortClient(plan_address, gateway_tls)
    results["plan_port_under_ingest"] = await _plans_under_ingest(
        registry, stub, port, requests[: args.plans], args.ingest_rate, args.seed
    )
    await port.close()
    await registry.close()
    await store_registry.close()
    for open_channel in (channel, engine_channel, store_channel):
        await open_channel.close()


def _vllm_payloads(blocks: int, nprng, *, maps: bool = False) -> list[bytes]:
    """vLLM-encoded batches: 64 BlockStored events of 1 block each, chained; tagged
    arrays in an array batch, or (`maps`) vLLM's map form."""
    payloads = []
    parent = None
    ts = time.time()
    for start in range(0, blocks, 64):
        events: list = []
        for i in range(start, min(blocks, start + 64)):
            tokens = nprng.integers(0, 32000, size=BS).tolist()
            if maps:
                events.append(
                    {
                        "type": "BlockStored",
                        "block_hashes": [i + 1],
                        "parent_block_hash": parent,
                        "token_ids": tokens,
                        "block_size": BS,
                        "lora_id": None,
                        "medium": "GPU",
                        "lora_name": None,
                    }
                )
            else:
                events.append(["BlockStored", [i + 1], parent, tokens, BS, None, "GPU"])
            parent = i + 1
        batch = {"ts": ts, "events": events, "data_parallel_rank": 0} if maps else [ts, events, 0]
        payloads.append(msgpack.packb(batch))
    return payloads


def _block_events(payloads: list[bytes]) -> int:
    """Events in the batches (one block each), either batch form."""
    batches = map(msgpack.unpackb, payloads)
    return sum(len(b["events"] if isinstance(b, dict) else b[1]) for b in batches)


def _ingest_in_process(payloads: list[bytes], what: str = "", passes: int = 3) -> dict:
    """Decode + translate every payload into a fresh index, `passes` times; the median
    pass is the figure (one pass is about a third of a second, short enough for this
    machine's noise to move it by 10%), the slowest and fastest are kept beside it."""
    blocks = _block_events(payloads)
    baselines, rates = [], []
    progress = Progress(f"events in-process {what}".strip(), passes * len(payloads))
    for _ in range(passes):
        t = time.perf_counter()
        for p in payloads:
            msgpack.unpackb(p)
        baselines.append(blocks / (time.perf_counter() - t))
        translator = EngineEventTranslator(MemoryIndex(), "bench-engine", MODEL, TOKENIZER)
        heap = HeapSettler()  # as the conductor's tick does
        t = time.perf_counter()
        for p in payloads:
            translator.apply(decode_bulk(p))
            heap.maybe_settle()
            progress.advance()
        rates.append(blocks / (time.perf_counter() - t))
    return {
        "block_events_per_s": statistics.median(rates),
        "block_events_per_s_passes": rates,
        "msgpack_only_per_s": statistics.median(baselines),
        "blocks": blocks,
    }


async def _ingest_zmq(payloads, registry, stub, port) -> dict:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    eid = "zmq-engine"
    try:
        await _register_zmq_engine(registry, eid, port)
        await _wait(lambda: _engine_blocks(stub, eid, want_present=True), 1)
        # Warm the subscription: a SUB socket misses what is published before it connects.
        seq = 0
        warm = msgpack.packb([time.time(), [["AllBlocksCleared"]], 0])
        while True:
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), warm])
            seq += 1
            stats = await stub.Stats(conductor_pb2.StatsRequest(), timeout=5)
            if seq > 3 and stats.events_applied > 0:
                break
            await asyncio.sleep(0.05)
        blocks = _block_events(payloads)
        progress = Progress("events over ZMQ", blocks)
        t = time.perf_counter()
        for p in payloads:
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), p])
            seq += 1
        seen = 0
        while seen < blocks:
            seen = await _engine_blocks(stub, eid)
            progress.done = seen
            progress.advance(0)
            if time.perf_counter() - t > 300:
                break
            await asyncio.sleep(0.05)
        elapsed = time.perf_counter() - t
        return {"block_events_per_s": seen / elapsed, "blocks": seen, "sent": blocks}
    finally:
        pub.close(0)
        ctx.term()


async def _register_zmq_engine(registry, eid: str, port: int) -> None:
    """An engine whose KV events the conductor subscribes to on a local ZMQ port."""
    await registry.register(
        NodeRecord(
            kind="engine",
            id=eid,
            address="",
            locality_domain="rack-0",
            base_url=f"http://127.0.0.1:1/{eid}",
            model=MODEL,
            tokenizer=TOKENIZER,
            kv_events_endpoint=f"tcp://127.0.0.1:{port}",
        ),
        30,
    )


CHURN_RUN = 32  # blocks a paced batch stores (and removes)
CHURN_RESIDENT = 1_000  # batches the engine's cache holds: a batch removes the one this far back


def _churn_payloads(batches: int, seed: int) -> list[bytes]:
    """vLLM-encoded batches of a full engine cache turning over: batch b stores a new
    CHURN_RUN-block chain (one BlockStored, as vLLM reports a prompt's new blocks) and,
    from batch CHURN_RESIDENT on, removes the chain of batch b - CHURN_RESIDENT."""
    rng = np.random.default_rng(seed)
    first, ts = 1 << 40, time.time()
    payloads = []
    for b in range(batches):
        base = first + b * CHURN_RUN
        tokens = rng.integers(0, 32000, size=CHURN_RUN * BS).tolist()
        stored = ["BlockStored", list(range(base, base + CHURN_RUN)), None, tokens, BS, None, "GPU"]
        events: list = [stored]
        if b >= CHURN_RESIDENT:
            old = base - CHURN_RESIDENT * CHURN_RUN
            events.append(["BlockRemoved", list(range(old, old + CHURN_RUN)), "GPU"])
        payloads.append(msgpack.packb([ts, events, 0]))
    return payloads


async def _plans_under_ingest(registry, stub, port, requests, rate: float, seed: int) -> dict:
    """Plan latency over the plan port (the gateway's path, each plan finished, untimed)
    while another engine's KV events arrive over ZMQ at `rate` block events a second,
    paced from a thread of their own; reports the latency, the offered rate and the
    rate the conductor applied them at (its event counter)."""
    zmq_port = free_port()
    eid = "zmq-engine-paced"
    await _register_zmq_engine(registry, eid, zmq_port)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(f"tcp://127.0.0.1:{zmq_port}")
    await _wait(lambda: _engine_blocks(stub, eid, want_present=True), 1)
    seq = 0
    warm = msgpack.packb([time.time(), [["AllBlocksCleared"]], 0])
    before = (await stub.Stats(conductor_pb2.StatsRequest(), timeout=5)).events_applied
    while (await stub.Stats(conductor_pb2.StatsRequest(), timeout=5)).events_applied == before:
        pub.send_multipart([b"", seq.to_bytes(8, "big"), warm])
        seq += 1
        await asyncio.sleep(0.05)
    # Enough batches for a minute at `rate`; the phase takes seconds.
    per_batch = 2 * CHURN_RUN
    payloads = _churn_payloads(CHURN_RESIDENT + int(60 * rate / per_batch), seed)
    # Fill the engine's cache before the clock starts.
    for p in payloads[:CHURN_RESIDENT]:
        pub.send_multipart([b"", seq.to_bytes(8, "big"), p])
        seq += 1
    await _wait(lambda: _engine_blocks(stub, eid), CHURN_RESIDENT * CHURN_RUN)
    payloads = payloads[CHURN_RESIDENT:]
    stop = threading.Event()
    sent = [0]

    def publish(seq: int = seq) -> None:
        interval = per_batch / rate
        start = time.perf_counter()
        i = 0
        while not stop.is_set() and i < len(payloads):
            due = start + i * interval
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payloads[i]])
            seq += 1
            i += 1
            sent[0] += per_batch

    applied_before = (await stub.Stats(conductor_pb2.StatsRequest(), timeout=5)).events_applied
    thread = threading.Thread(target=publish, name="paced-events", daemon=True)
    progress = Progress(f"plans under {rate / 1000:.0f}k block events/s", len(requests))
    t = time.perf_counter()
    thread.start()
    lat, inside = [], []
    try:
        for req in requests:
            start = time.perf_counter()
            reply = await port.plan(req, timeout=5)
            lat.append(time.perf_counter() - start)
            inside.append(reply.plan_us / 1e6)
            await port.finish(
                conductor_pb2.FinishRequest(
                    reservation_id=reply.reservation_id,
                    outcome=conductor_pb2.FinishRequest.CANCELLED,
                ),
                timeout=5,
            )
            progress.advance()
    finally:
        stop.set()
        thread.join()
        elapsed = time.perf_counter() - t
        applied = (await stub.Stats(conductor_pb2.StatsRequest(), timeout=5)).events_applied
        pub.close(0)
        ctx.term()
    return {
        **percentiles_us(lat),
        "in_conductor": percentiles_us(inside),
        "offered_block_events_per_s": sent[0] / elapsed,
        # The conductor counts events; each of these carries CHURN_RUN blocks.
        "applied_block_events_per_s": (applied - applied_before) * CHURN_RUN / elapsed,
        "seconds": elapsed,
    }


async def _engines(stub) -> int:
    stats = await stub.Stats(conductor_pb2.StatsRequest(), timeout=5)
    return len(stats.engines)


async def _engine_blocks(stub, eid, want_present=False) -> int:
    stats = await stub.Stats(conductor_pb2.StatsRequest(), timeout=5)
    for engine in stats.engines:
        if engine.engine_id == eid:
            return 1 if want_present else engine.resident_blocks
    return 0


async def _wait(probe, want: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while await probe() < want:
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {want}")
        await asyncio.sleep(0.05)


def _report(args, results) -> None:
    plan, base, unary = results["plan"], results["health_check"], results["plan_unary"]
    inproc, overzmq = results["events_in_process"], results["events_zmq"]
    inmap = results["events_in_process_map"]
    under = results["plan_port_under_ingest"]
    goals = [
        ("Plan p99 <= 3 ms (gRPC PlanStream)", plan["p99_us"] <= GOAL_P99_US),
        (">= 2,000 plans/s (gRPC PlanStream)", results["plans_per_s"] >= GOAL_PLANS_PER_S),
        ("Plan p99 <= 3 ms (plan port)", results["plan_port"]["p99_us"] <= GOAL_P99_US),
        (">= 2,000 plans/s (plan port)", results["plans_per_s_port"] >= GOAL_PLANS_PER_S),
        (
            ">= 500k block events/s in-process",
            inproc["block_events_per_s"] >= GOAL_EVENTS_IN_PROCESS,
        ),
        (">= 200k block events/s over ZMQ", overzmq["block_events_per_s"] >= GOAL_EVENTS_ZMQ),
        (
            f"Plan p99 <= 2 ms (plan port) under {args.ingest_rate / 1000:.0f}k block events/s",
            under["p99_us"] <= GOAL_P99_UNDER_INGEST_US,
        ),
    ]
    results["goals"] = {name: met for name, met in goals}
    print(
        f"\nConductor: {args.engines} engines, {args.stores} stores, "
        f"{results['resident_records']:,} resident records (loaded in {results['load_s']:.1f} s), "
        f"{args.prompt_blocks}-block prompts, "
        + ("plaintext (--insecure)" if args.insecure else "mutual TLS on every call")
    )
    print(
        render_table(
            ["measure", "value", "baseline", "ratio to baseline"],
            [
                (
                    "Plan p50 (us), unary",
                    unary["p50_us"],
                    base["p50_us"],
                    unary["p50_us"] / base["p50_us"],
                ),
                (
                    "Plan p99 (us), unary",
                    unary["p99_us"],
                    base["p99_us"],
                    unary["p99_us"] / base["p99_us"],
                ),
                (
                    "Plan p50 (us), PlanStream",
                    plan["p50_us"],
                    base["p50_us"],
                    plan["p50_us"] / base["p50_us"],
                ),
                (
                    "Plan p99 (us), PlanStream",
                    plan["p99_us"],
                    base["p99_us"],
                    plan["p99_us"] / base["p99_us"],
                ),
                (
                    "  of which planning in the conductor, p50/p99 (us)",
                    f"{results['plan_in_conductor']['p50_us']:,.0f} / "
                    f"{results['plan_in_conductor']['p99_us']:,.0f}",
                    "",
                    "",
                ),
                (
                    "Plan p50 (us), plan port",
                    results["plan_port"]["p50_us"],
                    base["p50_us"],
                    results["plan_port"]["p50_us"] / base["p50_us"],
                ),
                (
                    "Plan p99 (us), plan port",
                    results["plan_port"]["p99_us"],
                    base["p99_us"],
                    results["plan_port"]["p99_us"] / base["p99_us"],
                ),
                (
                    f"Plan p50 / p99 (us), plan port, under "
                    f"{under['offered_block_events_per_s']:,.0f} block events/s offered "
                    f"({under['applied_block_events_per_s']:,.0f}/s applied)",
                    f"{under['p50_us']:,.0f} / {under['p99_us']:,.0f}",
                    f"{results['plan_port']['p50_us']:,.0f} / {results['plan_port']['p99_us']:,.0f}",
                    under["p99_us"] / results["plan_port"]["p99_us"],
                ),
                (
                    f"plans/s, {args.concurrency} clients, unary",
                    results["plans_per_s_unary"],
                    1e6 / base["mean_us"],
                    results["plans_per_s_unary"] / (1e6 / base["mean_us"]),
                ),
                (
                    f"plans/s, {args.concurrency} clients, PlanStream",
                    results["plans_per_s"],
                    1e6 / base["mean_us"],
                    results["plans_per_s"] / (1e6 / base["mean_us"]),
                ),
                (
                    f"plans/s, {args.concurrency} clients, plan port",
                    results["plans_per_s_port"],
                    1e6 / base["mean_us"],
                    results["plans_per_s_port"] / (1e6 / base["mean_us"]),
                ),
                (
                    f"block events/s in-process (median of {len(inproc['block_events_per_s_passes'])}"
                    f" passes: {min(inproc['block_events_per_s_passes']):,.0f}"
                    f"-{max(inproc['block_events_per_s_passes']):,.0f})",
                    inproc["block_events_per_s"],
                    inproc["msgpack_only_per_s"],
                    inproc["block_events_per_s"] / inproc["msgpack_only_per_s"],
                ),
                (
                    "  the same events in vLLM's map form (no goal)",
                    inmap["block_events_per_s"],
                    inmap["msgpack_only_per_s"],
                    inmap["block_events_per_s"] / inmap["msgpack_only_per_s"],
                ),
                (
                    "block events/s over ZMQ",
                    overzmq["block_events_per_s"],
                    inproc["block_events_per_s"],
                    overzmq["block_events_per_s"] / inproc["block_events_per_s"],
                ),
            ],
        )
    )
    print(
        "baselines: a gRPC health Check (latency, calls/s; on the gateway's channel, so over "
        "the same TLS); msgpack decoding alone; in-process ingest"
    )
    print(
        "the Plan goals are judged over gRPC (PlanStream), as they are stated, and shown for the "
        "plan port (the same messages over a raw TLS stream, the gateway's path)"
    )
    for name, met in goals:
        print(f"  goal {name}: {'met' if met else 'NOT met'}")
    path = write_results("conductor", results, args.out_dir)
    png = _plot(results, path.with_suffix(".png"))
    print(f"\nwrote {path} and {png}")


def _plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4.2))
    names = {
        "health": "health_check",
        "Plan unary": "plan_unary",
        "PlanStream": "plan",
        "plan port": "plan_port",
    }
    left.bar([n + " p50" for n in names], [results[k]["p50_us"] for k in names.values()])
    left.bar([n + " p99" for n in names], [results[k]["p99_us"] for k in names.values()])
    left.axhline(GOAL_P99_US, color="red", linestyle="--", label="p99 goal")
    left.set_ylabel("latency (us)")
    left.legend()
    left.tick_params(axis="x", rotation=25)
    health_rate = 1e6 / results["health_check"]["mean_us"]
    plans = {
        "health Check\n(one client)": health_rate,
        "unary": results["plans_per_s_unary"],
        "PlanStream": results["plans_per_s"],
        "plan port": results["plans_per_s_port"],
    }
    middle.bar(list(plans), list(plans.values()), color="tab:green")
    middle.axhline(GOAL_PLANS_PER_S, color="red", linestyle="--", label="goal")
    middle.set_ylabel("plans/s (32 clients)")
    middle.legend()
    inproc = results["events_in_process"]
    rates = {
        "msgpack only": inproc["msgpack_only_per_s"],
        "in-process": inproc["block_events_per_s"],
        "in-process,\nmap form": results["events_in_process_map"]["block_events_per_s"],
        "over ZMQ": results["events_zmq"]["block_events_per_s"],
    }
    right.bar(list(rates), list(rates.values()), color="tab:purple")
    passes = inproc.get("block_events_per_s_passes")
    if passes:
        right.plot(["in-process"] * len(passes), passes, "k_", markersize=18, label="passes")
    right.plot(["in-process"], [GOAL_EVENTS_IN_PROCESS], "r*", markersize=12, label="goals")
    right.plot(["over ZMQ"], [GOAL_EVENTS_ZMQ], "r*", markersize=12)
    right.set_ylabel("block events/s")
    right.set_yscale("log")
    right.legend()
    fig.suptitle("Conductor: Plan latency and throughput, KV-event ingest")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
