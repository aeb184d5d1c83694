"""The sim engine's timing: one prefill at a time in arrival order, decodes in parallel.

`PrefillQueue` is the pure part: a single server whose busy time is booked when a
request arrives, so a request's prefill starts when every earlier one has finished
(queueing is real and load matters). `Scheduler` sleeps until the booked times with an
injected clock and sleep. Deadlines are absolute, so many tiny waits (at a small time
scale) do not add up to drift.

Decoding does not queue: each running request emits one token every
`decode_us_per_token * time_scale`, as in a continuous batch. With `prefill_stalls_decodes`
an engine runs one kind of step at a time, as vLLM does without chunked prefill: no
token is emitted while a prefill runs, and each running decode's later tokens move back
by the wait (the inter-token stall prefill/decode disaggregation removes from decode
engines).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from quillcache_core.errors import InvalidArgument

__all__ = ["PrefillQueue", "Scheduler"]

# Below this, waiting is a yield to the loop (a timer would overshoot by more).
_MIN_SLEEP_S = 0.0005
_YIELD_EVERY = 32


@dataclass(slots=True)
class PrefillQueue:
    """Book prefill slots on one server. Times are seconds on the caller's clock."""

    us_per_token: float
    time_scale: float
    free_at: float = 0.0

    def duration_s(self, tokens: int) -> float:
        if tokens < 0:
            raise InvalidArgument(f"tokens must be >= 0, got {tokens}")
        return tokens * self.us_per_token * self.time_scale / 1e6

    def book(self, now: float, tokens: int) -> tuple[float, float]:
        """(start, end) of a prefill of `tokens` arriving at `now`."""
        start = max(now, self.free_at)
        end = start + self.duration_s(tokens)
        self.free_at = end
        return start, end


class Scheduler:
    def __init__(
        self,
        *,
        prefill_us_per_token: float,
        decode_us_per_token: float,
        time_scale: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        prefill_stalls_decodes: bool = False,
    ) -> None:
        self.queue = PrefillQueue(prefill_us_per_token, time_scale)
        self.prefill_stalls_decodes = prefill_stalls_decodes
        self._busy: deque[tuple[float, float]] = deque()  # booked prefills (start, end)
        self.decode_interval_s = decode_us_per_token * time_scale / 1e6
        self._clock = clock
        self._sleep = sleep
        self.waiting = 0  # requests waiting for or in prefill
        self.queued_prefill_tokens = 0
        self.running = 0  # requests decoding

    async def _until(self, deadline: float) -> None:
        delay = deadline - self._clock()
        if delay > _MIN_SLEEP_S:
            await self._sleep(delay)

    def booked_ahead_s(self) -> float:
        """Seconds until the prefill server is free: a prefill booked now starts then."""
        return max(0.0, self.queue.free_at - self._clock())

    async def prefill(self, tokens: int, started: asyncio.Event | None = None) -> float:
        """Wait for this request's turn and its prefill time; returns the end time.
        `started` is set when the prefill begins (its turn came)."""
        start, end = self.queue.book(self._clock(), tokens)
        if self.prefill_stalls_decodes and end > start:
            self._busy.append((start, end))
        self.waiting += 1
        self.queued_prefill_tokens += tokens
        try:
            if started is not None:
                await self._until(start)
                started.set()
            await self._until(end)
        finally:
            self.waiting -= 1
            self.queued_prefill_tokens -= tokens
        return end

    async def _wait_prefills(self) -> float:
        """While a prefill runs (or one booked is due), wait for its end; returns the wait."""
        waited = 0.0
        busy = self._busy
        while True:
            now = self._clock()
            while busy and busy[0][1] <= now:
                busy.popleft()
            if not busy or busy[0][0] > now:
                return waited
            await self._sleep(busy[0][1] - now)
            waited += self._clock() - now

    async def decode(self, count: int, start: float) -> AsyncIterator[int]:
        """Yield token numbers 0..count-1, the i-th at `start + i * interval`.

        The first token comes with the end of prefill, as in a real engine."""
        self.running += 1
        shift = 0.0  # time spent waiting for other requests' prefills
        try:
            for i in range(count):
                deadline = start + i * self.decode_interval_s + shift
                if deadline - self._clock() > _MIN_SLEEP_S:
                    await self._sleep(deadline - self._clock())
                elif i % _YIELD_EVERY == _YIELD_EVERY - 1:
                    await asyncio.sleep(0)
                if self.prefill_stalls_decodes:
                    shift += await self._wait_prefills()
                yield i
        finally:
            self.running -= 1
