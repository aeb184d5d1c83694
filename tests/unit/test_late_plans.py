"""A plan answered after its caller gave up: its answer goes to `on_late` (which
cancels the reservation it opened), whichever comes first of the late answer and the
caller's own bookkeeping; a Finish answered late, or an answer for a call nobody made,
goes nowhere."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from quillcache.v1 import conductor_pb2
from quillcache_core.rpc.plan_client import ABANDONED_MAX, PendingCalls


def answer(call_id: int, reservation_id: str = "", finish: bool = False):
    message = conductor_pb2.PlanStreamResponse()
    result = message.results.add()
    result.call_id = call_id
    if finish:
        result.finish.SetInParent()
    else:
        result.plan.reservation_id = reservation_id
    return message


def plan_call() -> conductor_pb2.PlanCall:
    return conductor_pb2.PlanCall(plan=conductor_pb2.PlanRequest(request_id="r"))


async def in_flight(pending: PendingCalls) -> tuple[list, asyncio.Future]:
    """A plan sent through `pending` and not answered yet: (the calls sent, its caller)."""
    sent: list[conductor_pb2.PlanCall] = []
    task = asyncio.ensure_future(pending.call(plan_call(), 10, sent.append))
    await asyncio.sleep(0)
    return sent, task


def test_a_late_plan_after_the_caller_forgot_it_goes_to_on_late():
    late = []

    async def go():
        pending = PendingCalls(on_late=late.append)
        sent = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pending.call(plan_call(), 0.001, sent.append)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        pending.deliver(answer(sent[0].call_id, "res-1"))
        pending.deliver(answer(sent[0].call_id, "res-1"))  # a duplicate: once only
        pending.deliver(answer(999, "res-x"))  # nobody asked for it

    asyncio.run(go())
    assert [p.reservation_id for p in late] == ["res-1"]


def test_a_late_plan_arriving_before_the_caller_forgot_it_goes_to_on_late():
    """The deadline and the answer land in the same turn of the loop: the answer is
    read before the caller's task has run again."""
    late = []

    async def go():
        pending = PendingCalls(on_late=late.append)
        sent, task = await in_flight(pending)
        task.cancel()  # the caller gives up; its task has not run its cleanup yet
        pending.deliver(answer(sent[0].call_id, "res-2"))
        with pytest.raises(asyncio.CancelledError):
            await task
        pending.deliver(answer(sent[0].call_id, "res-2"))

    asyncio.run(go())
    assert [p.reservation_id for p in late] == ["res-2"]


def test_a_plan_answered_in_time_and_a_late_finish_go_nowhere_else():
    late = []

    async def go():
        pending = PendingCalls(on_late=late.append)
        sent, task = await in_flight(pending)
        pending.deliver(answer(sent[0].call_id, "res-3"))
        assert (await task).reservation_id == "res-3"
        finish = conductor_pb2.PlanCall(finish=conductor_pb2.FinishRequest(reservation_id="x"))
        with pytest.raises(grpc.aio.AioRpcError):
            await pending.call(finish, 0.001, sent.append)
        pending.deliver(answer(sent[1].call_id, finish=True))

    asyncio.run(go())
    assert late == []


def test_abandoned_plans_are_bounded_and_a_broken_connection_forgets_them():
    async def go():
        pending = PendingCalls(on_late=lambda plan: None)
        for _ in range(ABANDONED_MAX + 10):
            with pytest.raises(grpc.aio.AioRpcError):
                await pending.call(plan_call(), 0, lambda call: None)
        held = len(pending._abandoned)
        pending.fail_all(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None))
        return held, len(pending._abandoned)

    assert asyncio.run(go()) == (ABANDONED_MAX, 0)
