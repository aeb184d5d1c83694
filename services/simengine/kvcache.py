"""The sim engine's paged KV cache: engine block hashes, prefix cache, LRU eviction.

Pure: no sockets, no clock. Not thread-safe: the engine uses it from its event loop.

Engine block hashes follow vLLM: a chain of SHA-256 digests over msgpack of
(parent digest, the block's token ids, the block's extra keys), whose root parent is a
per-engine random seed, so they mean nothing outside this engine. The first block's
extra keys hold the request's cache salt (vLLM puts `cache_salt` there); later blocks
inherit it through the chain, so two salts never share a block. On the wire a hash is
the digest's low 64 bits as an unsigned integer.

The cache holds at most `capacity_blocks` blocks. A block in use by a running request
is pinned (reference count > 0) and never evicted; unpinned blocks wait in an LRU
queue. As in vLLM, a finished request frees its blocks tail first, so a prefix's last
blocks are evicted before its first ones.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack

from quillcache_core.errors import InvalidArgument
from quillcache_core.model import KvBlockKey

__all__ = [
    "CachedBlock",
    "InsertResult",
    "PrefixCache",
    "engine_digests",
    "extra_keys_for",
    "wire_hash",
]


def extra_keys_for(block_index: int, cache_salt: str | None) -> list[str] | None:
    """vLLM's per-block extra keys: the salt on the first block only (no LoRA here)."""
    if block_index == 0 and cache_salt:
        return [cache_salt]
    return None


def engine_digests(
    seed: bytes, tokens: Sequence[int], block_size: int, cache_salt: str | None
) -> list[bytes]:
    """32-byte engine digests of the full blocks of `tokens`, chained from `seed`."""
    if block_size <= 0:
        raise InvalidArgument(f"block_size must be positive, got {block_size}")
    out: list[bytes] = []
    parent = seed
    for i in range(len(tokens) // block_size):
        block = list(tokens[i * block_size : (i + 1) * block_size])
        raw = msgpack.packb([parent, block, extra_keys_for(i, cache_salt)])
        parent = hashlib.sha256(raw).digest()
        out.append(parent)
    return out


def wire_hash(digest: bytes) -> int:
    """The hash vLLM publishes by default: the digest's low 64 bits, unsigned."""
    return int.from_bytes(digest[-8:], "big")


@dataclass(slots=True)
class CachedBlock:
    """One block in the engine's cache.

    `key` is QuillCache's identity of the block (its store key when offloaded);
    `parent` is the engine hash of the previous block of the request that stored it.
    """

    engine_hash: int
    parent: int | None
    index: int
    token_ids: tuple[int, ...]
    key: KvBlockKey
    cache_salt: str | None
    refs: int = 0


@dataclass(slots=True)
class InsertResult:
    """What one insert did: blocks newly cached (in order), blocks evicted for them,
    and the engine hashes the caller now pins (new and already-cached ones)."""

    stored: list[CachedBlock] = field(default_factory=list)
    evicted: list[CachedBlock] = field(default_factory=list)
    pinned: list[int] = field(default_factory=list)


class PrefixCache:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise InvalidArgument(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[int, CachedBlock] = {}
        # Unpinned blocks, least recently used first.
        self._free: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0
        # Bumped by `clear`: pins taken before a clear must not be released after it.
        self.generation = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, engine_hash: int) -> bool:
        return engine_hash in self._blocks

    def get(self, engine_hash: int) -> CachedBlock | None:
        return self._blocks.get(engine_hash)

    @property
    def pinned_blocks(self) -> int:
        return len(self._blocks) - len(self._free)

    def lookup(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are cached (changes nothing)."""
        count = 0
        for engine_hash in hashes:
            if engine_hash not in self._blocks:
                break
            count += 1
        return count

    def acquire(self, hashes: Sequence[int]) -> list[int]:
        """Pin the cached blocks among `hashes`; returns the hashes pinned."""
        pinned = []
        for engine_hash in hashes:
            block = self._blocks.get(engine_hash)
            if block is None:
                continue
            self._pin(block)
            pinned.append(engine_hash)
        return pinned

    def release(self, hashes: Sequence[int], generation: int) -> None:
        """Unpin blocks a request acquired, given in request order (head first).

        Blocks that reach zero references join the LRU queue tail first, so the
        request's last block is the first of them to be evicted. Pins taken in an
        earlier `generation` (before a clear) are void and ignored."""
        if generation != self.generation:
            return
        for engine_hash in reversed(hashes):
            block = self._blocks.get(engine_hash)
            if block is None or block.refs <= 0:
                continue
            block.refs -= 1
            if block.refs == 0:
                self._free[engine_hash] = None

    def insert(self, blocks: Sequence[CachedBlock]) -> InsertResult:
        """Cache a request's computed blocks (in request order) and pin them.

        Blocks already cached are pinned as they are. A new block takes a free slot or
        evicts the least recently used unpinned block; when every block is pinned, the
        rest of the request is not cached (its chain would be broken anyway)."""
        result = InsertResult()
        for block in blocks:
            current = self._blocks.get(block.engine_hash)
            if current is not None:
                self._pin(current)
                result.pinned.append(current.engine_hash)
                continue
            if len(self._blocks) >= self.capacity_blocks:
                victim = self._evict_one()
                if victim is None:
                    break
                result.evicted.append(victim)
            block.refs = 1
            self._blocks[block.engine_hash] = block
            result.stored.append(block)
            result.pinned.append(block.engine_hash)
        return result

    def hottest(self, limit: int) -> list[CachedBlock]:
        """Up to `limit` cached blocks, hottest first: those in use, then the unpinned
        ones most recently released."""
        pinned = [b for b in self._blocks.values() if b.refs > 0]
        recent = (self._blocks[h] for h in reversed(self._free))
        out = pinned[:limit]
        for block in recent:
            if len(out) >= limit:
                break
            out.append(block)
        return out

    def clear(self) -> int:
        """Drop every block (vLLM's reset_prefix_cache); returns how many there were."""
        count = len(self._blocks)
        self.generation += 1
        self._blocks.clear()
        self._free.clear()
        return count

    def _pin(self, block: CachedBlock) -> None:
        if block.refs == 0:
            self._free.pop(block.engine_hash, None)
        block.refs += 1

    def _evict_one(self) -> CachedBlock | None:
        if not self._free:
            return None
        engine_hash, _ = self._free.popitem(last=False)
        self.evictions += 1
        return self._blocks.pop(engine_hash)
