"""Whose renewals keep a registry record alive.

etcd lets any authenticated client keep any lease alive: LeaseLeases, LeaseTimeToLive
(keys included) and LeaseKeepAlive carry no permission check (etcd 3.5), so a lease
that lives says nothing of its owner. What only the owner can do is write its record
(RBAC on the key). So an owner that registers with a TTL writes the TTL into its record
(`NodeRecord.lease_ttl_s`) and rewrites the record once a TTL (every third keepalive),
and a reader takes the record as alive only while it sees those writes: one not
rewritten for `STALE_AFTER_TTLS` times its TTL is gone, whoever keeps its lease alive.

A reader times the writes by its own clock (when it first saw a record's revision),
never by a writer's clock, so clocks need not agree. Time during which the reader could
not reach etcd does not count against an owner: the wait restarts from the reader's
last trouble with etcd (`trouble_at`), as an owner cannot rewrite through an outage
either. Pure logic: the clock is passed in.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# An owner rewrites once a TTL: two rewrites missed or late under load are not a death.
# (Rewriting every keepalive round cost each watcher a decode and a wake-up per node
# each third of a TTL; idle conductors spent half again as much CPU.)
REWRITE_EVERY_ROUNDS = 3
STALE_AFTER_TTLS = 3.0
MAX_TRACKED_KEYS = 65536


@dataclass
class _Seen:
    revision: int
    at: float  # when this reader first saw `revision`
    reported: bool = False  # its staleness was logged


class RenewalTracker:
    """Per record key, the revision last seen and when it was first seen.

    Holds at most `max_keys` keys (the longest unchanged goes first: seen again, it
    counts as new). One event loop; not thread-safe."""

    def __init__(self, clock: Callable[[], float], max_keys: int = MAX_TRACKED_KEYS) -> None:
        self._clock = clock
        self._max_keys = max_keys
        self._seen: dict[str, _Seen] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def observe(self, key: str, revision: int) -> None:
        """Note that `key` is at `revision` now (a write by its owner if it changed)."""
        seen = self._seen.get(key)
        if seen is not None and seen.revision == revision:
            return
        self._seen.pop(key, None)  # re-inserted last: the dict's order is by last change
        if len(self._seen) >= self._max_keys:
            del self._seen[next(iter(self._seen))]
        self._seen[key] = _Seen(revision, self._clock())

    def due_at(self, key: str, ttl_s: float, trouble_at: float) -> float:
        """When `key` turns stale unless rewritten (inf for a record that promises no
        renewals, ttl_s <= 0, or one never observed)."""
        seen = self._seen.get(key)
        if ttl_s <= 0 or seen is None:
            return math.inf
        return max(seen.at, trouble_at) + STALE_AFTER_TTLS * ttl_s

    def alive(self, key: str, revision: int, ttl_s: float, trouble_at: float) -> bool:
        """Observe `key` at `revision`, then whether its owner still renews it."""
        self.observe(key, revision)
        if self._clock() < self.due_at(key, ttl_s, trouble_at):
            return True
        seen = self._seen[key]
        if not seen.reported:
            seen.reported = True
            log.warning(
                "%s not rewritten by its owner for %.1fs (lease TTL %gs): taking it as gone "
                "even if its lease lives",
                key,
                self._clock() - seen.at,
                ttl_s,
            )
        return False
