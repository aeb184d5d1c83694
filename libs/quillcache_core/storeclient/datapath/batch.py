"""A request's blocks in one exchange with a store's block-data port (raw TCP, framing
in `dataproto`), for a client such as an engine: `put_many` sends every put of a batch
back to back and then reads their acks (the protocol allows several puts before their
acks), `get_many` sends one request naming every block and reads them back to back.
One connection and one round trip per batch instead of one RPC per block: what a
prefill for another engine (disaggregation) writes, and what the decode engine loads.

Per block, an outcome: a put's landed tier or its error; a get's bytes (checked against
the checksum the store recorded) or None. A connection that fails ends the batch: the
blocks not yet answered fail (NodeUnavailable for puts, None for gets), never raised.

Blocking: call from a worker thread. Thread-safe (connections are taken one caller at a
time from a shared `DataConnections`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from quillcache_core.errors import InvalidArgument, NodeUnavailable, QuillCacheError
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.security.tls import Tls
from quillcache_core.storeclient.blockcodec import payload_checksum
from quillcache_core.storeclient.datapath import protocol as dataproto
from quillcache_core.storeclient.datapath.conn import DataConnections
from quillcache_core.storeclient.datapath.put import read_ack_rest
from quillcache_core.storeclient.datapath.sockets import drain, recv_exactly, send_parts

__all__ = ["BlockBatches", "deliver"]

logger = logging.getLogger(__name__)

_IDLE_PER_ADDRESS = 4
# Puts sent before their acks are read: acks are 28 bytes, so the store's send buffer
# never fills while this side is still writing.
_PUTS_IN_FLIGHT = 256
_MAX_BLOCK_BYTES = 1 << 30


class BlockBatches:
    def __init__(
        self, *, io_timeout_s: float = 30.0, connect_timeout_s: float = 5.0, tls: Tls | None = None
    ) -> None:
        self._conns = DataConnections(
            idle_per_address=_IDLE_PER_ADDRESS,
            io_timeout_s=io_timeout_s,
            connect_timeout_s=connect_timeout_s,
            tls=tls,
        )

    def close(self) -> None:
        self._conns.close()

    def put_many(
        self,
        address: str,
        blocks: Sequence[tuple[KvBlockKey, bytes | memoryview]],
        *,
        tier: CacheTier = CacheTier.CPU_DRAM,
    ) -> list[CacheTier | QuillCacheError]:
        """Store every (key, payload) on the node whose data port is `address`; per
        block the tier it landed in or the store's error."""
        out: list[CacheTier | QuillCacheError] = []
        for start in range(0, len(blocks), _PUTS_IN_FLIGHT):
            part = blocks[start : start + _PUTS_IN_FLIGHT]
            out += self._put_part(address, part, tier)
        return out

    def _put_part(self, address, blocks, tier) -> list[CacheTier | QuillCacheError]:
        frames, sums = [], []
        for key, payload in blocks:
            view = memoryview(payload).cast("B")
            checksum = payload_checksum(view)
            sums.append((checksum, view.nbytes))
            frames += [dataproto.encode_put(key, view.nbytes, checksum, tier=tier, durable=False)]
            frames.append(view)
        sock = None
        out: list[CacheTier | QuillCacheError] = []
        try:
            sock, _ = self._conns.take(address)
            send_parts(sock, frames)
            head = memoryview(bytearray(dataproto.BLOCK_HEADER.size))
            keep = True
            for checksum, nbytes in sums:
                if recv_exactly(sock, head) < head.nbytes:
                    raise NodeUnavailable(f"data port {address} closed the connection")
                ack, message = read_ack_rest(sock, head, address)
                if ack.status == dataproto.STATUS_INVALID_ARGUMENT:
                    keep = False  # the store drops the connection after a malformed put
                if ack.status != dataproto.STATUS_OK:
                    out.append(dataproto.error_of(ack.status, message or "put refused"))
                elif ack.checksum != checksum or ack.payload_len != nbytes:
                    raise NodeUnavailable(f"data port {address} acknowledged another block")
                else:
                    out.append(ack.tier)
                if not keep:
                    break
        except (OSError, QuillCacheError) as exc:
            if sock is not None:
                sock.close()
                sock = None
            failed = exc if isinstance(exc, NodeUnavailable) else NodeUnavailable(str(exc))
            return out + [failed] * (len(blocks) - len(out))
        if keep:
            self._conns.give_back(address, sock)
        else:
            sock.close()
            out += [NodeUnavailable("connection closed by the store")] * (len(blocks) - len(out))
        return out

    def get_many(self, address: str, keys: Sequence[KvBlockKey]) -> list[bytes | None]:
        """The blocks' bytes from the node whose data port is `address` (None for one it
        does not hold, or that arrived damaged)."""
        out: list[bytes | None] = [None] * len(keys)

        def keep(i: int, view: memoryview) -> bool:
            out[i] = bytes(view)
            return True

        self.get_each(address, keys, keep)
        return out

    def get_each(
        self,
        address: str,
        keys: Sequence[KvBlockKey],
        sink: Callable[[int, memoryview], bool],
        into: Callable[[int, int], memoryview | None] | None = None,
    ) -> list[bool]:
        """Hand each block the node holds, intact, to `sink(index in keys, its bytes)`
        as it arrives; per key whether the sink took it (a sink returns False for bytes
        it cannot use). The view is valid only during the call: the blocks are received
        into one buffer, reused, so a load costs no allocation per block and touches no
        new pages. With `into`, a block is received where `into(index, its length)`
        says (a writable view of that length), or into the buffer when it says None."""
        taken = [False] * len(keys)
        for start in range(0, len(keys), dataproto.MAX_REQUEST_KEYS):
            part = list(keys[start : start + dataproto.MAX_REQUEST_KEYS])
            self._get_part(address, part, start, sink, taken, into)
        return taken

    def _get_part(self, address, keys, first, sink, taken, into=None) -> None:
        sock = None
        scratch = bytearray()
        try:
            request = dataproto.encode_request(keys)
            sock, _ = self._conns.take(address)
            send_parts(sock, [request])
            head = memoryview(bytearray(dataproto.BLOCK_HEADER.size))
            for i in range(len(keys)):
                if recv_exactly(sock, head) < head.nbytes:
                    raise NodeUnavailable(f"data port {address} closed the connection")
                block = dataproto.decode_block_header(head, _MAX_BLOCK_BYTES)
                if block.message_len:
                    drain(sock, block.message_len)
                if block.status != dataproto.STATUS_OK:
                    continue
                view = into(first + i, block.payload_len) if into is not None else None
                if view is None:
                    if len(scratch) < block.payload_len:
                        scratch = bytearray(block.payload_len)
                    view = memoryview(scratch)[: block.payload_len]
                if recv_exactly(sock, view) < block.payload_len:
                    raise NodeUnavailable(f"data port {address} closed inside a block")
                if payload_checksum(view) == block.checksum:
                    taken[first + i] = deliver(sink, first + i, view)
        except (OSError, ConnectionError, QuillCacheError, InvalidArgument):
            if sock is not None:
                sock.close()
            return
        self._conns.give_back(address, sock)


def deliver(sink: Callable[[int, memoryview], bool], index: int, view: memoryview) -> bool:
    """Whether `sink` took the block; a sink that fails has not (the stream goes on)."""
    try:
        return bool(sink(index, view))
    except Exception:
        logger.exception("a received block could not be used")
        return False
