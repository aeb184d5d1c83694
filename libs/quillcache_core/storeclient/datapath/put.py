"""Put blocks through a store node's block-data port (raw TCP, framing in `dataproto`).

`BlockPusher.put(address, key, payload, ...)` sends one PUT frame (header, identity,
payload handed to the kernel with `sendmsg`, no copy in Python) and waits for its ack:
the tier the block landed in, or the store's error as a domain exception (NotFound,
Corrupt, CapacityExceeded, InvalidArgument...). A durable put is acknowledged after
the store's SSD commit, so concurrent puts (one connection each) share commits.

Not retried (a put is not idempotent under eviction). A connection that fails before
any of the ack arrived is reported as NodeUnavailable; whether the block was stored is
then unknown. Idle connections are kept per address (a few) and reused; a reused one
that turns out closed before anything was sent is replaced once (the store may have
restarted).

Blocking: call from a worker thread (`StoreClient` does). Thread-safe.
"""

from __future__ import annotations

from quillcache_core.errors import NodeUnavailable
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.security.tls import Tls
from quillcache_core.storeclient.blockcodec import payload_checksum
from quillcache_core.storeclient.datapath import protocol as dataproto
from quillcache_core.storeclient.datapath.conn import DataConnections
from quillcache_core.storeclient.datapath.sockets import is_timeout, recv_exactly, send_parts

_IDLE_PER_ADDRESS = 8


class BlockPusher:
    """Puts blocks on stores' data ports. See the module docstring."""

    def __init__(
        self, *, io_timeout_s: float = 30.0, connect_timeout_s: float = 5.0, tls: Tls | None = None
    ) -> None:
        self.io_timeout_s = io_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._conns = DataConnections(
            idle_per_address=_IDLE_PER_ADDRESS,
            io_timeout_s=io_timeout_s,
            connect_timeout_s=connect_timeout_s,
            tls=tls,
        )

    def close(self) -> None:
        self._conns.close()

    def put(
        self,
        address: str,
        key: KvBlockKey,
        payload: bytes | bytearray | memoryview,
        *,
        durable: bool = False,
        tier: CacheTier = CacheTier.CPU_DRAM,
        checksum: int | None = None,
    ) -> CacheTier:
        """Store `payload` under `key` on the node whose data port is `address`; returns
        the tier it landed in. `checksum` (xxh3-64) is computed when not given."""
        view = memoryview(payload)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if checksum is None:
            checksum = payload_checksum(view)
        header = dataproto.encode_put(key, view.nbytes, checksum, tier=tier, durable=durable)
        for attempt in (0, 1):
            sock, reused = self._conns.take(address)
            try:
                ack, message = self._exchange(sock, header, view, address)
            except _Stale:
                sock.close()
                if reused and attempt == 0:
                    continue
                raise NodeUnavailable(f"data port {address} closed the connection") from None
            except BaseException:
                sock.close()
                raise
            if ack.status == dataproto.STATUS_INVALID_ARGUMENT:
                sock.close()  # the store drops the connection after a malformed put
            else:
                self._conns.give_back(address, sock)
            if ack.status != dataproto.STATUS_OK:
                raise dataproto.error_of(ack.status, message or "put refused")
            if ack.checksum != checksum or ack.payload_len != view.nbytes:
                raise NodeUnavailable(f"data port {address} acknowledged another block")
            return ack.tier
        raise AssertionError("unreachable")

    def _exchange(self, sock, header: bytes, view: memoryview, address: str):
        """Send one put and read its ack: (header, message)."""
        send_failed = False
        try:
            send_parts(sock, [header, view])
        except OSError as exc:
            if is_timeout(exc):
                raise NodeUnavailable(f"data port {address}: send timed out") from None
            send_failed = True  # the store may have refused the put and closed: read why
        head = memoryview(bytearray(dataproto.BLOCK_HEADER.size))
        try:
            got = recv_exactly(sock, head)
        except OSError as exc:
            if send_failed:
                raise _Stale() from None
            if is_timeout(exc):
                raise NodeUnavailable(
                    f"data port {address} sent no ack for {self.io_timeout_s:g}s"
                ) from None
            raise NodeUnavailable(f"data port {address}: {exc}") from None
        if got == 0:
            raise _Stale()
        if got < head.nbytes:
            raise NodeUnavailable(f"data port {address} closed the connection inside an ack")
        return read_ack_rest(sock, head, address)


def read_ack_rest(sock, head: memoryview, address: str):
    """The ack whose header is `head` (already received), with its message read from
    `sock`: (ack, message, "" without one)."""
    ack = dataproto.decode_ack(head)
    message = ""
    if ack.message_len:
        text = memoryview(bytearray(ack.message_len))
        if recv_exactly(sock, text) < ack.message_len:
            raise NodeUnavailable(f"data port {address} closed the connection inside an ack")
        message = bytes(text).decode("utf-8", "replace")
    return ack, message


class _Stale(Exception):
    """The connection was closed before the ack began (an idle one the store dropped)."""


__all__ = ["BlockPusher", "read_ack_rest"]
