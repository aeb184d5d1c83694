"""Wires the conductor: gRPC servicer, health, reflection, metrics, registry watch, events."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time

import grpc

from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
from quillcache_conductor import split
from quillcache_conductor.config import ConductorConfig
from quillcache_conductor.events import EventRouter
from quillcache_conductor.peer_load import PeerLoad
from quillcache_conductor.replica_sync import ReplicaLog, ReplicaPeers, ReplicaSyncServicer
from quillcache_conductor.servicer import ConductorServicer
from quillcache_conductor.standby import Standby
from quillcache_conductor.state import ConductorState
from quillcache_core.index import open_index
from quillcache_core.model import CostModel
from quillcache_core.process.heap import HeapSettler
from quillcache_core.process.metrics import MICRO_BUCKETS_S, MetricsRegistry
from quillcache_core.registry import NodeEvent, NodeRecord, open_registry
from quillcache_core.registry.records import JOIN, LEAVE
from quillcache_core.routing.references import make_policy
from quillcache_core.rpc.plan_port import PlanPortServer
from quillcache_core.rpc.server import (
    add_health_and_reflection,
    grpc_server,
    set_serving,
    start_metrics_app,
    start_server,
)

logger = logging.getLogger(__name__)

SERVICE_NAME = conductor_pb2.DESCRIPTOR.services_by_name["Conductor"].full_name
TICK_S = 1.0  # the clock: expiry, departures, the index's flush, heap settling
FLUSH_S = 1.0
FREEZE_S = 1.0


class ConductorServer:
    def __init__(self, config: ConductorConfig) -> None:
        self.config = config
        # Residency is a routing hint the engines' events rebuild: Plan and the event
        # path read and write an in-memory copy; lmdb gets the writes, batched, when
        # the tick flushes every second.
        self.index = open_index(
            config.index_backend, config.index_path or None, sync_commits=False, mirror=True
        )
        cost_model = CostModel() if config.seed_queue_cost else CostModel().queue_at_prefill_speed()
        # Our planner drains its queue estimate with the wall clock (µs) between plans.
        policy = make_policy(
            config.policy, cost_model, config.temperature, clock=lambda: time.monotonic() * 1e6
        )
        if hasattr(policy, "alternatives"):
            # Replies list this many other engines: cost out no more than that.
            policy.alternatives = config.plan_alternatives
        self.state = ConductorState(
            self.index,
            policy,
            clock=time.monotonic,
            rng=random.Random(config.seed or None),
            reservation_ttl_s=config.reservation_ttl_s,
            default_block_bytes=config.block_bytes,
            max_blocks_per_request=config.max_blocks_per_request,
            block_tokens=config.block_tokens,
            calibrate=config.calibrate_prefill,
        )
        split.configure(self.state, config.disagg_settings())
        self.metrics = MetricsRegistry(process=True)
        self.peer_load = PeerLoad(
            self.state, clock=time.monotonic, silence_s=config.replica_silence_s
        )
        self.standby = Standby(config.standby_linger_s, self.peer_load.any_planning)
        self.events = EventRouter(
            self.state, self.metrics, subscribe_zmq=config.kv_events, linger=self.standby.linger
        )
        self._register_metrics()
        self.tls = config.tls("conductor")
        self.registry = open_registry(config.registry, self.tls)
        self.server: grpc.aio.Server | None = None
        self.plan_port: PlanPortServer | None = None
        self.servicer: ConductorServicer | None = None
        self.grpc_port = 0
        self.metrics_port = 0
        self._runner = None
        self._tasks: list[asyncio.Task] = []
        self.engines_seen = asyncio.Event()
        # The other replicas' reservations, counted here (peer_load.py, replica_sync.py).
        self.start_time_s = time.time()
        self.state.release_peers = self.peer_load.release_due
        self.replica_log = ReplicaLog(
            self.state,
            config.node_id,
            self.start_time_s,
            heartbeat_s=config.replica_heartbeat_s,
            planning=self.peer_load.planning,
            standby_flush_s=config.replica_standby_flush_s,
        )
        self.replica_peers: ReplicaPeers | None = None
        self.tick_failures = 0
        self.ticks = 0  # the clock's wake-ups
        # A node whose record goes keeps its residency this long (it may be back: a
        # lease lost in an etcd stall), unrouted; right after a registry outage it also
        # stays routable for `leave_hold_s` (see ConductorState.node_left).
        grace = config.node_leave_grace_s
        self.leave_grace_s = grace if grace >= 0 else 2 * config.lease_ttl_s + 1
        self.leave_hold_s = max(1.0, config.lease_ttl_s)
        self.outage_window_s = max(2.0, config.lease_ttl_s)

    def _learned_speeds(self):
        return self.state.speeds.speeds.items() if self.state.speeds is not None else ()

    def _register_metrics(self) -> None:
        state = self.state
        m = self.metrics
        m.gauge("plans_total", "routing decisions made", read=lambda: [((), state.counters.plans)])
        self.plan_seconds = m.histogram(
            "conductor_plan_seconds",
            "time to compute a plan (Plan, PlanStream and the plan port alike)",
            MICRO_BUCKETS_S,
        )
        standby = self.standby
        m.gauge(
            "standing_by",
            "1 while a peer replica plans and this one does not: its ingest waits "
            "--standby-linger-s and takes what came meanwhile together",
            read=lambda: [((), int(standby.standing_by))],
        )
        m.gauge(
            "standby_lingers_total",
            "ingest waits begun while standing by, and those a plan or Locate ended early",
            ["end"],
            read=lambda: [(("begun",), standby.lingers), (("woken",), standby.woken)],
        )
        m.gauge(
            "finishes_total",
            "reservations released by Finish, by outcome",
            ["outcome"],
            read=lambda: [((k,), v) for k, v in state.counters.finishes.items()],
        )
        m.gauge(
            "prefill_seconds_per_token",
            "the engines' prefill speed each plan of the model is priced with: learned from "
            "measured TTFTs, the cost model's default until enough of them (--calibrate-prefill)",
            ["model"],
            read=lambda: [
                ((model,), speed.us_per_token / 1e6) for model, speed in self._learned_speeds()
            ],
        )
        m.gauge(
            "fetch_price_factor",
            "how many times the default cost model's price a fetch from the pool is priced "
            "at: learned from measured TTFTs of requests that fetched (1 until enough)",
            ["model"],
            read=lambda: (
                [((model,), speeds.fetch_factor(model)) for model in speeds.fetches]
                if (speeds := self.state.speeds) is not None
                else []
            ),
        )
        m.gauge(
            "prefill_samples_total",
            "finished requests whose TTFT taught the model's prefill speed",
            ["model"],
            read=lambda: [((model,), speed.samples) for model, speed in self._learned_speeds()],
        )
        m.gauge(
            "reservations_open",
            "reservations not yet finished",
            read=lambda: [((), len(state.reservations))],
        )
        m.gauge(
            "reservations_expired_total",
            "reservations released by expiry (no Finish)",
            read=lambda: [((), state.counters.reservations_expired)],
        )
        m.gauge(
            "departed_records_dropped_total",
            "residency records dropped at start for nodes no longer registered",
            read=lambda: [((), state.counters.departed_records_dropped)],
        )
        m.gauge(
            "restart_records_dropped_total",
            "residency records dropped because their engine registered a new run",
            read=lambda: [((), state.counters.restart_records_dropped)],
        )
        m.gauge(
            "residency_corrections_total",
            "Finishes whose engine's delivered cached tokens corrected its residency: "
            "planned hits it had lost dropped, blocks it held unknown recorded",
            ["engine"],
            read=lambda: [((k,), v) for k, v in state.counters.residency_corrections.items()],
        )
        m.gauge(
            "nodes_in_leave_grace",
            "engines and stores whose registry record went, their residency kept in case "
            "they register again (held: still routable, right after a registry outage)",
            ["kind", "held"],
            read=lambda: [
                ((kind, str(held).lower()), n)
                for (kind, held), n in collections.Counter(
                    (d.kind, d.held) for d in state.departures.values()
                ).items()
            ],
        )
        m.gauge(
            "node_leaves_total",
            "registry leaves of engines and stores by outcome: returned (registered again "
            "within the grace, same run or not), dropped (not back within it)",
            ["outcome"],
            read=lambda: [
                (("returned",), state.counters.nodes_returned),
                (("dropped",), state.counters.nodes_dropped_after_grace),
            ],
        )
        m.gauge(
            "index_write_failures_total",
            "queued index writes the durable backend refused (logged)",
            read=lambda: [((), getattr(self.index, "failed_writes", 0))],
        )
        m.gauge(
            "ticks_total",
            "wake-ups of the conductor's clock (once a second)",
            read=lambda: [((), self.ticks)],
        )
        m.gauge(
            "tick_failures_total",
            "periodic ticks (expiry, index flush) that raised; logged",
            read=lambda: [((), self.tick_failures)],
        )
        m.gauge(
            "guard_refusals_total",
            "content matches of another identity refused",
            read=lambda: [((), state.counters.guard_refusals)],
        )
        m.gauge(
            "kv_events_subscriber_total",
            "per engine's ZMQ subscriber: gaps seen, batches replayed, sequences lost "
            "(neither received nor replayed: the engine's records were dropped), publisher resets",
            ["engine", "what"],
            read=lambda: [
                ((engine, what), getattr(sub.counters, what))
                for engine, sub in list(self.events.subscribers.items())
                for what in ("gaps", "replayed", "lost", "resets")
            ],
        )
        m.gauge(
            "index_resident_records",
            "residency records in the index",
            read=lambda: [((), len(state.index))],
        )
        m.gauge(
            "engine_inflight_requests",
            "reserved in-flight requests per engine",
            ["engine"],
            read=lambda: [((e,), i.state.inflight_requests) for e, i in state.engines.items()],
        )
        m.gauge(
            "engine_queued_prefill_tokens",
            "reserved prefill tokens per engine",
            ["engine"],
            read=lambda: [((e,), i.state.queued_prefill_tokens) for e, i in state.engines.items()],
        )
        m.gauge(
            "engine_resident_blocks",
            "residency records per engine",
            ["engine"],
            read=lambda: [((e,), state.index.worker_block_count(e)) for e in state.engines],
        )
        m.gauge("stores", "live store nodes", read=lambda: [((), len(state.stores))])
        m.gauge(
            "replica_peers_streaming",
            "other conductor replicas whose reservations stream here",
            read=lambda: [((), len(self.replica_peers.connected) if self.replica_peers else 0)],
        )
        m.gauge(
            "replica_peer_reservations_open",
            "reservations of other replicas counted in this one's load",
            read=lambda: [((), self.peer_load.open_reservations())],
        )
        m.gauge(
            "replica_peers_dropped_silent_total",
            "replicas whose load was dropped here because they fell silent",
            read=lambda: [((), self.peer_load.dropped_silent)],
        )
        m.gauge(
            "replica_sync_coalesced_total",
            "sync messages to standby replicas (planning nothing) merged into the next",
            read=lambda: [((), self.replica_log.messages_coalesced)],
        )
        m.gauge(
            "replica_sync_messages_total",
            "sync messages sent to and received from other replicas",
            ["direction"],
            read=lambda: [
                (("sent",), self.replica_log.messages_sent),
                (("received",), self.replica_peers.messages_received if self.replica_peers else 0),
            ],
        )
        m.gauge(
            "replica_speed_samples_total",
            "TTFT samples of the engines' speed learned from other replicas' requests",
            read=lambda: [((), self.replica_peers.samples_received if self.replica_peers else 0)],
        )
        m.gauge(
            "plan_stream_messages_total",
            "PlanStream messages received (each answered with one message)",
            read=lambda: [((), self.servicer.stream_messages if self.servicer else 0)],
        )
        m.gauge(
            "plan_stream_calls_total",
            "Plan and Finish calls carried by PlanStream messages",
            read=lambda: [((), self.servicer.stream_calls if self.servicer else 0)],
        )
        m.gauge(
            "plan_port_frames_total",
            "PlanStream messages answered on the plan port",
            read=lambda: [((), self.plan_port.frames if self.plan_port else 0)],
        )
        m.gauge(
            "plan_port_calls_total",
            "Plan and Finish calls carried by the plan port's frames",
            read=lambda: [((), self.plan_port.calls if self.plan_port else 0)],
        )
        m.gauge(
            "plan_port_rejected_frames_total",
            "plan-port frames too big or unparsable (their connection was closed)",
            read=lambda: [((), self.plan_port.rejected_frames if self.plan_port else 0)],
        )
        m.gauge(
            "plan_port_refused_connections_total",
            "plan-port connections refused for the caller's role",
            read=lambda: [((), self.plan_port.refused_connections if self.plan_port else 0)],
        )

    async def start(self) -> None:
        cfg = self.config
        server = grpc_server(
            self.tls,
            self.metrics,
            [
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.so_reuseport", 0),
            ],
        )
        self.servicer = servicer = ConductorServicer(
            self.state,
            self.events,
            cfg.max_blocks_per_request,
            cfg.plan_alternatives,
            plan_seconds=self.plan_seconds,
            standby=self.standby,
        )
        conductor_pb2_grpc.add_ConductorServicer_to_server(servicer, server)
        if cfg.replica_sync:
            self.state.listener = self.replica_log
            conductor_pb2_grpc.add_ConductorReplicaServicer_to_server(
                ReplicaSyncServicer(self.replica_log), server
            )
        await self._load_fleet()
        if cfg.plan_port >= 0:
            self.plan_port = PlanPortServer(servicer.handle_calls, self.tls)
            port = await self.plan_port.start(cfg.host, cfg.plan_port)
            servicer.plan_address = f"{cfg.advertise_host or cfg.host}:{port}"
        health = add_health_and_reflection(server, [SERVICE_NAME])
        self.grpc_port = await start_server(server, cfg.host, cfg.port, self.tls)
        self.server = server
        self._runner, self.metrics_port = await start_metrics_app(
            self.metrics, cfg.host, cfg.metrics_port, tls=self.tls
        )
        # Workers the reopened index holds, before any event: those the registry no
        # longer lists left while this conductor was down.
        reopened = self.index.workers()
        if reopened and cfg.departed_sweep_s > 0:
            self._tasks.append(
                asyncio.create_task(self._sweep_departed(reopened), name="departed-sweep")
            )
        self._tasks.append(asyncio.create_task(self._watch_registry(), name="registry-watch"))
        self._tasks.append(asyncio.create_task(self._tick(), name="reservation-tick"))
        await self.registry.register(
            NodeRecord(
                kind="conductor",
                id=cfg.node_id,
                address=f"{cfg.advertise_host or cfg.host}:{self.grpc_port}",
                locality_domain="",
                start_time_s=self.start_time_s,
            ),
            cfg.lease_ttl_s,
        )
        if cfg.replica_sync:
            self.replica_peers = ReplicaPeers(
                self.registry,
                cfg.node_id,
                self.tls,
                self.peer_load,
                speeds=self.state.speeds,
                silence_s=cfg.replica_silence_s,
            )
            self.replica_peers.start()
        await set_serving(health, [SERVICE_NAME])
        logger.info("conductor %s serving on %s:%d", cfg.node_id, cfg.host, self.grpc_port)

    def ready_line(self) -> str:
        host = self.config.host
        plan = f" plan={host}:{self.plan_port.port}" if self.plan_port is not None else ""
        return (
            f"READY conductor grpc={host}:{self.grpc_port} "
            f"metrics={'https' if self.tls else 'http'}://{host}:{self.metrics_port}{plan}"
        )

    async def _load_fleet(self) -> None:
        """The registry's engines and stores, applied before the conductor answers anyone.

        A conductor that answered first (a restart, etcd slow to resolve or reach) would
        plan on an empty fleet: "no engine" to every request until its watch caught up.
        While it waits its ports stay closed, so the gateway routes by itself meanwhile
        (fallback.py). The watch that follows lists them again (joins are idempotent)."""
        delay_s = 0.25
        while True:
            try:
                records = await self.registry.list()
                break
            except Exception as exc:  # noqa: BLE001 - any registry trouble: wait for it
                logger.warning("the conductor waits for the registry before serving: %s", exc)
                await asyncio.sleep(delay_s)
                delay_s = min(2 * delay_s, 5.0)
        for record in records:
            self._apply_node_event(NodeEvent(JOIN, record))

    async def _watch_registry(self) -> None:
        """Apply the fleet's changes. The registry's own watch rides out etcd outages
        (it re-lists and sends the differences); should it fail anyway, the view is
        kept as it is until the registry answers, then reconciled."""
        restarted = False
        while True:
            try:
                if restarted:
                    await self._reconcile()
                restarted = True
                async for event in self.registry.watch():
                    self._apply_node_event(event)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("registry watch failed; the fleet view is kept, retrying")
                await asyncio.sleep(0.5)

    async def _reconcile(self) -> None:
        """After the watch broke: nodes known here that the registry no longer lists
        leave (with the usual grace); the new watch's snapshot brings the rest."""
        listed = {(record.kind, record.id) for record in await self.registry.list()}
        known = [*self.state.engines.values()]
        gone = [info.record for info in known if ("engine", info.record.id) not in listed]
        gone += [rec for rec in self.state.stores.values() if ("store", rec.id) not in listed]
        for record in gone:
            logger.info("%s %s is no longer registered (reconciled)", record.kind, record.id)
            self._apply_node_event(NodeEvent(LEAVE, record))

    async def _sweep_departed(self, workers: list[str]) -> None:
        """Once, --departed-sweep-s after start (time for restarting nodes to register
        again): drop the residency of `workers` the registry does not list."""
        await asyncio.sleep(self.config.departed_sweep_s)
        while True:
            try:
                listed = await self.registry.list()
                break
            except Exception as exc:  # the registry is down: never sweep blind
                logger.warning("departed-node sweep waits for the registry: %s", exc)
                await asyncio.sleep(self.config.departed_sweep_s)
        self.state.drop_departed(workers, (record.id for record in listed))

    def _apply_node_event(self, event) -> None:
        record = event.record
        if record.kind not in ("engine", "store"):
            return
        if event.type == "leave":
            # Right after etcd failed or stalled a call, a leave is most likely the
            # outage's (the node's lease ran out while it was alive): the node stays
            # routable for a moment, as it is about to register again.
            outage = self.registry.recently_unreachable(self.outage_window_s)
            dropped = self.state.node_left(
                record.kind,
                record.id,
                grace_s=self.leave_grace_s,
                hold_s=self.leave_hold_s if outage else 0.0,
            )
            if dropped and record.kind == "engine":
                self.events.engine_left(record.id)
        elif record.kind == "engine":
            if self.state.engine_joined(record):
                self.events.engine_restarted(record.id)
                self.peer_load.engine_restarted(record.id)
            self.events.engine_joined(record)
        else:
            self.state.store_joined(record)

    def _expire_departures(self) -> None:
        """Nodes not back within their leave grace lose their residency (and engines
        their KV event subscription) now."""
        for kind, node_id in self.state.expire_departures():
            if kind == "engine":
                self.events.engine_left(node_id)

    async def _tick(self) -> None:
        """The conductor's clock, once every TICK_S: expires reservations, departures
        and silent peers, flushes the index when it is dirty, settles the heap. Due
        prefill and lingering overlays need no clock: a plan releases every ledger's
        (its own and its peers') as it starts. An idle conductor wakes once a second."""
        last_flush = time.monotonic()
        heap = HeapSettler(FREEZE_S)
        heap.settle()
        while True:
            await asyncio.sleep(TICK_S)
            self.ticks += 1
            try:
                self.state.tick()
                self.peer_load.tick()
                self._expire_departures()
                now = time.monotonic()
                if now - last_flush >= FLUSH_S and self.index.dirty:
                    last_flush = now
                    await asyncio.to_thread(self.index.flush)
                # The index is millions of long-lived objects: keep the cycle collector
                # from walking them inside a Plan (see quillcache_core.process.heap).
                heap.maybe_settle()
            except Exception:  # expiry and flushing must outlive any one failure
                self.tick_failures += 1
                logger.exception("conductor tick failed; the next one runs as usual")

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.replica_peers is not None:
            await self.replica_peers.close()
        await self.events.close()
        with contextlib.suppress(Exception):
            await self.registry.deregister("conductor", self.config.node_id)
        await self.registry.close()
        if self.plan_port is not None:
            await self.plan_port.stop()
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self._runner is not None:
            await self._runner.cleanup()
        self.index.close()
