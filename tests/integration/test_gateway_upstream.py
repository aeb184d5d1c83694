"""The gateway's HTTP/1.1 client against scripted engines on loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from quillcache_gateway.upstream import UPSTREAM_ERRORS, UpstreamError, UpstreamPool

pytestmark = pytest.mark.integration


class ScriptedEngine:
    """Answers each request on a connection with the next scripted reply (raw bytes).

    A reply of None closes the connection instead of answering; with `close_after`
    each connection is closed after one answer, else it stays open.
    """

    def __init__(self, replies: list[bytes | None], close_after: bool = False) -> None:
        self.replies = list(replies)
        self.close_after = close_after
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _serve(self, reader, writer) -> None:
        self.connections += 1
        try:
            while self.replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                self.requests.append(head + await reader.readexactly(length))
                reply = self.replies.pop(0)
                if reply is None:
                    return
                writer.write(reply)
                await writer.drain()
                if self.close_after:
                    return
            await reader.read()  # keep the connection until the client closes it
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.closed.set()

    async def stop(self) -> None:
        self.server.close()
        with contextlib.suppress(Exception):
            await self.server.wait_closed()


OK_JSON = (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok": 1}\r\n'
)
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"7;ext=1\r\ndata: 1\r\n"
    b"e\r\ndata: [DONE]\n\n\r\n"
    b"0\r\nX-Trailer: t\r\n\r\n"
)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def post(pool, url, body=b"{}"):
    return await pool.post(url, "/v1/completions", body, b"x-quillcache-request-id: r1\r\n")


def test_content_length_and_chunked_answers_on_one_kept_alive_connection():
    async def main():
        engine = ScriptedEngine([OK_JSON, CHUNKED, OK_JSON])
        url = await engine.start()
        pool = UpstreamPool()
        try:
            reply = await post(pool, url, b'{"a": 1}')
            assert (reply.status, reply.headers["content-type"]) == (200, "application/json")
            assert await reply.read_all() == b'{"ok": 1}\r\n'
            reply.release()
            reply = await post(pool, url)
            pieces = []
            while piece := await reply.read():
                pieces.append(piece)
            # The chunks that arrived together come as one piece (the same bytes).
            assert b"".join(pieces) == b"data: 1data: [DONE]\n\n"
            reply.release()
            reply = await post(pool, url)
            assert await reply.read_all() == b'{"ok": 1}\r\n'
            reply.release()
            assert engine.connections == 1
            first = engine.requests[0]
            assert first.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
            assert b"\r\nContent-Type: application/json\r\n" in first
            assert b"\r\nx-quillcache-request-id: r1\r\n" in first
            assert first.endswith(b'\r\n\r\n{"a": 1}')
        finally:
            await pool.close()
            await engine.stop()

    run(main())


def test_a_body_until_eof_interim_answers_and_connection_close_are_not_reused():
    async def main():
        until_eof = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it"
        interim = b"HTTP/1.1 100 Continue\r\n\r\n" + OK_JSON
        closing = OK_JSON.replace(b"OK\r\n", b"OK\r\nConnection: close\r\n", 1)
        engine = ScriptedEngine([until_eof, interim, closing, OK_JSON], close_after=True)
        url = await engine.start()
        pool = UpstreamPool()
        try:
            reply = await post(pool, url)
            assert await reply.read_all() == b"all of it"
            reply.release()
            for _ in range(3):
                reply = await post(pool, url)
                assert reply.status == 200
                assert await reply.read_all() == b'{"ok": 1}\r\n'
                reply.release()
            assert engine.connections == 4
        finally:
            await pool.close()
            await engine.stop()

    run(main())


def test_an_idle_connection_the_engine_closed_is_replaced_without_an_error():
    async def main():
        engine = ScriptedEngine([OK_JSON], close_after=True)
        url = await engine.start()
        pool = UpstreamPool()
        try:
            reply = await post(pool, url)
            await reply.read_all()
            reply.release()  # kept: the answer said nothing about closing
            await engine.closed.wait()
            engine.replies.append(OK_JSON)
            reply = await post(pool, url)
            assert await reply.read_all() == b'{"ok": 1}\r\n'
            reply.release()
            assert engine.connections == 2
        finally:
            await pool.close()
            await engine.stop()

    run(main())


def test_a_stale_connection_that_still_looks_open_is_retried_once():
    async def main():
        engine = ScriptedEngine([OK_JSON, None, OK_JSON])
        url = await engine.start()
        pool = UpstreamPool()
        try:
            reply = await post(pool, url)
            await reply.read_all()
            reply.release()
            # The engine drops the reused connection on the next request; a new one works.
            reply = await post(pool, url)
            assert await reply.read_all() == b'{"ok": 1}\r\n'
            reply.release()
            assert engine.connections == 2
        finally:
            await pool.close()
            await engine.stop()

    run(main())


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200\r\n\r\n",  # a status line without a reason is fine
        b"garbage\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: nope\r\n\r\n",
        None,
    ],
)
def test_malformed_or_missing_answers_raise_upstream_errors(reply):
    async def main():
        engine = ScriptedEngine([reply], close_after=True)
        url = await engine.start()
        pool = UpstreamPool()
        try:
            if reply == b"HTTP/1.1 200\r\n\r\n":
                answer = await post(pool, url)
                assert answer.status == 200 and await answer.read_all() == b""
                answer.release()
                return
            with pytest.raises(UPSTREAM_ERRORS):
                await post(pool, url)
        finally:
            await pool.close()
            await engine.stop()

    run(main())


def test_a_body_cut_short_and_a_slow_engine_fail_cleanly():
    async def main():
        short = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this"
        engine = ScriptedEngine([short], close_after=True)
        url = await engine.start()
        pool = UpstreamPool(total_timeout_s=0.3)
        try:
            reply = await post(pool, url)
            with pytest.raises(UPSTREAM_ERRORS):
                await reply.read_all()
            reply.release()
            silent = ScriptedEngine([])  # reads nothing, answers nothing
            silent_url = await silent.start()
            with pytest.raises(UpstreamError, match="deadline"):
                await post(pool, silent_url)
            await silent.stop()
            with pytest.raises(OSError):
                await post(pool, "http://127.0.0.1:1")
        finally:
            await pool.close()
            await engine.stop()

    run(main())
