"""The destination side of the block data path: pull blocks from a peer's data port.

`BlockPuller.pull(address, keys, ...)` sends one request (framing in `protocol`) to a
source node's block-data port and stores each block as it arrives: into DRAM its
bytes go from the socket straight into a pooled buffer (`TieredStore.put_filled`,
`recv_into`, one copy), are checked against the checksum the source recorded when
the block was stored, and only then become visible. A block whose bytes do not all
arrive, or do not match, is never stored (a block already held under its key stays).

Every key gets exactly one `PullOutcome`, in order, through `on_result`:
- the source lacks the block or refuses it: its status (NOT_FOUND, DATA_LOSS, ...);
- the checksum does not match: DATA_LOSS (the stream stays in step, later blocks go on);
- the connection breaks or times out: that block and every later one UNAVAILABLE,
  naming how many bytes of which block arrived (the caller may retry them);
- storing fails here (capacity, disk): that block's error, `source_failed` False.

Blocking: call from a worker thread. Idle connections are kept per address (a few)
and reused; a reused connection that fails before its first byte is retried once on
a fresh one (the source may have restarted). Thread-safe.

`OutcomeBatches` carries the outcomes of pulls running in worker threads to the event
loop in batches: 2 MiB blocks finish about a millisecond apart, and waking the loop
(then sending a gRPC message) once per block cost the destination and the transfer
service more CPU than storing the block.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from quillcache_core.errors import Corrupt, InvalidArgument, NodeUnavailable
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.security.tls import Tls
from quillcache_core.storeclient.blockcodec import CorruptBlock, payload_checksum
from quillcache_core.storeclient.datapath import protocol as dataproto
from quillcache_core.storeclient.datapath.conn import DataConnections
from quillcache_core.storeclient.datapath.sockets import is_timeout, recv_exactly, send_parts
from quillcache_store.tiers.tiered import TieredStore

log = logging.getLogger(__name__)

_IDLE_PER_ADDRESS = 4
_DRAIN_CHUNK = 1 << 20


@dataclass(slots=True)
class PullOutcome:
    """What became of one requested block (`index` into the request's keys)."""

    index: int
    ok: bool
    bytes: int = 0
    checksum: int = 0
    tier: CacheTier | None = None
    code: str = ""  # gRPC status name of the failure
    error: str = ""
    source_failed: bool = False  # the failure is the source's (or the connection's)


class _Lost(Exception):
    """The connection broke at block `index`: it and the rest of the request are lost.

    `fresh`: nothing of the response had arrived (a stale idle connection looks so)."""

    def __init__(self, message: str, index: int, *, fresh: bool = False) -> None:
        super().__init__(message)
        self.index = index
        self.fresh = fresh


class BlockPuller:
    """Pulls blocks from peers' data ports into `tiered`. See the module docstring."""

    def __init__(
        self,
        tiered: TieredStore,
        *,
        max_block_bytes: int,
        io_timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        tls: Tls | None = None,
    ) -> None:
        self.tiered = tiered
        self.max_block_bytes = max_block_bytes
        self.io_timeout_s = io_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._conns = DataConnections(
            idle_per_address=_IDLE_PER_ADDRESS,
            io_timeout_s=io_timeout_s,
            connect_timeout_s=connect_timeout_s,
            tls=tls,
        )
        self.blocks_pulled = 0
        self.bytes_pulled = 0
        self.blocks_failed = 0

    # --- connections ------------------------------------------------------------------------

    def close(self) -> None:
        self._conns.close()

    # --- pulling ------------------------------------------------------------------------------

    def pull(
        self,
        address: str,
        keys: list[KvBlockKey],
        *,
        on_result: Callable[[PullOutcome], None],
        tier: CacheTier = CacheTier.CPU_DRAM,
        durable: bool = False,
        cancelled: threading.Event | None = None,
    ) -> None:
        """Pull `keys` from the data port at `address`; one `on_result` per key, in order.

        `cancelled` (set by another thread) stops the pull between blocks: the rest
        fail with CANCELLED and the connection is dropped.
        """
        try:
            request = dataproto.encode_request(keys)
        except InvalidArgument as exc:
            self._fail_rest(keys, 0, on_result, "INVALID_ARGUMENT", str(exc), False)
            return
        progress = [0]  # outcomes delivered so far
        for attempt in (0, 1):
            try:
                sock, reused = self._conns.take(address)
            except (NodeUnavailable, InvalidArgument) as exc:
                self._fail_rest(keys, 0, on_result, dataproto.code_name(exc), str(exc), True)
                return
            try:
                try:
                    send_parts(sock, [request])
                except OSError as exc:
                    raise _Lost(f"data port {address}: {exc}", 0, fresh=True) from None
                done = self._receive(sock, keys, tier, durable, on_result, cancelled, progress)
            except _Lost as exc:
                sock.close()
                if reused and attempt == 0 and exc.fresh:
                    log.debug("idle connection to %s was stale; reconnecting", address)
                    continue
                self._fail_rest(keys, exc.index, on_result, "UNAVAILABLE", str(exc), True)
                return
            except Exception as exc:  # a bug: still one outcome per key
                sock.close()
                log.exception("pull from %s failed", address)
                self._fail_rest(
                    keys, progress[0], on_result, "INTERNAL", f"internal error: {exc!r}", False
                )
                return
            except BaseException:
                sock.close()
                raise
            if done < len(keys):  # cancelled
                sock.close()
                self._fail_rest(keys, done, on_result, "CANCELLED", "pull cancelled", False)
            else:
                self._conns.give_back(address, sock)
            return

    def _fail_rest(self, keys, start, on_result, code, message, source_failed) -> None:
        with self._lock:
            self.blocks_failed += len(keys) - start
        for i in range(start, len(keys)):
            on_result(PullOutcome(i, False, code=code, error=message, source_failed=source_failed))

    def _receive(self, sock, keys, tier, durable, on_result, cancelled, progress) -> int:
        """Receive and store the blocks of one request; returns how many were handled
        (fewer than asked only when cancelled). `progress[0]` follows along."""
        head = memoryview(bytearray(dataproto.BLOCK_HEADER.size))
        for i, key in enumerate(keys):
            if cancelled is not None and cancelled.is_set():
                return i
            got = self._recv(sock, head, key, i)
            if got < head.nbytes:
                message = _lost_message(key, "header", got, head.nbytes, i)
                raise _Lost(message, i, fresh=i == 0 and got == 0)
            try:
                block = dataproto.decode_block_header(head, self.max_block_bytes)
            except InvalidArgument as exc:
                raise _Lost(f"source sent a malformed block header: {exc}", i) from None
            message = ""
            if block.message_len:
                text = memoryview(bytearray(block.message_len))
                got = self._recv(sock, text, key, i)
                if got < block.message_len:
                    raise _Lost(_lost_message(key, "message", got, block.message_len, i), i)
                message = bytes(text).decode("utf-8", "replace")
            if block.status != dataproto.STATUS_OK:
                code = dataproto.CODE_NAMES[block.status]
                with self._lock:
                    self.blocks_failed += 1
                outcome = PullOutcome(i, False, code=code, error=message, source_failed=True)
            else:
                outcome = self._store_one(sock, key, i, block, tier, durable)
            on_result(outcome)
            progress[0] = i + 1
        return len(keys)

    def _recv(self, sock, view, key, i) -> int:
        try:
            return recv_exactly(sock, view)
        except OSError as exc:
            if is_timeout(exc):
                raise _Lost(
                    f"source did not send block {i} ({key.block_hash}) within "
                    f"{self.io_timeout_s:g}s; nothing of it stored",
                    i,
                ) from None
            raise _Lost(
                f"connection to the source failed during block {i} ({key.block_hash}): "
                f"{exc}; nothing of it stored",
                i,
                fresh=i == 0,
            ) from None

    def _store_one(self, sock, key, i, block, tier, durable) -> PullOutcome:
        n, checksum = block.payload_len, block.checksum
        filled = False

        def fill(view: memoryview) -> None:
            nonlocal filled
            filled = True
            got = self._recv(sock, view, key, i)
            if got < n:
                raise _Lost(_lost_message(key, "payload", got, n, i), i)
            actual = payload_checksum(view)
            if actual != checksum:
                raise CorruptBlock(
                    f"block {key.block_hash} arrived with checksum {actual:016x}, the source "
                    f"recorded {checksum:016x}; not stored",
                    key,
                    n,
                )

        started = time.perf_counter()
        try:
            landed = self.tiered.put_filled(key, n, checksum, fill, durable=durable, tier=tier)
        except _Lost:
            raise
        except Exception as exc:
            if not filled:
                self._drain(sock, n, key, i)  # keep the stream in step for the next block
            with self._lock:
                self.blocks_failed += 1
            return PullOutcome(
                i,
                False,
                code=dataproto.code_name(exc),
                error=str(exc),
                source_failed=isinstance(exc, Corrupt),
            )
        with self._lock:
            self.blocks_pulled += 1
            self.bytes_pulled += n
        log.debug(
            "pulled %s: %d bytes -> %s in %.2f ms",
            key.block_hash,
            n,
            landed,
            (time.perf_counter() - started) * 1e3,
        )
        return PullOutcome(i, True, bytes=n, checksum=checksum, tier=landed)

    def _drain(self, sock, n: int, key, i) -> None:
        scratch = memoryview(bytearray(min(n, _DRAIN_CHUNK)))
        left = n
        while left:
            view = scratch[: min(left, scratch.nbytes)]
            got = self._recv(sock, view, key, i)
            if got < view.nbytes:
                raise _Lost(_lost_message(key, "payload", n - left + got, n, i), i)
            left -= got


def _lost_message(key: KvBlockKey, part: str, got: int, total: int, i: int) -> str:
    return (
        f"source closed the connection after {got} of {total} bytes of the {part} of "
        f"block {i} ({key.block_hash}); nothing of it stored"
    )


class OutcomeBatches:
    """PullOutcomes from worker threads, handed to the event loop in batches.

    `add` (any thread) queues an outcome; `next_batch` (the loop) returns all the
    queued ones (more than `max_batch` if the loop was busy) once a batch is due:
    `max_batch` of them are queued, the first of them has waited `linger_s`, or all
    `expected` outcomes have arrived. The loop is woken at
    most twice per batch (its first outcome, then full or complete), not per outcome.
    With `max_batch` 1 (or no linger) the outcomes are handed over as soon as the
    loop gets to them: what was queued meanwhile comes as one batch.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        expected: int,
        *,
        max_batch: int,
        linger_s: float,
    ) -> None:
        self._loop = loop
        self._expected = expected
        self._max_batch = max(1, max_batch)
        self._linger_s = max(0.0, linger_s)
        self._lock = threading.Lock()
        self._queued: list[PullOutcome] = []
        self._arrived = 0
        self._handed = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        """The producers stopped without delivering every outcome (a bug): once what is
        queued was handed over, `next_batch` raises `error` instead of waiting forever.
        Thread-safe."""
        with self._lock:
            self._error = error
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            try:
                self._loop.call_soon_threadsafe(_wake, waiter)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def add(self, outcome: PullOutcome) -> None:
        """Queue one outcome. Thread-safe; never blocks on the loop."""
        with self._lock:
            self._queued.append(outcome)
            self._arrived += 1
            waiter = self._waiter
            if waiter is None or not (len(self._queued) == 1 or self._due()):
                return
            self._waiter = None
        try:
            self._loop.call_soon_threadsafe(_wake, waiter)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _due(self) -> bool:
        return len(self._queued) >= self._max_batch or self._arrived >= self._expected

    async def next_batch(self) -> list[PullOutcome]:
        """The next batch (at least one outcome). Event loop only; call it no more
        often than until `expected` outcomes were returned."""
        if self._handed >= self._expected:
            raise RuntimeError("every expected outcome was already handed over")
        take = False  # the linger is over: take what is queued
        while True:
            with self._lock:
                if self._queued and (take or not self._linger_s or self._due()):
                    batch, self._queued = self._queued, []
                    self._handed += len(batch)
                    return batch
                if self._error is not None:
                    if not self._queued:
                        raise self._error
                    take = True
                    continue
                waiter = self._waiter = self._loop.create_future()
                lingering = bool(self._queued)
            if not lingering:
                await waiter  # woken by the first outcome
                continue
            # The batch's first outcome is here: wait until it fills up or the last
            # outcome arrives, at most the linger.
            handle = self._loop.call_later(self._linger_s, _wake, waiter)
            try:
                await waiter
            finally:
                handle.cancel()
            take = True


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


__all__ = ["BlockPuller", "OutcomeBatches", "PullOutcome"]
