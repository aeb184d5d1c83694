"""Transfer gRPC servicer: proto <-> domain translation only (the work is in `mover`)."""

from __future__ import annotations

import asyncio
import logging

from quillcache.v1 import transfer_pb2, transfer_pb2_grpc
from quillcache_core.errors import InvalidArgument, NotFound
from quillcache_core.model import CacheTier
from quillcache_core.process.metrics import Histogram
from quillcache_core.registry import NodeRegistry
from quillcache_core.registry.records import record_data_address
from quillcache_core.rpc.server import stream_errors
from quillcache_core.security.tls import Tls
from quillcache_core.storeclient import wire
from quillcache_core.storeclient.blockcodec import check_field_size
from quillcache_core.storeclient.client import StoreClient
from quillcache_core.wire.tiers import tier_from_proto
from quillcache_transfer.config import TransferConfig
from quillcache_transfer.mover import Progress, TransferOptions, TransferStats, run_transfer

logger = logging.getLogger(__name__)

SERVICE_NAME = transfer_pb2.DESCRIPTOR.services_by_name["Transfer"].full_name
MIN_CHUNK_BYTES = 16 * 1024
MAX_CHUNK_BYTES = 8 * 1024 * 1024


def progress_to_proto(p: Progress) -> transfer_pb2.TransferProgress:
    return transfer_pb2.TransferProgress(
        blocks_done=p.blocks_done,
        blocks_total=p.blocks_total,
        bytes_done=p.bytes_done,
        bytes_per_s=p.bytes_per_s,
        results=[
            transfer_pb2.BlockResult(
                key=wire.key_to_proto(o.key),
                ok=o.ok,
                error=o.error,
                bytes=o.bytes,
                skipped=o.skipped,
                code=o.code,
            )
            for o in p.results
        ],
        finished=p.finished,
        blocks_failed=p.blocks_failed,
        blocks_skipped=p.blocks_skipped,
        elapsed_s=p.elapsed_s,
    )


class TransferServicer(transfer_pb2_grpc.TransferServicer):
    def __init__(
        self,
        config: TransferConfig,
        registry: NodeRegistry,
        stats: TransferStats,
        tls: Tls | None = None,
    ):
        self.config = config
        self.tls = tls
        self.registry = registry
        self.stats = stats
        self._clients: dict[str, StoreClient] = {}
        self.requests: dict[str, int] = {}
        self.paths: dict[str, int] = {}  # requests per data path
        # Each request's time to its last block, by mode and path (None: not timed).
        self.seconds: Histogram | None = None

    async def _store(self, node_id: str) -> StoreClient:
        return (await self._resolve(node_id))[0]

    async def _resolve(self, node_id: str) -> tuple[StoreClient, str]:
        """The node's client and its block-data address ("" if it has none)."""
        record = await self.registry.get("store", node_id)
        if record is None or not record.address:
            raise NotFound(f"store node {node_id!r} is not registered")
        data_address = record_data_address(record)
        client = self._clients.get(record.address)
        if client is None:
            client = StoreClient(
                record.address,
                timeout_s=self.config.block_timeout_s,
                chunk_bytes=self.config.chunk_bytes,
                retries=self.config.retries,
                backoff_s=self.config.backoff_s,
                tls=self.tls,
            )
            self._clients[record.address] = client
        return client, data_address

    def _source_data_address(self, node_id: str, known: str):
        """The first call returns `known` (just resolved); later ones (before each
        retry or next Pull) re-resolve the source's data address (it may have restarted
        on another port), keeping the last known one while its record is gone."""
        last = [known]
        fresh = [True]

        async def resolve() -> str:
            if fresh[0]:
                fresh[0] = False
                return last[0]
            record = await self.registry.get("store", node_id)
            if record is not None and record_data_address(record):
                last[0] = record_data_address(record)
            return last[0]

        return resolve

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()

    async def _run(self, mode: str, request, context):
        cfg = self.config
        if not request.source_node or not request.destination_node:
            raise InvalidArgument("source_node and destination_node are required")
        check_field_size("source_node", request.source_node)
        check_field_size("destination_node", request.destination_node)
        if request.source_node == request.destination_node:
            raise InvalidArgument("source_node and destination_node are the same node")
        if not request.keys:
            raise InvalidArgument("keys is empty: nothing to transfer")
        keys = [wire.key_from_proto(k, f"keys[{i}]") for i, k in enumerate(request.keys)]
        if mode == "prefetch":
            tier = CacheTier.CPU_DRAM
        elif request.destination_tier == 0:
            tier = CacheTier.CPU_DRAM
        else:
            tier = tier_from_proto(request.destination_tier)
            if tier not in (CacheTier.CPU_DRAM, CacheTier.LOCAL_SSD):
                raise InvalidArgument("destination_tier must be TIER_CPU_DRAM or TIER_LOCAL_SSD")
        window = request.window or cfg.default_window
        if window > cfg.max_window:
            raise InvalidArgument(f"window {window} exceeds the maximum of {cfg.max_window}")
        chunk = request.chunk_bytes or cfg.chunk_bytes
        if not MIN_CHUNK_BYTES <= chunk <= MAX_CHUNK_BYTES:
            raise InvalidArgument(
                f"chunk_bytes must be in {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}, got {chunk}"
            )
        # Both at once (a registry round trip each); an unknown source is named first.
        resolved = await asyncio.gather(
            self._resolve(request.source_node),
            self._resolve(request.destination_node),
            return_exceptions=True,
        )
        for outcome in resolved:
            if isinstance(outcome, BaseException):
                raise outcome
        (source, source_data), (destination, destination_data) = resolved
        # Both ends must have a data port: the destination's Pull needs its own.
        data_address = None
        if cfg.data_path and source_data and destination_data:
            data_address = self._source_data_address(request.source_node, source_data)
        opts = TransferOptions(
            window=window,
            chunk_bytes=chunk,
            tier=tier,
            durable=request.durable and mode != "prefetch",
            retries=cfg.retries,
            backoff_s=cfg.backoff_s,
            block_timeout_s=cfg.block_timeout_s,
            progress_every=cfg.progress_every_blocks,
            progress_interval_s=cfg.progress_interval_s,
        )
        self.requests[mode] = self.requests.get(mode, 0) + 1
        names = (request.source_node, request.destination_node)
        path = "data" if data_address is not None else "grpc"
        self.paths[path] = self.paths.get(path, 0) + 1
        logger.debug("%s of %d blocks %s -> %s (%s path)", mode, len(keys), *names, path)
        async for progress in run_transfer(
            mode, source, destination, names, keys, opts, self.stats, data_address=data_address
        ):
            if progress.finished:
                if self.seconds is not None:
                    self.seconds.observe(progress.elapsed_s, mode=mode, path=path)
                logger.info(
                    "%s %s -> %s (%s path): %d blocks, %d failed, %d skipped, %.1f MB/s",
                    mode,
                    *names,
                    path,
                    progress.blocks_total,
                    progress.blocks_failed,
                    progress.blocks_skipped,
                    progress.bytes_per_s / 1e6,
                )
            yield progress_to_proto(progress)

    @stream_errors
    async def Copy(self, request, context):
        async for message in self._run("copy", request, context):
            yield message

    @stream_errors
    async def Move(self, request, context):
        async for message in self._run("move", request, context):
            yield message

    @stream_errors
    async def Prefetch(self, request, context):
        async for message in self._run("prefetch", request, context):
            yield message
