"""The source side of the block data path: this node's blocks on a raw TCP port.

`BlockDataServer` listens on the block-data port (framing in `dataproto`). Each
connection gets a thread that reads a request, then sends every named block in order:
a DRAM block straight from its pinned pool buffer (verified, then handed to the
kernel with `sendmsg`, no copy in Python), an SSD block from a verified read (which
promotes it, as a gRPC Get does). A block this node lacks, or whose copy is corrupt
(dropped and reported, as on every read), is answered with its error status instead.

Threads, not the event loop: the bytes move in blocking `sendmsg` calls that release
the GIL, so a transfer costs the node's gRPC loop nothing. At most `max_connections`
connections are served at once; more are closed on accept.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

from quillcache_core.errors import NotFound, QuillCacheError
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_store import dataproto
from quillcache_store.blockcodec import payload_checksum
from quillcache_store.tiers import TieredStore

log = logging.getLogger(__name__)


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay after a block header. Buffer sizes stay the kernel's: setting
    SO_SNDBUF/SO_RCVBUF turns off TCP's autotuning, which measured no faster here."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def recv_exactly(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` from `sock`; returns the bytes received (short only at end of stream)."""
    got = 0
    total = view.nbytes
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            break
        got += n
    return got


def send_parts(sock: socket.socket, parts: list) -> None:
    """Send the buffers in order with as few syscalls as possible (no joining copy)."""
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    while views:
        sent = sock.sendmsg(views)
        while sent:
            head = views[0]
            if sent >= head.nbytes:
                sent -= head.nbytes
                views.pop(0)
            else:
                views[0] = head[sent:]
                sent = 0


class BlockDataServer:
    """Serves this node's blocks on a raw TCP port. `start()` returns the port."""

    def __init__(
        self,
        tiered: TieredStore,
        host: str,
        port: int,
        *,
        max_connections: int = 64,
        io_timeout_s: float = 30.0,
    ) -> None:
        self.tiered = tiered
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.io_timeout_s = io_timeout_s
        self._listener: socket.socket | None = None
        self._accepter: threading.Thread | None = None
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._stopping = False
        self.blocks_sent = 0
        self.bytes_sent = 0
        self.blocks_refused = 0
        self.connections_accepted = 0
        self.connections_rejected = 0

    def start(self) -> int:
        listener = socket.create_server((self.host, self.port), backlog=128, reuse_port=False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accepter = threading.Thread(
            target=self._accept_loop, name="store-data-accept", daemon=True
        )
        self._accepter.start()
        log.info("block data port listening on %s:%d", self.host, self.port)
        return self.port

    def stop(self) -> None:
        """Close the listener and every connection (a transfer in flight fails cleanly)."""
        with self._lock:
            self._stopping = True
            conns = list(self._conns)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._accepter is not None:
            self._accepter.join(timeout=5)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "blocks_sent": self.blocks_sent,
                "bytes_sent": self.bytes_sent,
                "blocks_refused": self.blocks_refused,
                "connections_open": len(self._conns),
                "connections_accepted": self.connections_accepted,
                "connections_rejected": self.connections_rejected,
            }

    # --- connections ------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        listener = self._listener
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                if self._stopping:
                    return
                log.exception("block data accept failed")
                continue
            with self._lock:
                if self._stopping or len(self._conns) >= self.max_connections:
                    self.connections_rejected += 1
                    conn.close()
                    continue
                self._conns.add(conn)
                self.connections_accepted += 1
            threading.Thread(
                target=self._serve, args=(conn, peer), name="store-data-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        try:
            tune_socket(conn)
            conn.settimeout(self.io_timeout_s)
            header = memoryview(bytearray(dataproto.REQUEST_HEADER.size))
            while True:
                got = recv_exactly(conn, header)
                if got == 0:
                    return  # the peer closed between requests
                if got < header.nbytes:
                    raise ConnectionError("connection closed inside a request header")
                body = memoryview(bytearray(dataproto.decode_request_header(header)))
                if recv_exactly(conn, body) < body.nbytes:
                    raise ConnectionError("connection closed inside a request body")
                keys = dataproto.decode_request_body(body)
                for key in keys:
                    self._send_block(conn, key)
        except (OSError, ConnectionError, QuillCacheError) as exc:
            # A peer that went away, timed out or spoke something else: drop it.
            log.debug("block data connection from %s ended: %s", peer, exc)
        except Exception:
            log.exception("block data connection from %s failed", peer)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _send_block(self, conn: socket.socket, key: KvBlockKey) -> None:
        pinned = self.tiered.dram.pin(key)
        if pinned is not None:
            try:
                if payload_checksum(pinned.payload) == pinned.checksum:
                    view = pinned.payload
                    header = dataproto.encode_block_header(
                        CacheTier.CPU_DRAM, view.nbytes, pinned.checksum
                    )
                    send_parts(conn, [header, view])
                    self._count_sent(view.nbytes)
                    return
            finally:
                pinned.release()
            # TieredStore.get re-reads it, drops the corrupt copy, reports it and falls
            # through to the SSD copy if there is one.
            log.warning("DRAM copy of %s failed its checksum", key.block_hash)
        try:
            payload, tier = self.tiered.get(key)
        except QuillCacheError as exc:
            status = dataproto.status_of(exc)
            if not isinstance(exc, NotFound):
                log.info("block %s not sent: %s", key.block_hash, exc)
            with self._lock:
                self.blocks_refused += 1
            conn.sendall(dataproto.encode_block_error(status, str(exc)))
            return
        view = memoryview(payload)
        header = dataproto.encode_block_header(tier, view.nbytes, payload_checksum(view))
        send_parts(conn, [header, view])
        self._count_sent(view.nbytes)

    def _count_sent(self, nbytes: int) -> None:
        with self._lock:
            self.blocks_sent += 1
            self.bytes_sent += nbytes
