"""Residency index backends and the factory that picks one by name."""

from __future__ import annotations

from quillcache_core.errors import InvalidArgument
from quillcache_core.index.art_index import ArtIndex, ArtTreeIndex
from quillcache_core.index.base import Chain, IndexBackend
from quillcache_core.index.fs_index import FsIndex, JournaledIndex
from quillcache_core.index.lmdb_index import LmdbIndex
from quillcache_core.index.memory import MemoryIndex
from quillcache_core.index.mirrored import MirroredIndex
from quillcache_core.index.rocksdb_index import RocksIndex

__all__ = [
    "ArtIndex",
    "ArtTreeIndex",
    "BACKENDS",
    "Chain",
    "FsIndex",
    "IndexBackend",
    "JournaledIndex",
    "LmdbIndex",
    "MemoryIndex",
    "MirroredIndex",
    "RocksIndex",
    "open_index",
]

BACKENDS = ("memory", "lmdb", "rocksdb", "fs", "art")
_PERSISTENT = {"lmdb": LmdbIndex, "rocksdb": RocksIndex, "fs": FsIndex, "art": ArtIndex}


def open_index(
    backend: str, path: str | None = None, *, sync_commits: bool = True, mirror: bool = False
) -> IndexBackend:
    """Open the index backend named `backend` (one of BACKENDS, any case).

    Every backend but "memory" needs `path`, its directory (created if missing);
    "memory" ignores it. With `sync_commits` (the default) a persistent backend's write
    is durable when the call returns; `sync_commits=False` defers that to `flush()`
    (see LmdbIndex.flush, RocksIndex, JournaledIndex). With `mirror`, a persistent
    backend is served from an in-memory copy and written at flush() (MirroredIndex).
    fs and art read from memory anyway, but like every backend they are not
    thread-safe: a caller that runs flush() on another thread than its writes (the
    conductor's tick) needs the mirror. Raises InvalidArgument for an unknown name or
    a persistent backend without a path.
    """
    name = str(backend).strip().lower()
    if name == "memory":
        return MemoryIndex()
    if name not in BACKENDS:
        raise InvalidArgument(
            f"unknown index backend {backend!r}; expected one of: {', '.join(BACKENDS)}"
        )
    if not path:
        raise InvalidArgument(f"index backend {name!r} needs a path (its directory)")
    durable = _PERSISTENT[name](path, sync_commits=sync_commits)
    return MirroredIndex(durable) if mirror else durable
