"""Residency reports to every conductor replica, each with its own queue and retries.

A store node reports its residency to every conductor: the ones at fixed addresses
(`--conductor a,b`), else every conductor registered in the registry (kind
"conductor"), joined as they appear. Each replica has its own `ConductorLink` (a fixed
address: gRPC reconnects to it) and its own `ResidencyReporter` (queue, batches,
backoff), so a dead or slow replica never delays the others; its bounded queue overflows
into a resync once it answers again. A replica's reporter starts with a resync
(AllBlocksCleared, then the node's full residency), which is how a conductor that joins
later, or restarts (a new `start_time_s`), learns what this node holds.

A replica that leaves the registry keeps its reporter for `leave_grace_s` (an etcd
stall or a lost lease while it lives must not cost a resync); back with the same start
time it carries on, otherwise it is dropped. Locate asks the replicas in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from quillcache_core.errors import NodeUnavailable
from quillcache_core.model import KvBlockKey
from quillcache_core.registry import NodeRecord
from quillcache_core.security.tls import Tls
from quillcache_store.links import ConductorLink
from quillcache_store.pooled import PeerLocation
from quillcache_store.reporter import ResidencyReporter
from quillcache_store.tiers.tiered import TierEvent

log = logging.getLogger(__name__)

_COUNTERS = ("events_sent", "events_dropped", "send_failures", "batches_sent", "resyncs")


@dataclass
class _Replica:
    id: str
    address: str
    start_time_s: float
    link: ConductorLink
    reporter: ResidencyReporter
    task: asyncio.Task | None = None
    departed: asyncio.Task | None = field(default=None)


class ConductorReplicas:
    """Fan-out of residency events to every conductor; Locate on the first that answers."""

    def __init__(
        self,
        node_id: str,
        fixed: str,
        timeout_s: float,
        tls: Tls | None,
        snapshot: Callable[[], list[TierEvent]],
        *,
        max_queue: int = 100_000,
        max_batch: int = 512,
        linger_s: float = 0.0,
        leave_grace_s: float = 30.0,
    ) -> None:
        self.node_id = node_id
        self.fixed = [a.strip() for a in fixed.split(",") if a.strip()]
        self.timeout_s = timeout_s
        self.tls = tls
        self._snapshot = snapshot
        self._reporter_args = {"max_queue": max_queue, "max_batch": max_batch, "linger_s": linger_s}
        self.leave_grace_s = leave_grace_s
        self._replicas: dict[str, _Replica] = {}
        self._seen: dict[str, float] = {}  # with fixed addresses: conductor id -> start time
        # Read by `offer` on any thread: replaced whole, never mutated.
        self._reporters: tuple[ResidencyReporter, ...] = ()
        self._retired = dict.fromkeys(_COUNTERS, 0)
        self.events_offered = 0

    # --- producer side (any thread) ----------------------------------------------------

    def offer(self, event: TierEvent) -> None:
        """Queue one event for every replica; never blocks. Thread-safe."""
        self.events_offered += 1
        for reporter in self._reporters:
            reporter.offer(event)

    def request_resync(self) -> None:
        for reporter in self._reporters:
            reporter.request_resync()

    # --- membership (event loop) -------------------------------------------------------

    def start(self) -> None:
        """Start reporting to the fixed addresses (registry replicas come by `joined`)."""
        for address in self.fixed:
            self._add(address, address, 0.0)

    def _add(self, replica_id: str, address: str, start_time_s: float) -> None:
        link = ConductorLink(address, None, self.timeout_s, self.tls)
        reporter = ResidencyReporter(
            self.node_id, link.ingest, self._snapshot, **self._reporter_args
        )
        replica = _Replica(replica_id, address, start_time_s, link, reporter)
        replica.task = asyncio.create_task(reporter.run(), name=f"residency-to-{replica_id}")
        self._replicas[replica_id] = replica
        self._reporters = tuple(r.reporter for r in self._replicas.values())
        log.info("reporting residency to conductor %s at %s", replica_id, address)

    async def _remove(self, replica_id: str) -> None:
        replica = self._replicas.pop(replica_id, None)
        if replica is None:
            return
        self._reporters = tuple(r.reporter for r in self._replicas.values())
        for name in _COUNTERS:
            self._retired[name] += getattr(replica.reporter, name)
        for task in (replica.task, replica.departed):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        with contextlib.suppress(Exception):
            await replica.link.close()

    async def joined(self, record: NodeRecord) -> None:
        """A conductor record appeared or changed in the registry."""
        if not record.address:
            return
        if self.fixed:
            # Fixed addresses: a restarted conductor gets the full residency again (all
            # replicas do when its record names none of them, e.g. another host name).
            seen = self._seen.get(record.id)
            self._seen[record.id] = record.start_time_s
            if seen is None or seen == record.start_time_s:
                return  # the one announced to at start, or back after a lease loss
            log.info("conductor %s restarted: resending residency", record.id)
            matching = [r for r in self._replicas.values() if r.address == record.address]
            for replica in matching or self._replicas.values():
                replica.reporter.request_resync()
            return
        replica = self._replicas.get(record.id)
        if replica is not None:
            if replica.departed is not None:
                replica.departed.cancel()
                replica.departed = None
            if (replica.address, replica.start_time_s) == (record.address, record.start_time_s):
                return  # back after a lease loss, still the same process
            log.info("conductor %s (re)started: resending residency", record.id)
            await self._remove(record.id)
        self._add(record.id, record.address, record.start_time_s)

    async def left(self, record: NodeRecord) -> None:
        """A conductor record left the registry: drop its reporter after the grace."""
        replica = self._replicas.get(record.id)
        if self.fixed or replica is None or replica.departed is not None:
            return
        replica.departed = asyncio.create_task(self._expire(record.id), name="conductor-leave")

    async def _expire(self, replica_id: str) -> None:
        await asyncio.sleep(self.leave_grace_s)
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.departed = None
            log.info("conductor %s stayed away: no longer reporting to it", replica_id)
            await self._remove(replica_id)

    # --- calls ---------------------------------------------------------------------------

    async def locate(self, key: KvBlockKey) -> list[PeerLocation]:
        """Locate on the replicas in turn (present ones first); the first answer wins."""
        replicas = sorted(self._replicas.values(), key=lambda r: (r.departed is not None, r.id))
        last: Exception | None = None
        for replica in replicas:
            try:
                return await replica.link.locate(key)
            except NodeUnavailable as exc:
                last = exc
        raise last or NodeUnavailable("no conductor configured or registered")

    @property
    def ids(self) -> list[str]:
        return sorted(self._replicas)

    def reporter(self, replica_id: str) -> ResidencyReporter | None:
        replica = self._replicas.get(replica_id)
        return replica.reporter if replica else None

    @property
    def pending(self) -> int:
        return sum(r.pending for r in self._reporters)

    def _total(self, name: str) -> int:
        return self._retired[name] + sum(getattr(r, name) for r in self._reporters)

    @property
    def events_sent(self) -> int:
        return self._total("events_sent")

    @property
    def events_dropped(self) -> int:
        return self._total("events_dropped")

    @property
    def send_failures(self) -> int:
        return self._total("send_failures")

    async def close(self) -> None:
        for replica_id in list(self._replicas):
            await self._remove(replica_id)


__all__ = ["ConductorReplicas"]
