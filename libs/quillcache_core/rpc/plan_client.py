"""Plan and Finish over the conductor's PlanStream, shared by every task of a process.

A unary gRPC call costs about twice a message on an open stream here (call setup,
metadata, a task per call on each side), and Plan sits on every request's critical
path. `PlanClient` keeps one stream open, gives each call an id, sends the calls
queued while the previous message was being written as one message, and resolves
each caller's future from the results. Failures look exactly like the unary RPC's:
`grpc.aio.AioRpcError` with the same status code and details. If the stream breaks,
the calls in flight fail with UNAVAILABLE and the next call opens a new stream; a
conductor without PlanStream (UNIMPLEMENTED) is called unary from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable

import grpc

from quillcache.v1 import conductor_pb2, conductor_pb2_grpc

logger = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a unary call with this status would have raised."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))


# Plans whose caller gave up, remembered so a late answer is recognised (the oldest
# forgotten first: a plan answered this late has expired at its conductor anyway).
ABANDONED_MAX = 4096

OnLatePlan = Callable[[conductor_pb2.PlanResponse], None]


class PendingCalls:
    """The callers waiting on one connection's results, by call id.

    Shared by PlanClient (PlanStream) and PlanPortClient (the plan port): ids are
    allotted here, each caller waits with one timer (cheaper than wait_for's wrapper
    future and callbacks), results resolve the callers, and a broken connection
    fails them all at once. A Plan answered after its caller gave up (its deadline,
    a cancellation) still opened a reservation at the conductor, which nobody would
    finish: the answer goes to `on_late`, which cancels it (`ConductorCalls`).
    """

    def __init__(self, on_late: OnLatePlan | None = None) -> None:
        self._ids = itertools.count(1)
        self._futures: dict[int, asyncio.Future] = {}
        self._abandoned: dict[int, None] = {}  # plans' call ids, oldest first
        self.on_late = on_late

    async def call(
        self,
        call: conductor_pb2.PlanCall,
        timeout: float | None,
        send: Callable[[conductor_pb2.PlanCall], None],
    ):
        """Give `call` an id, `send` it, and wait for its result or its deadline."""
        call.call_id = call_id = next(self._ids)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._futures[call_id] = future
        send(call)
        timer = None if timeout is None else loop.call_later(timeout, _expire, future)
        try:
            return await future
        finally:
            if timer is not None:
                timer.cancel()
            # Still here: not answered (deliver pops first), so the caller gave up.
            if self._futures.pop(call_id, None) is not None and call.HasField("plan"):
                abandoned = self._abandoned
                if len(abandoned) >= ABANDONED_MAX:
                    abandoned.pop(next(iter(abandoned)))
                abandoned[call_id] = None

    def deliver(self, message: conductor_pb2.PlanStreamResponse) -> None:
        """Resolve the callers' futures from a response's results."""
        futures = self._futures
        for result in message.results:
            future = futures.pop(result.call_id, None)
            which = result.WhichOneof("result")
            if future is None or future.done():  # the caller timed out or was cancelled
                # (done: it gave up but has not yet run to forget the call; None: it
                # forgot it, as abandoned if it was a plan)
                gave_up = future is not None or self._abandoned.pop(result.call_id, 0) is None
                if gave_up and which == "plan" and self.on_late is not None:
                    self.on_late(result.plan)
                continue
            if which == "plan":
                future.set_result(result.plan)
            elif which == "finish":
                future.set_result(result.finish)
            else:
                code = _CODES.get(result.error.code, grpc.StatusCode.UNKNOWN)
                future.set_exception(rpc_error(code, result.error.message))

    def fail_all(self, error: grpc.aio.AioRpcError) -> None:
        """Fail every call in flight (the connection broke or the client closed: what
        they opened at the conductor is never answered here, and expires there)."""
        futures, self._futures = self._futures, {}
        self._abandoned.clear()
        for future in futures.values():
            if not future.done():
                future.set_exception(error)


class PlanClient:
    """Multiplexes Plan and Finish calls from many tasks over one PlanStream."""

    def __init__(self, channel: grpc.aio.Channel, on_late: OnLatePlan | None = None) -> None:
        self._stub = conductor_pb2_grpc.ConductorStub(channel)
        self._pending = PendingCalls(on_late)
        self._outbox: list[conductor_pb2.PlanCall] = []
        self._wake = asyncio.Event()
        self._call = None
        self._tasks: list[asyncio.Task] = []
        self._unary = False
        self._closed = False
        self.streams_opened = 0

    async def plan(
        self, request: conductor_pb2.PlanRequest, timeout: float | None = None
    ) -> conductor_pb2.PlanResponse:
        return await self._either(conductor_pb2.PlanCall(plan=request), self._stub.Plan, timeout)

    async def finish(
        self, request: conductor_pb2.FinishRequest, timeout: float | None = None
    ) -> conductor_pb2.FinishResponse:
        return await self._either(
            conductor_pb2.PlanCall(finish=request), self._stub.Finish, timeout
        )

    async def _either(self, call: conductor_pb2.PlanCall, unary, timeout: float | None):
        """Over the stream, or unary once the conductor said it has no PlanStream."""
        request = getattr(call, call.WhichOneof("call"))
        if self._unary:
            return await unary(request, timeout=timeout)
        try:
            return await self._submit(call, timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.UNIMPLEMENTED or self._unary is False:
                raise
            return await unary(request, timeout=timeout)

    async def close(self) -> None:
        self._closed = True
        self._stop(rpc_error(grpc.StatusCode.CANCELLED, "plan client closed"))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    # --- internals ---------------------------------------------------------------------

    async def _submit(self, call: conductor_pb2.PlanCall, timeout: float | None):
        if self._closed:
            raise rpc_error(grpc.StatusCode.CANCELLED, "plan client closed")
        if self._call is None:
            self._open()
        return await self._pending.call(call, timeout, self._enqueue)

    def _enqueue(self, call: conductor_pb2.PlanCall) -> None:
        self._outbox.append(call)
        self._wake.set()

    def _open(self) -> None:
        self._call = call = self._stub.PlanStream()
        self.streams_opened += 1
        self._tasks = [
            asyncio.create_task(self._writer(call)),
            asyncio.create_task(self._reader(call)),
        ]

    async def _writer(self, call) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if not self._outbox:
                    continue
                calls, self._outbox = self._outbox, []
                await call.write(conductor_pb2.PlanStreamRequest(calls=calls))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reader reports the stream's status
            logger.debug("PlanStream write failed: %s", exc)

    async def _reader(self, call) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "PlanStream closed by the conductor")
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    break
                self._pending.deliver(message)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                logger.info("conductor has no PlanStream; calling Plan and Finish unary")
                self._unary = True
            # The stream broke (the conductor died or restarted: grpc says UNAVAILABLE
            # or INTERNAL): to a caller that is the conductor being unavailable.
            code = exc.code()
            if code not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.CANCELLED):
                code = grpc.StatusCode.UNAVAILABLE
            error = rpc_error(code, f"PlanStream: {exc.code().name}: {exc.details()}")
        except Exception as exc:
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"PlanStream failed: {exc}")
        if self._call is call:
            self._stop(error)

    def _stop(self, error: grpc.aio.AioRpcError) -> None:
        """Fail every call in flight; the next call opens a new stream."""
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._outbox = []
        self._pending.fail_all(error)
