"""Persistent adaptive radix tree (ART) residency index: the Python analogue of Holt.

`ArtTree` is an adaptive radix tree over byte keys (Leis et al., ICDE 2013): inner
nodes of 4, 16, 48 and 256 children that grow and shrink with their fan-out, path
compression (each inner node keeps the bytes all keys below it share, pessimistically,
in full) and lazy expansion (a lone key is a leaf holding the whole key, split only
when a second key diverges). Keys must be prefix-free, which the encoding below
guarantees.

`ArtTreeIndex` keeps residency in two trees:

- the *chain* tree, keyed by ``model | tokenizer | adapter | tenant | prefix_hash |
  block_hash | block_index | token_count | worker | tier``, each field msgpack-packed
  (self-delimiting, so keys are prefix-free and every leading run of fields is a byte
  prefix). A block sits under its parent's hash inside its identity scope, so
  `prefix_scan(scope, parent)` is one descent to the node for ``scope | parent`` and a
  walk of its subtree, and `locate(key)` the same for the first eight fields;
- the *hash* tree, keyed by ``block_hash | chain key``: `locate_hash` and the removals
  (which address a hash across identities) walk the subtree under ``block_hash``.

plus each worker's chain keys (a dict used as an ordered set) for clear_worker and
worker_block_count. `ArtIndex` ("art") makes it persistent with the journal and
snapshots of fs_index.py: reads never touch the disk, and reopening replays the newest
snapshot and the log tail into a fresh tree (see JournaledIndex for the layout and for
when a write is acknowledged).
"""

from __future__ import annotations

import os
from bisect import bisect
from collections.abc import Iterable

import msgpack

from quillcache_core.index.base import IndexBackend
from quillcache_core.index.fs_index import JournaledIndex
from quillcache_core.model import (
    CacheResidency,
    CacheTier,
    IdentityScope,
    IndexMetrics,
    KvBlockKey,
)

# --- the tree ----------------------------------------------------------------------------


class _Leaf:
    __slots__ = ("key", "value")

    def __init__(self, key: bytes, value: object) -> None:
        self.key = key
        self.value = value


class _Node4:
    """Up to 4 children: sorted key bytes and children side by side."""

    __slots__ = ("prefix", "keys", "children")
    capacity = 4

    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix
        self.keys = bytearray()
        self.children: list = []


class _Node16(_Node4):
    """Up to 16 children, the same sorted arrays (ART's SIMD search is bytearray.find)."""

    __slots__ = ()
    capacity = 16


class _Node48:
    """Up to 48 children: a 256-byte index of slot + 1 (0: none) into 48 slots."""

    __slots__ = ("prefix", "index", "children", "count")

    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix
        self.index = bytearray(256)
        self.children: list = [None] * 48
        self.count = 0


class _Node256:
    """Up to 256 children, addressed directly by the key byte."""

    __slots__ = ("prefix", "children", "count")

    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix
        self.children: list = [None] * 256
        self.count = 0


_Inner = _Node4 | _Node16 | _Node48 | _Node256


def _find(node: _Inner, byte: int):
    kind = type(node)
    if kind is _Node256:
        return node.children[byte]
    if kind is _Node48:
        slot = node.index[byte]
        return node.children[slot - 1] if slot else None
    i = node.keys.find(byte)
    return node.children[i] if i >= 0 else None


def _set(node: _Inner, byte: int, child: object) -> None:
    """Replace the existing child under `byte`."""
    kind = type(node)
    if kind is _Node256:
        node.children[byte] = child
    elif kind is _Node48:
        node.children[node.index[byte] - 1] = child
    else:
        node.children[node.keys.index(byte)] = child


def _items(node: _Inner) -> list[tuple[int, object]]:
    """(byte, child) in byte order."""
    kind = type(node)
    if kind is _Node256:
        return [(b, c) for b, c in enumerate(node.children) if c is not None]
    if kind is _Node48:
        children = node.children
        return [(b, children[s - 1]) for b, s in enumerate(node.index) if s]
    return list(zip(node.keys, node.children, strict=True))


def _rebuild(kind: type, prefix: bytes, items: list[tuple[int, object]]) -> _Inner:
    node = kind(prefix)
    if kind is _Node256:
        for byte, child in items:
            node.children[byte] = child
        node.count = len(items)
    elif kind is _Node48:
        for slot, (byte, child) in enumerate(items):
            node.index[byte] = slot + 1
            node.children[slot] = child
        node.count = len(items)
    else:
        node.keys = bytearray(b for b, _ in items)
        node.children = [c for _, c in items]
    return node


def _add(node: _Inner, byte: int, child: object) -> _Inner:
    """Add a child under a new `byte`; returns the node, or the larger one it grew into."""
    kind = type(node)
    if kind is _Node256:
        node.children[byte] = child
        node.count += 1
        return node
    if kind is _Node48:
        if node.count < 48:
            slot = node.children.index(None)
            node.children[slot] = child
            node.index[byte] = slot + 1
            node.count += 1
            return node
        grown = _rebuild(_Node256, node.prefix, _items(node))
        return _add(grown, byte, child)
    keys = node.keys
    if len(keys) < node.capacity:
        i = bisect(keys, byte)
        keys.insert(i, byte)
        node.children.insert(i, child)
        return node
    grown = _rebuild(_Node16 if kind is _Node4 else _Node48, node.prefix, _items(node))
    return _add(grown, byte, child)


def _remove(node: _Inner, byte: int) -> object:
    """Drop the child under `byte`; returns the node, the smaller one it shrank into, or
    (a node left with one child) that child with the node's prefix folded in."""
    kind = type(node)
    if kind is _Node256:
        node.children[byte] = None
        node.count -= 1
        if node.count > 37:
            return node
        return _rebuild(_Node48, node.prefix, _items(node))
    if kind is _Node48:
        slot = node.index[byte]
        node.index[byte] = 0
        node.children[slot - 1] = None
        node.count -= 1
        if node.count > 12:
            return node
        return _rebuild(_Node16, node.prefix, _items(node))
    i = node.keys.index(byte)
    del node.keys[i]
    del node.children[i]
    if kind is _Node16:
        return node if len(node.keys) > 3 else _rebuild(_Node4, node.prefix, _items(node))
    if len(node.keys) > 1:
        return node
    (last_byte,), (only,) = node.keys, node.children
    if type(only) is not _Leaf:  # path compression: fold this node into its child
        only.prefix = node.prefix + bytes((last_byte,)) + only.prefix
    return only


def _mismatch(a: bytes, b: bytes, start: int) -> int:
    """How many bytes `a` and `b` share from `start` on (one XOR, not a Python loop)."""
    end = min(len(a), len(b))
    diff = int.from_bytes(a[start:end], "big") ^ int.from_bytes(b[start:end], "big")
    return (end - start) - (diff.bit_length() + 7) // 8


class ArtTree:
    """An adaptive radix tree from prefix-free byte keys to values."""

    __slots__ = ("_root", "_size")

    def __init__(self) -> None:
        self._root: object = None
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def _replace(self, parent: _Inner | None, byte: int, node: object) -> None:
        if parent is None:
            self._root = node
        else:
            _set(parent, byte, node)

    def insert(self, key: bytes, value: object) -> object:
        """Map `key` to `value`; returns the value it replaced, or None."""
        node = self._root
        parent, pbyte, depth = None, 0, 0
        while True:
            if node is None:
                self._root = _Leaf(key, value)
                break
            if type(node) is _Leaf:
                if node.key == key:
                    old, node.value = node.value, value
                    return old
                same = _mismatch(node.key, key, depth)
                split = _Node4(key[depth : depth + same])
                at = depth + same
                pairs = sorted(((node.key[at], node), (key[at], _Leaf(key, value))))
                split.keys = bytearray(b for b, _ in pairs)
                split.children = [c for _, c in pairs]
                self._replace(parent, pbyte, split)
                break
            prefix = node.prefix
            if prefix:
                if not key.startswith(prefix, depth):
                    same = _mismatch(prefix, key[depth : depth + len(prefix)], 0)
                    split = _Node4(prefix[:same])
                    node.prefix = prefix[same + 1 :]
                    pairs = sorted(((prefix[same], node), (key[depth + same], _Leaf(key, value))))
                    split.keys = bytearray(b for b, _ in pairs)
                    split.children = [c for _, c in pairs]
                    self._replace(parent, pbyte, split)
                    break
                depth += len(prefix)
            byte = key[depth]
            child = _find(node, byte)
            if child is None:
                grown = _add(node, byte, _Leaf(key, value))
                if grown is not node:
                    self._replace(parent, pbyte, grown)
                break
            parent, pbyte, node, depth = node, byte, child, depth + 1
        self._size += 1
        return None

    def get(self, key: bytes) -> object:
        node, depth = self._root, 0
        while node is not None and type(node) is not _Leaf:
            if not key.startswith(node.prefix, depth):
                return None
            depth += len(node.prefix)
            node = _find(node, key[depth])
            depth += 1
        return node.value if node is not None and node.key == key else None

    def delete(self, key: bytes) -> object:
        """Remove `key`; returns its value, or None when absent."""
        node = self._root
        parent = grand = None
        pbyte = gbyte = depth = 0
        while node is not None and type(node) is not _Leaf:
            if not key.startswith(node.prefix, depth):
                return None
            depth += len(node.prefix)
            grand, gbyte, parent, pbyte = parent, pbyte, node, key[depth]
            node = _find(node, pbyte)
            depth += 1
        if node is None or node.key != key:
            return None
        if parent is None:
            self._root = None
        else:
            smaller = _remove(parent, pbyte)
            if smaller is not parent:
                self._replace(grand, gbyte, smaller)
        self._size -= 1
        return node.value

    def _subtree(self, prefix: bytes) -> object:
        """The node whose subtree holds exactly the keys starting with `prefix`."""
        node, depth, n = self._root, 0, len(prefix)
        while node is not None:
            if type(node) is _Leaf:
                return node if node.key.startswith(prefix) else None
            own = node.prefix
            if depth + len(own) >= n:  # `prefix` ends inside this node's own bytes
                return node if own[: n - depth] == prefix[depth:] else None
            if not prefix.startswith(own, depth):
                return None
            depth += len(own)
            node = _find(node, prefix[depth])
            depth += 1
            if depth == n:
                return node
        return None

    def prefix_values(self, prefix: bytes) -> list:
        """The values of every key starting with `prefix`, in key order."""
        node = self._subtree(prefix)
        if node is None:
            return []
        if type(node) is _Leaf:
            return [node.value]
        return _values(node)

    def values(self) -> list:
        return [] if self._root is None else _values(self._root)


def _values(root: object) -> list:
    out: list = []
    stack = [root]
    while stack:
        node = stack.pop()
        if type(node) is _Leaf:
            out.append(node.value)
        else:
            stack.extend(child for _, child in reversed(_items(node)))
    return out


# --- the index ---------------------------------------------------------------------------


class ArtTreeIndex(IndexBackend):
    """In-memory residency index in two adaptive radix trees (module docstring)."""

    name = "art-memory"

    def __init__(self) -> None:
        self._pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack
        self._chain = ArtTree()
        self._hash = ArtTree()
        self._held: dict[str, dict[bytes, None]] = {}  # worker -> its chain keys
        self._epochs: dict[str, float] = {}
        self._bytes = 0
        self._puts = self._removes = self._prefix_scans = 0

    def _key8(self, key: KvBlockKey) -> bytes:
        return b"".join(map(self._pack, key))

    def _chain_key(self, r: CacheResidency) -> bytes:
        p = self._pack
        return b"".join(map(p, r.key)) + p(r.worker_id) + p(r.tier._value_)

    def put(self, residency: CacheResidency) -> None:
        key = self._chain_key(residency)
        old = self._chain.insert(key, residency)
        self._hash.insert(self._pack(residency.key.block_hash) + key, residency)
        self._puts += 1
        if old is None:
            held = self._held.get(residency.worker_id)
            if held is None:
                held = self._held[residency.worker_id] = {}
            held[key] = None
            self._bytes += residency.bytes
        else:
            self._bytes += residency.bytes - old.bytes

    def put_many(self, residencies: Iterable[CacheResidency]) -> None:
        put = self.put
        for residency in residencies:
            put(residency)

    def _drop(self, key: bytes) -> None:
        """Remove one record from both trees and the totals (not from _held)."""
        old = self._chain.delete(key)
        self._hash.delete(self._pack(old.key.block_hash) + key)
        self._bytes -= old.bytes
        self._removes += 1

    def _remove_where(self, block_hash: str, doomed) -> int:
        victims = [r for r in self._hash.prefix_values(self._pack(block_hash)) if doomed(r)]
        for r in victims:
            key = self._chain_key(r)
            self._drop(key)
            held = self._held[r.worker_id]
            del held[key]
            if not held:
                del self._held[r.worker_id]
        return len(victims)

    def remove_block(self, scope: IdentityScope, worker_id: str, block_hash: str) -> int:
        return self._remove_where(
            block_hash, lambda r: r.worker_id == worker_id and scope.matches(r.key)
        )

    def remove_tier(self, worker_id: str, block_hash: str, tier: object) -> int:
        wanted = tier if isinstance(tier, CacheTier) else CacheTier.parse(str(tier))
        return self._remove_where(
            block_hash, lambda r: r.worker_id == worker_id and r.tier is wanted
        )

    def clear_worker(self, worker_id: str) -> int:
        held = self._held.pop(worker_id, None)
        if not held:
            return 0
        for key in held:
            self._drop(key)
        return len(held)

    def clear(self) -> None:
        self._removes += len(self._chain)
        self._chain, self._hash = ArtTree(), ArtTree()
        self._held.clear()
        self._bytes = 0

    def locate(self, key: KvBlockKey) -> list[CacheResidency]:
        return self._chain.prefix_values(self._key8(key))

    def locate_hash(self, block_hash: str) -> list[CacheResidency]:
        return self._hash.prefix_values(self._pack(block_hash))

    def prefix_scan(self, scope: IdentityScope, prefix_hash: str) -> list[CacheResidency]:
        self._prefix_scans += 1
        p = self._pack
        prefix = b"".join(
            (
                p(scope.model_id),
                p(scope.tokenizer_id),
                p(scope.adapter_id),
                p(scope.tenant_id),
                p(prefix_hash),
            )
        )
        return self._chain.prefix_values(prefix)

    def snapshot(self) -> list[CacheResidency]:
        """Every record, in chain-key order."""
        return self._chain.values()

    def __len__(self) -> int:
        return len(self._chain)

    def worker_block_count(self, worker_id: str) -> int:
        held = self._held.get(worker_id)
        return len(held) if held else 0

    def workers(self) -> list[str]:
        return sorted(self._held)

    def worker_epochs(self) -> dict[str, float]:
        return dict(self._epochs)

    def set_worker_epoch(self, worker_id: str, epoch: float) -> None:
        self._epochs[worker_id] = float(epoch)

    def metrics(self) -> IndexMetrics:
        return IndexMetrics(
            resident_blocks=len(self._chain),
            resident_bytes=self._bytes,
            puts=self._puts,
            removes=self._removes,
            prefix_scans=self._prefix_scans,
            bytes_written=0,
        )


class ArtIndex(JournaledIndex):
    """The "art" backend: ArtTreeIndex made durable by the journal (JournaledIndex)."""

    name = "art"

    def __init__(self, path: str | os.PathLike[str], **options) -> None:
        super().__init__(path, ArtTreeIndex(), **options)
