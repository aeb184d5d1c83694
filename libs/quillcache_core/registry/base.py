"""The `NodeRegistry` interface both registries implement.

Every node registers a `NodeRecord` under `/quillcache/v1/nodes/{kind}/{id}` with a
lease (TTL). The owner keeps the lease alive in the background; when the owner dies
the lease expires and the key disappears, so watchers see a "leave". Only the owner's
renewals count: someone else keeping its lease alive does not keep the node in the
fleet (etcd lets any client renew any lease, so there the owner also rewrites its
record and readers drop one that is not rewritten: `renewals`).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType

from quillcache_core.registry.records import NodeEvent, NodeRecord

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- interface


class NodeRegistry(abc.ABC):
    """Register this node, list the fleet, watch it change. All methods are async."""

    @abc.abstractmethod
    async def register(self, record: NodeRecord, ttl_s: float) -> None:
        """Publish `record` with a lease of `ttl_s` seconds and keep it alive in the
        background until `deregister`/`close`. Registering the same (kind, id) again
        replaces the record (watchers see an "update")."""

    @abc.abstractmethod
    async def deregister(self, kind: str, id: str) -> None:
        """Stop keeping the node alive and remove it at once. No-op if not registered
        through this registry."""

    @abc.abstractmethod
    async def list(self, kind: str | None = None) -> list[NodeRecord]:
        """Current records (of one kind, or all), sorted by (kind, id)."""

    @abc.abstractmethod
    async def get(self, kind: str, id: str) -> NodeRecord | None:
        """One record, or None."""

    @abc.abstractmethod
    def watch(self, kind: str | None = None) -> AsyncIterator[NodeEvent]:
        """A "join" for every current node (one consistent snapshot), then live events.

        Stops when the registry is closed or the consumer stops iterating."""

    def recently_unreachable(self, within_s: float) -> bool:
        """Whether the registry's backing store failed or stalled a call of this process
        within the last `within_s` seconds, or has one stuck now. A "leave" seen then
        may be the outage's doing (leases ran out while their owners were alive, and
        they are about to register again): the conductor holds such leaves briefly.
        Always False for a registry that cannot be unreachable (memory)."""
        return False

    async def stop_keepalive(self, kind: str, id: str) -> None:
        """Fault injection: stop keeping the lease alive without revoking it, as if
        this process had hung or crashed. The node disappears once its TTL runs out."""
        raise NotImplementedError

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop keepalives, remove this process's registrations, end watches."""

    async def __aenter__(self) -> NodeRegistry:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


WATCH_END = object()


@dataclass
class WatchFailure:
    exc: BaseException
