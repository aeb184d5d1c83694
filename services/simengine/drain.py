"""Draining the sim engine: out of service without losing its cache.

Told to save (`POST /sim/drain` phase "save", the operator's), the engine saves its
hottest cached blocks that its store node lacks to that node (the save path the KV
connector uses) and names them, so the caller can wait until the conductors locate
them in the pool. Told to stop (phase "stop"), it rewrites its registry record with
state `draining` (every conductor replica leaves it out of new plans), waits for the
requests it runs to finish, and rewrites its record with state `drained`. It keeps serving whatever still reaches it. Its prefixes
are then in the pool, and the conductors plan them as FETCH on the other engines.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from quillcache_core.model import KvBlockKey
from quillcache_simengine.kvcache import PrefixCache
from quillcache_simengine.offload import BlockMover
from quillcache_simengine.scheduler import Scheduler

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.02


@dataclass
class DrainReport:
    state: str = "serving"
    hot_blocks: int = 0  # cached blocks considered by the last save (the hottest)
    saved_blocks: int = 0  # of those, saved because the store node lacked them
    requests_waited: int = 0  # requests running or queued when the stop began
    idle: bool = False  # False: the deadline passed with requests still running


class Drainer:
    """Two phases, so the pool holds the blocks before any conductor stops planning to
    the engine: `save` (while it still serves), then `stop` (one at a time; asked again,
    it waits for the same one)."""

    def __init__(
        self,
        cache: PrefixCache,
        mover: BlockMover,
        scheduler: Scheduler,
        set_state: Callable[[str], Awaitable[None]],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.mover = mover
        self.scheduler = scheduler
        self.set_state = set_state
        self.clock = clock
        self.report = DrainReport()
        self._stopping: asyncio.Task[DrainReport] | None = None

    async def save(self, save_blocks: int) -> list[KvBlockKey]:
        """Save the hottest `save_blocks` cached blocks the own store node lacks; returns
        those saved."""
        hot = [block.key for block in self.cache.hottest(save_blocks)]
        missing = await self.mover.missing(hot)
        saved = await self.mover.store_now(missing)
        self.report.hot_blocks, self.report.saved_blocks = len(hot), saved
        log.info("drain: %d of %d hot blocks saved to the pool", saved, len(hot))
        return missing if saved == len(missing) else await self._held(missing)

    async def stop(self, timeout_s: float) -> DrainReport:
        """Record state `draining`, wait at most `timeout_s` for the requests it runs,
        then record `drained`."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(
                self._stop(timeout_s), name="drain"
            )
        return await asyncio.shield(self._stopping)

    async def _stop(self, timeout_s: float) -> DrainReport:
        report = self.report
        report.state = "draining"
        report.requests_waited = self._busy()
        await self.set_state("draining")
        deadline = self.clock() + timeout_s
        await self.mover.drain(timeout_s)  # queued saves finish too
        while self._busy() and self.clock() < deadline:
            await asyncio.sleep(IDLE_POLL_S)
        report.idle = not self._busy()
        report.state = "drained"
        await self.set_state("drained")
        log.info("drained: %d requests waited for (idle %s)", report.requests_waited, report.idle)
        return report

    async def _held(self, keys: list[KvBlockKey]) -> list[KvBlockKey]:
        lacking = set(await self.mover.missing(keys))
        return [key for key in keys if key not in lacking]

    def _busy(self) -> int:
        return self.scheduler.running + self.scheduler.waiting
