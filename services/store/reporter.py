"""Residency reporting: the node's TierEvents, batched, to the conductor, in order.

`offer(event)` is what `TieredStore` calls on every residency change. It may run on any
thread, under a per-key lock, so it only appends to a bounded queue and wakes the
sender; it never blocks and never does I/O. The sender (`run`, a task on the event
loop) takes what is queued (up to `max_batch` events), turns it into one KvEventBatch
(source_kind "store") and hands it to `send`, after lingering `linger_s` for more
events unless a whole batch is already queued; on failure the same batch is retried with
backoff (0.1 s doubling to 2 s), so events reach the conductor in the order they
happened. A conductor that stands by (a replica a peer plans for) says in its reply how
long to linger instead (`IngestResponse.linger_ms`); the longer of the two is kept until
its next reply says otherwise.

Resync. Each event sets or unsets one (block, tier) fact, so the state at time T is
"everything held at T" followed by the events queued before T, in order. The reporter
starts with a resync (AllBlocksCleared, then a "stored" event for every block the node
holds: `snapshot()`), which is how a restarted node announces what its SSD tier kept.
If the queue overflows (the conductor is unreachable for long), queued events are
dropped and another resync is sent once it is reachable again: memory stays bounded
and the conductor ends up right.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable

from quillcache.v1 import conductor_pb2
from quillcache_core.storeclient import wire
from quillcache_store.tiers.tiered import STORED, TierEvent

log = logging.getLogger(__name__)

_BACKOFF_START_S = 0.1
_BACKOFF_MAX_S = 2.0


# Blocks one coalesced event carries at most (a run longer than that is cut in two).
MAX_RUN = 256


def event_to_proto(event: TierEvent) -> conductor_pb2.KvEvent:
    """One store KvEvent: a "stored" carries the block's identity, parent, index and size."""
    return events_to_protos([event])[0]


def events_to_protos(events: list[TierEvent]) -> list[conductor_pb2.KvEvent]:
    """The events as KvEvents, runs coalesced: consecutive "stored" events of one chain
    (each block the child of the one before, same identity, tier, size and bytes) become
    one BlockStored with all their hashes, and consecutive "removed" events of one tier
    one BlockRemoved. A prompt's blocks offloaded or demoted together are one event, not
    one per block; the conductor applies exactly the same facts, in the same order."""
    out: list[conductor_pb2.KvEvent] = []
    run: list[TierEvent] = []
    for event in events:
        if run and len(run) < MAX_RUN and _continues(run[-1], event):
            run.append(event)
            continue
        if run:
            out.append(_run_to_proto(run))
        run = [event]
    if run:
        out.append(_run_to_proto(run))
    return out


def _continues(last: TierEvent, event: TierEvent) -> bool:
    if event.kind != last.kind or event.tier is not last.tier:
        return False
    if event.kind != STORED:
        return True
    a, b = last.key, event.key
    return (
        b.prefix_hash == a.block_hash
        and b.block_index == a.block_index + 1
        and b.token_count == a.token_count
        and event.bytes == last.bytes
        and b.tenant_id == a.tenant_id
        and b.model_id == a.model_id
        and b.tokenizer_id == a.tokenizer_id
        and b.adapter_id == a.adapter_id
    )


def _run_to_proto(run: list[TierEvent]) -> conductor_pb2.KvEvent:
    first = run[0]
    key = first.key
    medium = first.tier.value
    hashes = [event.key.block_hash for event in run]
    if first.kind == STORED:
        return conductor_pb2.KvEvent(
            stored=conductor_pb2.BlockStored(
                block_hashes=hashes,
                parent_block_hash=key.prefix_hash,
                block_size=key.token_count,
                medium=medium,
                bytes_per_block=first.bytes,
                identity=wire.identity_of(key),
                first_block_index=key.block_index,
            )
        )
    return conductor_pb2.KvEvent(
        removed=conductor_pb2.BlockRemoved(block_hashes=hashes, medium=medium)
    )


# The most a conductor's reply may ask this node to hold its batches (a standby's
# linger): a reply asking for more is read as this.
MAX_ASKED_LINGER_S = 1.0


class ResidencyReporter:
    """Queue of residency events and the task that delivers them. See the module doc."""

    def __init__(
        self,
        node_id: str,
        send: Callable[[conductor_pb2.KvEventBatch], Awaitable[float | None]],
        snapshot: Callable[[], list[TierEvent]],
        *,
        max_queue: int = 100_000,
        max_batch: int = 512,
        linger_s: float = 0.0,
    ) -> None:
        self.node_id = node_id
        self._send = send
        self._snapshot = snapshot
        self._max_queue = max(1, max_queue)
        self._max_batch = max(1, max_batch)
        self._linger_s = max(0.0, linger_s)
        self._asked_linger_s = 0.0  # what the conductor's last reply asked for (a standby)
        self._queue: collections.deque[TierEvent] = collections.deque()
        self._resync = True  # the first thing sent: what this node holds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._signalled = False
        self._sequence = 0
        self.events_offered = 0
        self.events_sent = 0
        self.events_dropped = 0
        self.batches_sent = 0
        self.send_failures = 0
        self.resyncs = 0

    # --- producer side (any thread) ----------------------------------------------------

    def offer(self, event: TierEvent) -> None:
        """Queue one event; never blocks. Thread-safe."""
        self.events_offered += 1
        if len(self._queue) >= self._max_queue:
            dropped = len(self._queue)
            self._queue.clear()
            self.events_dropped += dropped + 1
            if not self._resync:
                log.warning(
                    "residency queue full (%d events): dropped, a full resync will follow",
                    dropped,
                )
            self._resync = True
        else:
            self._queue.append(event)
        self._signal()

    def request_resync(self) -> None:
        """Send AllBlocksCleared and the full residency next (e.g. after a conductor restart)."""
        self._resync = True
        self._signal()

    def _signal(self) -> None:
        if self._signalled or self._loop is None or self._wake is None:
            return
        self._signalled = True
        try:
            self._loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop is closed: shutting down
            pass

    @property
    def pending(self) -> int:
        return len(self._queue)

    # --- sender side (event loop) --------------------------------------------------------

    async def run(self) -> None:
        """Deliver events until cancelled."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        while True:
            self._signalled = False
            self._wake.clear()
            if self._resync:
                await self._deliver_resync()
                continue
            if not self._queue:
                await self._wake.wait()
                continue
            linger = max(self._linger_s, self._asked_linger_s)
            if linger and len(self._queue) < self._max_batch:
                # Blocks arrive one by one during a transfer: a short wait turns a call
                # per block (each costing this loop and the conductor) into one per batch.
                # A standby conductor asks for a longer one: nothing reads its index yet.
                await asyncio.sleep(linger)
            events = []
            while self._queue and len(events) < self._max_batch:
                events.append(self._queue.popleft())
            await self._deliver(events)

    async def _deliver_resync(self) -> None:
        self._resync = False
        self.resyncs += 1
        # Events queued before the snapshot are replayed after it (see the module doc).
        held = await asyncio.to_thread(self._snapshot)
        batches = [([conductor_pb2.KvEvent(cleared=conductor_pb2.AllBlocksCleared())], 1)]
        for i in range(0, len(held), self._max_batch):
            part = held[i : i + self._max_batch]
            batches.append((events_to_protos(part), len(part)))
        for batch, count in batches:
            if self._resync:  # overflowed meanwhile: start over
                return
            await self._deliver_protos(batch, count)
        log.info("announced residency to the conductor: %d blocks", len(held))

    async def _deliver(self, events: list[TierEvent]) -> None:
        await self._deliver_protos(events_to_protos(events), len(events))

    async def _deliver_protos(self, protos: list[conductor_pb2.KvEvent], count: int) -> None:
        self._sequence += 1
        batch = conductor_pb2.KvEventBatch(
            engine_id=self.node_id,
            ts_ms=int(time.time() * 1000),
            events=protos,
            source_kind="store",
            sequence=self._sequence,
        )
        delay = _BACKOFF_START_S
        failures = 0
        while True:
            try:
                asked = await self._send(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: keep the batch, retry it
                self.send_failures += 1
                failures += 1
                level = logging.WARNING if failures == 1 else logging.DEBUG
                log.log(
                    level, "residency batch %d not delivered (%s); retrying", batch.sequence, exc
                )
                if self._resync:
                    return  # the resync supersedes this batch
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
                continue
            if failures:
                log.info("residency batch %d delivered after %d failures", batch.sequence, failures)
            self.batches_sent += 1
            self.events_sent += count
            self._asked_linger_s = min(MAX_ASKED_LINGER_S, max(0.0, asked or 0.0))
            return
