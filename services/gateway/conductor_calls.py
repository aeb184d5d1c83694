"""The gateway's calls to the conductor on a request's path: Plan, and Finish after it.

`ConductorCalls` is the one place that knows how they travel (multiplexed over one
long-lived PlanStream by `PlanClient`, which falls back to the unary RPCs);
`FinishQueue` sends Finish strictly off the request's critical path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

import grpc

from quillcache.v1 import conductor_pb2
from quillcache_core.metrics import Counter
from quillcache_core.plan_client import PlanClient

logger = logging.getLogger(__name__)


class ConductorCalls:
    """Plan and Finish over one channel; errors are grpc.aio.AioRpcError with their codes."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._client = PlanClient(channel)

    async def plan(
        self, request: conductor_pb2.PlanRequest, timeout_s: float
    ) -> conductor_pb2.PlanResponse:
        return await self._client.plan(request, timeout_s)

    async def finish(
        self, request: conductor_pb2.FinishRequest, timeout_s: float
    ) -> conductor_pb2.FinishResponse:
        return await self._client.finish(request, timeout_s)

    async def close(self) -> None:
        await self._client.close()


class FinishQueue:
    """Finish calls sent in batches from a background task, never on a request's path.

    `submit` only appends and wakes the sender, which runs on a later turn of the event
    loop, after the answer's bytes were handed to the socket. While a request is held
    (`hold` .. `unhold`: between its arrival and its engine's first answer) queued
    Finishes wait, up to `max_hold_s`, so neither the gateway nor the conductor works
    on bookkeeping while a client waits for its first byte. At most `max_pending`
    requests wait; beyond that the newest is dropped and counted (its reservation then
    expires at the conductor by itself). At most `max_in_flight` calls are open at once.
    Not thread-safe: one event loop.
    """

    def __init__(
        self,
        calls: ConductorCalls,
        timeout_s: float,
        dropped: Counter,
        *,
        max_hold_s: float = 0.0,
        max_pending: int = 10_000,
        max_in_flight: int = 256,
    ) -> None:
        self._calls = calls
        self._timeout_s = timeout_s
        self._dropped = dropped
        self._max_pending = max_pending
        self._max_hold_s = max_hold_s
        self._holds = 0
        self._quiet = asyncio.Event()
        self._quiet.set()
        self._pending: deque[conductor_pb2.FinishRequest] = deque()
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(max_in_flight)
        self._in_flight: set[asyncio.Task] = set()
        self._sender: asyncio.Task | None = None

    def start(self) -> None:
        self._sender = asyncio.get_running_loop().create_task(self._send_forever())

    def submit(self, request: conductor_pb2.FinishRequest) -> None:
        if len(self._pending) >= self._max_pending:
            self._dropped.inc()
            logger.warning("finish queue full: %s left to expire", request.reservation_id)
            return
        self._pending.append(request)
        self._wake.set()

    def hold(self) -> None:
        self._holds += 1
        self._quiet.clear()

    def unhold(self) -> None:
        self._holds -= 1
        if self._holds <= 0:
            self._holds = 0
            self._quiet.set()

    async def _send_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._max_hold_s > 0 and not self._quiet.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._quiet.wait(), self._max_hold_s)
            while self._pending:
                await self._slots.acquire()
                task = asyncio.get_running_loop().create_task(self._send(self._pending.popleft()))
                self._in_flight.add(task)
                task.add_done_callback(self._in_flight.discard)

    async def _send(self, request: conductor_pb2.FinishRequest) -> None:
        try:
            await self._calls.finish(request, self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.warning(
                "finish of %s failed: %s %s",
                request.reservation_id,
                exc.code().name,
                exc.details(),
            )
        finally:
            self._slots.release()

    async def stop(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, wait up to `timeout_s` for the calls, then cancel the rest."""
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)
        loop = asyncio.get_running_loop()
        while self._pending:
            task = loop.create_task(self._send(self._pending.popleft()))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)
        if self._in_flight:
            _, late = await asyncio.wait(set(self._in_flight), timeout=timeout_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
