"""The block identity: the one function that decides which identity keys a request's blocks.

Every process that names a block calls `block_identity`: the gateway for a request,
the conductor's event translator for what an engine reports, the sim engine for its
own cache, benchmarks and tests. Its inputs are what both ends of the wire can see:

- the model and tokenizer as the engine's registry record names them (an empty
  tokenizer means the model's own, as vLLM's `--tokenizer` defaults to `--model`),
  never a name a process made up for its local tokenizer files;
- the LoRA adapter, if any;
- the cache salt the engine was sent (vLLM's `cache_salt`), which is the tenant's
  cache partition. An engine's KV events carry the salt but no tenant, so the
  tenant of an identity is its salt, or `DEFAULT_TENANT` when unsalted.

Callers that never meet an engine's events (a store reporting blocks with an explicit
identity, a test) may name a tenant; a request that must meet what its engine reports
passes only the salt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from quillcache_core.identity.chain import chain_keys
from quillcache_core.identity.hashing import ROOT_PARENT, block_hashes, identity_digest
from quillcache_core.model import IdentityScope, KvBlockKey

DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class BlockIdentity:
    """Who a block belongs to, and the 16-byte digest its chained hashes are keyed by."""

    model_id: str
    tokenizer_id: str
    adapter_id: str | None
    tenant_id: str
    cache_salt: str | None
    digest: bytes

    def scope(self) -> IdentityScope:
        return IdentityScope(self.model_id, self.tokenizer_id, self.adapter_id, self.tenant_id)

    def hashes(self, tokens: Sequence[int], block_size: int) -> list[str]:
        """Chained hex hashes of the full blocks of `tokens` (a partial tail is never hashed)."""
        return block_hashes(tokens, block_size, self.digest)

    def keys(
        self,
        tokens: Sequence[int],
        block_size: int,
        *,
        parent: str = ROOT_PARENT,
        first_index: int = 0,
    ) -> list[KvBlockKey]:
        """KvBlockKeys of the full blocks of `tokens`, chained from `parent`."""
        hashes = block_hashes(
            tokens, block_size, self.digest, None if parent == ROOT_PARENT else parent
        )
        return chain_keys(
            self.scope(), hashes, parent=parent, first_index=first_index, token_count=block_size
        )


def identity_tokenizer(model_id: str, tokenizer_id: str) -> str:
    """The tokenizer an identity names: the record's, else the model's own (vLLM's
    `--tokenizer` defaults to `--model`)."""
    return tokenizer_id or model_id


def block_identity(
    model_id: str,
    tokenizer_id: str = "",
    *,
    cache_salt: str | None = None,
    adapter_id: str | None = None,
    tenant_id: str | None = None,
) -> BlockIdentity:
    """The identity of a request's blocks on an engine serving `model_id`.

    `model_id` and `tokenizer_id` are the engine record's; an empty `tokenizer_id` is
    the model's own tokenizer. The tenant is `tenant_id` when given, else the salt,
    else DEFAULT_TENANT. An empty salt or adapter is none (vLLM treats them so).
    """
    tokenizer = identity_tokenizer(model_id, tokenizer_id)
    salt = cache_salt or None
    adapter = adapter_id or None
    if tenant_id is None:
        tenant_id = salt if salt is not None else DEFAULT_TENANT
    return BlockIdentity(
        model_id,
        tokenizer,
        adapter,
        tenant_id,
        salt,
        identity_digest(model_id, tokenizer, adapter, tenant_id, salt),
    )


def request_blocks(
    tokens: Sequence[int],
    block_size: int,
    *,
    model_id: str,
    tokenizer_id: str,
    adapter_id: str | None,
    tenant_id: str,
    cache_salt: str | None = None,
) -> list[KvBlockKey]:
    """KvBlockKeys for the full blocks of a prompt under an identity named in full."""
    identity = block_identity(
        model_id, tokenizer_id, cache_salt=cache_salt, adapter_id=adapter_id, tenant_id=tenant_id
    )
    return identity.keys(tokens, block_size)
