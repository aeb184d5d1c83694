"""Moving blocks between two store nodes: the transfer service's core.

Two data paths, one orchestration (retries, progress, per-block results):

- The block data path (when `run_transfer` gets the source's `data_address`): the
  destination is told to pull (`Store.Pull`), and fetches the blocks from the source's
  raw TCP block-data port, straight into its DRAM pool, verifying each block against
  the checksum the source recorded. The bytes cross the network once, store to store;
  this service only sees a small result per block, several to a message (up to
  `progress_every`: the destination sends what finished since its last message, so
  neither side pays a message and a wake-up per block). Blocks go in Pull calls of up to
  `PULL_BATCH_BLOCKS`, one call at a time: one connection streams them back to back
  (TCP's flow control bounds what is in flight; `window` does not apply). Pull, not
  push: the destination owns the buffers the bytes land in and the decision to make a
  block visible, so a source dying mid-block can only lose that block.
- gRPC (otherwise): each block streams the source's Get into the destination's Put,
  chunk by chunk as they arrive (the chunks are forwarded, not reassembled). At most
  `window` blocks are in flight. The checksum from the source's first chunk travels in
  the first PutChunk, and the destination stores the block only if the whole block
  matches it. A failed block cancels its Put.

Either way verification is end to end and the store commits only complete, verified
blocks, so a source dying mid-block never leaves a half-written block behind.

A block that fails with UNAVAILABLE (either side) is retried with backoff (`retries`
times). Once one side has failed that way through all retries, the remaining blocks of
the request fail at once with the same error instead of waiting through theirs.

Modes: "copy"; "move" deletes each block at the source once the destination has
acknowledged it (on the data path in groups of up to `MOVE_DELETE_BATCH` blocks); "prefetch" first asks the destination which blocks it already holds
(Exists), skips those and writes the rest into DRAM.

`run_transfer` yields `Progress` snapshots: at least every `progress_every` finished
blocks and every `progress_interval_s` while blocks are in flight, then a final one
(`finished`) with every block's outcome in request order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio

from quillcache.v1 import store_pb2
from quillcache_core.errors import QuillCacheError
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.rpc.server import status_for
from quillcache_core.storeclient import wire
from quillcache_core.storeclient.client import StoreClient
from quillcache_core.wire.tiers import tier_to_proto

log = logging.getLogger(__name__)

MODES = ("copy", "move", "prefetch")
PULL_BATCH_BLOCKS = 256
MOVE_DELETE_BATCH = 16  # move: source deletes go in groups of this many blocks
_MAX_BACKOFF_S = 2.0


@dataclass(slots=True)
class BlockOutcome:
    key: KvBlockKey
    ok: bool
    bytes: int = 0
    error: str = ""
    code: str = ""  # gRPC status name of the failure
    skipped: bool = False


@dataclass(slots=True)
class Progress:
    blocks_total: int
    blocks_done: int
    blocks_failed: int
    blocks_skipped: int
    bytes_done: int
    elapsed_s: float
    results: list[BlockOutcome] = field(default_factory=list)
    finished: bool = False

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_done / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class TransferOptions:
    window: int = 8
    chunk_bytes: int = 1 << 20
    tier: CacheTier = CacheTier.CPU_DRAM
    durable: bool = False
    retries: int = 3
    backoff_s: float = 0.1
    block_timeout_s: float = 30.0
    progress_every: int = 16
    progress_interval_s: float = 0.5


class BlockFailed(Exception):
    """One attempt at one block failed; `side` is "source" or "destination"."""

    def __init__(self, side: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.side = side
        self.code = code


class TransferStats:
    """Service-wide counters (event loop only)."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[str, str], int] = {}
        self.bytes: dict[str, int] = {}
        self.retries = 0
        self.inflight = 0

    def count(self, mode: str, outcome: BlockOutcome) -> None:
        result = "skipped" if outcome.skipped else ("ok" if outcome.ok else "failed")
        self.blocks[(mode, result)] = self.blocks.get((mode, result), 0) + 1
        self.bytes[mode] = self.bytes.get(mode, 0) + (outcome.bytes if outcome.ok else 0)


def _code_of(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code()
    if isinstance(exc, QuillCacheError):
        return status_for(exc)
    return grpc.StatusCode.INTERNAL


async def _put_status(call: grpc.aio.StreamUnaryCall) -> tuple[grpc.StatusCode, str]:
    code = await call.code()
    return code, (await call.details()) or code.name


async def copy_block(
    source: StoreClient,
    destination: StoreClient,
    key: KvBlockKey,
    opts: TransferOptions,
) -> int:
    """Stream one block from `source` to `destination`; returns its size in bytes.

    Raises BlockFailed naming the side that failed. The destination's Put is cancelled
    on any failure, so nothing partial is stored.
    """
    get_call = source.open_get(key, chunk_bytes=opts.chunk_bytes, timeout_s=opts.block_timeout_s)
    put_call: grpc.aio.StreamUnaryCall | None = None
    received = total = checksum = 0
    started = False
    try:
        try:
            async for frame in get_call:
                if not started:
                    started = True
                    total, checksum = frame.header.total_bytes, frame.header.checksum
                    put_call = destination.open_put(timeout_s=opts.block_timeout_s)
                    header = store_pb2.PutChunk(
                        key=wire.key_to_proto(key),
                        total_bytes=total,
                        checksum=checksum,
                        durable=opts.durable,
                        tier=tier_to_proto(opts.tier),
                    )
                    chunk = wire.encode_put_chunk(header, frame.data)
                else:
                    chunk = wire.encode_put_chunk(None, frame.data)
                received += frame.data.nbytes
                try:
                    await put_call.write(chunk)
                except asyncio.InvalidStateError:
                    code, details = await _put_status(put_call)
                    raise BlockFailed("destination", code, details) from None
                except grpc.aio.AioRpcError as exc:
                    details = exc.details() or exc.code().name
                    raise BlockFailed("destination", exc.code(), details) from None
        except grpc.aio.AioRpcError as exc:
            where = f" after {received} of {total} bytes" if started else ""
            details = (exc.details() or exc.code().name) + where
            raise BlockFailed("source", exc.code(), details) from None
        if not started or put_call is None:
            raise BlockFailed("source", grpc.StatusCode.UNAVAILABLE, "Get ended without a chunk")
        if received != total:
            raise BlockFailed(
                "source",
                grpc.StatusCode.DATA_LOSS,
                f"Get ended after {received} of {total} bytes",
            )
        try:
            await put_call.done_writing()
            reply = await put_call
        except asyncio.InvalidStateError:
            code, details = await _put_status(put_call)
            raise BlockFailed("destination", code, details) from None
        except grpc.aio.AioRpcError as exc:
            raise BlockFailed("destination", exc.code(), exc.details() or exc.code().name) from None
        if checksum and reply.checksum and reply.checksum != checksum:
            raise BlockFailed(
                "destination",
                grpc.StatusCode.DATA_LOSS,
                f"destination acknowledged checksum {reply.checksum:016x}, source sent "
                f"{checksum:016x}",
            )
        return total
    finally:
        if put_call is not None and not put_call.done():
            put_call.cancel()  # the store discards an incomplete Put
        if not get_call.done():
            get_call.cancel()


class _Breaker:
    """Per-request memory of a side that stayed UNAVAILABLE through all retries."""

    def __init__(self) -> None:
        self.down: dict[str, str] = {}


async def _one_block(
    mode: str,
    source: StoreClient,
    destination: StoreClient,
    names: tuple[str, str],
    key: KvBlockKey,
    opts: TransferOptions,
    breaker: _Breaker,
    stats: TransferStats,
) -> BlockOutcome:
    sides = {"source": names[0], "destination": names[1]}
    delay = opts.backoff_s
    attempt = 0
    while True:
        if breaker.down:
            side, message = next(iter(breaker.down.items()))
            return BlockOutcome(
                key,
                False,
                error=f"{side} node {sides[side]} unavailable: {message}; not copied",
                code="UNAVAILABLE",
            )
        try:
            nbytes = await copy_block(source, destination, key, opts)
            break
        except BlockFailed as exc:
            if exc.code == grpc.StatusCode.UNAVAILABLE and attempt < opts.retries:
                attempt += 1
                stats.retries += 1
                log.debug(
                    "block %s: %s unavailable (%s); retry %d in %.2fs",
                    key.block_hash,
                    exc.side,
                    exc,
                    attempt,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_BACKOFF_S)
                continue
            node = sides[exc.side]
            if exc.code == grpc.StatusCode.UNAVAILABLE:
                breaker.down.setdefault(exc.side, f"{exc} (after {attempt + 1} attempts)")
            what = "nothing stored at the destination" if exc.side == "source" else "not stored"
            return BlockOutcome(
                key,
                False,
                error=f"{exc.side} node {node}: {exc.code.name}: {exc}; {what}",
                code=exc.code.name,
            )
    if mode == "move":
        try:
            await source.delete([key])
        except QuillCacheError as exc:
            return BlockOutcome(
                key,
                False,
                bytes=nbytes,
                error=f"copied to {names[1]} but not deleted at {names[0]}: {exc}",
                code=_code_of(exc).name,
            )
    return BlockOutcome(key, True, bytes=nbytes)


def _failure(key: KvBlockKey, side: str, node: str, code: str, message: str) -> BlockOutcome:
    what = "nothing stored at the destination" if side == "source" else "not stored"
    return BlockOutcome(
        key, False, error=f"{side} node {node}: {code}: {message}; {what}", code=code
    )


async def _pull_blocks(
    mode: str,
    source: StoreClient,
    destination: StoreClient,
    names: tuple[str, str],
    keys: Sequence[KvBlockKey],
    todo: list[int],
    opts: TransferOptions,
    data_address: Callable[[], Awaitable[str]],
    stats: TransferStats,
    report: Callable[[int, BlockOutcome], None],
) -> None:
    """The block data path: `report`s exactly one outcome per index of `todo`."""
    sides = {"source": names[0], "destination": names[1]}
    pending = list(todo)
    attempt = 0
    delay = opts.backoff_s
    while pending:
        retry: dict[int, tuple[str, str]] = {}  # index -> (side, message) of UNAVAILABLE
        for start in range(0, len(pending), PULL_BATCH_BLOCKS):
            batch = pending[start : start + PULL_BATCH_BLOCKS]
            seen: set[int] = set()
            copied: list[tuple[int, int]] = []
            stats.inflight += len(batch)
            try:
                address = await data_address()
                call = destination.open_pull(
                    names[0],
                    address,
                    [keys[i] for i in batch],
                    tier=opts.tier,
                    durable=opts.durable,
                    timeout_s=opts.block_timeout_s * len(batch),
                    # Messages no larger than a progress step: progress stays as fine.
                    max_batch_results=opts.progress_every,
                )
                async for results in call:  # several blocks' results per message
                    for result in results:
                        i = batch[result.index]
                        seen.add(i)
                        side = "source" if result.source_failed else "destination"
                        if result.ok:
                            copied.append((i, result.bytes))
                        elif result.code == "UNAVAILABLE":
                            retry[i] = (side, result.error)
                        else:
                            report(
                                i, _failure(keys[i], side, sides[side], result.code, result.error)
                            )
                    if mode != "move":
                        await _finish_copied(mode, source, names, keys, copied, report)
                        copied = []
                    while len(copied) >= MOVE_DELETE_BATCH:
                        group, copied = copied[:MOVE_DELETE_BATCH], copied[MOVE_DELETE_BATCH:]
                        await _finish_copied(mode, source, names, keys, group, report)
            except grpc.aio.AioRpcError as exc:
                details = exc.details() or exc.code().name
                for i in batch:
                    if i in seen:
                        continue
                    if exc.code() == grpc.StatusCode.UNAVAILABLE:
                        retry[i] = ("destination", details)
                    else:
                        report(
                            i, _failure(keys[i], "destination", names[1], exc.code().name, details)
                        )
            except QuillCacheError as exc:  # resolving the source
                for i in batch:
                    if i not in seen:
                        report(
                            i, _failure(keys[i], "source", names[0], _code_of(exc).name, str(exc))
                        )
            finally:
                stats.inflight -= len(batch)
            await _finish_copied(mode, source, names, keys, copied, report)
        if not retry:
            return
        if attempt >= opts.retries:
            for i, (side, message) in sorted(retry.items()):
                message = f"{message} (after {attempt + 1} attempts)"
                report(i, _failure(keys[i], side, sides[side], "UNAVAILABLE", message))
            return
        attempt += 1
        stats.retries += len(retry)
        log.debug("%d blocks unavailable; retry %d in %.2fs", len(retry), attempt, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, _MAX_BACKOFF_S)
        pending = sorted(retry)


async def _finish_copied(mode, source, names, keys, copied, report) -> None:
    """Report the copied blocks; for "move", delete them at the source first."""
    if not copied:
        return
    if mode == "move":
        try:
            await source.delete([keys[i] for i, _ in copied])
        except QuillCacheError as exc:
            for i, nbytes in copied:
                report(
                    i,
                    BlockOutcome(
                        keys[i],
                        False,
                        bytes=nbytes,
                        error=f"copied to {names[1]} but not deleted at {names[0]}: {exc}",
                        code=_code_of(exc).name,
                    ),
                )
            return
    for i, nbytes in copied:
        report(i, BlockOutcome(keys[i], True, bytes=nbytes))


async def run_transfer(
    mode: str,
    source: StoreClient,
    destination: StoreClient,
    names: tuple[str, str],
    keys: Sequence[KvBlockKey],
    opts: TransferOptions,
    stats: TransferStats | None = None,
    *,
    data_address: Callable[[], Awaitable[str]] | None = None,
) -> AsyncIterator[Progress]:
    """Transfer `keys`; yields Progress (see the module docstring). `names` are the
    (source, destination) node ids, for messages. With `data_address` (resolving the
    source's block-data address, again before each retry) the destination pulls the
    blocks over the block data path; else they stream over gRPC. Closing the
    generator cancels the blocks still in flight."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    stats = stats or TransferStats()
    started = time.monotonic()
    total = len(keys)
    outcomes: list[BlockOutcome | None] = [None] * total
    # Indices of the blocks finished since the loop below last looked, and its wake-up:
    # results arrive in batches, so the loop runs once per batch, not per block.
    finished: list[int] = []
    wake = asyncio.Event()
    todo = list(range(total))
    if mode == "prefetch":
        present = await destination.exists(keys)
        todo = []
        for i, tier in enumerate(present):
            if tier is None:
                todo.append(i)
            else:
                outcomes[i] = BlockOutcome(keys[i], True, skipped=True)
                finished.append(i)
    window = asyncio.Semaphore(max(1, opts.window))
    breaker = _Breaker()

    async def run_one(i: int) -> None:
        async with window:
            stats.inflight += 1
            try:
                outcome = await _one_block(
                    mode, source, destination, names, keys[i], opts, breaker, stats
                )
            except Exception as exc:  # a bug, not an input: keep the request alive
                log.exception("block %s failed unexpectedly", keys[i].block_hash)
                outcome = BlockOutcome(
                    keys[i], False, error=f"internal error: {exc!r}", code="INTERNAL"
                )
            finally:
                stats.inflight -= 1
        report(i, outcome)

    def report(i: int, outcome: BlockOutcome) -> None:
        if outcomes[i] is None:
            outcomes[i] = outcome
            finished.append(i)
            wake.set()

    async def pull_all() -> None:
        try:
            await _pull_blocks(
                mode, source, destination, names, keys, todo, opts, data_address, stats, report
            )
        except Exception as exc:  # a bug, not an input: keep the request alive
            log.exception("pull of %d blocks failed unexpectedly", len(todo))
            for i in todo:
                report(
                    i,
                    BlockOutcome(keys[i], False, error=f"internal error: {exc!r}", code="INTERNAL"),
                )

    if data_address is not None:
        tasks = [asyncio.create_task(pull_all(), name="transfer-pull")] if todo else []
    else:
        tasks = [asyncio.create_task(run_one(i), name=f"transfer-block-{i}") for i in todo]
    done = failed = skipped = nbytes = 0
    fresh: list[BlockOutcome] = []
    last_emit = time.monotonic()
    try:
        while done < total:
            if not finished:
                timeout = opts.progress_interval_s - (time.monotonic() - last_emit)
                try:
                    async with asyncio.timeout(max(timeout, 0.001)):
                        await wake.wait()
                except TimeoutError:
                    last_emit = time.monotonic()
                    yield Progress(total, done, failed, skipped, nbytes, last_emit - started, fresh)
                    fresh = []
                    continue
            wake.clear()
            ready = finished[:]
            del finished[:]
            for i in ready:
                outcome = outcomes[i]
                stats.count(mode, outcome)
                done += 1
                fresh.append(outcome)
                if outcome.skipped:
                    skipped += 1
                elif outcome.ok:
                    nbytes += outcome.bytes
                else:
                    failed += 1
                if len(fresh) >= opts.progress_every and done < total:
                    last_emit = time.monotonic()
                    yield Progress(total, done, failed, skipped, nbytes, last_emit - started, fresh)
                    fresh = []
        yield Progress(
            total,
            done,
            failed,
            skipped,
            nbytes,
            time.monotonic() - started,
            [o for o in outcomes if o is not None],
            finished=True,
        )
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
