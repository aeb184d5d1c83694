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


async def _engine(parts: list[bytes], pause_s: float, hang_up: bool = False):
    async def serve(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause_s)
        if not hang_up:  # else the engine closes once it has sent its parts
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


# --- relay: each arrival handed on from the connection's callback ----------------------


async def _relayed(
    parts: list[bytes], pause_s: float = 0.0, stop_after: int | None = None, hang_up=False
):
    server, url = await _engine(parts, pause_s, hang_up)
    pool = UpstreamPool()
    pieces: list[bytes] = []

    def sink(piece: bytes) -> bool:
        pieces.append(piece)
        return stop_after is None or len(pieces) < stop_after

    try:
        reply = await pool.post(url, "/v1/completions", b"{}", b"")
        try:
            await reply.relay(sink, lambda: 0)
            reusable = reply._done and reply._keep_alive
        finally:
            reply.release()
        return pieces, reusable, pool.idle_connections()
    finally:
        await pool.close()
        server.close()


def test_a_relay_hands_on_one_piece_per_arrival_and_keeps_the_connection():
    parts = [HEAD] + [b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS] + [b"0\r\n\r\n"]
    pieces, reusable, idle = asyncio.run(_relayed(parts, pause_s=0.01))
    assert pieces == EVENTS
    assert reusable and idle == 1


def test_a_relay_takes_what_came_with_the_head_and_chunks_split_anywhere():
    pieces, _, _ = asyncio.run(_relayed([HEAD + BODY]))
    assert pieces == [b"".join(EVENTS)]
    for cut in (1, 3, 9, len(BODY) - 1):
        pieces, reusable, _ = asyncio.run(_relayed([HEAD + BODY[:cut], BODY[cut:]], 0.01))
        assert b"".join(pieces) == b"".join(EVENTS), cut
        assert reusable, cut


def test_a_relay_stopped_by_its_sink_drops_the_connection():
    parts = [HEAD] + [b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS] + [b"0\r\n\r\n"]
    pieces, reusable, idle = asyncio.run(_relayed(parts, pause_s=0.01, stop_after=2))
    assert pieces == EVENTS[:2]
    assert not reusable and idle == 0


def test_a_relay_of_a_body_cut_short_or_malformed_fails():
    with pytest.raises(asyncio.IncompleteReadError):
        asyncio.run(_relayed([HEAD + BODY[:20]], hang_up=True))  # closed mid-body
    with pytest.raises(UpstreamError):
        asyncio.run(_relayed([HEAD + b"zz\r\nabc\r\n0\r\n\r\n"]))


def test_a_relay_pauses_the_engine_while_its_destination_is_backed_up():
    """A client that reads slowly holds the engine back: the gateway does not buffer a
    whole long answer for it."""
    from quillcache_gateway.upstream import RELAY_HIGH

    piece = b"data: " + b"x" * 16_000 + b"\n\n"
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
    count = 800  # about 12.8 MB: far more than the socket buffers hold

    async def scenario():
        sent = 0

        async def serve(reader, writer):
            nonlocal sent
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            writer.write(HEAD)
            for _ in range(count):
                writer.write(chunk)
                await writer.drain()
                sent += 1
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            await reader.read()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = UpstreamPool()
        got = bytearray()
        backed_up = True
        try:
            reply = await pool.post(url, "/v1/completions", b"{}", b"")
            relay = asyncio.ensure_future(
                reply.relay(got.extend, lambda: RELAY_HIGH * 4 if backed_up else 0)
            )
            await asyncio.sleep(0.5)
            held = sent
            assert held < count // 2, "the engine kept sending into a backed-up relay"
            assert len(got) < RELAY_HIGH + 2 * 1024 * 1024
            backed_up = False
            await asyncio.wait_for(relay, 10)
            reply.release()
            assert bytes(got) == piece * count
        finally:
            await pool.close()
            server.close()

    asyncio.run(scenario())
