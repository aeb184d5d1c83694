"""The residency-index contract shared by every backend."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from itertools import repeat
from typing import NamedTuple

from quillcache_core.identity.chain import chain_keys
from quillcache_core.model import (
    CacheResidency,
    CacheTier,
    IdentityScope,
    IndexMetrics,
    KvBlockKey,
)


class IndexBackend(abc.ABC):
    """Maps block identity to residency: which worker and tier hold each block.

    A block may be resident on several workers, and on several tiers of one worker.
    `put` replaces the record for the same (key, worker, tier). Backends hold metadata
    only, never KV bytes. Not thread-safe: the owner serialises calls.
    """

    name: str = "abstract"

    @property
    def persistent(self) -> bool:
        """Whether residency survives a process restart."""
        return False

    @abc.abstractmethod
    def put(self, residency: CacheResidency) -> None: ...

    def put_many(self, residencies: Iterable[CacheResidency]) -> None:
        """Put several records; persistent backends commit them together."""
        for residency in residencies:
            self.put(residency)

    def put_chain(self, chain: Chain) -> None:
        """Put a chain of blocks of one scope, all on one worker and tier: put_many of
        `chain.records()` (persistent backends commit them together; MemoryIndex builds
        a fresh chain's records only when a read or put first touches one of its
        blocks)."""
        self.put_many(chain.records())

    @abc.abstractmethod
    def locate(self, key: KvBlockKey) -> list[CacheResidency]:
        """Every residency of exactly this key."""

    @abc.abstractmethod
    def locate_hash(self, block_hash: str) -> list[CacheResidency]:
        """Every residency whose key has this content hash, whatever its identity.

        This is what the reuse guard audits: content matches of other identities are
        returned here so they can be refused with a reason, never silently reused.
        """

    def locate_hashes(self, block_hashes: Iterable[str]) -> list[list[CacheResidency]]:
        return [self.locate_hash(block_hash) for block_hash in block_hashes]

    def locate_prefix(
        self,
        block_hashes: Iterable[str],
        extra: Mapping[str, list[CacheResidency]] | None = None,
    ) -> list[list[CacheResidency]]:
        """locate_hash for each hash up to the first one held nowhere (exclusive).

        `extra` adds records the index does not hold, by hash. A chained prefix cannot
        be reused past a block nobody holds, so a planner need not look further.
        """
        hashes = list(block_hashes)
        out: list[list[CacheResidency]] = []
        for block_hash, found in zip(hashes, self.locate_hashes(hashes), strict=True):
            added = extra.get(block_hash) if extra else None
            if added:
                found = [*found, *added]
            if not found:
                break
            out.append(found)
        return out

    @abc.abstractmethod
    def prefix_scan(self, scope: IdentityScope, prefix_hash: str) -> list[CacheResidency]:
        """Residencies in `scope` whose key's parent hash is `prefix_hash`."""

    @abc.abstractmethod
    def remove_block(self, scope: IdentityScope, worker_id: str, block_hash: str) -> int:
        """Remove a block (all tiers) from one worker; returns records removed."""

    @abc.abstractmethod
    def remove_tier(self, worker_id: str, block_hash: str, tier: object) -> int:
        """Remove one tier's copy of a block on one worker, any identity; records removed."""

    @abc.abstractmethod
    def clear_worker(self, worker_id: str) -> int:
        """Drop everything on one worker; returns records removed."""

    @abc.abstractmethod
    def clear(self) -> None: ...

    @abc.abstractmethod
    def snapshot(self) -> list[CacheResidency]: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def worker_block_count(self, worker_id: str) -> int:
        """Records held by one worker (SGLang's tree size, /metrics)."""

    @abc.abstractmethod
    def workers(self) -> list[str]:
        """Every worker holding at least one record, sorted."""

    @abc.abstractmethod
    def worker_epochs(self) -> dict[str, float]:
        """Each worker's epoch as last set by set_worker_epoch (a copy)."""

    @abc.abstractmethod
    def set_worker_epoch(self, worker_id: str, epoch: float) -> None:
        """Remember which run of `worker_id` its records belong to (the conductor uses
        the node's registry start time). Not a record: clear() and clear_worker() keep
        it; a persistent backend keeps it across reopens."""

    @abc.abstractmethod
    def metrics(self) -> IndexMetrics: ...

    @contextmanager
    def write_batch(self) -> Iterator[None]:
        """The writes made inside reach the backend as one write where it can make them
        one (LMDB: one transaction, all or none); by default each applies at once."""
        yield

    def flush(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Make every change so far durable; a no-op for in-memory backends."""

    @property
    def dirty(self) -> bool:
        """Whether `flush` has anything to do: a change since the last one (a backend
        that cannot tell says True). The conductor flushes only then: an idle one
        makes no disk write at all."""
        return self.persistent

    def close(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release files; a no-op for in-memory backends."""


_new = tuple.__new__


class Chain(NamedTuple):
    """A chain of blocks of one scope, all on one worker and tier (`put_chain`).

    Block i's key is KvBlockKey(*scope, prefix, block_hashes[i], first_index + i,
    token_count), its prefix `parent` for the first block and the previous hash after.
    """

    scope: tuple[str, str, str | None, str]
    parent: str
    block_hashes: list[str]
    first_index: int
    token_count: int
    worker_id: str
    tier: CacheTier
    nbytes: int
    last_access_ms: int = 0

    def records(self) -> list[CacheResidency]:
        """The chain's records, in chain order, built in C-level passes (no Python
        call per block)."""
        return _chain_records(*self)


def _chain_records(
    scope: tuple[str, str, str | None, str],
    parent: str,
    block_hashes: list[str],
    first_index: int,
    token_count: int,
    worker_id: str,
    tier: CacheTier,
    nbytes: int,
    last_access_ms: int,
) -> list[CacheResidency]:
    keys = chain_keys(
        scope, block_hashes, parent=parent, first_index=first_index, token_count=token_count
    )
    return list(
        map(
            _new,
            repeat(CacheResidency),
            zip(
                keys,
                repeat(worker_id),
                repeat(tier),
                repeat(nbytes),
                repeat(last_access_ms),
                repeat(0),
                repeat(False),
            ),
        )
    )
