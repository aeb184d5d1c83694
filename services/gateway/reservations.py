"""Every plan's reservation gets exactly one Finish, however its request ends.

A client may hang up at any moment: aiohttp then cancels the handler (CancelledError)
or the next write to the client fails (ConnectionError). The gateway keeps the plans
it holds in `OpenPlans` from the moment Plan returns until their Finish is queued
(`take` says whether it still has to be), so a catch-all on each exit path can finish
what the usual paths did not; and a Plan still in flight when its client leaves is
awaited in its own task (`shielded`), so the reservation it returns is cancelled
as soon as it arrives instead of being left to expire at the conductor; so is one
that comes after the gateway stopped waiting for it and routed the request itself
(fallback.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from quillcache.v1 import conductor_pb2
from quillcache_core.process.metrics import MetricsRegistry

T = TypeVar("T")
ERROR = conductor_pb2.FinishRequest.ERROR
CANCELLED = conductor_pb2.FinishRequest.CANCELLED


class OpenPlans:
    """The plans whose Finish is not queued yet, by identity (a plan is finished once)."""

    def __init__(
        self, metrics: MetricsRegistry, submit: Callable[[conductor_pb2.FinishRequest], None]
    ) -> None:
        self._open: dict[int, conductor_pb2.PlanResponse] = {}
        self._submit = submit
        metrics.gauge(
            "gateway_reservations_open",
            "plans whose Finish is not queued yet (requests between Plan and their end)",
            read=lambda: [((), float(len(self._open)))],
        )

    def __len__(self) -> int:
        return len(self._open)

    def add(self, plan: conductor_pb2.PlanResponse) -> None:
        self._open[id(plan)] = plan

    def take(self, plan: conductor_pb2.PlanResponse) -> bool:
        """True the first time for an open plan: its Finish is to be queued now."""
        return self._open.pop(id(plan), None) is not None

    def orphaned(self, plan: conductor_pb2.PlanResponse) -> None:
        """A plan that arrived after its client left: its reservation is cancelled."""
        self._submit(
            conductor_pb2.FinishRequest(reservation_id=plan.reservation_id, outcome=CANCELLED)
        )


async def shielded(
    call: Awaitable[T], orphaned: Callable[[T], None], timeout_s: float | None = None
) -> T:
    """`await call` in its own task; if the caller is cancelled first, or stops waiting
    after `timeout_s` (TimeoutError), the result (when it comes, if it does) goes to
    `orphaned`."""
    task = asyncio.ensure_future(call)
    try:
        if timeout_s is None:
            return await asyncio.shield(task)
        async with asyncio.timeout(timeout_s):
            return await asyncio.shield(task)
    except (asyncio.CancelledError, TimeoutError):
        task.add_done_callback(lambda done: _orphan(done, orphaned))
        raise


def _orphan(task: asyncio.Future, orphaned: Callable) -> None:
    if not task.cancelled() and task.exception() is None:
        orphaned(task.result())


def early_outcome(exc: BaseException) -> int:
    """A request's Finish outcome when `exc` ended it early: the client left, or an error."""
    if isinstance(exc, asyncio.CancelledError | ConnectionError):
        return CANCELLED
    return ERROR
