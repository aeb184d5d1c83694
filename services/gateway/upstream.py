"""A lean keep-alive HTTP/1.1 client for the gateway's calls to engines.

The gateway POSTs one JSON body per request to a handful of long-lived engines and
relays the answer. A general client (cookies, redirects, tracing, auto headers, a
timer per read) costs more CPU per request than the rest of the gateway's path; this
one does only what that path needs: pooled connections per engine, one write per
request, the response head parsed once, the body read by Content-Length, chunked
framing or to EOF, and one timer per request for the total deadline.

Each connection is its own protocol (`_Conn`): what the engine sends is buffered for
`read`, or, during `relay`, handed on from the connection's own callback as it
arrives. A streamed answer is one small write from the engine per token; relayed this
way, a token costs one callback instead of a task's wake-up through a stream reader
and back out through a writer's coroutines.

A request that fails on a reused connection before any byte of the answer arrived
is sent once more on a new connection (the engine closed an idle connection as it
was being reused). Not thread-safe: one event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

from quillcache_core.security.tls import Tls, role_of_cert

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
READ_LIMIT = 1024 * 1024  # buffered and unread: the engine's reading pauses above this
# A relay's destination with more than RELAY_HIGH bytes queued pauses the engine's side
# until it is under RELAY_LOW (checked every RELAY_POLL_S meanwhile).
RELAY_HIGH = 256 * 1024
RELAY_LOW = 64 * 1024
RELAY_POLL_S = 0.005


class UpstreamError(Exception):
    """The engine's answer is not valid HTTP/1.x, or it timed out."""


# What a failed engine call raises: the socket's errors, an early EOF, a malformed answer.
UPSTREAM_ERRORS = (OSError, EOFError, asyncio.LimitOverrunError, TimeoutError, UpstreamError)


class _Conn(asyncio.Protocol):
    """One connection to an engine: the bytes it sent and not yet taken (`buf`), whether
    it ended (`eof`), and at most one waiter for more, or one sink handed every arrival
    (`bytes`, then None at the end)."""

    __slots__ = ("transport", "buf", "eof", "idle_since", "reused", "_waiter", "_sink", "_paused")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.eof = False
        self.idle_since = 0.0
        self.reused = False
        self._waiter: asyncio.Future | None = None
        self._sink: Callable[[bytes | None], None] | None = None
        self._paused = False

    # --- the transport's callbacks ------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._sink is not None:
            self._sink(data)
            return
        self.buf += data
        if len(self.buf) > READ_LIMIT and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._ended()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended()

    def _ended(self) -> None:
        if self.eof:
            return
        self.eof = True
        if self._sink is not None:
            self._sink(None)
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- the reply's side ---------------------------------------------------------------

    async def more(self) -> None:
        """Until more bytes arrive or the connection ends (`eof`)."""
        self._unpause()
        if self.eof:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter

    def hand_to(self, sink: Callable[[bytes | None], None] | None) -> None:
        """Every arrival to `sink` from now on (None: buffered again)."""
        self._sink = sink
        self._unpause()

    def _unpause(self) -> None:
        """Read from the engine again after a full buffer paused it."""
        if self._paused:
            self._paused = False
            self.transport.resume_reading()

    def usable(self, now: float, idle_s: float) -> bool:
        return (
            not self.eof
            and not self.buf  # bytes while idle: not a clean end of the last answer
            and not self.transport.is_closing()
            and now - self.idle_since < idle_s
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class UpstreamPool:
    """Keep-alive connections per (host, port), at most `max_idle_per_host` idle each."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 2.0,
        total_timeout_s: float = 300.0,
        idle_timeout_s: float = 30.0,
        max_idle_per_host: int = 512,
        tls: Tls | None = None,
        engine_key: str = "",
    ) -> None:
        """With `tls`, engines are reached only over https, must show an engine
        certificate, and get `engine_key` as their bearer credential."""
        self._ssl = tls.client_context() if tls else None
        self._auth = f"Authorization: Bearer {engine_key}\r\n".encode() if engine_key else b""
        self.connect_timeout_s = connect_timeout_s
        self.total_timeout_s = total_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[tuple[str, int], deque[_Conn]] = {}
        self._targets: dict[str, tuple[str, int, bytes]] = {}
        self._closed = False

    async def post(self, base_url: str, path: str, body: bytes, headers: bytes) -> UpstreamReply:
        """POST `body` (JSON) to base_url + path; returns once the answer's head is read.

        `headers` are extra header lines, each ending in CRLF. Raises one of
        UPSTREAM_ERRORS when no answer head arrives.
        """
        host, port, host_header = self._target(base_url)
        head = b"".join(
            (
                b"POST ",
                path.encode("ascii"),
                b" HTTP/1.1\r\nHost: ",
                host_header,
                b"\r\nContent-Type: application/json\r\nContent-Length: ",
                str(len(body)).encode(),
                b"\r\n",
                self._auth,
                headers,
                b"\r\n",
            )
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_timeout_s
        for _ in range(2):
            conn = await self._acquire(host, port)
            reply = UpstreamReply(self, (host, port), conn, loop, deadline)
            try:
                conn.transport.write(head + body)
                await reply._read_head()
            except UPSTREAM_ERRORS:
                reply.close()
                if conn.reused and not reply.head_started:
                    continue  # an idle connection the engine had closed: once more, new
                raise
            except BaseException:  # cancelled (its client left): the answer is not wanted
                reply.close()
                raise
            return reply
        raise UpstreamError("unreachable")  # pragma: no cover - the loop returns or raises

    def _target(self, base_url: str) -> tuple[str, int, bytes]:
        found = self._targets.get(base_url)
        if found is None:
            parts = urlsplit(base_url)
            scheme = "https" if self._ssl else "http"
            if parts.scheme != scheme or not parts.hostname:
                raise UpstreamError(f"engine URL {base_url!r} is not {scheme}://host[:port]")
            port = parts.port or (443 if self._ssl else 80)
            found = (parts.hostname, port, parts.netloc.encode("idna"))
            if len(self._targets) >= 4096:
                self._targets.clear()
            self._targets[base_url] = found
        return found

    async def _acquire(self, host: str, port: int) -> _Conn:
        idle = self._idle.get((host, port))
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable(now, self.idle_timeout_s):
                conn.reused = True
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        transport, conn = await asyncio.wait_for(
            loop.create_connection(_Conn, host, port, ssl=self._ssl),
            self.connect_timeout_s,
        )
        if self._ssl is not None:
            role = role_of_cert(transport.get_extra_info("peercert"))
            if role != "engine":
                transport.abort()
                raise UpstreamError(f"{host}:{port} is not an engine (certificate of {role})")
        return conn

    def _release(self, key: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.setdefault(key, deque())
        if self._closed or len(idle) >= self.max_idle_per_host:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def idle_connections(self) -> int:
        """Keep-alive connections held open, waiting for the next request."""
        return sum(len(idle) for idle in self._idle.values())

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


class UpstreamReply:
    """An engine's answer: status and headers read, the body read with `read`/`read_all`
    or handed on with `relay`.

    `release()` must be called once: the connection goes back to the pool when the
    body was read to its end and both sides keep it alive, else it is closed.
    """

    __slots__ = (
        "_pool",
        "_key",
        "_conn",
        "_timer",
        "_timed_out",
        "_chunked",
        "_remaining",
        "_keep_alive",
        "_done",
        "head_started",
        "status",
        "headers",
    )

    def __init__(self, pool, key, conn: _Conn, loop, deadline: float) -> None:
        self._pool = pool
        self._key = key
        self._conn = conn
        self._timed_out = False
        self._timer = loop.call_at(deadline, self._expire)
        self._chunked = False
        self._remaining = -1  # body bytes left; -1 = until EOF
        self._keep_alive = False
        self._done = False
        self.head_started = False
        self.status = 0
        self.headers: dict[str, str] = {}

    def _expire(self) -> None:
        self._timed_out = True
        self._conn.close()

    def _failed(self, exc: BaseException) -> BaseException:
        if self._timed_out:
            return UpstreamError("the engine did not answer within the deadline")
        return exc

    def _cut_short(self) -> BaseException:
        return self._failed(asyncio.IncompleteReadError(bytes(self._conn.buf), None))

    async def _read_head(self) -> None:
        conn = self._conn
        buf = conn.buf
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    self.head_started = True
                    raise UpstreamError("the engine's response head is too large")
                if conn.eof:
                    self.head_started = bool(buf)
                    raise self._cut_short()
                await conn.more()
                continue
            self.head_started = True
            if end > MAX_HEAD_BYTES:
                raise UpstreamError("the engine's response head is too large")
            raw = bytes(buf[:end])
            del buf[: end + 4]
            first, _, raw = raw.partition(b"\r\n")
            version, status = _status_line(first)
            if not 100 <= status < 200:
                break  # else an interim answer (100 Continue): the real one follows
        headers = {}
        for line in raw.decode("latin-1").split("\r\n"):
            if line:
                name, sep, value = line.partition(":")
                if not sep:
                    raise UpstreamError(f"malformed header line {line[:80]!r}")
                headers[name.strip().lower()] = value.strip()
        self.status = status
        self.headers = headers
        connection = headers.get("connection", "").lower()
        if version == "HTTP/1.1":
            self._keep_alive = "close" not in connection
        else:
            self._keep_alive = "keep-alive" in connection
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._chunked = True
        elif "content-length" in headers:
            try:
                self._remaining = int(headers["content-length"])
            except ValueError:
                raise UpstreamError("malformed Content-Length") from None
            if self._remaining < 0:
                raise UpstreamError("malformed Content-Length")
        elif status in (204, 304):
            self._remaining = 0
        else:
            self._keep_alive = False  # the body ends at EOF
        if self._remaining == 0:
            self._done = True

    def _take(self) -> bytes:
        """The body's bytes buffered and whole (every whole chunk, when chunked); b""
        when none yet. Sets `_done` at the body's end; raises UpstreamError on bad framing
        and the cut-short error when the connection ended before the body did."""
        conn = self._conn
        buf = conn.buf
        if self._chunked:
            out = self._take_chunks(buf)
        elif self._remaining < 0:
            out = bytes(buf)
            buf.clear()
            if conn.eof:
                self._done = True
            return out
        else:
            out = bytes(buf[: self._remaining])
            del buf[: len(out)]
            self._remaining -= len(out)
            if self._remaining == 0:
                self._done = True
        if not self._done and not out and conn.eof:
            raise self._cut_short()
        return out

    def _take_chunks(self, buf: bytearray) -> bytes:
        out: list[bytes] = []
        pos, size_end = 0, buf.find(b"\r\n")
        try:
            while size_end >= 0:
                try:
                    size = int(bytes(buf[pos:size_end]).split(b";", 1)[0], 16)
                except ValueError:
                    raise UpstreamError("malformed chunk size") from None
                if size < 0:
                    raise UpstreamError("malformed chunk size")
                if size == 0:
                    # The last chunk; trailer lines, if any, up to an empty line.
                    end = buf.find(b"\r\n\r\n", size_end)
                    if end < 0:
                        break
                    if len(buf) > end + 4:
                        self._keep_alive = False  # bytes after the body: not reusable
                    pos = len(buf)
                    self._done = True
                    break
                end = size_end + 2 + size
                if len(buf) < end + 2:
                    break
                if buf[end : end + 2] != b"\r\n":
                    raise UpstreamError("malformed chunk")
                out.append(bytes(buf[size_end + 2 : end]))
                pos = end + 2
                size_end = buf.find(b"\r\n", pos)
        finally:
            if pos:
                del buf[:pos]
        if not out and not self._done and size_end < 0 and len(buf) > MAX_HEAD_BYTES:
            raise UpstreamError("malformed chunk size")
        return b"".join(out)

    async def read(self) -> bytes:
        """The next piece of the body as it arrives; b"" at its end.

        A chunked body gives every whole chunk that has arrived, at least one: a
        stream's events that came in one read go on in one write (the same bytes)."""
        while not self._done:
            out = self._take()
            if out:
                return out
            if self._done:
                break
            await self._conn.more()
        return b""

    async def read_all(self) -> bytes:
        """The whole body (the engine's non-streamed answers are small)."""
        parts = []
        while piece := await self.read():
            parts.append(piece)
        return b"".join(parts)

    async def relay(self, sink: Callable[[bytes], bool], backlog: Callable[[], int]) -> None:
        """Hand each piece of the body to `sink` as it arrives, from the connection's
        own callback, until the body's end.

        `sink` returns False when it wants no more (its reader left): the relay ends
        at once, and the connection is not reused. `backlog` tells how many bytes the
        sink's destination has queued: above RELAY_HIGH the engine's side pauses until
        it is under RELAY_LOW. Raises one of UPSTREAM_ERRORS if the body fails, or what
        `sink` raised."""
        conn = self._conn
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        paused = False

        def resume_when_drained() -> None:
            nonlocal paused
            if ended.done():
                return
            if backlog() > RELAY_LOW:
                loop.call_later(RELAY_POLL_S, resume_when_drained)
                return
            paused = False
            conn.transport.resume_reading()

        def arrived(data: bytes | None) -> None:
            nonlocal paused
            if ended.done():
                return
            if data:
                conn.buf += data
            try:
                out = self._take()
                if out and sink(out) is False:
                    self._keep_alive = False
                    ended.set_result(None)
                    return
                if data is None and not self._done:
                    raise self._cut_short()
            except BaseException as exc:  # noqa: BLE001 - the relay's caller gets it
                ended.set_exception(exc)
                return
            if self._done:
                ended.set_result(None)
            elif not paused and backlog() > RELAY_HIGH:
                paused = True
                conn.transport.pause_reading()
                loop.call_later(RELAY_POLL_S, resume_when_drained)

        conn.hand_to(arrived)
        try:
            arrived(None if conn.eof else b"")  # what came with the head, or its end
            await ended
        finally:
            conn.hand_to(None)
            if paused and not conn.eof:
                conn.transport.resume_reading()

    def release(self) -> None:
        if self._conn is None:
            return
        self._timer.cancel()
        conn, self._conn = self._conn, None
        if self._done and self._keep_alive and not self._timed_out:
            self._pool._release(self._key, conn)
        else:
            conn.close()

    def close(self) -> None:
        """Drop the connection (the answer is not read to its end)."""
        self._keep_alive = False
        self.release()


def _status_line(line: bytes) -> tuple[str, int]:
    parts = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or len(parts[1]) != 3:
        raise UpstreamError(f"malformed status line {line[:80]!r}")
    try:
        return parts[0], int(parts[1])
    except ValueError:
        raise UpstreamError(f"malformed status line {line[:80]!r}") from None
