"""The plan the gateway attaches to an upstream engine request.

It travels in the OpenAI request body as `kv_transfer_params.quillcache` (vLLM's
field for KV-connector parameters), so an engine knows which blocks to load from
which store node instead of recomputing them, and whose blocks they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from quillcache_core.errors import InvalidArgument
from quillcache_core.model import CacheTier, KvBlockKey

FIELD = "quillcache"


@dataclass(frozen=True, slots=True)
class FetchAction:
    block_index: int
    block_hash: str
    source_node: str
    source_address: str
    tier: str  # a CacheTier value


@dataclass(frozen=True, slots=True)
class EnginePlan:
    reservation_id: str
    engine_id: str
    model_id: str
    tokenizer_id: str
    tenant_id: str
    adapter_id: str | None = None
    cache_salt: str | None = None
    block_size: int = 16
    hit_blocks: int = 0
    recompute_blocks: int = 0
    fetch: tuple[FetchAction, ...] = field(default_factory=tuple)
    # "prefill": this engine prefills for another that decodes (disaggregation): its
    # prompt's blocks are to be in its store node when it answers. "" otherwise.
    disagg: str = ""

    def to_json(self) -> dict:
        body = asdict(self)
        body["fetch"] = [asdict(f) for f in self.fetch]
        if not self.disagg:
            del body["disagg"]  # only a split's prefill carries it
        return body

    @classmethod
    def from_json(cls, body: Mapping) -> EnginePlan:
        if not isinstance(body, Mapping):
            raise InvalidArgument("kv_transfer_params.quillcache must be an object")
        try:
            fetch = tuple(FetchAction(**f) for f in body.get("fetch", ()))
            for action in fetch:
                CacheTier.parse(action.tier)
            values = {k: body[k] for k in cls.__dataclass_fields__ if k in body and k != "fetch"}
            return cls(fetch=fetch, **values)
        except (TypeError, KeyError) as exc:
            raise InvalidArgument(f"malformed quillcache plan: {exc}") from None

    def fetch_key(self, action: FetchAction, prefix_hash: str) -> KvBlockKey:
        """The store key of a block to fetch (its parent is the previous block's hash)."""
        return KvBlockKey(
            model_id=self.model_id,
            tokenizer_id=self.tokenizer_id,
            adapter_id=self.adapter_id,
            tenant_id=self.tenant_id,
            prefix_hash=prefix_hash,
            block_hash=action.block_hash,
            block_index=action.block_index,
            token_count=self.block_size,
        )
