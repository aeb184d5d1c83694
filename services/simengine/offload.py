"""Moving KV blocks between the sim engine and store nodes: offload and FETCH.

Save: with `store_writes` "computed" (the engine's default, as the QuillCache vLLM
connector does), every newly computed full block of a prompt goes to the engine's own
store node once its prefill is done, one batch per request, in the background from a
bounded queue: a full queue drops the batch (counted), serving never waits for it. Any
engine can then FETCH those blocks from the pool instead of recomputing them.

Offload: with "evicted", an evicted block's bytes (see `kvbytes`) go to the engine's
own store node under the block's QuillCache key instead. It runs in background workers
from a bounded queue, so serving never waits for it; a full queue drops the block
(counted), as an engine under memory pressure would. With "none" nothing goes there.

Fetch: a block the plan says to FETCH is read from a store (the engine's own node,
which may pull it from a peer, or the plan's source address directly) and checked
byte for byte against the deterministic content. Any failure (absent, unreachable,
wrong bytes, timeout) is reported as False: the engine recomputes that block instead.

Clients are created on first use, one per address, and live until `close`.

Batches: with a `batches` factory and the store nodes' block-data addresses (from
`data_address`, resolved through the registry), a prefill's write-through (`store_now`),
a save, and a request's FETCH of each run of blocks from one store node (`fetch_many`:
the own node's, or a peer's read directly) are each one exchange with that store's
data port (`datapath.batch`), instead of one gRPC call per block. Blocks a batch does
not return are fetched one by one as before (the own node pulls them from a peer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from quillcache_core.errors import QuillCacheError
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_simengine.kvbytes import kv_payload
from quillcache_simengine.kvbytes import payload_bytes as payload_size

__all__ = ["BlockMover", "MoverStats", "StoreLike"]

log = logging.getLogger(__name__)

MAX_CLIENTS = 64
FETCH_CONCURRENCY = 16  # blocks of one engine being read at once


class StoreLike(Protocol):
    """The part of `quillcache_core.storeclient.client.StoreClient` the engine uses."""

    async def put(
        self,
        key: KvBlockKey,
        payload: bytes | memoryview,
        *,
        durable: bool = False,
        tier: CacheTier = CacheTier.CPU_DRAM,
    ) -> CacheTier: ...

    async def get(
        self, key: KvBlockKey, *, allow_remote: bool = False
    ) -> tuple[bytes, CacheTier]: ...

    async def exists(self, keys: Sequence[KvBlockKey]) -> list[CacheTier | None]: ...

    async def close(self) -> None: ...


StoreFactory = Callable[[str, float], StoreLike]


def default_store_factory(address: str, timeout_s: float, tls=None) -> StoreLike:
    """A StoreClient, over mutual TLS as the engine when `tls` is given."""
    from quillcache_core.storeclient.client import StoreClient

    return StoreClient(address, timeout_s=timeout_s, tls=tls)


@dataclass(slots=True)
class MoverStats:
    offloaded: int = 0
    offload_failures: int = 0
    offload_dropped: int = 0
    offloaded_bytes: int = 0
    fetched: int = 0
    fetch_failures: int = 0
    fetch_mismatches: int = 0  # bytes arrived but differ from the block's content
    fetched_bytes: int = 0
    stored_through: int = 0  # prompt blocks stored at once for a decode engine
    saved: int = 0  # computed blocks saved in the background (store_writes "computed")
    save_dropped: int = 0  # computed blocks not saved: the save queue was full
    batched_puts: int = 0  # blocks stored or saved in one data-port batch per request
    batched_fetches: int = 0  # fetched blocks read in one data-port batch per request
    fetch_requests: int = 0  # requests that fetched (planned FETCH actions)
    fetch_seconds: float = 0.0  # their fetches' wall time, summed


class BlockMover:
    def __init__(
        self,
        *,
        own_address: str,
        own_node_id: str,
        kv_shape: tuple[int, ...],
        timeout_s: float,
        queue_blocks: int,
        concurrency: int,
        store_factory: StoreFactory = default_store_factory,
        batches: Callable[[], object] | None = None,
        data_address: Callable[[str], Awaitable[str]] | None = None,
        store_writes: str = "evicted",
        save_queue_blocks: int = 8192,
    ) -> None:
        self.own_address = own_address
        self.store_writes = store_writes  # computed, evicted or none (see the module)
        self.own_node_id = own_node_id
        self.kv_shape = tuple(kv_shape)
        self.timeout_s = timeout_s
        self.stats = MoverStats()
        self._factory = store_factory
        self._clients: dict[str, StoreLike] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._fetch_slots = asyncio.Semaphore(FETCH_CONCURRENCY)
        self._storing = 0
        self._queue: asyncio.Queue[KvBlockKey] = asyncio.Queue(maxsize=queue_blocks)
        self._saves: asyncio.Queue[list[KvBlockKey]] = asyncio.Queue()
        self._save_limit = save_queue_blocks
        self._saving = 0  # blocks queued or being saved
        self._concurrency = concurrency
        self._workers: list[asyncio.Task[None]] = []
        self._batch_factory = batches
        self._batches = None  # a datapath.batch.BlockBatches, made on first use
        self._resolve_data_address = data_address
        self._data_addresses: dict[str, str] = {}  # store node id -> its data port
        self._data_address_tried: dict[str, float] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.own_address)

    @property
    def pending(self) -> int:
        """Evicted or computed blocks queued or being stored right now."""
        return self._queue.qsize() + self._storing + self._saving

    def start(self) -> None:
        if not self.enabled:
            return
        loop = asyncio.get_running_loop()
        self._workers = [
            loop.create_task(self._offload_worker(), name=f"offload-{i}")
            for i in range(self._concurrency)
        ]
        # Two save batches in flight: one travels while the next one's bytes are made
        # (idle unless `store_writes` is "computed": it may be changed in place).
        self._workers += [loop.create_task(self._save_worker(), name=f"save-{i}") for i in range(2)]

    def client(self, address: str) -> StoreLike:
        """The client of a store address (created on first use; the least recently
        used one is closed beyond MAX_CLIENTS, as plans may name any address)."""
        client = self._clients.pop(address, None)
        if client is None:
            client = self._factory(address, self.timeout_s)
            if len(self._clients) >= MAX_CLIENTS:
                oldest = next((a for a in self._clients if a != self.own_address), None)
                if oldest is not None:
                    stale = self._clients.pop(oldest)
                    task = asyncio.get_running_loop().create_task(stale.close())
                    self._closing.add(task)
                    task.add_done_callback(self._closing.discard)
        self._clients[address] = client  # most recently used last
        return client

    # --- offload ------------------------------------------------------------------------

    def offload(self, key: KvBlockKey) -> bool:
        """Queue an evicted block for offload; False if offload is off or the queue is full."""
        if not self.enabled:
            return False
        try:
            self._queue.put_nowait(key)
        except asyncio.QueueFull:
            self.stats.offload_dropped += 1
            log.debug("offload queue full: dropped block %s", key.block_hash)
            return False
        return True

    async def _offload_worker(self) -> None:
        while True:
            key = await self._queue.get()
            self._storing += 1
            try:
                await self._offload_one(key)
            finally:
                self._storing -= 1
                self._queue.task_done()

    async def _offload_one(self, key: KvBlockKey) -> None:
        try:
            payload = await asyncio.to_thread(kv_payload, key.block_hash, self.kv_shape)
            async with asyncio.timeout(self.timeout_s):
                tier = await self.client(self.own_address).put(key, payload)
        except asyncio.CancelledError:
            raise
        except (QuillCacheError, TimeoutError, OSError) as exc:
            self.stats.offload_failures += 1
            log.warning("offload of block %s failed: %s", key.block_hash, exc)
            return
        except Exception:
            self.stats.offload_failures += 1
            log.exception("offload of block %s failed", key.block_hash)
            return
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += len(payload)
        log.debug("offloaded block %s (%d bytes) to %s", key.block_hash, len(payload), tier)

    async def data_address(self, node_id: str = "") -> str:
        """The block-data address of store node `node_id` (default: the own one); ''
        when batches are off or it is not known (looked up again at most every 5 s)."""
        node = node_id or self.own_node_id
        known = self._data_addresses.get(node, "")
        if known or self._batch_factory is None or not self.enabled:
            return known
        if self._resolve_data_address is None:
            return ""
        now = asyncio.get_running_loop().time()
        if now - self._data_address_tried.get(node, -1e9) < 5.0:
            return ""
        self._data_address_tried[node] = now
        try:
            known = await self._resolve_data_address(node)
        except (QuillCacheError, OSError, TimeoutError) as exc:
            log.info("data address of store %s not resolved: %s", node, exc)
            return ""
        if known:
            self._data_addresses[node] = known
        return known

    def _batcher(self):
        if self._batches is None:
            self._batches = self._batch_factory()
        return self._batches

    async def store_now(self, keys: list[KvBlockKey]) -> int:
        """Store the blocks in the own store node now (a prefill for a decode engine);
        returns how many are stored. Failures are counted, never raised."""
        stored = await self._put_blocks(keys)
        self.stats.stored_through += stored
        return stored

    async def missing(self, keys: Sequence[KvBlockKey]) -> list[KvBlockKey]:
        """The blocks among `keys` the own store node lacks (all of them when it cannot
        be asked: a save of a block it has is only a wasted put)."""
        if not self.enabled or not keys:
            return []
        try:
            found = await self.client(self.own_address).exists(list(keys))
        except QuillCacheError as exc:
            log.warning("could not ask the store which of %d blocks it has: %s", len(keys), exc)
            return list(keys)
        return [key for key, tier in zip(keys, found, strict=True) if tier is None]

    def save_later(self, keys: list[KvBlockKey]) -> bool:
        """Queue a prompt's newly computed blocks for a background save to the own store
        node; False (the blocks counted as dropped) when the queue is full or saving is off."""
        if not self.enabled or self.store_writes != "computed" or not keys:
            return False
        if self._saving + len(keys) > self._save_limit:
            self.stats.save_dropped += len(keys)
            return False
        self._saving += len(keys)
        self._saves.put_nowait(list(keys))
        return True

    async def _save_worker(self) -> None:
        while True:
            keys = await self._saves.get()
            try:
                self.stats.saved += await self._put_blocks(keys)
            except asyncio.CancelledError:
                raise
            except Exception:
                self.stats.offload_failures += len(keys)
                log.exception("save of %d blocks failed", len(keys))
            finally:
                self._saving -= len(keys)
                self._saves.task_done()

    async def _put_blocks(self, keys: list[KvBlockKey]) -> int:
        """Put the blocks in the own store node (one data-port batch when it can, else
        one call each); returns how many are stored. Failures are counted, never raised."""
        if not self.enabled or not keys:
            return 0
        address = await self.data_address()
        if address:
            return await self._store_batch(address, keys)

        async def one(key: KvBlockKey) -> bool:
            async with self._fetch_slots:
                try:
                    payload = await asyncio.to_thread(kv_payload, key.block_hash, self.kv_shape)
                    async with asyncio.timeout(self.timeout_s):
                        await self.client(self.own_address).put(key, payload)
                except asyncio.CancelledError:
                    raise
                except (QuillCacheError, TimeoutError, OSError) as exc:
                    self.stats.offload_failures += 1
                    log.warning("store of block %s failed: %s", key.block_hash, exc)
                    return False
                self.stats.offloaded_bytes += len(payload)
                return True

        return sum(await asyncio.gather(*(one(key) for key in keys)))

    async def _store_batch(self, address: str, keys: list[KvBlockKey]) -> int:
        shape, batcher = self.kv_shape, self._batcher()

        def run():
            blocks = [(key, kv_payload(key.block_hash, shape)) for key in keys]
            return batcher.put_many(address, blocks), len(blocks[0][1])

        outcomes, size = await asyncio.to_thread(run)
        stored = sum(1 for o in outcomes if isinstance(o, CacheTier))
        if stored < len(keys):
            self.stats.offload_failures += len(keys) - stored
            first = next(o for o in outcomes if not isinstance(o, CacheTier))
            log.warning("store of %d of %d blocks failed: %s", len(keys) - stored, len(keys), first)
        self.stats.offloaded_bytes += stored * size
        self.stats.batched_puts += stored
        return stored

    async def fetch_many(self, wanted: Sequence[tuple[KvBlockKey, str, str]]) -> list[bool]:
        """`fetch` for each (key, source node, source address), in order: each run of
        blocks from one store node in one batch from its data port when it can (the own
        node's, or a peer's read directly), from the first block a batch lacks on (or
        with no data port known) one by one, concurrently."""
        began = time.perf_counter()
        try:
            return await self._fetch_many(wanted)
        finally:
            self.stats.fetch_requests += 1
            self.stats.fetch_seconds += time.perf_counter() - began

    async def _fetch_many(self, wanted: Sequence[tuple[KvBlockKey, str, str]]) -> list[bool]:
        results: list[bool] = []
        sources = [self.own_node_id if self._is_own(n, a) else n for _k, n, a in wanted]
        start = 0
        while start < len(wanted):
            node = sources[start]
            end = start
            while end < len(wanted) and sources[end] == node:
                end += 1
            address = await self.data_address(node) if node else ""
            if not address:
                break
            got = await self._fetch_batch(address, [w[0] for w in wanted[start:end]])
            results += [True] * got
            if got < end - start:
                break
            start = end
        rest = await asyncio.gather(*(self.fetch(*w) for w in wanted[len(results) :]))
        return results + list(rest)

    async def _fetch_batch(self, address: str, keys: list[KvBlockKey]) -> int:
        """Read the blocks in one batch and check their bytes; how many lead intact."""
        shape, batcher = self.kv_shape, self._batcher()
        # The bytes to check them against are made while they travel.
        got, expected = await asyncio.gather(
            asyncio.to_thread(batcher.get_many, address, keys),
            asyncio.to_thread(lambda: [kv_payload(k.block_hash, shape) for k in keys]),
        )
        leading = 0
        for data, want in zip(got, expected, strict=True):
            if data is None or data != want:
                break
            leading += 1
        self.stats.fetched += leading
        self.stats.batched_fetches += leading
        self.stats.fetched_bytes += leading * payload_size(shape)
        return leading

    def _is_own(self, source_node: str, source_address: str) -> bool:
        return bool(self.own_address) and (not source_address or source_node == self.own_node_id)

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every queued offload and save finished (or `timeout_s` passed)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._queue.join()
                await self._saves.join()
            return True
        except TimeoutError:
            return False

    # --- fetch --------------------------------------------------------------------------

    async def fetch(self, key: KvBlockKey, source_node: str, source_address: str) -> bool:
        """Read one block and verify its bytes; False (counted) on any failure."""
        own = self._is_own(source_node, source_address)
        address = self.own_address if own else source_address
        if not address:
            self.stats.fetch_failures += 1
            return False
        try:
            async with self._fetch_slots:
                async with asyncio.timeout(self.timeout_s):
                    data, tier = await self.client(address).get(key, allow_remote=own)
                expected = await asyncio.to_thread(kv_payload, key.block_hash, self.kv_shape)
        except asyncio.CancelledError:
            raise
        except (QuillCacheError, TimeoutError, OSError) as exc:
            self.stats.fetch_failures += 1
            log.info("fetch of block %s from %s failed: %s", key.block_hash, address, exc)
            return False
        except Exception:
            self.stats.fetch_failures += 1
            log.exception("fetch of block %s from %s failed", key.block_hash, address)
            return False
        if data != expected:
            self.stats.fetch_failures += 1
            self.stats.fetch_mismatches += 1
            log.warning("block %s from %s has the wrong bytes", key.block_hash, address)
            return False
        self.stats.fetched += 1
        self.stats.fetched_bytes += len(data)
        log.debug("fetched block %s from %s (%s)", key.block_hash, address, tier)
        return True

    async def close(self) -> None:
        workers, self._workers = self._workers, []
        for task in workers:
            task.cancel()
        for task in workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        batches, self._batches = self._batches, None
        if batches is not None:
            await asyncio.to_thread(batches.close)
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()
