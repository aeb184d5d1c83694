"""PooledStore: a node's reads, from its own tiers first, else from a peer node.

`read(key, allow_remote=...)` returns a `ServedBlock` (a verified payload view, its
checksum, the tier and the node that served it). Local reads try a zero-copy pin of
the DRAM copy (checksum verified before serving), then `TieredStore.get` (DRAM copy or
SSD read, verified; a corrupt copy is dropped, reported and never served).

On a local miss with `allow_remote`, the block is fetched from a peer: `locate(key)`
(the conductor's index) names the nodes holding it; for each, best tier first,
`pull(peer, key)` pulls it over the block data path (the peer's raw TCP data port,
straight into this node's DRAM pool, checksum verified) when the peer has one;
otherwise `copy_here(peer, key)` has the transfer service copy it into this node (or,
without a transfer service, `fetch(peer, key)` returns its bytes and this node stores
them). The copy is kept, and the local read then serves it. Concurrent reads of one
missing block share one fetch.

The network calls are injected, so this module holds no gRPC, etcd or socket code.
Call from one event loop; disk and checksum work runs on `executor`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from quillcache_core.errors import Corrupt, NodeUnavailable, NotFound, QuillCacheError
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.storeclient.blockcodec import payload_checksum
from quillcache_store.tiers.tiered import TieredStore

log = logging.getLogger(__name__)

# Verifying a pinned DRAM block inline costs ~0.05 ms per MiB; bigger ones go to a thread.
_INLINE_VERIFY_BYTES = 1 << 20
_TIER_ORDER = {CacheTier.HBM: 0, CacheTier.CPU_DRAM: 1, CacheTier.LOCAL_SSD: 2}


@dataclass(frozen=True, slots=True)
class PeerLocation:
    """A node holding a block, per the conductor: its id, gRPC address and tier."""

    node_id: str
    address: str
    tier: CacheTier


class ServedBlock:
    """A verified payload to serve; call `release()` once its bytes are sent."""

    __slots__ = ("payload", "checksum", "tier", "served_from", "_release")

    def __init__(self, payload, checksum: int, tier: CacheTier, served_from: str, release=None):
        self.payload: memoryview = payload
        self.checksum = checksum
        self.tier = tier
        self.served_from = served_from
        self._release = release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class PooledStore:
    """Local tiers, then peers. See the module docstring."""

    def __init__(
        self,
        node_id: str,
        tiered: TieredStore,
        executor: Executor,
        *,
        locate: Callable[[KvBlockKey], Awaitable[list[PeerLocation]]] | None = None,
        copy_here: Callable[[PeerLocation, KvBlockKey], Awaitable[None]] | None = None,
        fetch: Callable[[PeerLocation, KvBlockKey], Awaitable[bytes]] | None = None,
        pull: Callable[[PeerLocation, KvBlockKey], Awaitable[int | None]] | None = None,
    ) -> None:
        self.node_id = node_id
        self.tiered = tiered
        self._executor = executor
        self._locate = locate
        self._copy_here = copy_here
        self._fetch = fetch
        self._pull = pull
        self._inflight: dict[KvBlockKey, asyncio.Future] = {}
        self.hits = 0
        self.misses = 0
        self.peer_fetches = 0
        self.peer_fetch_failures = 0
        self.peer_fetch_bytes = 0

    @property
    def remote_enabled(self) -> bool:
        return (
            self._locate is not None and (self._pull or self._copy_here or self._fetch) is not None
        )

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # --- reads --------------------------------------------------------------------------

    async def read(self, key: KvBlockKey, *, allow_remote: bool = False) -> ServedBlock:
        """The block, verified; NotFound if neither this node (nor, with `allow_remote`,
        any peer) has a good copy."""
        try:
            block = await self.read_local(key)
        except NotFound:
            if not (allow_remote and self.remote_enabled):
                self.misses += 1
                raise
        else:
            self.hits += 1
            return block
        source = await self._fetch_once(key)
        try:
            block = await self.read_local(key)
        except NotFound:
            self.misses += 1
            raise NotFound(
                f"block {key.block_hash} was fetched from {source} but is no longer here"
            ) from None
        block.served_from = source
        return block

    async def read_local(self, key: KvBlockKey) -> ServedBlock:
        """This node's copy: a pinned DRAM view when possible, else a verified read."""
        pinned = self.tiered.dram.pin(key)
        if pinned is not None:
            view = pinned.payload
            if view.nbytes <= _INLINE_VERIFY_BYTES:
                ok = payload_checksum(view) == pinned.checksum
            else:
                ok = await self._run(_verify, view, pinned.checksum)
            if ok:
                return ServedBlock(
                    view, pinned.checksum, CacheTier.CPU_DRAM, self.node_id, pinned.release
                )
            pinned.release()
            # TieredStore.get re-reads it, drops the corrupt copy, reports it and falls
            # through to the SSD copy if there is one.
            log.warning("DRAM copy of %s failed its checksum", key.block_hash)
        payload, tier = await self._run(self.tiered.get, key)
        view = memoryview(payload)
        checksum = await self._run(payload_checksum, view)
        return ServedBlock(view, checksum, tier, self.node_id)

    # --- peer fetch -----------------------------------------------------------------------

    async def _fetch_once(self, key: KvBlockKey) -> str:
        """Fetch a block from a peer into this node; one fetch per key at a time."""
        future = self._inflight.get(key)
        if future is not None:
            return await asyncio.shield(future)
        future = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            source = await self._fetch_remote(key)
        except BaseException as exc:
            if isinstance(exc, Exception):
                future.set_exception(exc)
                future.exception()  # retrieved: no "never retrieved" warning without waiters
            else:
                future.cancel()
            raise
        else:
            future.set_result(source)
            return source
        finally:
            self._inflight.pop(key, None)

    async def _fetch_remote(self, key: KvBlockKey) -> str:
        if self._locate is None:
            raise NotFound(f"block {key.block_hash} is not stored on this node")
        try:
            found = await self._locate(key)
        except QuillCacheError as exc:
            self.misses += 1
            self.peer_fetch_failures += 1
            raise NotFound(
                f"block {key.block_hash} is not on this node and its peers could not be "
                f"located: {exc}"
            ) from None
        peers = sorted(
            (loc for loc in found if loc.node_id != self.node_id),
            key=lambda loc: _TIER_ORDER.get(loc.tier, 9),
        )
        if not peers:
            self.misses += 1
            raise NotFound(f"block {key.block_hash} is not stored on this node nor on a peer")
        errors = []
        for peer in peers:
            try:
                await self._fetch_from(peer, key)
            except (NotFound, NodeUnavailable, Corrupt) as exc:
                errors.append(f"{peer.node_id}: {exc}")
                log.info("peer fetch of %s from %s failed: %s", key.block_hash, peer.node_id, exc)
                continue
            self.peer_fetches += 1
            log.debug("fetched %s from %s (%s)", key.block_hash, peer.node_id, peer.tier)
            return peer.node_id
        self.misses += 1
        self.peer_fetch_failures += 1
        raise NotFound(
            f"block {key.block_hash} is not on this node and no peer served it: "
            + "; ".join(errors)
        )

    async def _fetch_from(self, peer: PeerLocation, key: KvBlockKey) -> None:
        if self._pull is not None:
            # The block data path; None when the peer has no data port.
            pulled = await self._pull(peer, key)
            if pulled is not None:
                self.peer_fetch_bytes += pulled
                return
        if self._copy_here is not None:
            try:
                await self._copy_here(peer, key)
                info = self.tiered.dram.info(key) or self.tiered.ssd.info(key)
                self.peer_fetch_bytes += info[0] if info else 0
                return
            except NodeUnavailable as exc:
                if self._fetch is None:
                    raise
                log.debug(
                    "transfer service unavailable (%s); fetching %s directly", exc, key.block_hash
                )
        if self._fetch is None:
            raise NodeUnavailable("no way to fetch from peers is configured")
        data = await self._fetch(peer, key)
        await self._run(lambda: self.tiered.put(key, data))
        self.peer_fetch_bytes += len(data)


def _verify(view: memoryview, checksum: int) -> bool:
    return payload_checksum(view) == checksum
