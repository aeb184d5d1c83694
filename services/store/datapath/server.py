"""This node's raw TCP block-data port: peers pull its blocks, clients push puts.

`BlockDataServer` listens on the block-data port (framing in `protocol`). Each
connection gets a thread that reads a request, then sends every named block in order:
a DRAM block straight from its pinned pool buffer (handed to the kernel with
`sendmsg`, no copy in Python), an SSD block from a verified read (which promotes it,
as a gRPC Get does). A block this node lacks, or whose SSD copy is corrupt (dropped
and reported, as on every read), is answered with its error status instead.

A DRAM block is verified while it is sent, piece by piece (`SEND_PIECE_BYTES`): each
piece is hashed right before the kernel copies it, while it is cache-hot (a separate
pass first took ~15% of a block's send time; measured here, pieces cost about as much
CPU but ran a few % faster in paired runs). The header, with the
checksum recorded at store time, has gone out by then; a copy found corrupt reaches
the destination, which checks every block against that checksum and stores nothing
(DATA_LOSS), and is dropped here (reported, as on every read), so a retry gets the
SSD copy or NOT_FOUND.

A put (`protocol` PUT frames) is received straight into where it is stored: a DRAM
pool buffer, or for a durable or SSD put an SSD record buffer with its header's room
reserved (`TieredStore.put_filled`), checked against the checksum the client sent,
then acknowledged (a durable put after its SSD commit, which concurrent puts on other
connections share). Acks are written when the client has nothing more waiting on the
connection, or every `ACKS_PER_WRITE` puts (`_Acks`): a batch of puts sent back to back
gets its acks in a few writes, in order, instead of one write (a TLS record and a
syscall on each side) per block; a lone put is answered at once.

A client on this host may use the node's Unix socket instead (`local_socket`): the
same protocol without TLS, for a peer running as the store's own user (its socket
credentials are checked on accept; the socket file is the owner's only, in a directory
of the owner's only). An engine loading from its own node's DRAM is bound by TLS on the
TCP port: Python's TLS moved 0.45-0.72 GB/s on this 2-core machine's loopback, plain
sockets 2.6-3.4 GB/s, and a load's bytes are the engine's own cache coming back to it.

Threads, not the event loop: the bytes move in blocking `sendmsg` calls that release
the GIL, so a transfer costs the node's gRPC loop nothing. At most `max_connections`
connections are served at once; more are closed on accept. With TLS a connection takes
one of them only once authenticated (`gate.TlsGate`: its handshake done within
`handshake_timeout_s`, by a role in DATA_PORT_ROLES), so connections that never
handshake keep no peer out. Every receive and send has a deadline (`io_timeout_s` a
call, `sockets`); a connection that sends no first request within `handshake_timeout_s`,
or no next one for `idle_timeout_s`, is closed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import ssl
import stat
import struct
import threading
import time

from quillcache_core.errors import InvalidArgument, NotFound, QuillCacheError
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.security.access import DATA_PORT_ROLES
from quillcache_core.security.tls import Tls
from quillcache_core.storeclient.blockcodec import CorruptBlock, payload_checksum, payload_hasher
from quillcache_core.storeclient.datapath import protocol as dataproto
from quillcache_core.storeclient.datapath.sockets import (
    drain,
    recv_exactly,
    send_parts,
    tune_socket,
    wait_readable,
)
from quillcache_store.datapath.gate import TlsGate
from quillcache_store.tiers.tiered import TieredStore
from quillcache_store.timings import StoreTimings

log = logging.getLogger(__name__)

SEND_PIECE_BYTES = 512 * 1024


def linger_close(sock: socket.socket, *, max_s: float = 2.0, max_bytes: int = 1 << 30) -> None:
    """Stop sending, then read and discard the peer's data until it closes, `max_s`
    pass or `max_bytes` arrive: what was sent last reaches the peer intact."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        tune_socket(sock, 0.2)
        scratch = memoryview(bytearray(1 << 20))
        deadline = time.monotonic() + max_s
        seen = 0
        while seen < max_bytes and time.monotonic() < deadline:
            n = sock.recv_into(scratch)
            if n == 0:
                return
            seen += n


def send_verified(sock: socket.socket, header: bytes, view: memoryview, checksum: int) -> bool:
    """Send `header` then `view`, hashing each piece just before it is sent; returns
    whether the payload matched `checksum` (everything is sent either way)."""
    hasher = payload_hasher()
    total = view.nbytes
    parts = [header]
    for offset in range(0, total, SEND_PIECE_BYTES):
        piece = view[offset : offset + SEND_PIECE_BYTES]
        hasher.update(piece)
        parts.append(piece)
        send_parts(sock, parts)
        parts = []
    if parts:
        send_parts(sock, parts)
    return hasher.intdigest() == checksum


ACKS_PER_WRITE = 64  # puts answered by one write at most (an ack is 28 bytes)


class _Acks:
    """One connection's put acks not yet written, in order (see the module docstring)."""

    __slots__ = ("_conn", "_queued", "_poll", "_written")

    def __init__(self, conn: socket.socket, written) -> None:
        self._conn = conn
        self._queued: list[bytes] = []
        self._poll = select.poll()
        self._poll.register(conn, select.POLLIN)
        self._written = written  # called with the acks of each write

    def add(self, ack: bytes) -> None:
        self._queued.append(ack)

    def flush_unless_more(self) -> None:
        """Write the queued acks, unless the client has already sent more (bytes TLS
        has decrypted, or bytes waiting on the socket) and fewer than ACKS_PER_WRITE
        are queued: the next request is read first."""
        if len(self._queued) < ACKS_PER_WRITE and (
            (isinstance(self._conn, ssl.SSLSocket) and self._conn.pending()) or self._poll.poll(0)
        ):
            return
        self.flush()

    def flush(self) -> None:
        if self._queued:
            queued, self._queued = self._queued, []
            send_parts(self._conn, queued)
            self._written(len(queued))


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
        handshake_timeout_s: float = 5.0,
        idle_timeout_s: float = 300.0,
        max_pending_handshakes: int = 256,
        max_block_bytes: int = 256 * 1024 * 1024,
        tls: Tls | None = None,
        local_socket: str = "",
        timings: StoreTimings | None = None,
    ) -> None:
        self.tiered = tiered
        self.timings = timings  # each block's get and put time (None: not timed)
        self.local_socket = local_socket  # a Unix socket's path ("" = none)
        self.max_block_bytes = max_block_bytes
        # With TLS a peer shows a certificate of a role in DATA_PORT_ROLES first.
        self._ssl = tls.server_context() if tls else None
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.io_timeout_s = io_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_pending_handshakes = max_pending_handshakes
        self._listener: socket.socket | None = None
        self._local_listener: socket.socket | None = None
        self._accepters: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._stopping = False
        self.blocks_sent = 0
        self.bytes_sent = 0
        self.blocks_refused = 0
        self.connections_accepted = 0
        self.connections_rejected = 0
        self.blocks_received = 0
        self.bytes_received = 0
        self.puts_refused = 0
        self.connections_refused = 0
        self.local_connections = 0
        self.acks_sent = 0
        self.ack_writes = 0

    def start(self) -> int:
        listener = socket.create_server((self.host, self.port), backlog=128, reuse_port=False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accept_on(listener, local=False)
        log.info("block data port listening on %s:%d", self.host, self.port)
        if self.local_socket:
            try:
                self._local_listener = _unix_listener(self.local_socket)
            except OSError as exc:  # clients on this host use the TCP port instead
                log.warning("no block data socket at %s: %s", self.local_socket, exc)
                self.local_socket = ""
            else:
                self._accept_on(self._local_listener, local=True)
                log.info("block data socket listening on %s", self.local_socket)
        return self.port

    def _accept_on(self, listener: socket.socket, *, local: bool) -> None:
        if self._ssl is not None and not local:
            gate = TlsGate(
                self._ssl,
                roles=DATA_PORT_ROLES,
                handshake_timeout_s=self.handshake_timeout_s,
                max_pending=self.max_pending_handshakes,
                admit=lambda conn, peer: self._admit(conn, peer, local=False),
                refused=self._count_refused,
                stopping=lambda: self._stopping,
            )
            target, args = gate.run, (listener,)
        else:
            target, args = self._accept_loop, (listener, local)
        thread = threading.Thread(target=target, args=args, name="store-data-accept", daemon=True)
        self._accepters.append(thread)
        thread.start()

    def stop(self) -> None:
        """Close the listeners and every connection (a transfer in flight fails cleanly)."""
        with self._lock:
            self._stopping = True
            conns = list(self._conns)
        for listener in (self._listener, self._local_listener):
            if listener is not None:
                with contextlib.suppress(OSError):
                    listener.shutdown(socket.SHUT_RDWR)
                listener.close()
        if self._local_listener is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.local_socket)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in self._accepters:
            thread.join(timeout=5)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "blocks_sent": self.blocks_sent,
                "bytes_sent": self.bytes_sent,
                "blocks_refused": self.blocks_refused,
                "connections_open": len(self._conns),
                "connections_accepted": self.connections_accepted,
                "connections_rejected": self.connections_rejected,
                "blocks_received": self.blocks_received,
                "bytes_received": self.bytes_received,
                "puts_refused": self.puts_refused,
                "connections_refused": self.connections_refused,
                "local_connections": self.local_connections,
                "acks_sent": self.acks_sent,
                "ack_writes": self.ack_writes,
            }

    # --- connections ------------------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket, local: bool) -> None:
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                if self._stopping:
                    return
                log.exception("block data accept failed")
                continue
            if local and not _same_user(conn):
                self._count_refused()
                log.warning("block data socket: refused a peer of another user")
                conn.close()
                continue
            self._admit(conn, peer or "local", local=local)

    def _admit(self, conn: socket.socket, peer, *, local: bool) -> None:
        """Serve an accepted (and, with TLS, authenticated) connection on its own thread
        if a slot is free; close it otherwise."""
        with self._lock:
            if self._stopping or len(self._conns) >= self.max_connections:
                self.connections_rejected += 1
                conn.close()
                return
            self._conns.add(conn)
            self.connections_accepted += 1
            self.local_connections += local
        threading.Thread(
            target=self._serve, args=(conn, peer), name="store-data-conn", daemon=True
        ).start()

    def _count_refused(self) -> None:
        with self._lock:
            self.connections_refused += 1

    def _serve(self, conn: socket.socket, peer) -> None:
        acks = None
        try:
            tune_socket(conn, self.io_timeout_s)
            acks = _Acks(conn, self._count_acks)
            header = memoryview(bytearray(dataproto.REQUEST_HEADER.size))
            # A client connects when it has a request: one that sends none soon (in the
            # clear, it may be anyone) gives its slot back.
            wait_s = self.handshake_timeout_s
            while True:
                if not wait_readable(conn, wait_s):
                    return  # idle too long: the client reconnects when it needs to
                wait_s = self.idle_timeout_s
                got = recv_exactly(conn, header)
                if got == 0:
                    return  # the peer closed between requests
                if got < header.nbytes:
                    raise ConnectionError("connection closed inside a request header")
                kind, flags, length = dataproto.decode_frame_header(header)
                if kind == dataproto.PUT_MAGIC:
                    self._receive_put(conn, flags, length, acks)
                    acks.flush_unless_more()
                    continue
                acks.flush()  # a get is answered after the puts before it
                body = memoryview(bytearray(length))
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
            if acks is not None:  # what was stored is still acknowledged, if it can be
                with contextlib.suppress(OSError):
                    acks.flush()
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _send_block(self, conn: socket.socket, key: KvBlockKey) -> None:
        started = time.perf_counter()
        pinned = self.tiered.dram.pin(key)
        if pinned is not None:
            try:
                nbytes = pinned.payload.nbytes
                header = dataproto.encode_block_header(CacheTier.CPU_DRAM, nbytes, pinned.checksum)
                intact = send_verified(conn, header, pinned.payload, pinned.checksum)
            finally:
                pinned.release()
            if intact:
                self._count_sent(nbytes)
                if self.timings is not None:
                    self.timings.got(started, CacheTier.CPU_DRAM)
                return
            # Sent, and refused by the destination's check. TieredStore.get re-reads
            # it, drops the corrupt copy and reports it (promoting an SSD copy if any).
            log.warning("DRAM copy of %s failed its checksum while sent", key.block_hash)
            with contextlib.suppress(QuillCacheError):
                self.tiered.get(key)
            return
        try:
            payload, tier = self.tiered.get(key)
        except QuillCacheError as exc:
            status = dataproto.status_of(exc)
            if not isinstance(exc, NotFound):
                log.info("block %s not sent: %s", key.block_hash, exc)
            with self._lock:
                self.blocks_refused += 1
            send_parts(conn, [dataproto.encode_block_error(status, str(exc))])
            if self.timings is not None and isinstance(exc, NotFound):
                self.timings.got(started, None)
            return
        view = memoryview(payload)
        header = dataproto.encode_block_header(tier, view.nbytes, payload_checksum(view))
        send_parts(conn, [header, view])
        self._count_sent(view.nbytes)
        if self.timings is not None:
            self.timings.got(started, tier)

    def _receive_put(self, conn: socket.socket, flags: int, identity_len: int, acks) -> None:
        """One put: its header rest, identity and payload, stored, then its ack queued
        on `acks`. Raises (dropping the connection) when the stream cannot be followed."""
        fixed = memoryview(bytearray(dataproto.PUT_FIXED.size + identity_len))
        if recv_exactly(conn, fixed) < fixed.nbytes:
            raise ConnectionError("connection closed inside a put header")
        try:
            put = dataproto.decode_put_fixed(
                flags, identity_len, fixed[: dataproto.PUT_FIXED.size], self.max_block_bytes
            )
            key = dataproto.decode_put_identity(fixed[dataproto.PUT_FIXED.size :])
        except InvalidArgument as exc:
            # The payload's length cannot be trusted: answer, then drop the connection,
            # reading what the client still sends for a moment first (closing with
            # unread bytes resets the connection, which can discard the answer).
            self._refuse_put(acks, exc)
            acks.flush()
            linger_close(conn)
            raise
        n, checksum = put.payload_len, put.checksum
        filled = False
        started = time.perf_counter()

        def fill(view: memoryview) -> None:
            nonlocal filled
            filled = True
            if recv_exactly(conn, view) < n:
                raise ConnectionError(f"connection closed inside the payload of a put of {n}")
            actual = payload_checksum(view)
            if actual != checksum:
                raise CorruptBlock(
                    f"put of block {key.block_hash} arrived with checksum {actual:016x}, "
                    f"the client sent {checksum:016x}; not stored",
                    key,
                    n,
                )

        try:
            landed = self.tiered.put_filled(
                key, n, checksum, fill, durable=put.durable, tier=put.tier
            )
        except (OSError, ConnectionError):
            raise
        except Exception as exc:
            if not filled:
                drain(conn, n)  # keep the stream in step for the next put
            if not isinstance(exc, QuillCacheError):
                log.exception("put of %s failed", key.block_hash)
            self._refuse_put(acks, exc)
            return
        with self._lock:
            self.blocks_received += 1
            self.bytes_received += n
        if self.timings is not None:
            self.timings.put(started, landed)
        acks.add(dataproto.encode_ack(landed, n, checksum))

    def _refuse_put(self, acks: _Acks, exc: BaseException) -> None:
        with self._lock:
            self.puts_refused += 1
        log.debug("put refused: %s", exc)
        acks.add(dataproto.encode_ack_error(dataproto.status_of(exc), str(exc)))

    def _count_acks(self, acks: int) -> None:
        with self._lock:
            self.acks_sent += acks
            self.ack_writes += 1

    def _count_sent(self, nbytes: int) -> None:
        with self._lock:
            self.blocks_sent += 1
            self.bytes_sent += nbytes


def _unix_listener(path: str) -> socket.socket:
    """A Unix socket listening at `path`, readable and writable by its owner only (a
    stale socket there, from a node that died, is replaced; any other file is not).
    Not by the umask, which is the whole process's and would race its other threads:
    connecting takes write permission, which under the usual umask (022) only the
    owner has from the bind to the chmod, and an `auto` socket's directory is the
    owner's alone anyway."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        os.chmod(path, 0o600)
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    return listener


_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def _same_user(conn: socket.socket) -> bool:
    """Whether the process at the other end of a Unix connection runs as this one's user."""
    try:
        _pid, uid, _gid = _PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
    except OSError:
        return False
    return uid == os.getuid()
