"""`MemoryRegistry`: the in-process registry, for unit tests and single-process runs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from quillcache_core.errors import NodeUnavailable
from quillcache_core.registry.base import WATCH_END, NodeRegistry
from quillcache_core.registry.records import (
    JOIN,
    LEAVE,
    UPDATE,
    NodeEvent,
    NodeKey,
    NodeRecord,
    _check_part,
    check_ttl,
)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------- memory


@dataclass
class _MemLease:
    ttl_s: float
    timer: asyncio.TimerHandle | None = None  # set once keepalive stops


class MemoryRegistry(NodeRegistry):
    """In-process registry. Registrations stay alive until `deregister`/`close`;
    `stop_keepalive` arms a TTL timer (loop.call_later) that removes the node, and
    `expire` removes it at once (a simulated lease loss; no automatic re-register)."""

    def __init__(self) -> None:
        self._records: dict[NodeKey, NodeRecord] = {}
        self._leases: dict[NodeKey, _MemLease] = {}
        self._watchers: dict[asyncio.Queue[object], str | None] = {}
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise NodeUnavailable("registry is closed")

    async def register(self, record: NodeRecord, ttl_s: float) -> None:
        self._check_open()
        ttl_s = check_ttl(ttl_s)
        key = (record.kind, record.id)
        self._cancel_lease(key)
        self._leases[key] = _MemLease(ttl_s)
        old = self._records.get(key)
        self._records[key] = record
        log.info("registered %s/%s (memory, ttl %.1fs)", record.kind, record.id, ttl_s)
        self._publish(NodeEvent(UPDATE if old is not None else JOIN, record))

    async def deregister(self, kind: str, id: str) -> None:
        key = (_check_part("kind", kind), _check_part("id", id))
        self._cancel_lease(key)
        if self._remove(key):
            log.info("deregistered %s/%s (memory)", kind, id)

    async def stop_keepalive(self, kind: str, id: str) -> None:
        key = (_check_part("kind", kind), _check_part("id", id))
        lease = self._leases.get(key)
        if lease is not None and lease.timer is None:
            loop = asyncio.get_running_loop()
            lease.timer = loop.call_later(lease.ttl_s, self._on_lease_expired, key)

    def expire(self, kind: str, id: str) -> bool:
        """Simulate a lease loss now: the node is removed and watchers see a "leave".
        Returns whether the node existed."""
        key = (_check_part("kind", kind), _check_part("id", id))
        self._cancel_lease(key)
        return self._remove(key)

    def _on_lease_expired(self, key: NodeKey) -> None:
        self._leases.pop(key, None)
        if self._remove(key):
            log.info("lease of %s/%s expired (memory)", *key)

    def _cancel_lease(self, key: NodeKey) -> None:
        lease = self._leases.pop(key, None)
        if lease is not None and lease.timer is not None:
            lease.timer.cancel()

    def _remove(self, key: NodeKey) -> bool:
        record = self._records.pop(key, None)
        if record is None:
            return False
        self._publish(NodeEvent(LEAVE, record))
        return True

    def _publish(self, event: NodeEvent) -> None:
        for queue, kind in self._watchers.items():
            if kind is None or kind == event.record.kind:
                queue.put_nowait(event)

    async def list(self, kind: str | None = None) -> list[NodeRecord]:
        if kind is not None:
            _check_part("kind", kind)
        return [rec for key, rec in sorted(self._records.items()) if kind in (None, key[0])]

    async def get(self, kind: str, id: str) -> NodeRecord | None:
        return self._records.get((_check_part("kind", kind), _check_part("id", id)))

    def watch(self, kind: str | None = None) -> AsyncIterator[NodeEvent]:
        if kind is not None:
            _check_part("kind", kind)
        return self._watch(kind)

    async def _watch(self, kind: str | None) -> AsyncIterator[NodeEvent]:
        if self._closed:
            return
        # Snapshot and subscription happen with no await in between: nothing is lost.
        queue: asyncio.Queue[object] = asyncio.Queue()
        snapshot = [rec for key, rec in sorted(self._records.items()) if kind in (None, key[0])]
        self._watchers[queue] = kind
        try:
            for rec in snapshot:
                yield NodeEvent(JOIN, rec)
            while True:
                item = await queue.get()
                if item is WATCH_END:
                    return
                assert isinstance(item, NodeEvent)
                yield item
        finally:
            self._watchers.pop(queue, None)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for key in list(self._leases):
            self._cancel_lease(key)
        self._records.clear()
        for queue in self._watchers:
            queue.put_nowait(WATCH_END)
        log.info("memory registry closed")
