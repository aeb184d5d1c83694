"""What the store's figures are measured against: raw loopback TCP, raw fsync'd
writes and a bare gRPC bytes stream, with no QuillCache code on the path.

These are not QuillCache processes and stay plaintext: a store figure
(mutual TLS) against them includes the cost of TLS. `raw_tcp(..., tls=...)` gives the
same stream over TLS with the cluster's certificates, to show that cost on its own.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from quillcache_core.process.malloc import tune_malloc_for_large_values

if TYPE_CHECKING:
    from quillcache_core.security.tls import Tls

MIB = 1024 * 1024


# --- baselines ------------------------------------------------------------------------------


def distinct_buffers(blocks: int, block_bytes: int) -> tuple[list[bytes], list[memoryview]]:
    """`blocks` different source payloads and as many receive buffers, every page touched."""
    rng = np.random.default_rng(5)
    sources = [rng.bytes(block_bytes) for _ in range(blocks)]
    sinks = [memoryview(bytearray(block_bytes)) for _ in range(blocks)]
    for sink in sinks:
        sink[:] = sources[0]
    return sources, sinks


def raw_tcp(
    blocks: int,
    block_bytes: int,
    buffers: tuple[list[bytes], list[memoryview]] | None = None,
    tls: Tls | None = None,
) -> float:
    """Seconds to stream `blocks` blocks over loopback TCP (sender and receiver threads).

    By default one cache-hot buffer is sent again and again into one receive buffer;
    with `buffers` (`distinct_buffers`) block i goes from source i to sink i, as a pool's
    blocks do. With `tls` the stream is mutual TLS with those certificates on both ends
    (blocking ssl sockets, as the store's block-data connections are); the handshake is
    not timed."""
    blob = np.random.default_rng(1).bytes(block_bytes)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    if tls is not None:
        server = tls.server_context().wrap_socket(server, server_side=True)
    done = threading.Event()

    def receive() -> None:
        conn, _ = server.accept()
        own = memoryview(bytearray(block_bytes))
        with conn:
            for i in range(blocks):
                buf = buffers[1][i % len(buffers[1])] if buffers else own
                got = 0
                while got < block_bytes:
                    n = conn.recv_into(buf[got:], block_bytes - got)
                    if n == 0:
                        raise ConnectionError("sender closed early")
                    got += n
        done.set()

    receiver = threading.Thread(target=receive)
    receiver.start()
    sock = socket.create_connection(("127.0.0.1", port))
    if tls is not None:
        sock = tls.client_context().wrap_socket(sock)  # takes over the socket
    with sock:
        start = time.perf_counter()
        for i in range(blocks):
            sock.sendall(buffers[0][i % len(buffers[0])] if buffers else blob)
        receiver.join()
        elapsed = time.perf_counter() - start
    server.close()
    return elapsed


def raw_fsync_write(path: Path, blocks: int, block_bytes: int) -> float:
    """Seconds to write `blocks` blocks sequentially to a new file at `path` and
    fdatasync them (one sync). The file is left in place: see `store_figures`."""
    blob = np.random.default_rng(2).bytes(block_bytes)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        start = time.perf_counter()
        for _ in range(blocks):
            os.write(fd, blob)
        os.fdatasync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)


_BARE = "bench.Bare"


def bare_grpc_server(port_queue, block_bytes: int, chunk_bytes: int) -> None:
    """Child process: a gRPC server streaming pre-built raw bytes (no protobuf, no store)."""
    import grpc
    import grpc.aio

    tune_malloc_for_large_values()
    chunks = [
        np.random.default_rng(3).bytes(block_bytes)[o : o + chunk_bytes]
        for o in range(0, block_bytes, chunk_bytes)
    ]

    async def down(request: bytes, context):
        for _ in range(int.from_bytes(request, "little")):
            for chunk in chunks:
                yield chunk

    async def up(request_iterator, context):
        total = 0
        async for message in request_iterator:
            total += len(message)
        return total.to_bytes(8, "little")

    async def serve() -> None:
        from quillcache_core.storeclient.client import CHANNEL_OPTIONS

        server = grpc.aio.server(options=CHANNEL_OPTIONS)
        handlers = {
            "Down": grpc.unary_stream_rpc_method_handler(down),
            "Up": grpc.stream_unary_rpc_method_handler(up),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_BARE, handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_queue.put(port)
        await server.wait_for_termination()

    asyncio.run(serve())


async def bare_grpc(address: str, blocks: int, block_bytes: int, chunk_bytes: int, clients: int):
    """(one-call stream s, per-block down s, per-block up s) against the bare server."""
    import grpc.aio

    from quillcache_core.storeclient.client import CHANNEL_OPTIONS

    channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(clients)]
    downs = [c.unary_stream(f"/{_BARE}/Down") for c in channels]
    ups = [c.stream_unary(f"/{_BARE}/Up") for c in channels]
    blob = np.random.default_rng(4).bytes(block_bytes)
    pieces = [blob[o : o + chunk_bytes] for o in range(0, block_bytes, chunk_bytes)]
    for down in downs:  # connect and warm up
        async for _ in down((1).to_bytes(8, "little")):
            pass

    start = time.perf_counter()
    async for _ in downs[0](blocks.to_bytes(8, "little")):
        pass
    stream_s = time.perf_counter() - start

    async def per_block_down(c: int) -> None:
        for _ in range(c, blocks, clients):
            async for _ in downs[c]((1).to_bytes(8, "little")):
                pass

    async def per_block_up(c: int) -> None:
        for _ in range(c, blocks, clients):
            call = ups[c]()
            for piece in pieces:
                await call.write(piece)
            await call.done_writing()
            await call

    start = time.perf_counter()
    await asyncio.gather(*(per_block_down(c) for c in range(clients)))
    down_s = time.perf_counter() - start
    start = time.perf_counter()
    await asyncio.gather(*(per_block_up(c) for c in range(clients)))
    up_s = time.perf_counter() - start
    for channel in channels:
        await channel.close()
    return stream_s, down_s, up_s
