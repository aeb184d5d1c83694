"""The TLS gate of the block-data port: a new connection is authenticated before it may
take one of the port's connection slots.

`TlsGate.run(listener)` accepts connections and completes their TLS handshakes on its
one thread, without blocking on any of them (non-blocking sockets and a selector):
each must finish its handshake within `handshake_timeout_s`, with a certificate of an
allowed role, or it is closed and counted as refused. At most `max_pending` handshakes
are under way at once; a new connection past that closes the oldest one, so idle or
slow connections cannot keep an allowed peer out, nor cost a thread each. A connection
that passes is handed, blocking again, to `admit`.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

from quillcache_core.security.tls import role_of_cert

log = logging.getLogger(__name__)

_WAKE_S = 0.5  # longest the loop sleeps, so it notices `stopping`
_ACCEPT_BACKOFF_S = 0.05


@dataclass(slots=True)
class _Pending:
    peer: object
    deadline: float


class TlsGate:
    """See the module docstring. Not thread-safe: one thread calls `run`."""

    def __init__(
        self,
        context: ssl.SSLContext,
        *,
        roles: frozenset[str],
        handshake_timeout_s: float,
        max_pending: int,
        admit: Callable[[ssl.SSLSocket, object], None],
        refused: Callable[[], None],
        stopping: Callable[[], bool],
    ) -> None:
        self._context = context
        self._roles = roles
        self.handshake_timeout_s = handshake_timeout_s
        self.max_pending = max_pending
        self._admit = admit
        self._refused = refused
        self._stopping = stopping
        self._selector = selectors.DefaultSelector()
        self._pending: dict[ssl.SSLSocket, _Pending] = {}  # oldest first

    def run(self, listener: socket.socket) -> None:
        """Accept and authenticate connections on `listener` until `stopping()`."""
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)
        try:
            while not self._stopping():
                for key, _events in self._selector.select(self._wait_s()):
                    if key.fileobj is listener:
                        self._accept(listener)
                    else:
                        self._step(key.fileobj)
                self._expire()
        finally:
            for conn in list(self._pending):
                self._drop(conn)
            self._selector.close()

    def _wait_s(self) -> float:
        if not self._pending:
            return _WAKE_S
        oldest = next(iter(self._pending.values()))
        return min(_WAKE_S, max(0.0, oldest.deadline - time.monotonic()))

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, peer = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if self._stopping():
                return
            # Out of descriptors, most likely: free the oldest handshake's and back off
            # a moment rather than spin on a listener that stays readable.
            log.warning("block data accept failed: %s", exc)
            if self._pending:
                self._refuse(next(iter(self._pending)))
            time.sleep(_ACCEPT_BACKOFF_S)
            return
        conn.setblocking(False)
        try:
            secured = self._context.wrap_socket(
                conn, server_side=True, do_handshake_on_connect=False
            )
        except (OSError, ValueError) as exc:
            log.debug("block data port: TLS with %s failed: %s", peer, exc)
            conn.close()
            self._refused()
            return
        if len(self._pending) >= self.max_pending:
            self._refuse(next(iter(self._pending)))
        deadline = time.monotonic() + self.handshake_timeout_s
        self._pending[secured] = _Pending(peer, deadline)
        self._selector.register(secured, selectors.EVENT_READ)
        self._step(secured)  # the ClientHello is usually there already

    def _step(self, conn: ssl.SSLSocket) -> None:
        pending = self._pending.get(conn)
        if pending is None:  # closed earlier in the same round of events
            return
        try:
            conn.do_handshake()
        except ssl.SSLWantReadError:
            self._selector.modify(conn, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._selector.modify(conn, selectors.EVENT_WRITE)
            return
        except (OSError, ValueError) as exc:
            log.debug("block data port: TLS handshake with %s failed: %s", pending.peer, exc)
            self._refuse(conn)
            return
        role = role_of_cert(conn.getpeercert())
        if role not in self._roles:
            log.warning("block data port: refused %s (role %s)", pending.peer, role)
            self._refuse(conn)
            return
        self._selector.unregister(conn)
        del self._pending[conn]
        conn.setblocking(True)
        self._admit(conn, pending.peer)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            conn, pending = next(iter(self._pending.items()))
            if pending.deadline > now:
                return
            log.debug(
                "block data port: %s did not finish its TLS handshake within %gs",
                pending.peer,
                self.handshake_timeout_s,
            )
            self._refuse(conn)

    def _refuse(self, conn: ssl.SSLSocket) -> None:
        self._drop(conn)
        self._refused()

    def _drop(self, conn: ssl.SSLSocket) -> None:
        del self._pending[conn]
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()
