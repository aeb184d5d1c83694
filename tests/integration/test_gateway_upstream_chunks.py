"""The gateway's chunked-body reader: whole chunks that arrived together come out as one
piece; a chunk split over several reads, or a size line split, is waited for."""

from __future__ import annotations

import asyncio

import pytest

from quillcache_gateway.upstream import UpstreamError, UpstreamPool

pytestmark = pytest.mark.integration

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [f"data: {i}\n\n".encode() for i in range(5)] + [b"data: [DONE]\n\n"]
BODY = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS) + b"0\r\n\r\n"


async def _engine(parts: list[bytes], pause_s: float):
    async def serve(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause_s)
        await reader.read()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _pieces(parts: list[bytes], pause_s: float = 0.0) -> tuple[list[bytes], bool]:
    server, url = await _engine(parts, pause_s)
    pool = UpstreamPool()
    try:
        reply = await pool.post(url, "/v1/completions", b"{}", b"")
        pieces = []
        while piece := await reply.read():
            pieces.append(piece)
        done = reply._done and reply._keep_alive
        reply.release()
        return pieces, done
    finally:
        await pool.close()
        server.close()


def test_chunks_that_arrived_together_are_one_piece():
    pieces, reusable = asyncio.run(_pieces([HEAD + BODY]))
    assert pieces == [b"".join(EVENTS)]
    assert reusable


def test_a_chunk_split_anywhere_over_reads_is_waited_for():
    raw = BODY
    for cut in (1, 2, 3, 5, 9, len(raw) - 3, len(raw) - 1):
        parts = [HEAD + raw[:cut], raw[cut:]]
        pieces, reusable = asyncio.run(_pieces(parts, pause_s=0.01))
        assert b"".join(pieces) == b"".join(EVENTS), cut
        assert reusable, cut


def test_one_piece_per_arrival_when_events_come_apart():
    parts = [HEAD] + [b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS] + [b"0\r\n\r\n"]
    pieces, _ = asyncio.run(_pieces(parts, pause_s=0.01))
    assert pieces == EVENTS


def test_malformed_chunks_fail():
    for bad in (b"zz\r\nabc\r\n0\r\n\r\n", b"3\r\nabcXX0\r\n\r\n", b"-3\r\nabc\r\n0\r\n\r\n"):
        with pytest.raises(UpstreamError):
            asyncio.run(_pieces([HEAD + bad]))


def test_bytes_after_the_last_chunk_make_the_connection_not_reusable():
    pieces, reusable = asyncio.run(_pieces([HEAD + BODY + b"junk"]))
    assert b"".join(pieces) == b"".join(EVENTS)
    assert not reusable
