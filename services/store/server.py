"""Wires a store node: tiers, servicer, health, reflection, metrics, registry, reporter."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from quillcache_core.errors import NodeUnavailable
from quillcache_core.process.metrics import MetricsRegistry
from quillcache_core.registry import NodeRecord, open_registry
from quillcache_core.rpc.server import (
    add_health_and_reflection,
    error_from_status,
    grpc_server,
    set_serving,
    start_metrics_app,
    start_server,
)
from quillcache_core.storeclient.client import MAX_MESSAGE_BYTES
from quillcache_store.config import StoreConfig
from quillcache_store.datapath.pull import BlockPuller
from quillcache_store.datapath.server import BlockDataServer
from quillcache_store.links import PeerStores, TransferLink
from quillcache_store.pooled import PooledStore
from quillcache_store.replicas import ConductorReplicas
from quillcache_store.servicer import SERVICE_NAME, ByteBudget, StoreServicer
from quillcache_store.tiers.dram import DramTier
from quillcache_store.tiers.ssd import SsdTier
from quillcache_store.tiers.tiered import TieredStore
from quillcache_store.timings import StoreTimings

logger = logging.getLogger(__name__)

VERSION = "0.1.0"


class StoreServer:
    """One store node process. `start()`, `ready_line()`, `stop()` (see service.py)."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.metrics = MetricsRegistry(process=True)
        # Each block's Get and Put time, by tier: gRPC and the data port (timings.py).
        self.timings = StoreTimings(self.metrics)
        self.tls = tls = config.tls("store")
        self.registry = open_registry(config.registry, tls)
        # A memory registry knows only this process: discovery needs etcd.
        discovering = None if config.registry.strip().startswith("memory") else self.registry
        self.transfer: TransferLink | None = None
        if config.transfer.lower() != "none":
            self.transfer = TransferLink(
                config.node_id, config.transfer, discovering, config.rpc_timeout_s, tls
            )
        self.peers = PeerStores(discovering, config.rpc_timeout_s, tls)
        self._discovering = discovering is not None
        self._reporting = bool(config.conductor) or discovering is not None
        self.executor = ThreadPoolExecutor(config.worker_threads, thread_name_prefix="store-io")
        # Every conductor replica gets every residency event (replicas.py).
        self.conductor = self.reporter = ConductorReplicas(
            config.node_id,
            config.conductor,
            config.rpc_timeout_s,
            tls,
            self._snapshot,
            max_queue=config.event_queue_max,
            max_batch=config.event_batch_max,
            linger_s=config.event_linger_s,
        )
        self.tiered: TieredStore | None = None
        self.pooled: PooledStore | None = None
        self.servicer: StoreServicer | None = None
        self.server: grpc.aio.Server | None = None
        self.data_server: BlockDataServer | None = None
        self._socket_dir = ""  # the private directory of an 'auto' data socket
        self.puller: BlockPuller | None = None
        self.grpc_port = 0
        self.metrics_port = 0
        self.data_port = 0
        self._ssd_corrupt_on_open = 0
        self._runner = None
        self._tasks: list[asyncio.Task] = []
        self._registered = False

    # --- wiring ----------------------------------------------------------------------------

    def _open_tiers(self) -> TieredStore:
        cfg = self.config
        dram = DramTier(cfg.dram_capacity_bytes, prefault=cfg.dram_prefault)
        ssd = SsdTier(
            os.path.join(cfg.data_dir, "ssd"),
            cfg.ssd_capacity_bytes,
            group_commit_window_s=cfg.group_commit_window_s,
            lazy_commit_window_s=cfg.lazy_commit_window_s,
        )
        self._ssd_corrupt_on_open = ssd.stats()["corrupt_blocks"]
        return TieredStore(dram, ssd, on_event=self._on_tier_event)

    def _on_tier_event(self, event) -> None:
        if self._reporting:
            self.reporter.offer(event)

    def _snapshot(self):
        return self.tiered.residency() if self.tiered is not None else []

    async def _copy_here(self, peer, key) -> None:
        if self.transfer is None:
            raise NodeUnavailable("no transfer service configured")
        await self.transfer.copy_here(peer, key)

    async def _pull_here(self, peer, key) -> int | None:
        """Pull one block from a peer's data port into this node; None if it has none."""
        address = await self.peers.data_address_of(peer)
        if not address or self.puller is None:
            return None
        outcomes = []
        await asyncio.get_running_loop().run_in_executor(
            self.executor,
            functools.partial(self.puller.pull, address, [key], on_result=outcomes.append),
        )
        outcome = outcomes[0]
        if outcome.ok:
            return outcome.bytes
        if outcome.code == "UNAVAILABLE":
            self.peers.forget(peer.node_id)  # it may have restarted elsewhere
        code = getattr(grpc.StatusCode, outcome.code, grpc.StatusCode.UNAVAILABLE)
        raise error_from_status(code, f"data path from {peer.node_id}: {outcome.error}")

    @property
    def metrics_scheme(self) -> str:
        return "https" if self.tls else "http"

    async def start(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        self.tiered = await loop.run_in_executor(self.executor, self._open_tiers)
        if cfg.data_port >= 0:
            self.puller = BlockPuller(
                self.tiered,
                max_block_bytes=cfg.max_block_bytes,
                io_timeout_s=cfg.rpc_timeout_s,
                tls=self.tls,
            )
            self.data_server = BlockDataServer(
                self.tiered,
                cfg.host,
                cfg.data_port,
                io_timeout_s=cfg.rpc_timeout_s,
                handshake_timeout_s=cfg.data_handshake_timeout_s,
                idle_timeout_s=cfg.data_idle_timeout_s,
                max_block_bytes=cfg.max_block_bytes,
                tls=self.tls,
                local_socket=self._data_socket_path(),
                timings=self.timings,
            )
            self.data_port = self.data_server.start()
        self.pooled = PooledStore(
            cfg.node_id,
            self.tiered,
            self.executor,
            locate=self.conductor.locate if cfg.peer_fetch else None,
            # Without a reachable transfer service, PooledStore fetches directly.
            copy_here=self._copy_here if self.transfer is not None else None,
            fetch=self.peers.fetch,
            pull=self._pull_here if self.puller is not None else None,
        )
        self.servicer = StoreServicer(
            cfg.node_id,
            self.tiered,
            self.pooled,
            self.executor,
            max_chunk_bytes=cfg.max_chunk_bytes,
            max_block_bytes=cfg.max_block_bytes,
            default_chunk_bytes=cfg.default_chunk_bytes,
            put_budget=ByteBudget(cfg.max_inflight_put_bytes),
            extra_corrupt=lambda: self._ssd_corrupt_on_open,
            puller=self.puller,
            data_address=self.data_address,
            data_socket=self.data_server.local_socket if self.data_server else "",
            pull_streams=cfg.pull_streams,
            timings=self.timings,
        )
        self._register_metrics()
        server = grpc_server(
            self.tls,
            self.metrics,
            [
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        handlers = self.servicer.method_handlers()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )
        server.add_registered_method_handlers(SERVICE_NAME, handlers)
        health = add_health_and_reflection(server, [SERVICE_NAME])
        self.grpc_port = await start_server(server, cfg.host, cfg.port, self.tls)
        self.server = server
        self._runner, self.metrics_port = await start_metrics_app(
            self.metrics, cfg.host, cfg.metrics_port, tls=self.tls
        )
        await self.registry.register(
            NodeRecord(
                kind="store",
                id=cfg.node_id,
                address=self.address,
                locality_domain=cfg.locality_domain,
                capacity_bytes=cfg.dram_capacity_bytes + cfg.ssd_capacity_bytes,
                version=VERSION,
                start_time_s=time.time(),
                data_address=self.data_address,
                extra={
                    "dram_capacity_bytes": cfg.dram_capacity_bytes,
                    "ssd_capacity_bytes": cfg.ssd_capacity_bytes,
                    "metrics_url": f"{self.metrics_scheme}://{cfg.advertised_host}:{self.metrics_port}",
                },
            ),
            cfg.lease_ttl_s,
        )
        self._registered = True
        if self._reporting:
            self.conductor.start()
        if self._discovering:
            self._tasks.append(asyncio.create_task(self._watch_fleet(), name="registry-watch"))
        else:
            logger.warning(
                "no conductor configured and no registry to find one: residency is not reported"
            )
        await set_serving(health, [SERVICE_NAME])
        s = self.tiered.stats()
        logger.info(
            "store %s serving on %s (data port %s, dram %d bytes, ssd %d blocks / %d bytes "
            "reopened, peer fetch via %s) in %.2fs",
            cfg.node_id,
            self.address,
            self.data_address or "off",
            cfg.dram_capacity_bytes,
            s["local_ssd_blocks"],
            s["local_ssd_bytes"],
            "the data path" if self.puller is not None else "transfer/gRPC",
            time.monotonic() - started,
        )

    async def _watch_fleet(self) -> None:
        """Follow the conductor replicas (a new or restarted one gets the full residency,
        replicas.py), and resend it to all when this node's own record came back after a
        leave (its lease expired during an etcd outage, so the conductors dropped its
        blocks)."""
        node_id = self.config.node_id
        own_present = True
        while True:
            try:
                async for event in self.registry.watch():
                    record = event.record
                    if record.kind == "conductor":
                        if event.type == "leave":
                            await self.conductor.left(record)
                        else:
                            await self.conductor.joined(record)
                    elif record.kind == "store" and record.id == node_id:
                        if event.type == "leave":
                            own_present = False
                        elif not own_present:
                            own_present = True
                            logger.info("registered again after a lease loss: resending residency")
                            self.reporter.request_resync()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("registry watch failed; restarting it")
                await asyncio.sleep(0.5)

    @property
    def address(self) -> str:
        return f"{self.config.advertised_host}:{self.grpc_port}"

    def _data_socket_path(self) -> str:
        """Where the block-data Unix socket listens ("" for none)."""
        wanted = self.config.data_socket
        if wanted in ("", "off"):
            return ""
        if wanted != "auto":
            return wanted
        try:
            self._socket_dir = tempfile.mkdtemp(prefix="quillcache-store-")  # mode 0700
        except OSError as exc:  # a read-only /tmp: clients use the TCP port
            logger.warning("no block-data socket (%s): clients on this host use TLS", exc)
            return ""
        return os.path.join(self._socket_dir, "data.sock")

    @property
    def data_address(self) -> str:
        """host:port of the block-data port, or "" when it is off."""
        return f"{self.config.advertised_host}:{self.data_port}" if self.data_port else ""

    def ready_line(self) -> str:
        host = self.config.advertised_host
        line = (
            f"READY store grpc={host}:{self.grpc_port} "
            f"metrics={self.metrics_scheme}://{host}:{self.metrics_port}"
        )
        return f"{line} data={self.data_address}" if self.data_address else line

    def _register_metrics(self) -> None:
        m = self.metrics
        tiered, pooled, servicer, reporter = self.tiered, self.pooled, self.servicer, self.reporter

        def per_tier(field: str):
            def read():
                s = tiered.stats()
                return [
                    (("cpu_dram",), s[f"cpu_dram_{field}"]),
                    (("local_ssd",), s[f"local_ssd_{field}"]),
                ]

            return read

        def stat(name: str):
            return lambda: [((), tiered.stats()[name])]

        m.gauge("store_bytes", "payload bytes held, per tier", ["tier"], read=per_tier("bytes"))
        m.gauge("store_blocks", "blocks held, per tier", ["tier"], read=per_tier("blocks"))
        m.gauge("store_capacity_bytes", "tier budgets", ["tier"], read=per_tier("capacity"))
        m.gauge(
            "store_dram_prefault_bytes",
            "DRAM tier memory touched up front (--dram-prefault), and of it carved into buffers",
            ["state"],
            read=lambda: [
                (("touched",), tiered.dram.stats().get("prefault_bytes", 0)),
                (("carved",), tiered.dram.stats().get("prefault_carved_bytes", 0)),
            ],
        )
        m.gauge("store_hits_total", "Gets served", read=lambda: [((), pooled.hits)])
        m.gauge("store_misses_total", "Gets answered NOT_FOUND", read=lambda: [((), pooled.misses)])
        m.gauge("store_demotions_total", "blocks demoted DRAM -> SSD", read=stat("demotions"))
        m.gauge("store_promotions_total", "blocks promoted SSD -> DRAM", read=stat("promotions"))
        m.gauge("store_evictions_total", "blocks evicted from SSD", read=stat("evictions"))
        m.gauge(
            "store_corrupt_blocks_total",
            "blocks that failed verification (dropped, never served)",
            read=lambda: [((), tiered.stats()["corrupt"] + self._ssd_corrupt_on_open)],
        )
        m.gauge(
            "store_peer_fetches_total",
            "blocks fetched from peers",
            read=lambda: [((), pooled.peer_fetches)],
        )
        m.gauge(
            "store_peer_fetch_bytes_total",
            "bytes fetched from peers",
            read=lambda: [((), pooled.peer_fetch_bytes)],
        )
        m.gauge(
            "store_puts_total",
            "blocks stored by Put, per landing tier",
            ["tier"],
            read=lambda: [((t.value,), n) for t, n in servicer.puts.items()],
        )
        m.gauge(
            "store_put_bytes_total", "bytes stored by Put", read=lambda: [((), servicer.put_bytes)]
        )
        m.gauge(
            "store_rejected_puts_total",
            "Puts refused (bad input, capacity, checksum)",
            read=lambda: [((), servicer.rejected_puts)],
        )
        m.gauge(
            "store_get_bytes_total", "bytes served by Get", read=lambda: [((), servicer.get_bytes)]
        )
        m.gauge(
            "store_ssd_commits_total",
            "SSD transactions committed",
            read=lambda: [((), tiered.ssd.stats()["commits"])],
        )
        data_server, puller = self.data_server, self.puller
        if data_server is not None and puller is not None:
            m.gauge(
                "store_data_sent_blocks_total",
                "blocks sent to peers on the block data port",
                read=lambda: [((), data_server.stats()["blocks_sent"])],
            )
            m.gauge(
                "store_data_sent_bytes_total",
                "bytes sent to peers on the block data port",
                read=lambda: [((), data_server.stats()["bytes_sent"])],
            )
            m.gauge(
                "store_data_put_blocks_total",
                "blocks clients put through the block data port",
                read=lambda: [((), data_server.stats()["blocks_received"])],
            )
            m.gauge(
                "store_data_put_bytes_total",
                "bytes clients put through the block data port",
                read=lambda: [((), data_server.stats()["bytes_received"])],
            )
            m.gauge(
                "store_data_connections_refused_total",
                "block-data connections refused (no certificate of an allowed role, or a "
                "Unix socket peer of another user)",
                read=lambda: [((), data_server.stats()["connections_refused"])],
            )
            m.gauge(
                "store_data_local_connections_total",
                "block-data connections accepted on the node's Unix socket (clients on "
                "this host, no TLS)",
                read=lambda: [((), data_server.stats()["local_connections"])],
            )
            m.gauge(
                "store_data_put_ack_writes_total",
                "writes that carried put acks on the block data port (a batch's acks go "
                "out together)",
                read=lambda: [((), data_server.stats()["ack_writes"])],
            )
            m.gauge(
                "store_data_puts_refused_total",
                "puts on the block data port that stored nothing",
                read=lambda: [((), data_server.stats()["puts_refused"])],
            )
            m.gauge(
                "store_data_pulled_blocks_total",
                "blocks pulled from peers' data ports and stored",
                read=lambda: [((), puller.blocks_pulled)],
            )
            m.gauge(
                "store_data_pulled_bytes_total",
                "bytes pulled from peers' data ports and stored",
                read=lambda: [((), puller.bytes_pulled)],
            )
            m.gauge(
                "store_data_pull_failures_total",
                "blocks a pull did not store (source or local errors)",
                read=lambda: [((), puller.blocks_failed)],
            )
        m.gauge(
            "store_residency_events_pending",
            "residency events not yet sent",
            read=lambda: [((), reporter.pending)],
        )
        m.gauge(
            "store_residency_events_sent_total",
            "residency events delivered",
            read=lambda: [((), reporter.events_sent)],
        )
        m.gauge(
            "store_residency_events_dropped_total",
            "events dropped on overflow (resynced)",
            read=lambda: [((), reporter.events_dropped)],
        )
        m.gauge(
            "store_residency_send_failures_total",
            "failed event deliveries (retried)",
            read=lambda: [((), reporter.send_failures)],
        )

    # --- shutdown ----------------------------------------------------------------------------

    async def stop(self) -> None:
        cfg = self.config
        if self._registered:
            # Leave first: the conductor stops planning fetches from this node.
            with contextlib.suppress(Exception):
                await self.registry.deregister("store", cfg.node_id)
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self.data_server is not None:
            self.data_server.stop()
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        if self.puller is not None:
            self.puller.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for link in (self.conductor, self.transfer, self.peers):
            if link is not None:
                with contextlib.suppress(Exception):
                    await link.close()
        await self.registry.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.tiered is not None:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.tiered.close)
        self.executor.shutdown(wait=True)
        logger.info("store %s stopped", cfg.node_id)
