"""The end-to-end part of `quillcache bench-index`: a real conductor per index backend.

One etcd (with client certificates and roles, as a deployment runs it) for the whole
run; for each backend a conductor process started with ``--index-backend NAME
--index-path DIR`` (so served through its in-memory mirror, the durable backend written
by a flush thread every second), fed a trace in order:

- each trace's writes between two lookups go as KV event batches, one per node, the
  batches of different nodes concurrently (their records are disjoint, so their order
  does not matter; each node's own events stay in order) through `IngestKvEvents` as
  the `store` role: puts as `BlockStored` runs (chained hashes, parent and first block
  index, the record's tier as the medium), removals as `BlockRemoved`, clears as
  `AllBlocksCleared`. The conductor takes records with removals only from store
  sources over gRPC (an engine's own KV events carry token ids, which a trace does not
  keep), so the simulated engines' HBM is reported by one store node per engine,
  ``hbm-eNNN`` in the engine's domain: the conductor's index holds the same records
  and sees the same puts and removals, under those names;
- each lookup becomes a `Plan` (as the `gateway` role, over the plan port, the
  gateway's path: packed hashes, action runs), timed from this client, then
  cancelled with `Finish` (untimed), as bench-conductor does.

Between traces every node's records are cleared (AllBlocksCleared).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from quillcache.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from quillcache_bench.common import Progress
from quillcache_bench.index_traces import CLEAR, LOOKUP, PUT, REMOVE, Trace
from quillcache_core.launch.process import ManagedProcess, ProcessFailed
from quillcache_core.registry import NodeRecord, open_registry
from quillcache_core.rpc.plan_port import PlanPortClient
from quillcache_core.security.credentials import role_tls, security_args
from quillcache_core.security.tls import grpc_channel
from quillcache_core.wire.plan import pack_hashes

MODEL, TOKENIZER = "llama-3-8b", "llama-3"
BLOCK_TOKENS = 16


def node_of(worker_id: str) -> str:
    """The conductor store node that reports a trace worker's records."""
    return f"hbm-{worker_id}" if worker_id.startswith("e") else worker_id


def trace_nodes(traces: list[Trace]) -> tuple[list[str], list[str]]:
    """The traces' engines and store nodes (trace worker ids)."""
    workers: set[str] = set()
    for trace in traces:
        for op in trace.ops:
            if op[0] == PUT:
                workers.add(op[1][0].worker_id)
    engines = sorted(w for w in workers if w.startswith("e"))
    stores = sorted(w for w in workers if not w.startswith("e"))
    return engines, stores


def _identity(scope) -> common_pb2.Identity:
    ident = common_pb2.Identity(model_id=scope[0], tokenizer_id=scope[1], tenant_id=scope[3])
    if scope[2] is not None:
        ident.adapter_id = scope[2]
    return ident


def _stored_events(records) -> list[conductor_pb2.KvEvent]:
    """A put op's records as BlockStored runs of consecutive chained blocks."""
    events = []
    run = [records[0]]
    for r in records[1:]:
        last = run[-1].key
        k = r.key
        if (
            k.prefix_hash == last.block_hash
            and k.block_index == last.block_index + 1
            and k[:4] == last[:4]
            and k.token_count == last.token_count
            and r.bytes == run[-1].bytes
        ):
            run.append(r)
        else:
            events.append(_stored(run))
            run = [r]
    events.append(_stored(run))
    return events


def _stored(run) -> conductor_pb2.KvEvent:
    first = run[0]
    event = conductor_pb2.KvEvent()
    event.stored.CopyFrom(
        conductor_pb2.BlockStored(
            block_hashes=[r.key.block_hash for r in run],
            parent_block_hash=first.key.prefix_hash,
            block_size=first.key.token_count,
            medium=first.tier.value,
            bytes_per_block=first.bytes,
            identity=_identity(first.key[:4]),
            first_block_index=first.key.block_index,
        )
    )
    return event


def segment_batches(writes: list[tuple]) -> list[conductor_pb2.KvEventBatch]:
    """Write ops (in order) as one KvEventBatch per node, each node's events in order."""
    per_node: dict[str, list] = {}
    for op in writes:
        if op[0] == PUT:
            node = node_of(op[1][0].worker_id)
            per_node.setdefault(node, []).extend(_stored_events(op[1]))
        elif op[0] == REMOVE:
            node = node_of(op[1])
            events = per_node.setdefault(node, [])
            medium = op[3].value
            if events and events[-1].WhichOneof("event") == "removed":
                removed = events[-1].removed
                if removed.medium == medium:
                    removed.block_hashes.append(op[2])
                    continue
            event = conductor_pb2.KvEvent()
            event.removed.CopyFrom(conductor_pb2.BlockRemoved(block_hashes=[op[2]], medium=medium))
            events.append(event)
        elif op[0] == CLEAR:
            event = conductor_pb2.KvEvent()
            event.cleared.CopyFrom(conductor_pb2.AllBlocksCleared())
            per_node.setdefault(node_of(op[1]), []).append(event)
    return [
        conductor_pb2.KvEventBatch(engine_id=node, source_kind="store", events=events)
        for node, events in per_node.items()
    ]


def plan_request(op: tuple, n: int) -> conductor_pb2.PlanRequest:
    _, scope, hashes, prompt_tokens, output_tokens = op
    return conductor_pb2.PlanRequest(
        request_id=f"r{n}",
        identity=_identity(scope),
        packed_hashes=pack_hashes(hashes),
        block_tokens=BLOCK_TOKENS,
        action_runs=True,
        max_others=0,
        prompt_tokens=max(prompt_tokens, BLOCK_TOKENS * len(hashes)),
        expected_decode_tokens=output_tokens,
    )


class Feed:
    """A trace cut into what the client sends: per lookup, the event batches written
    since the previous one, then the lookup's Plan (or None when not timed)."""

    def __init__(self, trace: Trace, max_plans: int) -> None:
        lookups = sum(1 for op in trace.ops if op[0] == LOOKUP)
        every = max(1, -(-lookups // max_plans)) if max_plans > 0 else 0
        self.name = trace.name
        self.steps: list[tuple[list, conductor_pb2.PlanRequest | None]] = []
        writes: list[tuple] = []
        n = 0
        for op in trace.ops:
            if op[0] != LOOKUP:
                writes.append(op)
                continue
            timed = every and n % every == 0
            n += 1
            if timed:
                self.steps.append((segment_batches(writes), plan_request(op, n)))
                writes = []
        if writes:
            self.steps.append((segment_batches(writes), None))
        self.plans = sum(1 for _, plan in self.steps if plan is not None)
        self.expected_records = trace.summary()["resident_records_end"]


async def register_fleet(etcd_url: str, certs, engines: list[str], stores: list[str]):
    """Register the traces' engines (for routing) and store nodes (the trace's stores,
    plus hbm-eNNN per engine); returns the registries (close them at the end)."""
    as_engine = open_registry(etcd_url, role_tls(certs, "engine"))
    as_store = open_registry(etcd_url, role_tls(certs, "store"))
    store_of = {e: stores[i % len(stores)] if stores else "" for i, e in enumerate(engines)}
    domain = {s: f"domain-{j % 2}" for j, s in enumerate(stores)}
    for i, engine in enumerate(engines):
        await as_engine.register(
            NodeRecord(
                kind="engine",
                id=engine,
                address="",
                locality_domain=domain.get(store_of[engine], f"domain-{i % 2}"),
                base_url=f"http://127.0.0.1:1/{engine}",
                model=MODEL,
                tokenizer=TOKENIZER,
                store_node=store_of[engine],
            ),
            30,
        )
    nodes = [(s, domain[s]) for s in stores] + [
        (node_of(e), domain.get(store_of[e], "domain-0")) for e in engines
    ]
    for j, (node, dom) in enumerate(nodes):
        await as_store.register(
            NodeRecord(kind="store", id=node, address=f"127.0.0.1:{1000 + j}", locality_domain=dom),
            30,
        )
    return as_engine, as_store, [n for n, _ in nodes]


async def run_conductor(
    backend: str,
    index_dir: Path,
    tmp: Path,
    certs,
    etcd_url: str,
    feeds: list[Feed],
    nodes: list[str],
    engines: int,
) -> dict:
    """Start a conductor on `backend`, feed it every trace, time its Plans."""
    log_path = tmp / f"conductor-{backend}.log"
    args = [
        sys.executable,
        "-m",
        "quillcache_core.launch.cli",
        "conductor",
        "--registry",
        etcd_url,
        "--log-level",
        "WARNING",
        "--reservation-ttl-s",
        "3600",
        "--index-backend",
        backend,
        *security_args(certs),
    ]
    if backend != "memory":
        args += ["--index-path", str(index_dir)]
    with ManagedProcess(args, log_path=log_path, name=f"conductor-{backend}") as proc:
        try:
            await proc.wait_ready_async(lambda: proc.ready_fields() is not None, timeout_s=60)
        except ProcessFailed as exc:
            raise SystemExit(f"conductor did not start: {exc}") from None
        out = await _feed(backend, proc.ready_fields()["grpc"], certs, feeds, nodes, engines)
        out["rss"] = _memory(proc.pid)
        return out


async def _feed(backend, address, certs, feeds, nodes, engines) -> dict:
    options = [("grpc.max_send_message_length", 64 << 20)]
    gateway_tls = role_tls(certs, "gateway")
    channel = grpc_channel(address, gateway_tls, options)
    store_channel = grpc_channel(address, role_tls(certs, "store"), options)
    stub = conductor_pb2_grpc.ConductorStub(channel)
    as_store = conductor_pb2_grpc.ConductorStub(store_channel)
    port = None
    try:
        await _wait_ready(stub, as_store, nodes, engines)

        async def plan_address() -> str:
            return (await stub.Stats(conductor_pb2.StatsRequest(), timeout=5)).plan_address

        port = PlanPortClient(plan_address, gateway_tls)
        # One untimed Plan opens the plan port's connection (TLS handshake).
        warm = feeds[0].steps[0][1] if feeds and feeds[0].steps else None
        if warm is not None:
            reply = await port.plan(warm, timeout=10)
            await _cancel(port, reply)
        out: dict = {"traces": {}}
        all_lat: list[float] = []
        all_inside: list[float] = []
        progress = Progress(f"conductor {backend}", sum(len(f.steps) for f in feeds))
        started = time.perf_counter()
        for feed in feeds:
            lat, inside = [], []
            ingest_s = 0.0
            rejected = 0
            for batches, plan in feed.steps:
                if batches:
                    t = time.perf_counter()
                    replies = await asyncio.gather(
                        *(as_store.IngestKvEvents(b, timeout=30) for b in batches)
                    )
                    ingest_s += time.perf_counter() - t
                    rejected += sum(r.rejected for r in replies)
                if plan is not None:
                    t = time.perf_counter()
                    reply = await port.plan(plan, timeout=10)
                    lat.append(time.perf_counter() - t)
                    inside.append(reply.plan_us / 1e6)
                    await _cancel(port, reply)
                progress.advance()
            stats = await stub.Stats(conductor_pb2.StatsRequest(), timeout=10)
            out["traces"][feed.name] = {
                "plans": len(lat),
                "plan_s": lat,
                "plan_in_conductor_s": inside,
                "ingest_s": ingest_s,
                "events_rejected": rejected,
                "resident_records": stats.resident_records,
                "expected_records": feed.expected_records,
            }
            all_lat += lat
            all_inside += inside
            await _clear_all(as_store, nodes)
        out["elapsed_s"] = time.perf_counter() - started
        out["plan_s"] = all_lat
        out["plan_in_conductor_s"] = all_inside
        stats = await stub.Stats(conductor_pb2.StatsRequest(), timeout=10)
        out["index_backend_reported"] = stats.index_backend
        return out
    finally:
        if port is not None:
            await port.close()
        await channel.close()
        await store_channel.close()


def _memory(pid: int) -> dict[str, int]:
    """The process's resident set now and at its peak (VmRSS, VmHWM), in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                out[name] = int(value.split()[0]) * 1024
    return out


async def _cancel(port, reply) -> None:
    await port.finish(
        conductor_pb2.FinishRequest(
            reservation_id=reply.reservation_id, outcome=conductor_pb2.FinishRequest.CANCELLED
        ),
        timeout=10,
    )


async def _clear_all(as_store, nodes) -> None:
    for node in nodes:
        batch = conductor_pb2.KvEventBatch(engine_id=node, source_kind="store")
        batch.events.add().cleared.CopyFrom(conductor_pb2.AllBlocksCleared())
        await as_store.IngestKvEvents(batch, timeout=10)


async def _wait_ready(stub, as_store, nodes, engines, timeout_s: float = 60) -> None:
    """Until the conductor lists every engine and accepts events from every store node."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await stub.Stats(conductor_pb2.StatsRequest(), timeout=5)
        if len(stats.engines) >= engines:
            try:
                await _clear_all(as_store, nodes)
                return
            except Exception:  # a store node not seen yet: INVALID_ARGUMENT
                pass
        if time.monotonic() > deadline:
            raise SystemExit("the conductor did not see the registered fleet in time")
        await asyncio.sleep(0.1)
