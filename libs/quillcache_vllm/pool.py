"""The store node beside an engine, as the connector inside vLLM uses it: sync calls, a
bounded background writer.

vLLM calls the connector from plain threads (its scheduler loop, its model runner), so
this runs the project's asyncio `StoreClient` on a loop of its own thread and waits on
it with a deadline. Saves go through a bounded queue drained by that loop: a save never
blocks the caller, and when the queue holds `max_pending_bytes` already the new blocks
are dropped and counted instead.

Block bytes go through the store node's block-data port (raw TCP, `datapath.batch`):
a step's saves are one batch of puts on one connection, a step's loads one request
naming every block, as the sim engine does. Per block over gRPC (a Put stream each,
a Get stream each) the store and this process spent about 1 ms of CPU a block, on
cores the engines and the control path share. Blocks the gateway's plan fetches from a
peer node come straight from that node's data port, one request per node (its Stats
names the port). gRPC stays the way for what the ports do not do: the lookups
(Exists), the nodes' Stats, and a load neither this node nor the plan's peer could
serve (Get with `allow_remote`: this node finds and pulls it from a peer). A node
without a data port, or one whose port fails, is used over gRPC as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from quillcache_core.errors import NodeUnavailable, QuillCacheError
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.storeclient.client import StoreClient
from quillcache_core.storeclient.datapath.batch import BlockBatches, deliver
from quillcache_core.storeclient.datapath.conn import UNIX_PREFIX

logger = logging.getLogger(__name__)

# After a node could not name its data port, gRPC only for this long before asking again.
DATA_PORT_RETRY_S = 30.0
MAX_PORTS = 1024  # nodes' data ports remembered


@dataclass
class PoolCounters:
    """What the connector did with the pool (read by its metrics)."""

    blocks_saved: int = 0
    bytes_saved: int = 0
    blocks_save_dropped: int = 0  # the queue was full, or the store refused them
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    blocks_load_failed: int = 0  # missing, corrupt or unreachable: recomputed instead
    requests_loaded_async: int = 0  # loads done in the background (vLLM's async loading)
    save_seconds: float = 0.0  # sending saved blocks to the store (in the background)
    load_seconds: float = 0.0  # a load until its bytes are in the engine's cache
    place_seconds: float = 0.0  # ... of which copying them into the paged cache
    copy_out_seconds: float = 0.0  # copying saved blocks out of the paged cache (forward path)
    match_seconds: float = 0.0  # in get_num_new_matched_tokens (vLLM's scheduling step)
    lookups: int = 0  # Exists asked of the store node (scheduler side)
    lookup_seconds: float = 0.0
    lookups_planned: int = 0  # answered from the conductor's plan, no store call
    plans_malformed: int = 0  # a request's plan its codec refused: served without one
    lookups_skipped: int = 0  # vLLM's own hit covered the prompt: nothing to ask
    lookups_late: int = 0  # not answered by the deadline: the request computed instead
    requests_bypassed: int = 0  # served as without the connector (its bypass file)
    data_port_batches: int = 0  # saves and loads sent as one batch on the data port
    blocks_loaded_from_peers: int = 0  # straight from the data port of the plan's peer


def _is_socket(path: str) -> bool:
    """Whether `path` is a Unix socket on this host (a node's data socket named in its
    Stats is reachable only from the node's own host)."""
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


class Pool:
    def __init__(
        self,
        store_address: str,
        *,
        timeout_s: float = 10.0,
        max_pending_bytes: int = 256 << 20,
        tls=None,
        local_sockets: bool = True,
    ) -> None:
        self.store_address = store_address
        # A node's Unix socket is used when it is on this host (`local_sockets`).
        self.local_sockets = local_sockets
        self.timeout_s = timeout_s
        self.max_pending_bytes = max_pending_bytes
        self.counters = PoolCounters()
        self.on_saved: Callable[[float], None] | None = None  # each save batch's seconds
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="quillcache-pool")
        self._thread.daemon = True
        self._thread.start()
        self._client = StoreClient(store_address, timeout_s=timeout_s, tls=tls)
        self._batches = BlockBatches(io_timeout_s=timeout_s, tls=tls)
        self._tls = tls
        # Node (gRPC address: this one or a peer) -> (its block-data port, or "" when it
        # has none or could not be asked: gRPC only until the time given, then asked again).
        self._ports: dict[str, tuple[str, float]] = {}

    def _call(self, coro) -> object:
        future: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(self.timeout_s + 1.0)

    # --- lookups and loads (the caller waits) -------------------------------------------

    def leading_held_later(self, keys: Sequence[KvBlockKey]) -> Future:
        """How many of `keys`, from the first, this store node holds (any tier), asked
        in the background: a Future of the count (0 where the node could not be asked)."""
        return asyncio.run_coroutine_threadsafe(self._leading_held(list(keys)), self._loop)

    async def _leading_held(self, keys: list[KvBlockKey]) -> int:
        if not keys:
            return 0
        self.counters.lookups += 1
        started = time.perf_counter()
        try:
            tiers = await self._client.exists(keys)
        except QuillCacheError as exc:
            logger.warning("pool lookup at %s failed: %s", self.store_address, exc)
            return 0
        finally:
            self.counters.lookup_seconds += time.perf_counter() - started
        held = 0
        for tier in tiers:
            if tier is None:
                break
            held += 1
        return held

    def get_many(
        self, keys: Sequence[KvBlockKey], sources: Mapping[str, str] | None = None
    ) -> list[bytes | None]:
        """Each block's bytes (fetched from a peer store node when this one has it not:
        `sources` maps a block hash to the node, by gRPC address, the plan names), None
        where it is missing, corrupt or unreachable. Checksums are verified by the store
        on the way out of its tiers and by the client on the wire."""
        found: list[bytes | None] = [None] * len(keys)

        def keep(i: int, view: memoryview) -> bool:
            found[i] = bytes(view)
            return True

        self.load_into(keys, keep, sources)
        return found

    def load_into(
        self,
        keys: Sequence[KvBlockKey],
        sink: Callable[[int, memoryview], bool],
        sources: Mapping[str, str] | None = None,
        into: Callable[[int, int], memoryview | None] | None = None,
    ) -> list[bool]:
        """Hand each block, as it arrives intact, to `sink(index in keys, bytes)`, which
        copies what it needs (the view is reused after the call) and says whether it
        could; per key whether it was delivered. Where from: as `get_many`. With `into`
        (`BlockBatches.get_each`'s), a block from a data port is received where it says.

        The data ports are read on the calling thread, the sink called there too: no
        hop through this pool's loop, so a load inside a busy engine process (whose
        main thread holds the GIL between its steps) waits for the GIL only when it
        returns from the socket, not at every hand-over between threads."""
        started = time.perf_counter()
        sizes = [0] * len(keys)

        def counted(i: int, view: memoryview) -> bool:
            sizes[i] = view.nbytes
            return sink(i, view)

        try:
            taken = self._load(list(keys), counted, dict(sources or {}), into)
        except TimeoutError:
            taken = [False] * len(keys)
        loaded = sum(taken)
        self.counters.blocks_loaded += loaded
        self.counters.bytes_loaded += sum(n for n, ok in zip(sizes, taken, strict=True) if ok)
        self.counters.blocks_load_failed += len(keys) - loaded
        self.counters.load_seconds += time.perf_counter() - started
        return taken

    def _load(self, keys: list[KvBlockKey], sink, sources: dict[str, str], into) -> list[bool]:
        """What the node's data port holds in one request; what the plan names on a peer
        node, from that node's data port in one request per node; the rest (or all, the
        ports unreachable) one gRPC Get each, with `allow_remote`."""
        taken = [False] * len(keys)
        address = self._port(self.store_address)
        if address:
            taken = self._batches.get_each(address, keys, sink, into)
            self.counters.data_port_batches += 1
        by_peer: dict[str, list[int]] = {}
        for i, done in enumerate(taken):
            peer = None if done else sources.get(keys[i].block_hash)
            if peer and peer != self.store_address:
                by_peer.setdefault(peer, []).append(i)
        for peer, indices in by_peer.items():
            port = self._port(peer)
            if not port:
                continue

            def to_sink(j: int, view: memoryview, indices=indices) -> bool:
                return sink(indices[j], view)

            def to_into(j: int, nbytes: int, indices=indices) -> memoryview | None:
                return into(indices[j], nbytes) if into is not None else None

            got = self._batches.get_each(port, [keys[i] for i in indices], to_sink, to_into)
            self.counters.data_port_batches += 1
            for i, done in zip(indices, got, strict=True):
                if done:
                    taken[i] = True
                    self.counters.blocks_loaded_from_peers += 1
        missing = [i for i, done in enumerate(taken) if not done]
        if missing:
            fetched = self._call(self._fetch_each([keys[i] for i in missing]))
            for i, payload in zip(missing, fetched, strict=True):
                if payload is not None:
                    taken[i] = deliver(sink, i, memoryview(payload).cast("B"))
        return taken

    async def _fetch_each(self, keys: list[KvBlockKey]) -> list[bytes | None]:
        """Each block by a gRPC Get with `allow_remote` (None where it failed)."""

        async def fetch(key: KvBlockKey) -> bytes | None:
            try:
                payload, _tier = await self._client.get(key, allow_remote=True)
                return payload
            except QuillCacheError as exc:
                logger.warning("pool load of %s failed: %s", key.block_hash, exc)
                return None

        return list(await asyncio.gather(*(fetch(key) for key in keys)))

    def _port(self, address: str) -> str:
        """`_port_of`, from the calling thread: answered from what is known when it can."""
        known = self._ports.get(address)
        if known is not None and (known[0] or time.monotonic() < known[1]):
            return known[0]
        return self._call(self._port_of(address))

    async def _port_of(self, address: str) -> str:
        """A node's block-data address, this node's or a peer's: its Unix socket when
        that is on this host (`unix:PATH`: no TLS to pay on the engine's own blocks),
        else its TCP port ("" if it has none or cannot be asked now)."""
        known = self._ports.get(address)
        if known is not None and (known[0] or time.monotonic() < known[1]):
            return known[0]
        if len(self._ports) >= MAX_PORTS:
            self._ports.clear()
        own = address == self.store_address
        client = (
            self._client if own else StoreClient(address, timeout_s=self.timeout_s, tls=self._tls)
        )
        try:
            stats = await client.stats()
            port = str(stats.get("data_address", ""))
            local = str(stats.get("data_socket", ""))
            if local and self.local_sockets and _is_socket(local):
                port = UNIX_PREFIX + local
        except QuillCacheError as exc:
            logger.warning("cannot ask %s for its data port: %s", address, exc)
            port = ""
        finally:
            if not own:
                await client.close()
        self._ports[address] = (port, time.monotonic() + DATA_PORT_RETRY_S)
        return port

    # --- saves (never wait) -------------------------------------------------------------

    def save_later(self, blocks: Sequence[tuple[KvBlockKey, bytes]]) -> int:
        """Queue blocks for the store; returns how many were queued (the rest dropped)."""
        size = sum(len(b) for _, b in blocks)
        with self._lock:
            if self._pending_bytes + size > self.max_pending_bytes:
                self.counters.blocks_save_dropped += len(blocks)
                return 0
            self._pending_bytes += size
        asyncio.run_coroutine_threadsafe(self._save(list(blocks), size), self._loop)
        return len(blocks)

    async def _save(self, blocks: list[tuple[KvBlockKey, bytes]], size: int) -> None:
        started = time.perf_counter()
        try:
            rest = blocks
            address = await self._port_of(self.store_address)
            if address:
                rest = await self._save_batch(address, blocks)
            for key, payload in rest:
                try:
                    await self._client.put(key, payload, tier=CacheTier.CPU_DRAM)
                    self.counters.blocks_saved += 1
                    self.counters.bytes_saved += len(payload)
                except QuillCacheError as exc:
                    self.counters.blocks_save_dropped += 1
                    logger.warning("pool save of %s failed: %s", key.block_hash, exc)
        finally:
            with self._lock:
                self._pending_bytes -= size
            elapsed_s = time.perf_counter() - started
            self.counters.save_seconds += elapsed_s
            if self.on_saved is not None:  # the connector's save histogram (metrics.py)
                self.on_saved(elapsed_s)

    async def _save_batch(
        self, address: str, blocks: list[tuple[KvBlockKey, bytes]]
    ) -> list[tuple[KvBlockKey, bytes]]:
        """Put `blocks` as one batch on the data port; returns those to send over gRPC
        instead (the port failed before they were stored)."""
        loop = asyncio.get_running_loop()
        outcomes = await loop.run_in_executor(None, self._batches.put_many, address, blocks)
        self.counters.data_port_batches += 1
        rest = []
        for (key, payload), outcome in zip(blocks, outcomes, strict=True):
            if isinstance(outcome, NodeUnavailable):
                rest.append((key, payload))
            elif isinstance(outcome, QuillCacheError):  # refused: capacity, checksum
                self.counters.blocks_save_dropped += 1
                logger.warning("pool save of %s refused: %s", key.block_hash, outcome)
            else:
                self.counters.blocks_saved += 1
                self.counters.bytes_saved += len(payload)
        if rest:
            logger.warning("data port %s failed: %d blocks go over gRPC", address, len(rest))
        return rest

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued save is done (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._pending_bytes == 0:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self.flush(5.0)
        with_timeout = asyncio.run_coroutine_threadsafe(self._client.close(), self._loop)
        try:
            with_timeout.result(5.0)
        finally:
            self._batches.close()
            self._loop.call_soon_threadsafe(self._loop.stop)
