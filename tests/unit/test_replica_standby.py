"""A replica's reservations go to a peer that plans as they come, and to a standby (a
peer that planned nothing lately) coalesced: far fewer messages, the same load once
applied; when the standby starts planning it gets what it was held, then every
message as it comes."""

from __future__ import annotations

import asyncio

import pytest

from quillcache.v1 import conductor_pb2
from quillcache_conductor.peer_load import PeerLoad
from quillcache_conductor.replica_sync import ReplicaLog, apply_deltas
from tests.unit.factories import make_request
from tests.unit.test_conductor_optimistic import make_state

pytestmark = pytest.mark.unit

STANDBY_S = 0.05


class Context:
    async def abort(self, code, details):  # pragma: no cover - a queue overflow only
        raise AssertionError(f"aborted: {code} {details}")


async def receive(log: ReplicaLog, peer: str, into: list) -> None:
    async for message in log.Sync(conductor_pb2.SyncRequest(conductor_id=peer), Context()):
        into.append(message)


def applied(messages: list, state) -> dict[str, int]:
    """Each engine's in-flight requests on a replica that applied `messages`."""
    peers = PeerLoad(state, clock=state.clock)
    for m in messages:
        apply_deltas(peers, "a", m)
    return {e: w.state.inflight_requests for e, w in state.engines.items()}


def test_a_standby_gets_the_same_reservations_in_a_fraction_of_the_messages():
    a, _ = make_state()
    planners = {"planner"}
    log = ReplicaLog(a, "a", 1.0, planning=lambda peer: peer in planners, standby_flush_s=STANDBY_S)
    a.listener = log
    to_planner: list = []
    to_standby: list = []

    async def go():
        tasks = [
            asyncio.ensure_future(receive(log, "planner", to_planner)),
            asyncio.ensure_future(receive(log, "standby", to_standby)),
        ]
        await asyncio.sleep(0)
        open_ = []
        for n in range(20):  # a request every 5 ms; every other one finishes
            open_.append(a.plan(make_request(8, seed=n)).reservation_id)
            if n % 2:
                a.finish(open_.pop(0), "success")
            await asyncio.sleep(0.005)
        await asyncio.sleep(2 * STANDBY_S)
        before_switch = (len(to_planner), len(to_standby))
        planners.add("standby")  # the standby takes over: it plans now
        a.finish(open_.pop(0), "cancelled")
        await asyncio.sleep(0.01)  # one flush_delay_s, far below STANDBY_S
        after_switch = len(to_standby)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return before_switch, after_switch

    (planner_n, standby_n), after_switch = asyncio.run(go())
    assert planner_n >= 15, planner_n  # as they came: about one message each
    assert standby_n <= 6, standby_n  # every 50 ms: about 2 for 100 ms of plans
    assert log.messages_coalesced >= planner_n - standby_n - 1
    assert after_switch == standby_n + 1, "a planning peer gets each message as it comes"
    # Once applied, both peers count the same load: 9 requests still open on A.
    b, _ = make_state()
    c, _ = make_state()
    assert applied(to_planner, b) == applied(to_standby, c)
    assert sum(applied(to_standby, make_state()[0]).values()) == 9


def test_without_a_standby_window_every_peer_gets_each_message_as_it_comes():
    a, _ = make_state()
    log = ReplicaLog(a, "a", 1.0, planning=lambda peer: False, standby_flush_s=0.0)
    a.listener = log
    got: list = []

    async def go():
        task = asyncio.ensure_future(receive(log, "standby", got))
        await asyncio.sleep(0)
        for n in range(5):
            a.plan(make_request(8, seed=n))
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    assert len(got) >= 1 + 5  # the snapshot, then one message a plan
    assert log.messages_coalesced == 0
