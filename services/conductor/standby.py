"""Whether this replica stands by, and how long its event ingest may wait meanwhile.

The gateways plan on one replica (`--conductor-spread primary`, the default); another
keeps its index current only to take over. A replica stands by while a peer plans
(`PeerLoad.any_planning`) and it has served no Plan or Locate for `PLANNING_S`. Then
nothing reads its index until a takeover, so each wake-up of its ingest can carry
many batches instead of one:

- an engine's KV event subscriber, woken by a batch, waits `linger_s` (`linger()`)
  and takes everything queued meanwhile at once;
- its IngestKvEvents replies carry `linger_ms`, and the stores hold their residency
  batches to it that long (a store's own `--event-linger-s`, if longer, still wins).

The first Plan or Locate it serves (`served()`) ends every wait at once and every
later one, so a takeover plans from an index at most one wait behind the engines:
`linger_s` is kept below `STALE_LAG_S`, which would count such a view as stale. A
lone replica, or one whose peers plan nothing, never waits.

Single-threaded: called from the event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable

from quillcache_conductor.peer_load import PLANNING_S

__all__ = ["Standby"]


class Standby:
    def __init__(
        self,
        linger_s: float,
        peers_planning: Callable[[], bool],
        *,
        clock: Callable[[], float] = time.monotonic,
        within_s: float = PLANNING_S,
    ) -> None:
        self.linger_s = max(0.0, linger_s)
        self._peers_planning = peers_planning
        self._clock = clock
        self._within_s = within_s
        self._last_served = -math.inf
        self._woken: asyncio.Event | None = None
        self.lingers = 0  # waits begun
        self.woken = 0  # waits ended early by a served call

    def served(self) -> None:
        """A Plan or Locate was served here: wait no more."""
        self._last_served = self._clock()
        woken = self._woken
        if woken is not None and not woken.is_set():
            woken.set()
            self.woken += 1

    @property
    def standing_by(self) -> bool:
        return (
            self.linger_s > 0
            and self._clock() - self._last_served > self._within_s
            and self._peers_planning()
        )

    def linger_ms(self) -> int:
        """What an IngestKvEvents reply asks the store to hold its batches for."""
        return round(self.linger_s * 1000) if self.standing_by else 0

    async def linger(self) -> bool:
        """Wait `linger_s` while standing by (until served, if sooner); else return at
        once. Whether it waited."""
        if not self.standing_by:
            return False
        if self._woken is None or self._woken.is_set():
            self._woken = asyncio.Event()
        self.lingers += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._woken.wait(), self.linger_s)
        return True
