"""Whether a conductor replica's view of an engine is current: the subscriber's
`StreamFreshness` for each way of being behind, and a plan carrying it as
`index_behind_ms` while a real ZMQ subscriber connects, replays a gap, applies a late
batch and loses its publisher."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import pytest
import zmq
import zmq.asyncio

from quillcache.v1 import common_pb2, conductor_pb2
from quillcache_conductor.events import EventRouter
from quillcache_conductor.servicer import ConductorServicer
from quillcache_conductor.state import ConductorState
from quillcache_conductor.zmq_sub import STALE_LAG_S, StreamFreshness
from quillcache_core.index import MemoryIndex
from quillcache_core.model import CostModel
from quillcache_core.process.metrics import MetricsRegistry
from quillcache_core.registry import NodeRecord
from quillcache_core.routing.planner import CostPlanner
from quillcache_core.wire.plan import pack_hashes
from tests.support.vllm_publisher import encode_batch, encode_event
from tests.unit.factories import MODEL, TENANT, TOKENIZER, make_request

pytestmark = pytest.mark.unit

T0 = 100.0


def current() -> StreamFreshness:
    fresh = StreamFreshness(T0)
    fresh.caught_up()
    return fresh


def test_a_subscriber_that_has_applied_nothing_live_yet_is_behind_since_it_started():
    fresh = StreamFreshness(T0)
    assert fresh.behind_ms(T0) == 1  # behind, however briefly
    assert fresh.behind_ms(T0 + 0.25) == 250
    fresh.caught_up()
    assert fresh.behind_ms(T0 + 0.25) == 0


def test_a_lost_connection_is_behind_from_the_loss_until_the_next_live_batch():
    fresh = current()
    fresh.disconnected(T0 + 1.0)
    assert fresh.behind_ms(T0 + 1.5) == 500
    fresh.disconnected(T0 + 1.2)  # a second loss before catching up: still from the first
    assert fresh.behind_ms(T0 + 2.0) == 1000
    fresh.caught_up()
    assert fresh.behind_ms(T0 + 2.0) == 0


def test_a_replayed_gap_is_behind_while_the_replay_lasts():
    fresh = current()
    fresh.replay_started(T0 + 3.0)
    assert fresh.behind_ms(T0 + 3.04) == 40
    fresh.replay_ended()
    assert fresh.behind_ms(T0 + 3.04) == 0


@pytest.mark.parametrize(
    ("lag_s", "behind_ms"),
    [(0.0, 0), (0.01, 0), (STALE_LAG_S, 0), (STALE_LAG_S + 0.1, 600), (2.0, 2000)],
)
def test_a_batch_applied_late_leaves_the_view_behind_by_its_lag_until_the_next(lag_s, behind_ms):
    fresh = current()
    fresh.applied(lag_s)
    assert fresh.behind_ms(T0 + 60.0) == behind_ms  # the lag stands, however long since
    fresh.applied(0.002)
    assert fresh.behind_ms(T0 + 60.0) == 0


def test_the_furthest_behind_of_the_conditions_counts():
    fresh = StreamFreshness(T0)
    fresh.replay_started(T0 + 0.5)
    fresh.applied(3.0)
    assert fresh.behind_ms(T0 + 1.0) == 3000  # the lag, more than the unsynced second
    assert fresh.behind_ms(T0 + 10.0) == 10_000  # unsynced since T0, the replay since later
    assert StreamFreshness(0.0).behind_ms(1e9) == 2**32 - 1  # a uint32 on the wire


# --- a real subscriber, its router and the plan --------------------------------------

IDENTITY = common_pb2.Identity(model_id=MODEL, tokenizer_id=TOKENIZER, tenant_id=TENANT)
REQUEST = make_request(4, extra_tokens=3)


def batch(ts: float) -> bytes:
    return encode_batch([encode_event("AllBlocksCleared", {}, "array")], "array", ts=ts)


def frames(seq: int, ts: float) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big", signed=True), batch(ts)]


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def publisher(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    """An XPUB bound at `endpoint` once a subscriber's subscription has reached it."""
    deadline = time.monotonic() + 5.0
    while True:
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        try:
            pub.bind(endpoint)
            break
        except zmq.ZMQError:  # the port of a publisher just closed: not free yet
            pub.close(linger=0)
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)
    assert await pub.poll(5000, zmq.POLLIN), "no subscription arrived"
    await pub.recv_multipart()
    return pub


async def wired() -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    pub.close(linger=0)
    endpoint = f"tcp://127.0.0.1:{port}"
    replay = ctx.socket(zmq.ROUTER)
    replay.setsockopt(zmq.LINGER, 0)
    replay_port = replay.bind_to_random_port("tcp://127.0.0.1")
    record = NodeRecord(
        kind="engine",
        id="e0",
        address="",
        locality_domain="rack-a",
        base_url="http://e0",
        model=MODEL,
        tokenizer=TOKENIZER,
        start_time_s=100.0,
        kv_events_endpoint=endpoint,
        kv_replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
    )
    state = ConductorState(
        MemoryIndex(), CostPlanner(CostModel()), clock=time.time, rng=random.Random(1)
    )
    state.engine_joined(record)
    router = EventRouter(state, MetricsRegistry(), subscribe_zmq=True)
    servicer = ConductorServicer(state, router, max_blocks=64)
    packed = pack_hashes([key.block_hash for key in REQUEST.blocks])
    pub = None

    def planned_behind_ms() -> int:
        reply = servicer.plan(
            conductor_pb2.PlanRequest(
                request_id="r",
                identity=IDENTITY,
                packed_hashes=packed,
                block_tokens=16,
                prompt_tokens=REQUEST.prompt_tokens,
            )
        )
        servicer.finish(
            conductor_pb2.FinishRequest(
                reservation_id=reply.reservation_id, outcome=conductor_pb2.FinishRequest.CANCELLED
            )
        )
        assert reply.engine_id == "e0"
        return reply.index_behind_ms

    try:
        router.engine_joined(record)
        subscriber = router.subscribers["e0"]
        # Started, its replay from 0 not answered yet: behind.
        assert await replay.poll(5000, zmq.POLLIN), "no replay request at start"
        peer, _, start = await replay.recv_multipart()
        assert int.from_bytes(start, "big", signed=True) == 0
        assert planned_behind_ms() >= 1
        # The engine has buffered nothing (it published nothing yet): current at once,
        # before any live batch.
        await replay.send_multipart([peer, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        await until(lambda: planned_behind_ms() == 0, "current once the replay says nothing")
        assert subscriber.counters.probes == 1
        pub = await publisher(ctx, endpoint)
        await pub.send_multipart(frames(0, time.time()))
        await until(lambda: subscriber.last_seq == 0, "the first live batch")
        assert planned_behind_ms() == 0

        # A gap: behind while the replay is under way, current once it is applied.
        await pub.send_multipart(frames(3, time.time()))
        assert await replay.poll(5000, zmq.POLLIN), "no replay request"
        peer, _, start = await replay.recv_multipart()
        assert int.from_bytes(start, "big", signed=True) == 1
        assert planned_behind_ms() >= 1
        for seq in (1, 2):
            await replay.send_multipart([peer, b"", *frames(seq, time.time())])
        await replay.send_multipart([peer, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        await until(lambda: subscriber.last_seq == 3, "the gap replayed")
        await until(lambda: planned_behind_ms() == 0, "current after the replay")

        # A batch applied well after the engine stamped it: behind by its lag.
        await pub.send_multipart(frames(4, time.time() - STALE_LAG_S / 2))
        await until(lambda: subscriber.last_seq == 4, "a slightly late batch")
        assert planned_behind_ms() == 0
        await pub.send_multipart(frames(5, time.time() - 2.0))
        await until(lambda: subscriber.last_seq == 5, "a late batch")
        assert planned_behind_ms() >= 2000
        await pub.send_multipart(frames(6, time.time()))
        await until(lambda: planned_behind_ms() == 0, "current after a prompt batch")

        # The publisher goes: behind from the lost connection, through the reconnect,
        # until the next live batch.
        pub.close(linger=0)
        await until(lambda: planned_behind_ms() >= 1, "behind after the connection is lost")
        pub = await publisher(ctx, endpoint)
        assert planned_behind_ms() >= 1
        await pub.send_multipart(frames(7, time.time()))
        await until(lambda: planned_behind_ms() == 0, "caught up after the reconnect")
    finally:
        await router.close()
        ctx.destroy(linger=0)  # closes the publisher and the replay socket too


def test_a_plan_says_how_far_its_replica_trails_the_engines_event_stream():
    async def bounded() -> None:
        async with asyncio.timeout(30):
            await wired()

    asyncio.run(bounded())
