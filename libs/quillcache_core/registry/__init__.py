"""Node registry: who is in the fleet (engines, stores, conductors, transfer, gateways).

Two implementations share the `NodeRegistry` interface (`base`):

* `MemoryRegistry` (`memory`): in-process, for unit tests and single-process runs.
* `EtcdRegistry` (`etcd`): etcd v3 via `etcd3aio` (async gRPC).

`open_registry("memory")` / `open_registry("etcd://127.0.0.1:2379")` /
`open_registry("https://127.0.0.1:2379", tls)` picks one. Records and their keys are
in `records`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from quillcache_core.errors import InvalidArgument
from quillcache_core.registry.base import NodeRegistry
from quillcache_core.registry.etcd import EtcdRegistry, RegistryAccessDenied, normalize_endpoint
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

if TYPE_CHECKING:
    from quillcache_core.security.tls import Tls

__all__ = [
    "NODES_PREFIX",
    "NODE_KINDS",
    "EtcdRegistry",
    "MemoryRegistry",
    "NodeEvent",
    "NodeRecord",
    "NodeRegistry",
    "RegistryAccessDenied",
    "kind_prefix",
    "node_key",
    "normalize_endpoint",
    "open_registry",
    "parse_node_key",
]


# ---------------------------------------------------------------------------- open


log = logging.getLogger(__name__)


def open_registry(spec: str, tls: Tls | None = None) -> NodeRegistry:
    """Open a registry from a spec string.

    * "memory" -> MemoryRegistry (`tls` is not used);
    * "https://h:p[,h:p...]" -> EtcdRegistry over mutual TLS as `tls.role`; `tls` is
      required;
    * "etcd://h:p[,...]" -> EtcdRegistry, over TLS when `tls` is given, else plaintext;
    * "http://h:p[,...]" -> EtcdRegistry in plaintext (a `tls` given is not used).

    Anything else raises InvalidArgument."""
    text = (spec or "").strip()
    if text in ("memory", "memory://"):
        return MemoryRegistry()
    for scheme in ("https://", "etcd://", "http://"):
        if text.startswith(scheme):
            rest = text[len(scheme) :]
            items = [item for item in rest.split(",") if item.strip()]
            if not items:
                break
            endpoints = [normalize_endpoint(item) for item in items]
            if scheme == "https://" and tls is None:
                raise InvalidArgument(
                    f"registry {spec!r} is TLS (https://): it needs the client's "
                    "certificates (--tls-dir), or an http:// registry with --insecure"
                )
            if scheme == "http://" and tls is not None:
                log.warning(
                    "registry %s is plaintext (http://): not using TLS for it; "
                    "use https:// for a TLS etcd",
                    spec,
                )
                tls = None
            return EtcdRegistry(endpoints, tls=tls)
    raise InvalidArgument(
        f"registry spec must be 'memory', 'https://host:port[,host:port...]' (TLS), "
        f"'etcd://host:port[,...]' or 'http://host:port[,...]', got {spec!r}"
    )
