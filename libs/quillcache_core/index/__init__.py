"""Residency index backends and the factory that picks one by name."""

from __future__ import annotations

from quillcache_core.errors import InvalidArgument
from quillcache_core.index.base import Chain, IndexBackend
from quillcache_core.index.lmdb_index import LmdbIndex
from quillcache_core.index.memory import MemoryIndex
from quillcache_core.index.mirrored import MirroredIndex

__all__ = ["Chain", "IndexBackend", "LmdbIndex", "MemoryIndex", "MirroredIndex", "open_index"]

BACKENDS = ("memory", "lmdb")


def open_index(
    backend: str, path: str | None = None, *, sync_commits: bool = True, mirror: bool = False
) -> IndexBackend:
    """Open the index backend named `backend` ("memory" or "lmdb", any case).

    "lmdb" needs `path`, the environment directory (created if missing); "memory"
    ignores it. `sync_commits=False` lets lmdb skip the fsync per commit (see
    LmdbIndex.flush). With `mirror`, lmdb is served from an in-memory copy and
    written at flush() (MirroredIndex). Raises InvalidArgument for an unknown name or
    lmdb without a path.
    """
    name = str(backend).strip().lower()
    if name == "memory":
        return MemoryIndex()
    if name == "lmdb":
        if not path:
            raise InvalidArgument("index backend 'lmdb' needs a path (the environment directory)")
        durable = LmdbIndex(path, sync_commits=sync_commits)
        return MirroredIndex(durable) if mirror else durable
    raise InvalidArgument(
        f"unknown index backend {backend!r}; expected one of: {', '.join(BACKENDS)}"
    )
