"""The conductor's plan port: PlanStream's messages over plain TCP.

Measured here (2 cores, loopback, 2.5 KB messages, 32 in flight): a message on an
open gRPC stream costs about 175 us of CPU on each side (Cython call objects, a
hand-off from gRPC's poller thread to the event loop per message); the same bytes
through an asyncio stream cost about 17 us on each side. On a request's critical
path, with the gateway, the conductor and the engines sharing the cores, that CPU is
latency. So the conductor also serves exactly the PlanStream messages on a TCP port:

    frame := length (4 bytes, big-endian) ‖ PlanStreamRequest (client → conductor)
           | length (4 bytes, big-endian) ‖ PlanStreamResponse (conductor → client)

one response frame per request frame, in order, on each connection. A call's failure
is its CallError, as on PlanStream. A frame that is too big or does not parse closes
that connection (counted and logged); other connections are unaffected. The gRPC
service stays the contract (health, reflection, grpcurl); Stats.plan_address names
this port, and `PlanPortClient` uses it with PlanClient's interface and errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from quillcache.v1 import conductor_pb2
from quillcache_core.rpc.plan_client import OnLatePlan, PendingCalls, rpc_error
from quillcache_core.security.access import PLAN_PORT_ROLES
from quillcache_core.security.tls import Tls, role_of_cert

logger = logging.getLogger(__name__)

LENGTH = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024


class PlanPortUnreachable(grpc.aio.AioRpcError):
    """UNAVAILABLE before anything was sent: no plan port, or no connection to it.

    A caller may safely send the same call another way (PlanStream).
    """

    def __init__(self, details: str) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details
        )


class PlanPortServer:
    """Serves `handle(PlanStreamRequest) -> PlanStreamResponse` on a TCP port."""

    def __init__(
        self,
        handle: Callable[[conductor_pb2.PlanStreamRequest], conductor_pb2.PlanStreamResponse],
        tls: Tls | None = None,
    ) -> None:
        self._handle = handle
        self._tls = tls
        self._server: asyncio.AbstractServer | None = None
        self.port = 0
        self.connections = 0
        self.frames = 0
        self.calls = 0
        self.rejected_frames = 0
        self.refused_connections = 0

    async def start(self, host: str, port: int) -> int:
        ssl = self._tls.server_context() if self._tls else None
        self._server = await asyncio.start_server(self._serve, host, port, ssl=ssl)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        peer = writer.get_extra_info("peername")
        if self._tls is not None:
            role = role_of_cert(writer.get_extra_info("peercert"))
            if role not in PLAN_PORT_ROLES:
                self.refused_connections += 1
                logger.warning("plan port: refused %s (role %s)", peer, role)
                writer.close()
                return
        try:
            while True:
                try:
                    head = await reader.readexactly(4)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the client went away between frames
                (size,) = LENGTH.unpack(head)
                if size > MAX_FRAME:
                    self.rejected_frames += 1
                    logger.warning("plan port: %s sent a %d-byte frame; closing", peer, size)
                    return
                body = await reader.readexactly(size)
                try:
                    message = conductor_pb2.PlanStreamRequest.FromString(body)
                except DecodeError as exc:
                    self.rejected_frames += 1
                    logger.warning("plan port: %s sent a bad frame (%s); closing", peer, exc)
                    return
                self.frames += 1
                self.calls += len(message.calls)
                out = self._handle(message).SerializeToString()
                writer.write(LENGTH.pack(len(out)) + out)
                if writer.transport.get_write_buffer_size() > 1 << 20:
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


class PlanPortClient:
    """Plan and Finish over the plan port, with PlanClient's interface and errors.

    `resolve()` returns the port's host:port (asked again after a connection fails,
    so a restarted conductor on a new port is found); "" means there is none, and
    the call fails with UNAVAILABLE. The calls made in one turn of the event loop go
    out together at its end, as one frame (no writer task): a gateway's Finishes
    leave its queue in one turn, and every frame is a TLS record and a write(2) on
    each side, and a read and an answer on the conductor. A reader task resolves each
    caller's future by call id.
    """

    def __init__(
        self,
        resolve: Callable[[], Awaitable[str]],
        tls: Tls | None = None,
        on_late: OnLatePlan | None = None,
    ) -> None:
        self._resolve = resolve
        self._ssl = tls.client_context() if tls else None
        self._pending = PendingCalls(on_late)
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._connecting: asyncio.Future | None = None
        self._outbox: list[conductor_pb2.PlanCall] = []  # this turn's calls, for _writer
        self._closed = False
        self.connections_opened = 0
        self.frames_sent = 0

    async def plan(
        self, request: conductor_pb2.PlanRequest, timeout: float | None = None
    ) -> conductor_pb2.PlanResponse:
        return await self._call(conductor_pb2.PlanCall(plan=request), timeout)

    async def finish(
        self, request: conductor_pb2.FinishRequest, timeout: float | None = None
    ) -> conductor_pb2.FinishResponse:
        return await self._call(conductor_pb2.PlanCall(finish=request), timeout)

    async def close(self) -> None:
        self._closed = True
        self._drop(rpc_error(grpc.StatusCode.CANCELLED, "plan client closed"))
        task, self._reader_task = self._reader_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _call(self, call: conductor_pb2.PlanCall, timeout: float | None):
        if self._closed:
            raise rpc_error(grpc.StatusCode.CANCELLED, "plan client closed")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        if self._writer is None or self._writer.is_closing():
            await self._connect(timeout)

        def send(call: conductor_pb2.PlanCall) -> None:
            if not self._outbox:
                loop.call_soon(self._send_outbox)
            self._outbox.append(call)

        remaining = None if deadline is None else deadline - loop.time()
        return await self._pending.call(call, remaining, send)

    def _send_outbox(self) -> None:
        """Write the calls queued this turn as one frame. Calls queued for a connection
        that broke meanwhile were failed with it (`_drop` empties the outbox)."""
        calls, self._outbox = self._outbox, []
        writer = self._writer
        if not calls or writer is None or writer.is_closing():
            return
        body = conductor_pb2.PlanStreamRequest(calls=calls).SerializeToString()
        writer.write(LENGTH.pack(len(body)) + body)
        self.frames_sent += 1

    async def _connect(self, timeout: float | None) -> asyncio.StreamWriter:
        """One connection attempt shared by every caller waiting for it."""
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        connecting = self._connecting
        try:
            return await asyncio.wait_for(asyncio.shield(connecting), timeout)
        except TimeoutError:
            raise rpc_error(
                grpc.StatusCode.DEADLINE_EXCEEDED, "connecting to the plan port"
            ) from None
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _open(self) -> asyncio.StreamWriter:
        try:
            address = await self._resolve()
        except grpc.aio.AioRpcError as exc:
            raise PlanPortUnreachable(f"asking for the plan port: {exc.details()}") from None
        if not address:
            raise PlanPortUnreachable("the conductor has no plan port")
        host, _, port = address.rpartition(":")
        try:
            reader, writer = await asyncio.open_connection(host, int(port), ssl=self._ssl)
        except (OSError, ValueError) as exc:
            raise PlanPortUnreachable(f"plan port {address}: {exc}") from None
        self._writer = writer
        self.connections_opened += 1
        self._reader_task = asyncio.create_task(self._read(reader, writer))
        return writer

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "plan port closed by the conductor")
        try:
            while True:
                (size,) = LENGTH.unpack(await reader.readexactly(4))
                message = conductor_pb2.PlanStreamResponse.FromString(
                    await reader.readexactly(size)
                )
                self._pending.deliver(message)
        except asyncio.CancelledError:
            raise
        except (asyncio.IncompleteReadError, ConnectionError, DecodeError) as exc:
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"plan port: {exc!r}")
        if self._writer is writer:
            self._drop(error)

    def _drop(self, error: grpc.aio.AioRpcError) -> None:
        """Fail every call in flight; the next call connects again."""
        writer, self._writer = self._writer, None
        self._outbox = []
        if writer is not None:
            writer.close()
        self._pending.fail_all(error)
