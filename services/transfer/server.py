"""Wires the transfer service: servicer, health, reflection, metrics, registry."""

from __future__ import annotations

import logging
import time

import grpc

from quillcache.v1 import transfer_pb2_grpc
from quillcache_core.process.malloc import tune_malloc_for_large_values
from quillcache_core.process.metrics import LATENCY_BUCKETS_S, MetricsRegistry
from quillcache_core.registry import NodeRecord, open_registry
from quillcache_core.rpc.server import (
    add_health_and_reflection,
    grpc_server,
    set_serving,
    start_metrics_app,
    start_server,
)
from quillcache_core.storeclient.client import MAX_MESSAGE_BYTES
from quillcache_transfer.config import TransferConfig
from quillcache_transfer.mover import TransferStats
from quillcache_transfer.servicer import SERVICE_NAME, TransferServicer

logger = logging.getLogger(__name__)


class TransferServer:
    """The transfer process. `start()`, `ready_line()`, `stop()` (see service.py)."""

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self.metrics = MetricsRegistry(process=True)
        self.tls = config.tls("transfer")
        self.registry = open_registry(config.registry, self.tls)
        self.stats = TransferStats()
        self.servicer = TransferServicer(config, self.registry, self.stats, self.tls)
        self.server: grpc.aio.Server | None = None
        self.grpc_port = 0
        self.metrics_port = 0
        self._runner = None
        self._registered = False
        self._register_metrics()

    def _register_metrics(self) -> None:
        m, stats, servicer = self.metrics, self.stats, self.servicer
        m.gauge(
            "transfer_blocks_total",
            "blocks finished, by mode and result (ok, failed, skipped)",
            ["mode", "result"],
            read=lambda: [((mode, result), n) for (mode, result), n in stats.blocks.items()],
        )
        m.gauge(
            "transfer_bytes_total",
            "bytes copied, by mode",
            ["mode"],
            read=lambda: [((mode,), n) for mode, n in stats.bytes.items()],
        )
        m.gauge(
            "transfer_requests_total",
            "Copy/Move/Prefetch requests, by mode",
            ["mode"],
            read=lambda: [((mode,), n) for mode, n in servicer.requests.items()],
        )
        m.gauge(
            "transfer_requests_by_path_total",
            "requests by the path their bytes took ('data': store to store over the "
            "sources' block-data ports; 'grpc': streamed through this service)",
            ["path"],
            read=lambda: [((path,), n) for path, n in servicer.paths.items()],
        )
        servicer.seconds = m.histogram(
            "transfer_seconds",
            "a Copy, Move or Prefetch request from its start to its last block done, by "
            "mode and the path its bytes took",
            LATENCY_BUCKETS_S,
            ["mode", "path"],
        )
        m.gauge(
            "transfer_retries_total",
            "block retries after UNAVAILABLE",
            read=lambda: [((), stats.retries)],
        )
        m.gauge(
            "transfer_blocks_inflight",
            "blocks being copied now",
            read=lambda: [((), stats.inflight)],
        )

    async def start(self) -> None:
        cfg = self.config
        # Chunks are fresh 1-2 MiB buffers: keep freed memory for reuse (~2x faster).
        tune_malloc_for_large_values()
        server = grpc_server(
            self.tls,
            self.metrics,
            [
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        transfer_pb2_grpc.add_TransferServicer_to_server(self.servicer, server)
        health = add_health_and_reflection(server, [SERVICE_NAME])
        self.grpc_port = await start_server(server, cfg.host, cfg.port, self.tls)
        self.server = server
        self._runner, self.metrics_port = await start_metrics_app(
            self.metrics, cfg.host, cfg.metrics_port, tls=self.tls
        )
        await self.registry.register(
            NodeRecord(
                kind="transfer",
                id=cfg.node_id,
                address=f"{cfg.advertised_host}:{self.grpc_port}",
                locality_domain="",
                start_time_s=time.time(),
            ),
            cfg.lease_ttl_s,
        )
        self._registered = True
        await set_serving(health, [SERVICE_NAME])
        logger.info("transfer %s serving on %s:%d", cfg.node_id, cfg.host, self.grpc_port)

    def ready_line(self) -> str:
        host = self.config.advertised_host
        return (
            f"READY transfer grpc={host}:{self.grpc_port} "
            f"metrics={'https' if self.tls else 'http'}://{host}:{self.metrics_port}"
        )

    async def stop(self) -> None:
        if self._registered:
            try:
                await self.registry.deregister("transfer", self.config.node_id)
            except Exception:  # noqa: BLE001 - the lease expires anyway
                logger.warning("could not deregister; the lease will expire")
        if self.server is not None:
            await self.server.stop(grace=1.0)
        await self.servicer.close()
        await self.registry.close()
        if self._runner is not None:
            await self._runner.cleanup()
