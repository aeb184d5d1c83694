"""Idle connections to stores' block-data ports, kept per address and reused.

Shared by the puller (peer fetch) and the pusher (puts): a few idle sockets per
address, handed out one caller at a time; `take` says whether the socket was reused,
so a caller can replace, once, a reused one that turns out to have been closed by a
store that restarted. Thread-safe.

An address is a data port's `host:port` (TLS when the connections have certificates)
or `unix:PATH`, a node's Unix socket on this host (no TLS: the node checks that the
client runs as its own user).
"""

from __future__ import annotations

import socket
import threading

from quillcache_core.errors import InvalidArgument, NodeUnavailable
from quillcache_core.security.tls import Tls
from quillcache_core.storeclient.datapath.sockets import tune_socket

UNIX_PREFIX = "unix:"  # an address naming a node's Unix socket, not a host:port


class DataConnections:
    def __init__(
        self,
        *,
        idle_per_address: int,
        io_timeout_s: float,
        connect_timeout_s: float,
        tls: Tls | None = None,
    ) -> None:
        self._ssl = tls.client_context() if tls else None
        self.idle_per_address = idle_per_address
        self.io_timeout_s = io_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._idle: dict[str, list[socket.socket]] = {}
        self._closed = False

    def connect(self, address: str) -> socket.socket:
        if address.startswith(UNIX_PREFIX):
            return self._connect_unix(address[len(UNIX_PREFIX) :])
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"data address {address!r} is not host:port")
        try:
            sock = socket.create_connection(
                (host.strip("[]"), int(port)), timeout=self.connect_timeout_s
            )
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock)
        except OSError as exc:
            raise NodeUnavailable(f"cannot connect to data port {address}: {exc}") from None
        tune_socket(sock, self.io_timeout_s)
        return sock

    def _connect_unix(self, path: str) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.connect_timeout_s)
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise NodeUnavailable(f"cannot connect to data socket {path}: {exc}") from None
        tune_socket(sock, self.io_timeout_s)
        return sock

    def take(self, address: str) -> tuple[socket.socket, bool]:
        """A connection to `address` and whether it was an idle one (reused)."""
        with self._lock:
            if self._closed:
                raise NodeUnavailable("the data connections are closed")
            idle = self._idle.get(address)
            if idle:
                return idle.pop(), True
        return self.connect(address), False

    def give_back(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if not self._closed and len(idle) < self.idle_per_address:
                idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        for sock in socks:
            sock.close()
