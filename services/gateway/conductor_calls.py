"""The gateway's calls to the conductor on a request's path: Plan, and Finish after it.

`ConductorCalls` is the one place that knows how they travel (the conductor's plan
port, else one long-lived PlanStream through `PlanClient`, which falls back to the
unary RPCs);
`FinishQueue` sends Finish strictly off the request's critical path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import grpc

from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
from quillcache_core.process.metrics import Counter
from quillcache_core.rpc.plan_client import PlanClient
from quillcache_core.rpc.plan_port import PlanPortClient, PlanPortUnreachable
from quillcache_core.security.tls import Tls

logger = logging.getLogger(__name__)

PORT_RETRY_S = 5.0
LATE_CANCEL_TIMEOUT_S = 10.0


class ConductorCalls:
    """Plan and Finish; errors are grpc.aio.AioRpcError with the unary RPCs' codes.

    Calls go over the conductor's plan port (PlanStream's messages on plain TCP, a
    tenth of a gRPC message's CPU on each side; its address comes from Stats) and,
    when the conductor has none or it cannot be reached before a call is sent, over
    the PlanStream (`PlanClient`, itself falling back to the unary RPCs).
    """

    def __init__(
        self, channel: grpc.aio.Channel, use_plan_port: bool = True, tls: Tls | None = None
    ) -> None:
        self._client = PlanClient(channel, on_late=self._cancel_late)
        self._stub = conductor_pb2_grpc.ConductorStub(channel)
        self._port = (
            PlanPortClient(self._plan_address, tls, on_late=self._cancel_late)
            if use_plan_port
            else None
        )
        self._port_retry_at = 0.0  # after the port was unreachable, PlanStream until then
        self._late: set[asyncio.Task] = set()
        self.fallbacks = 0
        self.late_plans_cancelled = 0  # reservations of plans answered after their deadline

    def _cancel_late(self, plan: conductor_pb2.PlanResponse) -> None:
        """A plan answered after the gateway gave up on it (and planned the request
        elsewhere, or failed it): its reservations are cancelled at once, rather than
        holding the engine's load (and a drain's wait) until they expire."""
        for reservation_id in (plan.reservation_id, plan.prefill_reservation_id):
            if reservation_id:
                self.late_plans_cancelled += 1
                task = asyncio.get_running_loop().create_task(self._cancel(reservation_id))
                self._late.add(task)
                task.add_done_callback(self._late.discard)

    async def _cancel(self, reservation_id: str) -> None:
        request = conductor_pb2.FinishRequest(
            reservation_id=reservation_id, outcome=conductor_pb2.FinishRequest.CANCELLED
        )
        try:
            await self.finish(request, LATE_CANCEL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:  # it expires at the conductor by itself
            logger.warning(
                "cancelling late plan %s failed: %s %s",
                reservation_id,
                exc.code().name,
                exc.details(),
            )

    async def _plan_address(self) -> str:
        try:
            stats = await self._stub.Stats(conductor_pb2.StatsRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                return ""  # a conductor without Stats has no plan port either
            raise
        return stats.plan_address

    @property
    def transport(self) -> str:
        return "plan port" if self._port is not None else "PlanStream"

    async def plan(
        self, request: conductor_pb2.PlanRequest, timeout_s: float
    ) -> conductor_pb2.PlanResponse:
        if self._port is not None and time.monotonic() >= self._port_retry_at:
            try:
                return await self._port.plan(request, timeout_s)
            except PlanPortUnreachable as exc:
                self._unreachable(exc)
        return await self._client.plan(request, timeout_s)

    async def finish(
        self, request: conductor_pb2.FinishRequest, timeout_s: float
    ) -> conductor_pb2.FinishResponse:
        if self._port is not None and time.monotonic() >= self._port_retry_at:
            try:
                return await self._port.finish(request, timeout_s)
            except PlanPortUnreachable as exc:
                self._unreachable(exc)
        return await self._client.finish(request, timeout_s)

    def _unreachable(self, exc: PlanPortUnreachable) -> None:
        self.fallbacks += 1
        if "no plan port" in (exc.details() or ""):
            logger.info("the conductor has no plan port: using PlanStream")
            self._port = None
        else:
            self._port_retry_at = time.monotonic() + PORT_RETRY_S
            logger.warning(
                "plan port unreachable (%s): PlanStream for the next %.0f s",
                exc.details(),
                PORT_RETRY_S,
            )

    async def close(self) -> None:
        if self._late:
            await asyncio.wait(set(self._late), timeout=LATE_CANCEL_TIMEOUT_S)
        if self._port is not None:
            await self._port.close()
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
