"""A store node's outbound calls: the conductor, the transfer service, peer stores.

Each link finds its target from a fixed address, else through the registry (the first
live node of the kind), and forgets a discovered address after a failed call so the
next call looks again. Every call has a deadline.
"""

from __future__ import annotations

import logging
import time

import grpc
import grpc.aio

from quillcache.v1 import (
    common_pb2,
    conductor_pb2,
    conductor_pb2_grpc,
    transfer_pb2,
    transfer_pb2_grpc,
)
from quillcache_core.errors import NodeUnavailable, NotFound
from quillcache_core.model import KvBlockKey
from quillcache_core.registry import NodeRegistry
from quillcache_core.registry.records import record_data_address
from quillcache_core.rpc.server import error_from_status
from quillcache_core.security.tls import Tls, grpc_channel
from quillcache_core.storeclient import wire
from quillcache_core.storeclient.client import CHANNEL_OPTIONS, StoreClient, domain_error
from quillcache_core.wire.tiers import tier_from_proto
from quillcache_store.pooled import PeerLocation

log = logging.getLogger(__name__)


class _Target:
    """A gRPC channel to a fixed address or to the first registry node of `kind`."""

    def __init__(
        self, kind: str, address: str, registry: NodeRegistry | None, tls: Tls | None
    ) -> None:
        self.kind = kind
        self.tls = tls
        self.fixed = address
        self.registry = registry
        self._address = ""
        self._channel: grpc.aio.Channel | None = None

    async def channel(self) -> grpc.aio.Channel:
        if self._channel is not None:
            return self._channel
        address = self.fixed
        if not address and self.registry is not None:
            nodes = [n for n in await self.registry.list(self.kind) if n.address]
            if nodes:
                address = nodes[0].address
        if not address:
            raise NodeUnavailable(f"no {self.kind} address configured or registered")
        self._address = address
        self._channel = grpc_channel(address, self.tls, CHANNEL_OPTIONS)
        log.info("using %s at %s", self.kind, address)
        return self._channel

    async def failed(self) -> None:
        """Forget a discovered address (a fixed one is kept: gRPC reconnects to it)."""
        if self.fixed or self._channel is None:
            return
        channel, self._channel = self._channel, None
        await channel.close()

    async def available(self) -> bool:
        try:
            await self.channel()
        except NodeUnavailable:
            return False
        return True

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()


class ConductorLink:
    """IngestKvEvents and Locate on the conductor."""

    def __init__(
        self, address: str, registry: NodeRegistry | None, timeout_s: float, tls: Tls | None
    ) -> None:
        self._target = _Target("conductor", address, registry, tls)
        self.timeout_s = timeout_s

    async def _stub(self) -> conductor_pb2_grpc.ConductorStub:
        return conductor_pb2_grpc.ConductorStub(await self._target.channel())

    async def ingest(self, batch: conductor_pb2.KvEventBatch) -> float:
        """Deliver one batch; raises on any failure (the reporter retries it). Returns
        how long the conductor asks the next batches to be held (a standby's, seconds)."""
        stub = await self._stub()
        try:
            reply = await stub.IngestKvEvents(batch, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                await self._target.failed()
            raise domain_error(exc) from None
        if reply.rejected:
            log.warning(
                "conductor rejected %d of %d residency events: %s",
                reply.rejected,
                len(batch.events),
                "; ".join(reply.errors[:3]),
            )
        return reply.linger_ms / 1000

    async def reset(self) -> None:
        """Look the conductor up again on the next call (it may have moved)."""
        await self._target.failed()

    async def locate(self, key: KvBlockKey) -> list[PeerLocation]:
        """Store nodes holding the block under its identity, per the conductor's index."""
        stub = await self._stub()
        request = conductor_pb2.LocateRequest(
            identity=wire.identity_of(key), block_hashes=[key.block_hash]
        )
        try:
            reply = await stub.Locate(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            await self._target.failed()
            raise domain_error(exc) from None
        out = []
        for block in reply.blocks:
            for loc in block.locations:
                tier = tier_from_proto(loc.tier)
                if loc.kind == "store" and tier is not None:
                    out.append(PeerLocation(loc.node_id, loc.address, tier))
        return out

    async def close(self) -> None:
        await self._target.close()


class TransferLink:
    """Transfer.Copy of one block from a peer into this node."""

    def __init__(
        self,
        node_id: str,
        address: str,
        registry: NodeRegistry | None,
        timeout_s: float,
        tls: Tls | None,
    ) -> None:
        self.node_id = node_id
        self._target = _Target("transfer", address, registry, tls)
        self.timeout_s = timeout_s

    async def available(self) -> bool:
        return await self._target.available()

    async def copy_here(self, peer: PeerLocation, key: KvBlockKey) -> None:
        """Copy `key` from `peer` into this node's DRAM; raises the block's error."""
        stub = transfer_pb2_grpc.TransferStub(await self._target.channel())
        request = transfer_pb2.TransferRequest(
            source_node=peer.node_id,
            destination_node=self.node_id,
            keys=[wire.key_to_proto(key)],
            destination_tier=common_pb2.TIER_CPU_DRAM,
            window=1,
        )
        last = None
        try:
            async for progress in stub.Copy(request, timeout=self.timeout_s):
                last = progress
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                await self._target.failed()
            raise domain_error(exc) from None
        if last is None or not last.finished or not last.results:
            raise NodeUnavailable("transfer service ended Copy without a final result")
        result = last.results[0]
        if not result.ok:
            code = getattr(grpc.StatusCode, result.code, grpc.StatusCode.UNAVAILABLE)
            raise error_from_status(code, f"transfer from {peer.node_id}: {result.error}")

    async def close(self) -> None:
        await self._target.close()


DATA_ADDRESS_TTL_S = 5.0


class PeerStores:
    """StoreClients to peer nodes, by address (resolved through the registry), and
    their block-data addresses."""

    def __init__(self, registry: NodeRegistry | None, timeout_s: float, tls: Tls | None) -> None:
        self.registry = registry
        self.timeout_s = timeout_s
        self.tls = tls
        self._clients: dict[str, StoreClient] = {}
        self._data_addresses: dict[str, tuple[str, float]] = {}

    async def data_address_of(self, peer: PeerLocation) -> str:
        """The peer's block-data address from its registry record ("" if it has none).

        Cached for a few seconds; `forget` drops it after a failure."""
        cached = self._data_addresses.get(peer.node_id)
        now = time.monotonic()
        if cached is not None and now - cached[1] < DATA_ADDRESS_TTL_S:
            return cached[0]
        address = ""
        if self.registry is not None:
            record = await self.registry.get("store", peer.node_id)
            if record is not None:
                address = record_data_address(record)
        self._data_addresses[peer.node_id] = (address, now)
        return address

    def forget(self, node_id: str) -> None:
        self._data_addresses.pop(node_id, None)

    async def address_of(self, peer: PeerLocation) -> str:
        if self.registry is not None:
            record = await self.registry.get("store", peer.node_id)
            if record is not None and record.address:
                return record.address
        if peer.address:
            return peer.address
        raise NotFound(f"store node {peer.node_id!r} is not registered")

    async def fetch(self, peer: PeerLocation, key: KvBlockKey) -> bytes:
        address = await self.address_of(peer)
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = StoreClient(
                address, timeout_s=self.timeout_s, tls=self.tls
            )
        data, _tier = await client.get(key)
        return data

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()


__all__ = ["ConductorLink", "PeerStores", "TransferLink"]
