"""Which engines take no new request: scale-in without losing the cache.

An engine drains when the operator asks a replica (`Drain`, each replica is asked) or
when its own registry record says `draining` or `drained` (the engine writes it: only
the engine role may write engine records). Either way the planner leaves it out; its
prefixes, saved to the pool before it goes, are then planned as FETCH elsewhere. A
draining engine still serves what it was sent, and takes new requests only when no
serving engine is left for a model (better a cold engine than a failed request).
"""

from __future__ import annotations

import logging

from quillcache_core.registry import NodeRecord

logger = logging.getLogger(__name__)


class Drains:
    """The engines told to drain on this replica. Bounded by the engines it knows: an
    engine that leaves or restarts (a new run serves again) is forgotten."""

    def __init__(self) -> None:
        self._told: set[str] = set()

    def begin(self, engine_id: str) -> bool:
        """Mark `engine_id` draining; False if it already was."""
        if engine_id in self._told:
            return False
        self._told.add(engine_id)
        logger.info("engine %s draining: no new requests planned to it", engine_id)
        return True

    def forget(self, engine_id: str) -> None:
        self._told.discard(engine_id)

    def excludes(self, record: NodeRecord) -> bool:
        """Whether the planner leaves this engine out."""
        return record.id in self._told or record.state != "serving"

    def state_of(self, record: NodeRecord) -> str:
        """The record's state, or `draining` for a serving record this replica was told."""
        if record.state == "serving" and record.id in self._told:
            return "draining"
        return record.state
