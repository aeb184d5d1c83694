"""A replica stands by while a peer plans and it does not: its engines' KV events are
taken after a wait, many a wake-up, and its stores are asked to hold theirs as long;
the first plan it serves ends every wait at once.

The subscriber tests use real ZMQ sockets and a real EngineSubscriber; the reporter
tests a real ResidencyReporter with the conductor's reply as its `send` returns it."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import zmq
import zmq.asyncio

from quillcache.v1 import conductor_pb2
from quillcache_conductor.config import ConductorConfig
from quillcache_conductor.standby import Standby
from quillcache_conductor.zmq_sub import LINGER_MAX_BATCHES, STALE_LAG_S, EngineSubscriber
from quillcache_core.errors import InvalidArgument
from quillcache_store.reporter import MAX_ASKED_LINGER_S, ResidencyReporter
from tests.unit.test_conductor_optimistic import Clock
from tests.unit.test_index_freshness import frames, publisher, until
from tests.unit.test_store_node import _stored, blocks, trickled


def test_a_replica_stands_by_only_while_a_peer_plans_and_it_serves_nothing():
    clock = Clock()
    peer_plans = [False]
    standby = Standby(0.2, lambda: peer_plans[0], clock=clock)
    assert not standby.standing_by and standby.linger_ms() == 0  # alone: never waits
    peer_plans[0] = True
    assert standby.standing_by and standby.linger_ms() == 200
    standby.served()
    assert not standby.standing_by and standby.linger_ms() == 0
    clock.now += 1.9
    assert not standby.standing_by  # served 1.9 s ago: it still plans
    clock.now += 0.2
    assert standby.standing_by  # nothing for over 2 s: a standby again
    assert not Standby(0.0, lambda: True, clock=clock).standing_by  # 0: never


def test_the_wait_is_kept_below_what_counts_as_a_stale_view():
    assert 0 < ConductorConfig(insecure=True).standby_linger_s < STALE_LAG_S
    with pytest.raises(InvalidArgument, match="--standby-linger-s"):
        ConductorConfig(insecure=True, standby_linger_s=STALE_LAG_S)


@contextlib.asynccontextmanager
async def subscribed(standby: Standby | None):
    """A real EngineSubscriber (with the standby's wait, if any) and a publisher it is
    subscribed to; yields (publisher, subscriber, [(seq, applied at)])."""
    ctx = zmq.asyncio.Context()
    probe = ctx.socket(zmq.XPUB)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)
    endpoint = f"tcp://127.0.0.1:{port}"
    applied: list[tuple[int, float]] = []

    def on_batch(_engine, seq, _batch):
        applied.append((seq, time.monotonic()))

    sub = EngineSubscriber(
        "e0",
        endpoint,
        None,
        on_batch=on_batch,
        linger=standby.linger if standby else None,
        catch_up=False,
        context=ctx,
    )
    sub.start()
    pub = None
    try:
        pub = await publisher(ctx, endpoint)
        yield pub, sub, applied
    finally:
        await sub.stop()
        if pub is not None:
            pub.close(linger=0)
        ctx.term()


def test_a_standing_by_subscriber_takes_the_batches_of_its_wait_in_one_wake_up():
    async def scenario() -> None:
        standby = Standby(0.3, lambda: True)
        async with subscribed(standby) as (pub, sub, applied):
            for seq in range(6):  # a busy engine: a batch every 20 ms
                await pub.send_multipart(frames(seq, time.time()))
                await asyncio.sleep(0.02)
            await until(lambda: len(applied) == 6, "six batches applied")
            assert sub.counters.wakes == 1, sub.counters
            assert standby.lingers == 1
            # Applied in order, none lost, each at most one wait after it was sent.
            assert [seq for seq, _ in applied] == list(range(6))
            assert sub.counters.lost == 0

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_without_a_standby_each_batch_is_its_own_wake_up():
    async def scenario() -> None:
        async with subscribed(None) as (pub, sub, applied):
            for seq in range(6):
                await pub.send_multipart(frames(seq, time.time()))
                await asyncio.sleep(0.02)
            await until(lambda: len(applied) == 6, "six batches applied")
            assert sub.counters.wakes == 6, sub.counters

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_the_first_plan_served_ends_the_wait_at_once():
    """A takeover: the gateways move to the standby in the middle of a wait. The batch
    waiting is applied as the plan is served, not a whole wait later."""

    async def scenario() -> None:
        standby = Standby(0.45, lambda: True)
        async with subscribed(standby) as (pub, sub, applied):
            await pub.send_multipart(frames(0, time.time()))
            await until(lambda: standby.lingers == 1, "the wait to begin")
            await asyncio.sleep(0.05)
            served = time.monotonic()
            standby.served()
            await until(lambda: len(applied) == 1, "the batch applied")
            assert applied[0][1] - served < 0.1, applied[0][1] - served
            assert standby.woken == 1 and not standby.standing_by
            # Serving: the next batches come as they arrive, each its own wake-up.
            await pub.send_multipart(frames(1, time.time()))
            await until(lambda: len(applied) == 2, "the next batch applied")
            assert standby.lingers == 1 and sub.counters.wakes == 2

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_a_backlog_past_one_wake_up_is_taken_without_waiting_again():
    async def scenario() -> None:
        standby = Standby(0.3, lambda: True)
        async with subscribed(standby) as (pub, sub, applied):
            total = LINGER_MAX_BATCHES * 2 + 5
            for seq in range(total):  # all queued during the first wait
                await pub.send_multipart(frames(seq, time.time()))
            started = time.monotonic()
            await until(lambda: len(applied) == total, "the backlog applied")
            # One wait for all of them, not one per wake-up's worth.
            assert standby.lingers == 1, standby.lingers
            assert time.monotonic() - started < 0.3 + 0.25
            assert [seq for seq, _ in applied] == list(range(total))

    asyncio.run(asyncio.wait_for(scenario(), 20))


def _reporter_run(asked: list[float]):
    """A reporter whose conductor answers each batch with `asked[0]` seconds of
    linger; returns the batches sent after its resync for events offered 20 ms apart."""
    sent: list[conductor_pb2.KvEventBatch] = []

    async def send(batch):
        sent.append(batch)
        return asked[0]

    reporter = ResidencyReporter("n1", send, list)
    asyncio.run(asyncio.wait_for(trickled(reporter, sent, 6, 0.02), 10))
    return sent


def test_a_store_holds_its_batches_as_long_as_a_standby_conductor_asks():
    held = _reporter_run([0.5])
    assert len(held) == 1 and blocks(held[0]) == 6, [blocks(b) for b in held]
    eager = _reporter_run([0.0])
    assert len(eager) == 6, [blocks(b) for b in eager]


def test_a_store_caps_what_a_conductor_may_ask_it_to_hold():
    sent: list[conductor_pb2.KvEventBatch] = []

    async def send(batch):
        sent.append(batch)
        return 3600.0  # a conductor gone wrong

    async def scenario():
        reporter = ResidencyReporter("n1", send, list)
        task = asyncio.create_task(reporter.run())
        while reporter.resyncs == 0 or not sent:
            await asyncio.sleep(0.001)
        offered = time.monotonic()
        reporter.offer(_stored(1))
        while reporter.events_sent < 2:  # the resync (1) and this one
            await asyncio.sleep(0.005)
        task.cancel()
        return time.monotonic() - offered

    took = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert MAX_ASKED_LINGER_S - 0.05 < took < MAX_ASKED_LINGER_S + 0.5, took
