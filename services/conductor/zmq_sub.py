"""Subscribe to one engine's KV events over ZMQ (vLLM's and SGLang's publisher).

Wire (vLLM's `ZmqEventPublisher`, vllm/distributed/kv_events.py): a PUB socket sends 3 frames per batch: topic, sequence number
(8-byte big-endian, from 0), msgpack payload. A ROUTER socket replays buffered
batches: the client (a DEALER) sends (b"", start sequence as 8-byte BE) and receives,
after the empty delimiter, one (topic, sequence, payload) message per buffered batch at
or after it, then (b"", -1 as signed 8-byte BE, b""), as vLLM's ZmqEventPublisher
answers. The older two-frame form, (sequence, payload) and (-1, b""), is read too.

The subscriber applies batches in sequence order exactly once:

- seq == last + 1: decode and hand to `on_batch`;
- seq <= last: already applied (typically through a replay): ignored;
- seq > last + 1: a gap; ask the replay socket for last + 1 onwards, apply what it
  returns in order, then carry on. What the replay cannot supply is counted in
  `lost`, reported as "events_lost", and `on_lost` is called: the engine's records
  can no longer be trusted (a missed BlockRemoved would claim a block for ever), so
  the owner drops them and relearns from the events that follow;
- a live sequence number at or below the previous live one means the publisher
  restarted: `on_reset` is called (the engine's cache is gone) and counting restarts.

With `catch_up` set, the subscriber asks the replay socket for everything from 0 as
it starts, before any live batch, so a conductor started after its engines learns the
blocks their replay buffers hold at once, and an engine that has published nothing yet
is known to be current (an empty answer). Without an answer (the engine is not up yet),
the first live batch after start (or a restart) with seq > 0 triggers that catch-up.

Payloads are decoded with `decode_bulk`, so `on_batch` receives a BulkBatch (which the
translator applies in bulk, and which reads like a DecodedBatch through `events`).
Receiving never waits on applying: libzmq's I/O thread keeps reading the socket into
its receive queue (bounded by `rcvhwm` messages; past it the publisher drops and the
gap is replayed), and each wake-up of the subscriber task takes up to
`max_batches_per_wake` queued messages at once, non-blocking (a wake-up waits on the
socket's descriptor with the loop's own reader, not on a zmq.asyncio future for each
message), and applies them one a turn of the event loop: a Plan
that arrives during a backlog waits for at most one batch, not the whole chunk. A
`linger` (a standby's, standby.py) is awaited after the first message of a wake-up,
and the wake-up then takes up to `LINGER_MAX_BATCHES`; a wake-up that filled its
chunk is followed by one without the wait.

Nothing on the wire stops the subscriber: malformed frames, undecodable payloads and
bad events are counted, logged at WARNING with the engine id and sequence number
(rate-limited), and passed to `on_error(engine_id, seq, reason, detail)`; `seq` is
None when the frames carried no readable sequence number.

What the subscriber sees of the stream tells how current the index's view of the
engine is (`StreamFreshness`, which a plan reads): behind from start until the replay
at start is answered or the first live batch is applied, and after the socket lost its
connection until the next live batch; while a gap is replayed; and by the lag of the
last batch applied when that passed `STALE_LAG_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from quillcache_core.kvevents.bulk import BulkBatch
from quillcache_core.kvevents.bulk_decode import decode_bulk
from quillcache_core.kvevents.events import WireError

__all__ = ["STALE_LAG_S", "EngineSubscriber", "StreamFreshness", "SubscriberCounters"]

log = logging.getLogger(__name__)

END_SEQ = -1
OnBatch = Callable[[str, int, BulkBatch], None | Awaitable[None]]
OnError = Callable[[str, int | None, str, str], None | Awaitable[None]]
OnReset = Callable[[str], None | Awaitable[None]]
OnLost = Callable[[str, int], None | Awaitable[None]]

# A batch applied more than this long after its engine stamped it (the lag counted in
# kv_event_lag_seconds) left the index that far behind the engine: half a second is a
# few hundred plans' worth of routing and more than a busy engine takes to store or
# evict the blocks a plan counts on, yet above the few milliseconds a healthy
# subscriber takes (and the clock skew between hosts NTP leaves).
STALE_LAG_S = 0.5
MAX_BEHIND_MS = 2**32 - 1  # a uint32 on the wire
# The most queued batches one wake-up takes after a `linger` wait.
LINGER_MAX_BATCHES = 64


class StreamFreshness:
    """How current the index's view of one engine is, from what its subscriber
    observes: `behind_ms(now)` is 0 when current, else how far behind (ms, at least 1).

    Behind while nothing live has been applied since the subscriber started or its
    socket last lost the connection (whatever the engine published meanwhile is
    unknown until the next live batch); while a sequence gap is being replayed; and,
    until the next batch, by the lag of the last batch applied when it passed
    `STALE_LAG_S`. `now` is monotonic seconds, passed in; lags are seconds. Event
    loop only (not thread-safe).
    """

    __slots__ = ("_lag_s", "_replay_since", "_unsynced_since")

    def __init__(self, now: float) -> None:
        self._unsynced_since: float | None = now  # nothing heard yet
        self._replay_since: float | None = None
        self._lag_s = 0.0

    def disconnected(self, now: float) -> None:
        if self._unsynced_since is None:
            self._unsynced_since = now

    def caught_up(self) -> None:
        """A live batch was applied in order (or had been, through a replay)."""
        self._unsynced_since = None

    def replay_started(self, now: float) -> None:
        self._replay_since = now

    def replay_ended(self) -> None:
        self._replay_since = None

    def applied(self, lag_s: float) -> None:
        """A batch was applied `lag_s` after its engine stamped it."""
        self._lag_s = lag_s

    def behind_ms(self, now: float) -> int:
        behind = self._lag_s if self._lag_s > STALE_LAG_S else 0.0
        since = self._unsynced_since
        if self._replay_since is not None and (since is None or self._replay_since < since):
            since = self._replay_since
        if since is None:
            if not behind:
                return 0
        else:
            behind = max(behind, now - since)
        return min(MAX_BEHIND_MS, max(1, round(behind * 1000)))


@dataclass(slots=True)
class SubscriberCounters:
    batches: int = 0  # batches decoded and handed to on_batch (live + replayed)
    events: int = 0  # events decoded in those batches
    event_errors: int = 0  # events the decoder rejected
    gaps: int = 0  # sequence gaps seen
    replayed: int = 0  # batches applied from a replay
    replay_failures: int = 0  # replay requests that timed out or failed
    lost: int = 0  # sequence numbers neither received nor replayed
    duplicates: int = 0  # batches ignored because already applied
    wire_errors: int = 0  # malformed frames or payloads
    callback_errors: int = 0  # exceptions raised by on_batch/on_error/on_reset
    resets: int = 0  # publisher restarts detected
    wakes: int = 0  # receives that found batches (one or more each)
    probes: int = 0  # replays from 0 answered at start (see `_probe`)


class _Arrivals:
    """Waits until a ZMQ socket has a message, on the socket's descriptor with the
    loop's own reader. ZMQ's descriptor only says the socket's state may have changed
    (edge-like): each signal is answered by reading ZMQ_EVENTS, which also clears it,
    and a wait returns at once while a message is queued."""

    __slots__ = ("_sock", "_fd", "_loop", "_waiter")

    def __init__(self, sock: zmq.Socket, loop: asyncio.AbstractEventLoop) -> None:
        self._sock = sock
        self._fd = sock.getsockopt(zmq.FD)
        self._loop = loop
        self._waiter: asyncio.Future | None = None
        loop.add_reader(self._fd, self._signalled)

    def _readable(self) -> bool:
        try:
            return bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        except zmq.ZMQError:
            return True  # closed: the receive that follows says so

    def _signalled(self) -> None:
        if self._readable():
            waiter, self._waiter = self._waiter, None
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        while not self._readable():
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._fd)


class EngineSubscriber:
    def __init__(
        self,
        engine_id: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        on_batch: OnBatch,
        on_error: OnError | None = None,
        on_reset: OnReset | None = None,
        on_lost: OnLost | None = None,
        linger: Callable[[], Awaitable[bool]] | None = None,
        topic: bytes = b"",
        context: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = 2.0,
        catch_up: bool = True,
        rcvhwm: int = 100_000,
        max_batches_per_wake: int = 4,
        max_message_bytes: int = 256 * 1024 * 1024,
        log_burst: int = 20,
        log_window_s: float = 10.0,
    ) -> None:
        self.engine_id = engine_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.on_batch = on_batch
        self.on_error = on_error
        self.on_reset = on_reset
        self.on_lost = on_lost
        self.linger = linger
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.catch_up = catch_up
        self.rcvhwm = rcvhwm
        self.max_batches_per_wake = max(1, max_batches_per_wake)
        self.max_message_bytes = max_message_bytes
        self.counters = SubscriberCounters()
        self.freshness = StreamFreshness(time.monotonic())
        # Highest sequence number applied (or skipped as lost); -1 before the first.
        self.last_seq = -1
        # Highest sequence number seen on the live socket; None after (re)start.
        self.live_seq: int | None = None
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._log_burst = log_burst
        self._log_window_s = log_window_s
        self._log_window_start = 0.0
        self._log_count = 0
        self._log_suppressed = 0

    # --- lifecycle ---------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Connect and start receiving in a task of the running event loop."""
        if self.running:
            raise RuntimeError(f"subscriber for {self.engine_id} already started")
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
        # A larger message makes ZMQ drop the connection (it reconnects): a gap, not OOM.
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        self._sub = sub
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name=f"kv-events-{self.engine_id}")
        self._watch_task = loop.create_task(
            self._watch(self._monitor), name=f"kv-events-monitor-{self.engine_id}"
        )

    async def stop(self) -> None:
        """Stop receiving and close the sockets; safe to call twice."""
        for task in (self._task, self._watch_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._watch_task = None
        if self._sub is not None and self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
        for sock in (self._monitor, self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._replay = self._monitor = None

    # --- receiving ---------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._sub is not None
        sub = self._sub
        # The same socket without the asyncio machinery: messages are taken
        # non-blocking, and waited for on the socket's descriptor (`_Arrivals`), with
        # no future and no zmq.asyncio bookkeeping per message.
        queued = zmq.Socket.shadow(sub.underlying)
        if self.catch_up and self.replay_endpoint is not None:
            await self._probe()
        arrivals = _Arrivals(queued, asyncio.get_running_loop())
        try:
            await self._receive(sub, queued, arrivals)
        finally:
            arrivals.close()

    async def _receive(self, sub, queued: zmq.Socket, arrivals: _Arrivals) -> None:
        backlog = False  # the last wake-up left messages queued: take them now
        while True:
            try:
                await arrivals.wait()
                chunk = [queued.recv_multipart(zmq.NOBLOCK)]
            except zmq.Again:
                continue  # the descriptor spoke of something else
            except zmq.ZMQError as exc:
                if exc.errno in (zmq.ETERM, zmq.ENOTSOCK) or sub.closed:
                    self.freshness.disconnected(time.monotonic())
                    log.info("kv events %s: socket closed, subscriber stops", self.engine_id)
                    return
                self.counters.wire_errors += 1
                log.warning("kv events %s: receive failed: %s", self.engine_id, exc)
                await asyncio.sleep(0.1)  # back off; do not spin on a persistent error
                continue
            most = self.max_batches_per_wake
            # A standby's wait (standby.py): what comes meanwhile joins this wake-up.
            if self.linger is not None and not backlog and await self.linger():
                most = max(most, LINGER_MAX_BATCHES)
            while len(chunk) < most:
                try:
                    chunk.append(queued.recv_multipart(zmq.NOBLOCK))
                except zmq.ZMQError:  # zmq.Again: nothing queued (or the socket closed)
                    break
            backlog = len(chunk) >= most
            self.counters.wakes += 1
            last = len(chunk) - 1
            for i, frames in enumerate(chunk):
                try:
                    await self._on_frames(frames)
                except asyncio.CancelledError:
                    raise
                except Exception:  # never die on one message
                    log.exception("kv events %s: unexpected error handling a batch", self.engine_id)
                # One batch a turn of the loop: a Plan that arrived meanwhile runs before
                # the next batch (taking a queued message does not yield), so it waits
                # for at most one batch's work. After the last, waiting for the next
                # message yields anyway.
                if i < last or backlog:
                    await asyncio.sleep(0)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """The live socket's lost connections: the view is behind from each until the
        next live batch. (A connect is not watched: the view is already behind since
        the start or the loss before it, and a connect event read after the first
        batch would wrongly undo that batch.)"""
        while True:
            try:
                frames = await monitor.recv_multipart()
            except zmq.ZMQError:
                return  # closed
            try:
                event = parse_monitor_message(frames)["event"]
            except Exception:  # a malformed notification: not a reason to stop watching
                continue
            if event == zmq.EVENT_MONITOR_STOPPED:
                return
            self.freshness.disconnected(time.monotonic())

    async def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            await self._wire_error(None, "bad_frames", f"{len(frames)} frames, expected 3")
            return
        _topic, seq_bytes, payload = frames
        if len(seq_bytes) != 8:
            await self._wire_error(
                None, "bad_sequence", f"sequence frame is {len(seq_bytes)} bytes"
            )
            return
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq < 0:
            await self._wire_error(
                seq, "bad_sequence", "negative sequence number on the live socket"
            )
            return
        if self.live_seq is not None and seq <= self.live_seq:
            await self._publisher_restarted(seq)
        self.live_seq = seq
        await self._take_live(seq, payload)
        self.freshness.caught_up()

    async def _take_live(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            self.counters.duplicates += 1
            return
        if seq > self.last_seq + 1 and (self.last_seq >= 0 or self.catch_up):
            self.counters.gaps += self.last_seq >= 0
            self.freshness.replay_started(time.monotonic())
            try:
                await self._recover(self.last_seq + 1, seq)
            finally:
                self.freshness.replay_ended()
            if seq <= self.last_seq:  # the replay covered it
                self.counters.duplicates += 1
                return
        await self._apply(seq, payload, replayed=False)

    async def _publisher_restarted(self, seq: int) -> None:
        self.counters.resets += 1
        self._warn(seq, "sequence_reset", f"live sequence went back from {self.live_seq} to {seq}")
        await self._call(
            self.on_error, self.engine_id, seq, "sequence_reset", f"from {self.live_seq}"
        )
        if self.on_reset is not None:
            await self._call(self.on_reset, self.engine_id)
        self.last_seq = -1

    async def _apply(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        if seq > self.last_seq + 1 and self.last_seq >= 0:
            missing = seq - self.last_seq - 1
            self.counters.lost += missing
            detail = f"sequences {self.last_seq + 1}..{seq - 1} not recovered"
            self._warn(seq, "events_lost", detail)
            await self._call(self.on_error, self.engine_id, seq, "events_lost", detail)
            await self._call(self.on_lost, self.engine_id, missing)
        self.last_seq = seq
        try:
            batch = decode_bulk(payload)
        except WireError as exc:
            await self._wire_error(seq, exc.reason, exc.detail)
            return
        self.counters.batches += 1
        self.counters.replayed += replayed
        self.counters.events += batch.event_count
        for error in batch.errors:
            self.counters.event_errors += 1
            detail = f"event {error.index}: {error.detail}"
            self._warn(seq, error.reason, detail)
            await self._call(self.on_error, self.engine_id, seq, error.reason, detail)
        await self._call(self.on_batch, self.engine_id, seq, batch)

    # --- replay ------------------------------------------------------------------------

    async def _recover(self, start: int, live_seq: int) -> None:
        """Replay from `start`; apply each new batch in order."""
        if self.replay_endpoint is None:
            return
        log.info(
            "kv events %s: gap before seq %d (last applied %d); replaying from %d",
            self.engine_id,
            live_seq,
            self.last_seq,
            start,
        )
        try:
            await self._replay_from(start)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.counters.replay_failures += 1
            self._warn(live_seq, "replay_failed", f"{type(exc).__name__}: {exc}")
            await self._call(self.on_error, self.engine_id, live_seq, "replay_failed", str(exc))
            self._drop_replay_socket()

    async def _probe(self) -> None:
        """At start, before any live batch: everything the engine's replay buffer holds,
        applied. An answer, even an empty one, leaves the view holding all the engine
        still buffers: current, so an idle engine's plans are not counted behind, and a
        conductor started beside warm engines knows their blocks before they publish
        again. No answer in time (the engine is not up yet) is no error: the view stays
        behind until the first live batch, whose gap, if any, is replayed then."""
        try:
            await self._replay_from(0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info("kv events %s: no replay at start (%s)", self.engine_id, exc)
            self._drop_replay_socket()
            return
        self.counters.probes += 1
        self.freshness.caught_up()

    async def _replay_from(self, start: int) -> None:
        """Ask the replay socket for `start` onwards and apply each new batch in order;
        raises when the answer does not come in time."""
        sock = self._replay_socket()
        await sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        while True:
            if not await sock.poll(int(self.replay_timeout_s * 1000), zmq.POLLIN):
                raise TimeoutError(f"no replay answer within {self.replay_timeout_s}s")
            frames = await sock.recv_multipart()
            if frames and frames[0] == b"":  # DEALER: drop the envelope delimiter
                frames = frames[1:]
            if len(frames) == 3:  # vLLM: (topic, seq, payload); the end has topic b""
                frames = frames[1:]
            if len(frames) != 2 or len(frames[0]) != 8:
                await self._wire_error(None, "bad_replay_frames", f"{len(frames)} frames")
                continue
            seq = int.from_bytes(frames[0], "big", signed=True)
            if seq == END_SEQ:
                return
            if seq <= self.last_seq:
                continue
            await self._apply(seq, frames[1], replayed=True)

    def _drop_replay_socket(self) -> None:
        """A late answer to an abandoned request must not confuse the next one."""
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None

    def _replay_socket(self) -> zmq.asyncio.Socket:
        if self._replay is None:
            assert self.replay_endpoint is not None
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            sock.connect(self.replay_endpoint)
            self._replay = sock
        return self._replay

    # --- reporting ---------------------------------------------------------------------

    async def _wire_error(self, seq: int | None, reason: str, detail: str) -> None:
        self.counters.wire_errors += 1
        self._warn(seq, reason, detail)
        await self._call(self.on_error, self.engine_id, seq, reason, detail)

    async def _call(self, callback: Callable[..., object] | None, *args: object) -> None:
        if callback is None:
            return
        try:
            result = callback(*args)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception:
            self.counters.callback_errors += 1
            log.exception("kv events %s: callback %r failed", self.engine_id, callback)

    def _warn(self, seq: int | None, reason: str, detail: str) -> None:
        now = time.monotonic()
        if now - self._log_window_start >= self._log_window_s:
            if self._log_suppressed:
                log.warning(
                    "kv events %s: %d more warnings suppressed in the last %.0fs",
                    self.engine_id,
                    self._log_suppressed,
                    self._log_window_s,
                )
            self._log_window_start = now
            self._log_count = 0
            self._log_suppressed = 0
        if self._log_count >= self._log_burst:
            self._log_suppressed += 1
            return
        self._log_count += 1
        log.warning("kv events %s seq %s: %s: %s", self.engine_id, seq, reason, detail)
