"""The gateway's client connections: their deadlines, and what their errors log.

aiohttp bounds neither how long a client may take over a request's headers nor how long
a kept-alive connection may sit idle (its default is an hour). Each connection here has
at most one deadline at a time, as Go's `http.Server` (ReadHeaderTimeout, IdleTimeout):

- `header_timeout_s`: the TLS handshake, then the request line and headers, counted
  from the connection's opening or from its first byte after an idle spell;
- `idle_timeout_s`: from the end of an answer to the next request's first byte;
- none while a request is handled: its body has `body_timeout_s` (`read_json`: 408),
  the engine call its own deadlines.

A connection past its deadline is dropped and counted
(`gateway_connections_timed_out_total{phase}`).

aiohttp logs a malformed request with its exception, whose text quotes the raw bytes
it could not parse (an Authorization header, a key in a URL). `server_logger` logs what
was wrong instead, at INFO: a client's mistake, not the gateway's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from quillcache_core.process.metrics import MetricsRegistry

HEADERS, BUSY, IDLE = "headers", "busy", "idle"
_PLAIN = re.compile(r"[A-Za-z ]{1,80}")


class ConnectionDeadlines:
    """The deadlines of every open connection (see the module's docstring)."""

    def __init__(
        self, header_timeout_s: float, idle_timeout_s: float, metrics: MetricsRegistry
    ) -> None:
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.timed_out = metrics.counter(
            "gateway_connections_timed_out_total",
            "client connections dropped past a deadline, by phase (headers: the TLS "
            "handshake or a request's headers took too long; idle: no request came)",
            ["phase"],
        )
        self._open: dict[asyncio.BaseTransport, _Guarded] = {}  # one entry a connection

    def protocol(self, inner: asyncio.Protocol) -> asyncio.Protocol:
        """`inner` (aiohttp's handler of one connection) under these deadlines."""
        return _Guarded(inner, self)

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        """No deadline while a request is handled; the idle one once it is answered."""
        guard = self._open.get(request.transport)
        if guard is None:
            return await handler(request)
        guard.arm(BUSY)
        try:
            return await handler(request)
        finally:
            guard.arm(IDLE)


class _Guarded(asyncio.Protocol):
    """aiohttp's handler of one connection, dropped past the connection's deadline."""

    __slots__ = ("_inner", "_owner", "_transport", "_timer", "phase")

    def __init__(self, inner: asyncio.Protocol, owner: ConnectionDeadlines) -> None:
        self._inner = inner
        self._owner = owner
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.phase = HEADERS

    def arm(self, phase: str) -> None:
        self.phase = phase
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        owner = self._owner
        timeout = {HEADERS: owner.header_timeout_s, IDLE: owner.idle_timeout_s}.get(phase)
        if timeout is not None and self._transport is not None:
            self._timer = asyncio.get_running_loop().call_later(timeout, self._expire, phase)

    def _expire(self, phase: str) -> None:
        self._timer = None
        if self._transport is not None and self.phase == phase:
            self._owner.timed_out.inc(phase=phase)
            self._transport.abort()

    def connection_made(self, transport) -> None:
        self._transport = transport
        self._owner._open[transport] = self
        self.arm(HEADERS)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.phase == IDLE:
            self.arm(HEADERS)  # the next request's first byte
        self._inner.data_received(data)

    def eof_received(self):
        return self._inner.eof_received()

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._owner._open.pop(self._transport, None)
        self._transport = None
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class GuardedSite(web.BaseSite):
    """`web.TCPSite` with each connection under `deadlines` (the TLS handshake too)."""

    __slots__ = ("_host", "_port", "_deadlines")

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, ssl_context, deadlines
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._host, self._port, self._deadlines = host, port, deadlines

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server, deadlines = self._runner.server, self._deadlines
        self._server = await asyncio.get_running_loop().create_server(
            lambda: deadlines.protocol(server()),
            self._host,
            self._port,
            ssl=self._ssl_context,
            ssl_handshake_timeout=deadlines.header_timeout_s if self._ssl_context else None,
            backlog=self._backlog,
        )


async def answer_and_close(request: web.Request, reply: web.Response) -> None:
    """Send `reply`, then end the connection at once (its request's body is unread:
    waiting for the rest would let a slow client hold it)."""
    with contextlib.suppress(ConnectionError):
        await reply.prepare(request)
        await reply.write_eof()
    if request.protocol is not None:
        request.protocol.force_close()


class _WithoutRawRequests(logging.Filter):
    """A malformed request's record says what was wrong, never the bytes it quotes."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        record.msg, record.args = "%s: %s (HTTP %d)", (record.getMessage(), _what(exc), exc.code)
        record.exc_info = record.exc_text = record.stack_info = None
        record.levelno, record.levelname = logging.INFO, "INFO"
        return logging.getLogger(record.name).isEnabledFor(logging.INFO)


def _what(exc: HttpProcessingError) -> str:
    """The error's kind, and its reason when that is plain words (llhttp's reasons are:
    "Invalid header value char"), never the quoted request bytes that follow."""
    reason = str(exc.message).split(":", 1)[0].strip()
    kind = type(exc).__name__
    return f"{kind}, {reason}" if _PLAIN.fullmatch(reason) else kind


def server_logger() -> logging.Logger:
    """The logger for aiohttp's server (its `logger=`): see the module's docstring."""
    found = logging.getLogger(__name__ + ".http")
    if not any(isinstance(f, _WithoutRawRequests) for f in found.filters):
        found.addFilter(_WithoutRawRequests())
    return found
