"""A request's block chain, and the one function that makes a chain's keys.

`BlockChain` is what every process passes for a prompt's full blocks: whose they are
(the reuse scope), how many tokens a block holds, the parent of the first block and its
index, and the blocks' 16-byte digests packed end to end (the form the gateway sends
and the conductor keeps). Hex hashes and `KvBlockKey`s are made from it on demand.

`chain_keys` is the only place keys of chained blocks are built: each block's
`prefix_hash` is the previous block's hash (the first one's is `parent`), its index the
previous one's plus one. It builds them from zipped columns in C-level passes (about
2.5x faster than a Python call per key), which matters: it runs for every block of
every plan and every event.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import count, repeat

from quillcache_core.errors import InvalidArgument
from quillcache_core.identity.hashing import (
    ROOT_PARENT,
    DeferredChains,
    RecentChains,
    block_hashes,
)
from quillcache_core.model import IdentityScope, KvBlockKey
from quillcache_core.wire.plan import HASH_BYTES, unpack_hashes

# tuple.__new__ mapped over (the class, each key's fields): C all the way, where
# NamedTuple._make (or a partial binding the class) is another call per key.
_new = tuple.__new__


def chain_keys(
    scope: Sequence,
    hashes: Sequence[str],
    *,
    parent: str = ROOT_PARENT,
    first_index: int = 0,
    token_count: int = 16,
    token_counts: Iterable[int] | None = None,
    parents: Sequence[str] | None = None,
    indexes: Iterable[int] | None = None,
) -> list[KvBlockKey]:
    """The keys of the chained blocks `hashes` under `scope` (model, tokenizer, adapter,
    tenant: an IdentityScope or a tuple in that order).

    Every block holds `token_count` tokens unless `token_counts` gives each its own.
    `parents` and `indexes`, when a sender gave them explicitly (a peer's columns),
    replace the chain's own; their lengths must match `hashes`."""
    if isinstance(scope, IdentityScope):
        model_id, tokenizer_id = scope.model_id, scope.tokenizer_id
        adapter_id, tenant_id = scope.adapter_id, scope.tenant_id
    else:
        model_id, tokenizer_id, adapter_id, tenant_id = scope
    if parents is None:
        parents = [parent, *hashes]
        parents.pop()
    return list(
        map(
            _new,
            repeat(KvBlockKey),
            zip(
                repeat(model_id),
                repeat(tokenizer_id),
                repeat(adapter_id),
                repeat(tenant_id),
                parents,
                hashes,
                count(first_index) if indexes is None else indexes,
                repeat(token_count) if token_counts is None else token_counts,
            ),
        )
    )


@dataclass(frozen=True, slots=True)
class BlockChain:
    """A prompt's full blocks: `scope`, `block_tokens` a block, the first block's
    `parent` and `first_index`, and `packed`, the blocks' digests (16 bytes each)."""

    scope: IdentityScope
    block_tokens: int
    packed: bytes
    parent: str = ROOT_PARENT
    first_index: int = 0

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise InvalidArgument(f"block_tokens must be positive, got {self.block_tokens}")
        if len(self.packed) % HASH_BYTES:
            raise InvalidArgument(
                f"packed hashes are {len(self.packed)} bytes, not a multiple of {HASH_BYTES}"
            )

    def __len__(self) -> int:
        return len(self.packed) // HASH_BYTES

    def hashes(self) -> list[str]:
        """The blocks' hashes as 32 hex digits each."""
        return unpack_hashes(self.packed)

    def keys(self, hashes: Sequence[str] | None = None) -> list[KvBlockKey]:
        """The blocks' keys (`hashes`: this chain's, when the caller has them already)."""
        return chain_keys(
            self.scope,
            self.hashes() if hashes is None else hashes,
            parent=self.parent,
            first_index=self.first_index,
            token_count=self.block_tokens,
        )

    @classmethod
    def of_tokens(
        cls,
        identity,
        tokens: Sequence[int],
        block_tokens: int,
        recent: RecentChains | DeferredChains | None = None,
    ) -> tuple[BlockChain, list[str]]:
        """The chain of `tokens`' full blocks under a `BlockIdentity` (its digest keys
        the hashes), and its hex hashes; with `recent`, an opening shared with a recent
        prompt is not hashed again."""
        if recent is not None:
            hashes, packed = recent.hashes(tokens, block_tokens, identity.digest)
        else:
            hashes = block_hashes(tokens, block_tokens, identity.digest)
            packed = b"".join(map(bytes.fromhex, hashes))
        return cls(identity.scope(), block_tokens, packed), hashes
