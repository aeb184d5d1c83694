"""Registry outages lose nothing: a stalled etcd (SIGSTOP, then SIGCONT) expires every
lease, but the nodes are alive: they register again at once, and the conductor keeps
their residency through its leave grace. A node that really died is dropped after it.

Real processes: a TLS+RBAC etcd, a conductor, a store and two sim engines, every lease
1 s so that a stall of a few seconds outlives them all."""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from quillcache.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from quillcache_conductor.records import OPTIMISTIC_LINGER_S
from quillcache_conductor.state import ConductorState
from quillcache_core.errors import NotFound
from quillcache_core.identity.keys import request_blocks
from quillcache_core.index import MemoryIndex
from quillcache_core.model import CacheResidency, CacheTier, CostModel
from quillcache_core.registry import EtcdRegistry, MemoryRegistry, NodeRecord
from quillcache_core.routing.actions import ActionKind
from quillcache_core.routing.planner import CostPlanner
from quillcache_core.storeclient.client import StoreClient
from tests.support.etcdctl import etcdctl, paused
from tests.support.services import ServiceProcess, wait_until
from tests.support.stores import Fleet, block_key
from tests.support.tls import client_context, engine_auth, tls
from tests.unit.factories import MODEL as UNIT_MODEL
from tests.unit.factories import TOKENIZER as UNIT_TOKENIZER
from tests.unit.factories import make_request

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# The full-size check is a 20 s stall with 3 s leases: QC_OUTAGE_TTL_S=3 QC_OUTAGE_STALL_S=20.
TTL_S = int(os.environ.get("QC_OUTAGE_TTL_S", "1"))
GRACE_S = 2 * TTL_S + 2  # the conductor's --node-leave-grace-s
STALL_S = float(os.environ.get("QC_OUTAGE_STALL_S", str(3 * TTL_S + 1)))
MODEL, TOKENIZER, BS = "sim-model", "builtin-v1", 16
PROMPTS, PROMPT_BLOCKS = 16, 64  # per engine
STORE_BLOCKS = 1200


class SimEngine(ServiceProcess):
    """`quillcache sim-engine`, ready once /health answers (it has no gRPC port)."""

    def __init__(self, args: list[str], log_dir: Path, name: str) -> None:
        super().__init__("sim-engine", args, log_dir, name=name)

    def _serving(self) -> bool:
        url = self.fields["http"] + "/health"
        with urllib.request.urlopen(url, timeout=1.0, context=client_context("gateway")) as r:
            return r.status == 200

    def complete(self, tokens: list[int]) -> dict:
        body = json.dumps({"model": MODEL, "prompt": tokens, "max_tokens": 1}).encode()
        request = urllib.request.Request(
            self.fields["http"] + "/v1/completions",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", **engine_auth()},
        )
        with urllib.request.urlopen(request, timeout=10, context=client_context("gateway")) as r:
            return json.loads(r.read())


def prompt(engine: int, n: int) -> list[int]:
    start = 100_000 * (engine + 1) + n * PROMPT_BLOCKS * BS
    return list(range(start, start + PROMPT_BLOCKS * BS))


def plan_request(tokens: list[int], request_id: str = "t") -> conductor_pb2.PlanRequest:
    # The engines' events carry no salt: their blocks are the "default" tenant's.
    keys = request_blocks(
        tokens,
        BS,
        model_id=MODEL,
        tokenizer_id=TOKENIZER,
        adapter_id=None,
        tenant_id="default",
        cache_salt=None,
    )
    return conductor_pb2.PlanRequest(
        request_id=request_id,
        identity=common_pb2.Identity(model_id=MODEL, tokenizer_id=TOKENIZER, tenant_id="default"),
        blocks=[common_pb2.BlockRef(block_hash=k.block_hash, token_count=BS) for k in keys],
        prompt_tokens=len(tokens),
        expected_decode_tokens=4,
    )


class Planner(threading.Thread):
    """Plans (and finishes) a request every `interval_s` until stopped; records each
    call's time and error."""

    def __init__(self, conductor: ServiceProcess, interval_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.conductor = conductor
        self.interval_s = interval_s
        self.results: list[tuple[float, str | None]] = []  # (monotonic time, error)
        self._done = threading.Event()

    def run(self) -> None:
        with self.conductor.channel("gateway") as channel:
            stub = conductor_pb2_grpc.ConductorStub(channel)
            n = 0
            while not self._done.wait(self.interval_s):
                n += 1
                started = time.monotonic()
                try:
                    reply = stub.Plan(plan_request(prompt(n % 2, n % PROMPTS), f"p{n}"), timeout=5)
                    stub.Finish(
                        conductor_pb2.FinishRequest(
                            reservation_id=reply.reservation_id,
                            outcome=conductor_pb2.FinishRequest.SUCCESS,
                        ),
                        timeout=5,
                    )
                    self.results.append((started, None))
                except grpc.RpcError as exc:
                    self.results.append((started, f"{exc.code().name}: {exc.details()}"))

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=10)

    def errors_since(self, t: float) -> list[tuple[float, str | None]]:
        return [r for r in self.results if r[0] >= t and r[1] is not None]

    def calls_since(self, t: float) -> int:
        return sum(1 for r in self.results if r[0] >= t)


def stats(conductor: ServiceProcess) -> conductor_pb2.StatsResponse:
    with conductor.channel("operator") as channel:
        return conductor_pb2_grpc.ConductorStub(channel).Stats(
            conductor_pb2.StatsRequest(), timeout=5
        )


def start_fleet(fleet: Fleet, tmp_path: Path) -> tuple[ServiceProcess, ServiceProcess, list]:
    conductor = fleet.conductor(
        "--lease-ttl-s", str(TTL_S), "--node-leave-grace-s", str(GRACE_S), "--departed-sweep-s", "0"
    )
    store = fleet.store("store-a", "--conductor", conductor.grpc_address, ttl_s=TTL_S)
    engines = []
    for i in range(2):
        engine = SimEngine(
            [
                "--registry", fleet.etcd.client_url, "--node-id", f"engine-{i}",
                "--lease-ttl-s", str(TTL_S), "--time-scale", "0", "--hbm-blocks", "8192",
                "--store", store.grpc_address, "--store-node-id", "store-a",
                # The residency counted below is the engines' own and the store's puts.
                "--store-writes", "evicted",
            ],
            tmp_path,
            f"engine-{i}",
        )  # fmt: skip
        fleet.procs.append(engine)
        engines.append(engine.start(timeout_s=20))
    wait_until(lambda: len(stats(conductor).engines) == 2, timeout_s=15, what="both engines")
    return conductor, store, engines


def fill(conductor: ServiceProcess, store: ServiceProcess, engines: list[SimEngine]) -> int:
    """Residency on every node: prompts on each engine (its KV events), blocks put to the
    store (its residency reports). Returns the conductor's record count once settled."""
    for i, engine in enumerate(engines):
        for n in range(PROMPTS):
            engine.complete(prompt(i, n))

    async def put_blocks() -> None:
        async with StoreClient(store.grpc_address, tls=tls("engine")) as client:
            for i in range(STORE_BLOCKS):
                await client.put(block_key(i, chain="outage"), b"kv" * 2048)

    asyncio.run(put_blocks())
    expected = 2 * PROMPTS * PROMPT_BLOCKS + STORE_BLOCKS
    wait_until(
        lambda: stats(conductor).resident_records >= expected,
        timeout_s=20,
        what=f"{expected} resident records",
    )
    return stats(conductor).resident_records


def test_an_etcd_stall_longer_than_every_lease_keeps_the_residency(etcd_server, fleet, tmp_path):
    conductor, store, engines = start_fleet(fleet, tmp_path)
    before = fill(conductor, store, engines)
    planner = Planner(conductor)
    planner.start()
    try:
        time.sleep(0.5)
        with paused(etcd_server):
            time.sleep(STALL_S)
        resumed = time.monotonic()
        # Every lease expired during the stall: etcd deletes the records as it resumes,
        # the nodes register again, and the conductor must not have dropped anything.
        samples = []
        while time.monotonic() - resumed < GRACE_S + 2:
            samples.append(stats(conductor).resident_records)
            time.sleep(0.2)
        after = stats(conductor)
    finally:
        planner.stop()
    print(
        f"residency before {before}, after {after.resident_records}, lowest {min(samples)}; "
        f"plans after resume {planner.calls_since(resumed)}, "
        f"errors {len(planner.errors_since(resumed))}"
    )
    # The bar: the count within 5% once etcd is back. (A store that lost its own
    # lease resends its residency, clear then refill, over a few batches: the lowest
    # sample may dip meanwhile; it is printed above.)
    assert abs(after.resident_records - before) <= 0.05 * before, (before, samples)
    assert {e.engine_id for e in after.engines} == {"engine-0", "engine-1"}
    assert planner.calls_since(resumed) > 20
    assert planner.errors_since(resumed) == [], planner.errors_since(resumed)[:5]
    with conductor.channel("gateway") as channel:
        reply = conductor_pb2_grpc.ConductorStub(channel).Plan(
            plan_request(prompt(1, 3)), timeout=5
        )
    assert (reply.engine_id, reply.hit_blocks) == ("engine-1", PROMPT_BLOCKS)


def test_nodes_that_really_died_are_dropped_after_the_grace(etcd_server, fleet, tmp_path):
    """An engine killed during the stall is held routable for a moment after etcd
    resumes (its leave looks like the outage's), then excluded, and its records go
    when the grace is over; a store killed while etcd is fine is excluded at once."""
    conductor, store, engines = start_fleet(fleet, tmp_path)
    before = fill(conductor, store, engines)
    engine_records = PROMPTS * PROMPT_BLOCKS
    planner = Planner(conductor)
    planner.start()
    try:
        with paused(etcd_server):
            engines[1].kill()
            time.sleep(STALL_S)
        resumed = time.monotonic()
        wait_until(
            lambda: {e.engine_id for e in stats(conductor).engines} == {"engine-0"},
            timeout_s=TTL_S + 3,
            what="the dead engine excluded",
        )
        excluded_after = time.monotonic() - resumed
        assert stats(conductor).resident_records >= before - 0.05 * before, "kept in grace"
        wait_until(
            lambda: stats(conductor).resident_records == before - engine_records,
            timeout_s=GRACE_S + 3,
            what="the dead engine's records dropped",
        )
        dropped_after = time.monotonic() - resumed
    finally:
        planner.stop()
    errors = planner.errors_since(resumed)
    print(
        f"killed engine: excluded {excluded_after:.2f}s and its records dropped "
        f"{dropped_after:.2f}s after etcd resumed; plans {planner.calls_since(resumed)}, "
        f"errors {len(errors)}"
    )
    assert errors == [], errors[:5]
    assert dropped_after >= GRACE_S - 0.5
    # A plan for the dead engine's prompt goes to the live one, with no hit (once the
    # overlay of the background planner's own finished requests there has lapsed).
    time.sleep(OPTIMISTIC_LINGER_S + 0.2)
    with conductor.channel("gateway") as channel:
        reply = conductor_pb2_grpc.ConductorStub(channel).Plan(
            plan_request(prompt(1, 3)), timeout=5
        )
    assert (reply.engine_id, reply.hit_blocks) == ("engine-0", 0)

    # The store dies while etcd is fine: no longer a fetch source once its lease runs
    # out, its records kept for the grace, then dropped.
    store_blocks = locate_blocks(conductor)
    assert store_blocks == STORE_BLOCKS
    killed = time.monotonic()
    store.kill()
    wait_until(lambda: locate_blocks(conductor) == 0, timeout_s=TTL_S + 3, what="store excluded")
    excluded_after = time.monotonic() - killed
    assert stats(conductor).resident_records == before - engine_records
    wait_until(
        lambda: stats(conductor).resident_records == before - engine_records - STORE_BLOCKS,
        timeout_s=GRACE_S + 3,
        what="the dead store's records dropped",
    )
    dropped_after = time.monotonic() - killed
    print(f"killed store: excluded {excluded_after:.2f}s, dropped {dropped_after:.2f}s after")
    assert dropped_after >= excluded_after + GRACE_S - 0.5


def locate_blocks(conductor: ServiceProcess) -> int:
    """How many of the store's blocks the conductor locates on it."""
    identity = common_pb2.Identity(
        model_id=block_key(0).model_id,
        tokenizer_id=block_key(0).tokenizer_id,
        tenant_id=block_key(0).tenant_id,
    )
    hashes = [block_key(i, chain="outage").block_hash for i in range(STORE_BLOCKS)]
    with conductor.channel("store") as channel:
        reply = conductor_pb2_grpc.ConductorStub(channel).Locate(
            conductor_pb2.LocateRequest(identity=identity, block_hashes=hashes), timeout=5
        )
    return sum(any(loc.kind == "store" for loc in b.locations) for b in reply.blocks)


# --- the conductor's leave grace, in process (a fake clock) -------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def grace_state() -> tuple[ConductorState, Clock]:
    clock = Clock()
    state = ConductorState(
        MemoryIndex(), CostPlanner(CostModel()), clock=clock, rng=random.Random(1)
    )
    for node in ("e0", "e1"):
        state.engine_joined(engine_record(node, start_time_s=100.0))
    state.store_joined(store_record("s0"))
    return state, clock


def engine_record(node: str, start_time_s: float) -> NodeRecord:
    return NodeRecord(
        kind="engine",
        id=node,
        address="",
        locality_domain="rack-a",
        base_url=f"http://{node}",
        model=UNIT_MODEL,
        tokenizer=UNIT_TOKENIZER,
        start_time_s=start_time_s,
    )


def store_record(node: str, start_time_s: float = 50.0) -> NodeRecord:
    return NodeRecord(
        kind="store",
        id=node,
        address=f"{node}:1",
        locality_domain="rack-a",
        start_time_s=start_time_s,
    )


def shape(n: int):
    return make_request(n, seed=n)


def fetched(state: ConductorState, request) -> int:
    return state.plan(request).decision.count(ActionKind.FETCH)


def hold_records(state: ConductorState, node: str, request, tier=CacheTier.HBM) -> None:
    state.index.put_many(CacheResidency(k, node, tier, 1024) for k in request.blocks)


def test_an_engine_back_with_the_same_run_keeps_its_records_and_its_requests():
    state, clock = grace_state()
    request = shape(8)
    hold_records(state, "e0", request)
    planned = state.plan(request)
    assert (planned.decision.engine.id, state.engines["e0"].state.inflight_requests) == ("e0", 1)
    assert state.node_left("engine", "e0", grace_s=5.0) is False
    # Excluded at once: plans go elsewhere, but the records stay.
    assert "e0" not in state.engines
    assert {state.plan(shape(2 + n)).decision.engine.id for n in range(4)} == {"e1"}
    assert state.index.worker_block_count("e0") == 8
    clock.now = 3.0
    assert state.expire_departures() == []
    assert state.engine_joined(engine_record("e0", start_time_s=100.0)) is False
    assert state.index.worker_block_count("e0") == 8
    assert state.plan(request).decision.engine.id == "e0"
    # Its reservation from before the leave is still open and releases its load.
    assert state.engines["e0"].state.inflight_requests == 2
    state.finish(planned.reservation_id, "success")
    assert state.engines["e0"].state.inflight_requests == 1
    assert state.index.worker_block_count("e0") == 8
    assert (state.counters.nodes_returned, state.departures) == (1, {})


def test_an_engine_back_as_a_new_run_or_not_back_at_all_loses_its_records():
    state, clock = grace_state()
    request = shape(6)
    hold_records(state, "e0", request)
    hold_records(state, "e1", request)
    planned = state.plan(request)
    engine = planned.decision.engine.id
    state.node_left("engine", engine, grace_s=5.0)
    clock.now = 1.0
    assert state.engine_joined(engine_record(engine, start_time_s=200.0)) is True
    assert state.index.worker_block_count(engine) == 0
    with pytest.raises(NotFound):  # its request died with the old process
        state.finish(planned.reservation_id, "success")
    other = "e1" if engine == "e0" else "e0"
    state.node_left("engine", other, grace_s=5.0)
    clock.now = 5.9
    assert state.expire_departures() == []
    assert state.index.worker_block_count(other) == 6
    clock.now = 6.0
    assert state.expire_departures() == [("engine", other)]
    assert state.index.worker_block_count(other) == 0
    assert other not in state.engines and state.departures == {}


def test_a_leave_held_after_an_outage_stays_routable_then_is_excluded():
    state, clock = grace_state()
    state.node_left("engine", "e0", grace_s=5.0, hold_s=1.0)
    assert "e0" in state.engines and state.departures[("engine", "e0")].held
    clock.now = 1.0
    assert state.expire_departures() == []
    assert "e0" not in state.engines
    clock.now = 5.0
    assert state.expire_departures() == [("engine", "e0")]


def test_a_departed_store_is_no_fetch_source_until_it_is_back():
    state, clock = grace_state()
    request = shape(4)
    hold_records(state, "s0", request, CacheTier.CPU_DRAM)
    hashes = [k.block_hash for k in request.blocks]
    assert fetched(state, request) == 4
    state.node_left("store", "s0", grace_s=5.0)
    assert fetched(state, request) == 0
    assert state.locate(request.scope(), hashes) == [[]] * 4
    state.store_joined(store_record("s0"))
    assert fetched(state, request) == 4
    assert state.index.worker_block_count("s0") == 4
    # Without a grace (--node-leave-grace-s 0) a leave drops at once, as before.
    assert state.node_left("store", "s0", grace_s=0) is True
    assert state.index.worker_block_count("s0") == 0


# --- the registry: a lost lease is replaced at once --------------------------------------


def test_a_revoked_or_expired_lease_is_replaced_at_once_and_the_outage_is_seen(etcd_server):
    """The owner re-registers as soon as etcd says its lease is gone (an operator
    revoked it), and as soon as etcd answers after a stall that outlived it; the
    registry reports that outage (`recently_unreachable`), a memory one never does."""

    async def main() -> dict[str, float]:
        owner = EtcdRegistry([etcd_server.endpoint], tls=tls("engine"))
        observer = EtcdRegistry([etcd_server.endpoint], tls=tls("conductor"))
        record = NodeRecord("engine", "e-lease", "", "rack-a", start_time_s=1.0)

        def leases() -> list[str]:
            return etcdctl(etcd_server, "lease", "list").split()[3:]  # "found N leases" ids

        async def back_on_a_new_lease(old: str, since: float) -> float:
            while old in leases() or await observer.get("engine", "e-lease") != record:
                assert time.monotonic() - since < 3 * TTL_S, "not registered again"
                await asyncio.sleep(0.01)
            return time.monotonic() - since

        figures = {}
        try:
            await owner.register(record, ttl_s=TTL_S)
            assert not owner.recently_unreachable(5.0)
            (lease,) = leases()
            revoked = time.monotonic()
            etcdctl(etcd_server, "lease", "revoke", lease)
            figures["after a revoke"] = await back_on_a_new_lease(lease, revoked)
            await asyncio.sleep(0.5)
            (lease,) = leases()
            with paused(etcd_server):
                await asyncio.sleep(STALL_S)
            resumed = time.monotonic()
            assert owner.recently_unreachable(2.0)
            figures["after the stall"] = await back_on_a_new_lease(lease, resumed)
            # Kept alive again.
            await asyncio.sleep(2.5 * TTL_S)
            assert await observer.get("engine", "e-lease") == record
            assert not MemoryRegistry().recently_unreachable(60.0)
        finally:
            await owner.close()
            await observer.close()
        return figures

    figures = asyncio.run(main())
    print(", ".join(f"re-registered {v:.3f}s {k}" for k, v in figures.items()))
    assert figures["after a revoke"] < 1.0 * TTL_S  # the next keepalive: TTL/3 s
    assert figures["after the stall"] < 1.0
