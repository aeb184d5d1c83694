"""Node registry: who is in the fleet (engines, stores, conductors, transfer, gateways).

Two implementations share the `NodeRegistry` interface (`base`):

* `MemoryRegistry` (`memory`): in-process, for unit tests and single-process runs.
* `EtcdRegistry` (`etcd`): etcd v3 via `etcd3aio` (async gRPC).

`open_registry("memory")` / `open_registry("etcd://127.0.0.1:2379")` picks one.
Records and their keys are in `records`.
"""

from __future__ import annotations

from quillcache_core.errors import InvalidArgument
from quillcache_core.registry.base import NodeRegistry
from quillcache_core.registry.etcd import EtcdRegistry, normalize_endpoint
from quillcache_core.registry.memory import MemoryRegistry
from quillcache_core.registry.records import (
    NODE_KINDS,
    NODES_PREFIX,
    NodeEvent,
    NodeRecord,
    kind_prefix,
    node_key,
    parse_node_key,
)

__all__ = [
    "NODES_PREFIX",
    "NODE_KINDS",
    "EtcdRegistry",
    "MemoryRegistry",
    "NodeEvent",
    "NodeRecord",
    "NodeRegistry",
    "kind_prefix",
    "node_key",
    "normalize_endpoint",
    "open_registry",
    "parse_node_key",
]


# ---------------------------------------------------------------------------- open


def open_registry(spec: str) -> NodeRegistry:
    """Open a registry from a spec string.

    "memory" -> MemoryRegistry; "etcd://h:p[,h:p...]" or "http://h:p[,...]" ->
    EtcdRegistry. Anything else raises InvalidArgument."""
    text = (spec or "").strip()
    if text in ("memory", "memory://"):
        return MemoryRegistry()
    for scheme in ("etcd://", "http://"):
        if text.startswith(scheme):
            rest = text[len(scheme) :]
            items = [item for item in rest.split(",") if item.strip()]
            if not items:
                break
            return EtcdRegistry([normalize_endpoint(item) for item in items])
    raise InvalidArgument(
        f"registry spec must be 'memory', 'etcd://host:port[,host:port...]' or "
        f"'http://host:port', got {spec!r}"
    )
