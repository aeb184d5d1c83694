"""The plan the gateway attaches to an upstream engine request, and its only codec.

It travels in the OpenAI request body as `kv_transfer_params.quillcache` (vLLM's
field for KV-connector parameters), so an engine knows which blocks to load from
which store node instead of recomputing them, and whose blocks they are.

Writers (the gateway, for a whole request, a split's prefill and its continuation):
`plan_json(reply, identity, block_size, hashes)` turns a conductor's PlanReply into
the engine's JSON without a Python object per block; `for_prefill` and `continued`
derive a split's two calls from it; `attach(body, plan)` puts it into a request body.
Readers (the vLLM connector, the sim engine): `EnginePlan.from_json`, or
`EnginePlan.from_params` over a request's whole `kv_transfer_params`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from quillcache.v1 import conductor_pb2
from quillcache_core.errors import InvalidArgument
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.wire.tiers import tier_from_proto

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
                _check(action.block_index, int, "fetch[].block_index")
                _check(action.block_hash, str, "fetch[].block_hash")
                _check(action.source_address, str, "fetch[].source_address")
            values = {k: body[k] for k in cls.__dataclass_fields__ if k in body and k != "fetch"}
            for name in ("block_size", "hit_blocks", "recompute_blocks"):
                _check(values.get(name, 0), int, name)
            for name in ("reservation_id", "engine_id", "disagg"):
                _check(values.get(name, ""), str, name)
            return cls(fetch=fetch, **values)
        except (TypeError, KeyError) as exc:
            raise InvalidArgument(f"malformed quillcache plan: {exc}") from None

    @classmethod
    def from_params(cls, params: object) -> EnginePlan | None:
        """The plan in a request's `kv_transfer_params` (None when it carries none);
        InvalidArgument when there is one and it is malformed."""
        if not isinstance(params, Mapping) or FIELD not in params:
            return None
        return cls.from_json(params[FIELD])

    @property
    def planned(self) -> bool:
        """Made by the conductor (it holds a reservation), not the gateway's fallback."""
        return bool(self.reservation_id)

    @property
    def prefill_for_another(self) -> bool:
        """A split's prefill: its blocks are to be in its store node when it answers."""
        return self.disagg == "prefill"

    def fetch_indices(self) -> frozenset[int]:
        """The block indices the plan has the engine load from the pool."""
        return frozenset(action.block_index for action in self.fetch)

    def sources(self) -> dict[str, str]:
        """Block hash -> the store node (gRPC address) the plan fetches it from."""
        return {
            a.block_hash: a.source_address for a in self.fetch if a.block_hash and a.source_address
        }

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


def _check(value: object, kind: type, name: str) -> None:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{name} must be {'an integer' if kind is int else 'a string'}")


_FETCH = conductor_pb2.BlockAction.FETCH


def plan_json(reply, identity, block_size: int, hashes: Sequence[str]) -> dict:
    """The engine's copy of a conductor's plan (`reply`, a PlanReply or the gateway's
    plan object: its reservation, engine, hit and recompute counts and actions), in
    `EnginePlan.to_json`'s shape. `identity` is the request's block identity, `hashes`
    its block hashes by index. A FETCH run is expanded to one entry per block."""
    fetch = []
    for action in reply.actions:
        if action.kind != _FETCH:
            continue
        tier = (tier_from_proto(action.source_tier) or CacheTier.CPU_DRAM).value
        node, address = action.source_node, action.source_address
        for index in range(action.block_index, action.block_index + (action.block_count or 1)):
            fetch.append(
                {
                    "block_index": index,
                    "block_hash": hashes[index],
                    "source_node": node,
                    "source_address": address,
                    "tier": tier,
                }
            )
    return {
        "reservation_id": reply.reservation_id,
        "engine_id": reply.engine_id,
        "model_id": identity.model_id,
        "tokenizer_id": identity.tokenizer_id,
        "tenant_id": identity.tenant_id,
        "adapter_id": identity.adapter_id,
        "cache_salt": identity.cache_salt,
        "block_size": block_size,
        "hit_blocks": reply.hit_blocks,
        "recompute_blocks": reply.recompute_blocks,
        "fetch": fetch,
    }


def for_prefill(plan: dict, reservation_id: str, engine_id: str) -> dict:
    """A split's prefill call: the same request for the prefill engine's reservation,
    nothing to fetch, its blocks to be in its store node when it answers."""
    return {
        **plan,
        "reservation_id": reservation_id,
        "engine_id": engine_id,
        "fetch": [],
        "disagg": "prefill",
    }


def continued(plan: dict, prompt_tokens: int, output_tokens: int) -> dict:
    """The plan of a continuation: how many of its prompt's ids are the client's
    prompt, and how many output tokens the rest are (an engine that models its output
    from the prompt, as the sim engine, needs it; vLLM's connector ignores it)."""
    return {**plan, "continues": {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens}}


def attach(body: dict, plan: dict) -> dict:
    """`body` (a request's JSON object, changed in place and returned) carrying `plan`
    in `kv_transfer_params`, beside whatever else the client put there."""
    params = body.get("kv_transfer_params")
    body["kv_transfer_params"] = {**(params if isinstance(params, dict) else {}), FIELD: plan}
    return body
