"""Conductor replicas share their reservations over a direct gRPC stream.

Every replica serves `ConductorReplica.Sync` and opens it on every other replica the
registry lists (records of kind "conductor", followed as they come and go). A stream
starts with a snapshot of the sender's open reservations, then carries each
reservation it opens (engine, prefill tokens and their TTFT, blocks, the optimistic
blocks) and closes (with the overlay's linger), coalesced for `flush_delay_s` (one
message per loop turn or so under load: a PlanStream batch of 30 plans is one
message; to a standby, a replica that plans nothing, for `standby_flush_s`), and an
empty heartbeat every `heartbeat_s` when idle. The receiver counts
them in `PeerLoad` as its own. A stream silent for `silence_s` is dropped with all the
load it brought, then opened again (a fresh snapshot); a replica that left the
registry loses its load at once.

Why a stream between replicas and not etcd or a message bus: a plan is answered in
about a millisecond and the next plan on the other replica may come a millisecond
later; a write to etcd per reservation is a Raft commit and an fsync (several
milliseconds, thousands per second on the cluster's one coordination service, the
very process whose stalls the replicas are there for), and NATS (Dynamo's way) is another
process to run, secure and keep alive. The registry already lists the replicas with
leases, and the stream reuses the cluster's mutual TLS and role guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from operator import itemgetter

import grpc

from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
from quillcache_conductor.peer_load import ClosedLoad, OpenedLoad, PeerLoad
from quillcache_conductor.records import Reservation
from quillcache_conductor.state import ConductorState
from quillcache_core.identity.chain import chain_keys
from quillcache_core.model import CacheResidency, CacheTier
from quillcache_core.routing.calibrate import ModelSpeeds
from quillcache_core.security.tls import Tls, grpc_channel
from quillcache_core.wire.plan import HASH_BYTES, unpack_hashes

logger = logging.getLogger(__name__)

HASH_HEX = 2 * HASH_BYTES
QUEUE_MAX = 4096  # messages waiting for one slow receiver; beyond, its stream is ended
HEARTBEAT = object()  # in a subscriber's queue: send an empty message (nothing went out)
# Opened reservations per message (about 2 KB each for a 128-block prompt): a snapshot
# of thousands, or a backlog after a long loop turn, goes as several messages, each
# well under gRPC's 4 MB default (and the receiver allows more anyway).
OPENED_PER_MESSAGE = 256
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
_new_record = partial(tuple.__new__, CacheResidency)


_key = itemgetter(0)
_parent, _hash, _index, _tokens = itemgetter(4), itemgetter(5), itemgetter(6), itemgetter(7)


def _opened_to_proto(
    res_id: str,
    engine_id: str,
    prefill_tokens: int,
    blocks: int,
    prefill_s: float,
    expires_s: float,
    records: list,
) -> conductor_pb2.ReservationOpened:
    """A reservation as sent to the peers. Its overlay is usually a chain of blocks of
    one size: then only the hashes travel (packed), with the chain's first parent and
    index; every column is extracted in C (this runs once per plan)."""
    msg = conductor_pb2.ReservationOpened(
        reservation_id=res_id,
        engine_id=engine_id,
        prefill_tokens=prefill_tokens,
        blocks=blocks,
        prefill_s=max(0.0, prefill_s),
        expires_s=max(0.0, expires_s),
    )
    if not records:
        return msg
    keys = list(map(_key, records))
    first = keys[0]
    identity = msg.identity
    identity.model_id = first.model_id
    identity.tokenizer_id = first.tokenizer_id
    if first.adapter_id is not None:
        identity.adapter_id = first.adapter_id
    identity.tenant_id = first.tenant_id
    msg.bytes_per_block = records[0][3]
    hashes = list(map(_hash, keys))
    joined = "".join(hashes)
    if len(joined) == HASH_HEX * len(hashes) and joined == joined.lower():
        try:
            msg.packed_hashes = bytes.fromhex(joined)
        except ValueError:
            msg.block_hashes.extend(hashes)
    else:
        msg.block_hashes.extend(hashes)
    parents = list(map(_parent, keys))
    msg.first_parent = parents[0]
    if parents[1:] != hashes[:-1]:
        msg.prefix_hashes.extend(parents)
    indexes = list(map(_index, keys))
    msg.first_index = indexes[0]
    if indexes != list(range(indexes[0], indexes[0] + len(indexes))):
        msg.block_indexes.extend(indexes)
    counts = list(map(_tokens, keys))
    msg.block_tokens = counts[0]
    if counts.count(counts[0]) != len(counts):
        msg.token_counts.extend(counts)
    return msg


def opened_from_proto(msg: conductor_pb2.ReservationOpened) -> OpenedLoad:
    """A peer's reservation as this replica keys its overlay records (the same keys the
    peer's planner made). Malformed columns (lengths that disagree) give no overlay."""
    hashes = list(msg.block_hashes) or (
        unpack_hashes(msg.packed_hashes) if len(msg.packed_hashes) % HASH_BYTES == 0 else []
    )
    records: list[CacheResidency] = []
    n = len(hashes)
    parents = list(msg.prefix_hashes) or [msg.first_parent, *hashes[:-1]]
    indexes = list(msg.block_indexes) or range(msg.first_index, msg.first_index + n)
    counts = list(msg.token_counts) or repeat(msg.block_tokens, n)
    if n and len(parents) == n == len(indexes) and (not msg.token_counts or len(counts) == n):
        identity = msg.identity
        adapter = identity.adapter_id if identity.HasField("adapter_id") else None
        keys = chain_keys(
            (identity.model_id, identity.tokenizer_id, adapter, identity.tenant_id),
            hashes,
            parents=parents,
            indexes=indexes,
            token_counts=counts,
        )
        records = list(
            map(
                _new_record,
                zip(
                    keys,
                    repeat(msg.engine_id, n),
                    repeat(CacheTier.HBM, n),
                    repeat(msg.bytes_per_block, n),
                    repeat(0, n),
                    repeat(0, n),
                    repeat(False, n),
                    strict=True,
                ),
            )
        )
    return OpenedLoad(
        reservation_id=msg.reservation_id,
        engine_id=msg.engine_id,
        prefill_tokens=msg.prefill_tokens,
        blocks=msg.blocks,
        prefill_s=msg.prefill_s,
        expires_s=msg.expires_s,
        records=records,
    )


class _Silence:
    """Cancels a stream nothing came in on for `silence_s` (`fired` then): one timer
    checked every half of it, rather than a deadline on every read."""

    def __init__(self, call, silence_s: float) -> None:
        self._call = call
        self._silence_s = silence_s
        self._loop = asyncio.get_running_loop()
        self._heard = self._loop.time()
        self.fired = False
        self._timer = self._loop.call_later(silence_s / 2, self._check)

    def heard(self) -> None:
        self._heard = self._loop.time()

    def _check(self) -> None:
        if self._loop.time() - self._heard > self._silence_s:
            self.fired = True
            self._call.cancel()
        elif not self._call.done():
            self._timer = self._loop.call_later(self._silence_s / 2, self._check)

    def cancel(self) -> None:
        self._timer.cancel()


@dataclass(slots=True)
class _Owed:
    """What a standby peer is owed since its last message: the flushes held for it."""

    opened: list = field(default_factory=list)
    closed: list = field(default_factory=list)
    prefilled: list = field(default_factory=list)
    flushes: int = 0


class ReplicaLog:
    """This replica's reservations as they open and close, sent to every peer that
    streams them (the state's listener and the `ConductorReplica` servicer).

    A peer that plans gets them as they come (coalesced for `flush_delay_s`); a peer
    that `planning` says does not (a standby: the gateways plan on a primary) gets them
    coalesced for `standby_flush_s`, one message where there were dozens: it needs our
    load only to take over, and a standby's CPU goes on every message it reads. Once
    it plans, its own reservations reach us and it gets ours as they come again."""

    def __init__(
        self,
        state: ConductorState,
        node_id: str,
        start_time_s: float,
        *,
        flush_delay_s: float = 0.001,
        heartbeat_s: float = 0.5,
        planning: Callable[[str], bool] | None = None,
        standby_flush_s: float = 0.0,
    ) -> None:
        self.state = state
        self.node_id = node_id
        self.start_time_s = start_time_s
        self.flush_delay_s = flush_delay_s
        self.heartbeat_s = heartbeat_s
        self.planning = planning
        self.standby_flush_s = standby_flush_s
        self._subscribers: dict[int, asyncio.Queue] = {}
        self._peer_of: dict[int, str] = {}  # subscriber -> the peer replica's id
        self._held: dict[int, _Owed] = {}  # what each standby is owed
        self._standby_handle: asyncio.TimerHandle | None = None
        self.messages_coalesced = 0  # messages to standbys merged into others
        self._next_id = 0
        self._opened: list[tuple] = []
        self._closed: list[conductor_pb2.ReservationClosed] = []
        self._prefilled: list[str] = []  # reservations whose first token came
        self._flush_handle: asyncio.TimerHandle | None = None
        self.messages_sent = 0
        self.overflows = 0

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    # --- the state's listener (hot path: queue only) -------------------------------------

    def opened(self, res: Reservation, prefill_s: float) -> None:
        if not self._subscribers:
            return
        self._opened.append(
            (
                res.id,
                res.engine_id,
                res.prefill_tokens,
                res.blocks,
                prefill_s,
                self.state.reservation_ttl_s,
                res.optimistic,  # the list itself: a close rebinds, never clears it
            )
        )
        self._schedule()

    def closed(self, res: Reservation, linger_s: float, resident: bool) -> None:
        if not self._subscribers:
            return
        closed = conductor_pb2.ReservationClosed(
            reservation_id=res.id, linger_s=linger_s, resident=resident
        )
        if res.sample_ttft_us > 0:
            closed.sample.model_id = res.model_id
            closed.sample.tokens = res.sample_ahead + res.sample_tokens
            closed.sample.ttft_us = res.sample_ttft_us
            closed.sample.fetch_us = res.sample_fetch_us
        self._closed.append(closed)
        self._schedule()

    def prefilled(self, res: Reservation) -> None:
        if not self._subscribers:
            return
        self._prefilled.append(res.id)
        self._schedule()

    def _schedule(self) -> None:
        if self._flush_handle is None:
            loop = asyncio.get_running_loop()
            self._flush_handle = loop.call_later(self.flush_delay_s, self.flush)

    def flush(self) -> None:
        """Send what was queued to every subscriber: one message, or several for a
        long backlog (its closes in the last, after every open they may close)."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if not self._opened and not self._closed and not self._prefilled:
            return
        opened = [_opened_to_proto(*item) for item in self._opened]
        closed, prefilled = self._closed, self._prefilled
        self._opened, self._closed, self._prefilled = [], [], []
        messages = None  # built for the first peer that plans
        for sub_id, queue in self._subscribers.items():
            if self._standby(sub_id):
                owed = self._held.get(sub_id)
                if owed is None:
                    owed = self._held[sub_id] = _Owed()
                owed.opened += opened
                owed.closed += closed
                owed.prefilled += prefilled
                owed.flushes += 1
                if self._standby_handle is None:
                    loop = asyncio.get_running_loop()
                    self._standby_handle = loop.call_later(
                        self.standby_flush_s, self.flush_standbys
                    )
                continue
            if sub_id in self._held:
                self.flush_standbys(only=sub_id)  # what it was owed first, in order
            if messages is None:
                messages = self._messages(opened, closed, prefilled=prefilled)
            for message in messages:
                self._offer(queue, message)

    def _standby(self, sub_id: int) -> bool:
        if not self.standby_flush_s or self.planning is None:
            return False
        return not self.planning(self._peer_of.get(sub_id, ""))

    def flush_standbys(self, only: int | None = None) -> None:
        """Send each standby what it was held, merged: every open, then every first
        token, then every close (as a message applies them: a reservation is opened
        before it is closed, so the merge keeps their meaning)."""
        if only is None and self._standby_handle is not None:
            self._standby_handle.cancel()
            self._standby_handle = None
        for sub_id in [only] if only is not None else list(self._held):
            owed = self._held.pop(sub_id, None)
            queue = self._subscribers.get(sub_id)
            if owed is None or queue is None:
                continue
            merged = self._messages(owed.opened, owed.closed, prefilled=owed.prefilled)
            self.messages_coalesced += max(0, owed.flushes - len(merged))
            for message in merged:
                self._offer(queue, message)

    def _messages(
        self, opened: list, closed: list, *, snapshot: bool = False, prefilled: list = ()
    ) -> list:
        step = OPENED_PER_MESSAGE
        chunks = [opened[i : i + step] for i in range(0, len(opened), step)] or [[]]
        last = len(chunks) - 1
        return [
            self._message(
                snapshot=snapshot and i == 0,
                opened=chunk,
                closed=closed if i == last else (),
                prefilled=prefilled if i == last else (),
            )
            for i, chunk in enumerate(chunks)
        ]

    def _offer(self, queue: asyncio.Queue, message) -> None:
        try:
            queue.put_nowait(message)
        except asyncio.QueueFull:  # a receiver this far behind starts again from a snapshot
            self.overflows += 1
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(None)  # its stream ends there (RESOURCE_EXHAUSTED)

    def _message(
        self, *, snapshot: bool = False, opened=(), closed=(), prefilled=()
    ) -> conductor_pb2.LoadDeltas:
        return conductor_pb2.LoadDeltas(
            conductor_id=self.node_id,
            start_time_s=self.start_time_s,
            snapshot=snapshot,
            opened=opened,
            closed=closed,
            heartbeat_s=self.heartbeat_s,
            prefilled=prefilled,
        )

    def snapshot(self) -> list[conductor_pb2.LoadDeltas]:
        """Every open reservation, with what remains of its prefill time and TTL, and
        every finished one whose overlay still lingers (opened and closed at once, with
        what remains of its linger). The first message says snapshot."""
        state = self.state
        now = state.clock()
        due = state.ledger.prefill_due_at()
        opened = [
            _opened_to_proto(
                res.id,
                res.engine_id,
                0 if res.prefill_released else res.prefill_tokens,
                res.blocks,
                due.get(res.id, now) - now,
                res.expires_s - now,
                res.optimistic,
            )
            for res in state.reservations.values()
        ]
        closed = []
        for until, res in state.ledger.lingering():
            if res.optimistic and until > now:
                left = until - now  # (its TTL too: a tick between two messages keeps it)
                opened.append(
                    _opened_to_proto(res.id, res.engine_id, 0, 0, 0, left, res.optimistic)
                )
                closed.append(conductor_pb2.ReservationClosed(reservation_id=res.id, linger_s=left))
        return self._messages(opened, closed, snapshot=True)

    # --- the servicer --------------------------------------------------------------------

    async def Sync(self, request, context):  # noqa: N802 (a gRPC method)
        self.flush()  # what happened before the snapshot is in it: older news to the others
        queue: asyncio.Queue = asyncio.Queue(QUEUE_MAX)
        self._next_id += 1
        sub_id = self._next_id
        snapshot = self.snapshot()
        self._subscribers[sub_id] = queue
        self._peer_of[sub_id] = request.conductor_id
        logger.info(
            "conductor %s streams our reservations (%d open)",
            request.conductor_id or "?",
            sum(len(m.opened) for m in snapshot),
        )
        # A heartbeat goes into the queue when nothing went out for `heartbeat_s` (a
        # timer, not a deadline on every get: that costs a task a message).
        loop = asyncio.get_running_loop()
        sent_at = loop.time()

        def beat() -> None:
            nonlocal timer
            if queue.empty() and loop.time() - sent_at >= 0.9 * self.heartbeat_s:
                queue.put_nowait(HEARTBEAT)
            timer = loop.call_later(self.heartbeat_s, beat)

        timer = loop.call_later(self.heartbeat_s, beat)
        try:
            for message in snapshot:
                yield message
                self.messages_sent += 1
            while True:
                message = await queue.get()
                if message is HEARTBEAT:
                    message = self._message()
                if message is None:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "too far behind: open Sync again for a snapshot",
                    )
                yield message
                self.messages_sent += 1
                sent_at = loop.time()
        finally:
            timer.cancel()
            self._subscribers.pop(sub_id, None)
            self._peer_of.pop(sub_id, None)
            self._held.pop(sub_id, None)


class ReplicaSyncServicer(conductor_pb2_grpc.ConductorReplicaServicer):
    def __init__(self, log: ReplicaLog) -> None:
        self.log = log

    async def Sync(self, request, context):  # noqa: N802 (a gRPC method)
        async for message in self.log.Sync(request, context):
            yield message


class ReplicaPeers:
    """Streams the reservations of every other replica the registry lists into
    `peer_load` (see the module doc)."""

    def __init__(
        self,
        registry,
        node_id: str,
        tls: Tls | None,
        peer_load: PeerLoad,
        *,
        speeds: ModelSpeeds | None = None,
        silence_s: float = 2.0,
        retry_max_s: float = 0.5,
    ) -> None:
        self.registry = registry
        self.node_id = node_id
        self.tls = tls
        self.peer_load = peer_load
        # The learned speeds, taught by the samples in the peers' closes too.
        self.speeds = speeds
        self.samples_received = 0
        self.silence_s = silence_s
        self.retry_max_s = retry_max_s
        self._streams: dict[str, tuple[str, asyncio.Task]] = {}  # peer id -> (address, task)
        self._watch: asyncio.Task | None = None
        self.messages_received = 0
        self.connected: set[str] = set()

    def start(self) -> None:
        self._watch = asyncio.create_task(self._follow(), name="replica-peers")

    async def _follow(self) -> None:
        while True:
            try:
                async for event in self.registry.watch("conductor"):
                    record = event.record
                    if record.id == self.node_id:
                        continue
                    if event.type == "leave":
                        await self._stop(record.id)
                        self.peer_load.drop_peer(record.id, why="left the registry")
                        continue
                    known = self._streams.get(record.id)
                    if known is not None and known[0] == record.address:
                        continue
                    await self._stop(record.id)
                    if record.address:
                        task = asyncio.create_task(
                            self._sync(record.id, record.address), name=f"sync-{record.id}"
                        )
                        self._streams[record.id] = (record.address, task)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("watching the conductor replicas failed; watching again")
                await asyncio.sleep(0.5)

    async def _stop(self, peer_id: str) -> None:
        known = self._streams.pop(peer_id, None)
        if known is not None:
            known[1].cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await known[1]
        self.connected.discard(peer_id)

    async def _sync(self, peer_id: str, address: str) -> None:
        delay_s = 0.05
        quiet = False
        while True:
            try:
                async with grpc_channel(address, self.tls, CHANNEL_OPTIONS) as channel:
                    stub = conductor_pb2_grpc.ConductorReplicaStub(channel)
                    call = stub.Sync(conductor_pb2.SyncRequest(conductor_id=self.node_id))
                    watch = _Silence(call, self.silence_s)
                    try:
                        while True:
                            try:
                                message = await call.read()
                            except (asyncio.CancelledError, grpc.aio.AioRpcError):
                                if not watch.fired:
                                    raise
                                self.peer_load.drop_peer(peer_id, why="its stream fell silent")
                                raise ConnectionError(f"silent for {self.silence_s}s") from None
                            watch.heard()
                            if message is grpc.aio.EOF:
                                raise ConnectionError("stream ended")
                            self._apply(peer_id, message)
                            if peer_id not in self.connected:
                                self.connected.add(peer_id)
                                logger.info("streaming the reservations of conductor %s", peer_id)
                                delay_s, quiet = 0.05, False
                    finally:
                        watch.cancel()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the peer is away: try again soon
                self.connected.discard(peer_id)
                (logger.debug if quiet else logger.info)(
                    "reservations of conductor %s at %s: %s; trying again",
                    peer_id,
                    address,
                    _detail(exc),
                )
                quiet = True
            await asyncio.sleep(delay_s)
            delay_s = min(2 * delay_s, self.retry_max_s)

    def _apply(self, peer_id: str, message: conductor_pb2.LoadDeltas) -> None:
        self.messages_received += 1
        apply_deltas(self.peer_load, peer_id, message)
        if self.speeds is None:
            return
        for m in message.closed:
            if m.HasField("sample"):
                self.samples_received += 1
                sample = m.sample  # out-of-range values are refused by the fits
                self.speeds.observe(sample.model_id, sample.tokens, sample.ttft_us, sample.fetch_us)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch
        for peer_id in list(self._streams):
            await self._stop(peer_id)


def apply_deltas(peer_load: PeerLoad, peer_id: str, message: conductor_pb2.LoadDeltas) -> None:
    """One of a peer's sync messages, counted in `peer_load`."""
    peer_load.apply(
        peer_id,
        message.start_time_s,
        snapshot=message.snapshot,
        opened=[opened_from_proto(m) for m in message.opened],
        closed=[ClosedLoad(m.reservation_id, m.linger_s, m.resident) for m in message.closed],
        prefilled=message.prefilled,
    )


def _detail(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__
