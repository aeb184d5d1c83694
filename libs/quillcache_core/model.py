"""The QuillCache data model: block identity, tiers, residency, engines, events, costs.

Pure data and arithmetic. No I/O, no clock, no randomness: callers pass those in.
Ported from the seed contract (quillcache-core 1.0.0-alpha.1): same names, same
defaults, same formulas; a few fields are added where the running system needs them
(each is marked "added").
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from quillcache_core.errors import InvalidArgument

MIB = 1024 * 1024


class KvBlockKey(NamedTuple):
    """The identity of one KV block (immutable, hashable).

    `block_hash` is the chained content hash (it already folds in the parent and the
    identity); `prefix_hash` is the parent block's hash ("root" for the first block).
    Two keys are the same block only if every field agrees. A NamedTuple rather than
    a frozen dataclass: the index and the event path build millions of them, and a
    tuple is built and hashed about 2.5x faster.
    """

    model_id: str
    tokenizer_id: str
    adapter_id: str | None
    tenant_id: str
    prefix_hash: str
    block_hash: str
    block_index: int
    token_count: int

    def scope(self) -> IdentityScope:
        return IdentityScope(self.model_id, self.tokenizer_id, self.adapter_id, self.tenant_id)


class CacheTier(enum.Enum):
    """Where a block's bytes live. Values are the seed's display names."""

    HBM = "hbm"
    REMOTE_HBM = "remote_hbm"
    CPU_DRAM = "cpu_dram"
    LOCAL_SSD = "local_ssd"
    OBJECT_STORE = "object_store"

    @classmethod
    def parse(cls, value: str) -> CacheTier:
        """Parse a tier name or an engine's `medium` (case-insensitive, seed aliases).

        Raises InvalidArgument for an unknown name.
        """
        tier = _TIER_ALIASES.get(str(value).strip().lower())
        if tier is None:
            raise InvalidArgument(f"unknown cache tier or medium: {value!r}")
        return tier

    def __str__(self) -> str:
        return self.value


_TIER_ALIASES: dict[str, CacheTier] = {}
for _names, _tier in (
    (("hbm", "gpu", "gpu_memory", "vram"), CacheTier.HBM),
    (("remote_hbm", "remote_gpu", "remote_gpu_memory"), CacheTier.REMOTE_HBM),
    # cpu_pinned is SGLang's name for its host tier.
    (("cpu", "dram", "cpu_dram", "host", "host_memory", "cpu_pinned"), CacheTier.CPU_DRAM),
    (("ssd", "local_ssd", "nvme", "disk"), CacheTier.LOCAL_SSD),
    (("object", "object_store", "s3", "blob", "external"), CacheTier.OBJECT_STORE),
):
    for _name in _names:
        _TIER_ALIASES[_name] = _tier


class CacheResidency(NamedTuple):
    """One copy of a block: which worker (engine or store node) and tier hold it."""

    key: KvBlockKey
    worker_id: str
    tier: CacheTier
    bytes: int
    last_access_ms: int = 0
    ref_count: int = 0
    pinned: bool = False

    @classmethod
    def hbm(cls, worker_id: str, key: KvBlockKey, nbytes: int) -> CacheResidency:
        return cls(key=key, worker_id=worker_id, tier=CacheTier.HBM, bytes=nbytes)


@dataclass(slots=True)
class WorkerState:
    """An engine as the planner sees it: locality, capacity and live load.

    added: `store_node_id` (the store node on the engine's host, whose DRAM/SSD tiers
    are local to it), `inflight_requests`, `inflight_blocks` (Dynamo's decode blocks)
    and `resident_blocks` (SGLang's tree size), `base_url`.
    """

    id: str
    locality_domain: str
    hbm_capacity_bytes: int = 80 * 1024 * MIB
    hbm_used_bytes: int = 0
    cpu_capacity_bytes: int = 512 * 1024 * MIB
    cpu_used_bytes: int = 0
    running_decodes: int = 0
    queued_prefill_tokens: int = 0
    store_node_id: str | None = None
    inflight_requests: int = 0
    inflight_blocks: int = 0
    resident_blocks: int = 0
    base_url: str = ""

    def with_load(self, queued_prefill_tokens: int, running_decodes: int) -> WorkerState:
        self.queued_prefill_tokens = queued_prefill_tokens
        self.running_decodes = running_decodes
        return self

    def kv_utilisation(self) -> float:
        if self.hbm_capacity_bytes <= 0:
            return 1.0
        return min(1.0, self.hbm_used_bytes / self.hbm_capacity_bytes)


# --- requests and SLOs ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SloTarget:
    ttft_ms: int = 800
    tpot_ms: int = 80


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What the planner needs to know about one request.

    added: `prompt_tokens` counts the tokens of a trailing partial block too, which
    is never cached but is always prefilled; 0 means "sum of the blocks".
    """

    id: str
    model_id: str
    tokenizer_id: str
    adapter_id: str | None
    tenant_id: str
    blocks: tuple[KvBlockKey, ...]
    estimated_decode_tokens: int = 0
    slo: SloTarget = field(default_factory=SloTarget)
    prompt_tokens: int = 0
    block_bytes: int = 2 * MIB
    # The blocks' token total when the caller knows it (-1: sum them). The planner
    # asks for input_tokens() several times per plan; summing 128 blocks each time
    # showed up in the conductor's profile.
    block_tokens_total: int = -1
    # At most this many other engines' cost breakdowns wanted in the decision (None:
    # the policy's own cap). A gateway that never reads them asks for 0.
    max_others: int | None = None

    def input_tokens(self) -> int:
        cached = self.block_tokens_total
        if cached < 0:
            cached = sum(block.token_count for block in self.blocks)
        return max(cached, self.prompt_tokens)

    def scope(self) -> IdentityScope:
        return IdentityScope(self.model_id, self.tokenizer_id, self.adapter_id, self.tenant_id)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Microsecond costs. Defaults and formulas are the seed's."""

    prefill_us_per_token: int = 45
    decode_us_per_token: int = 80
    queue_us_per_prefill_token: int = 4
    running_decode_penalty_us: int = 1_500
    hbm_hit_us: int = 5
    remote_hbm_us_per_mb: int = 20
    cpu_dram_us_per_mb: int = 55
    local_ssd_us_per_mb: int = 280
    object_store_us_per_mb: int = 1_800
    cross_domain_penalty_us: int = 350

    def prefill_cost_us(self, tokens: int) -> int:
        return self.prefill_us_per_token * tokens

    def queue_at_prefill_speed(self) -> CostModel:
        """A copy whose queue term drains at the engine's prefill speed.

        A prefill token queued ahead of a request delays it by the time the engine
        takes to prefill that token; the seed's default (4 us against 45 us of
        prefill) prices queueing about 11x too low, so a router using it keeps
        piling requests on a cache-hot engine long after its queue outweighs the hit.
        """
        return dataclasses.replace(self, queue_us_per_prefill_token=self.prefill_us_per_token)

    def decode_cost_us(self, tokens: int, running_decodes: int) -> int:
        return self.decode_us_per_token * tokens + self.running_decode_penalty_us * running_decodes

    def queue_cost_us(self, worker: WorkerState) -> int:
        return self.queue_us_per_prefill_token * worker.queued_prefill_tokens

    def tier_us_per_mb(self, tier: CacheTier) -> int:
        if tier in (CacheTier.HBM, CacheTier.REMOTE_HBM):
            return self.remote_hbm_us_per_mb
        if tier is CacheTier.CPU_DRAM:
            return self.cpu_dram_us_per_mb
        if tier is CacheTier.LOCAL_SSD:
            return self.local_ssd_us_per_mb
        return self.object_store_us_per_mb

    def transfer_cost_us(
        self, tier: CacheTier, nbytes: int, same_worker: bool, same_locality_domain: bool
    ) -> int:
        """Cost of making one block of `nbytes` usable on a worker from `tier`."""
        if same_worker and tier is CacheTier.HBM:
            return self.hbm_hit_us
        mb = max(1, -(-nbytes // MIB))
        base = self.tier_us_per_mb(tier) * mb
        if same_worker or same_locality_domain:
            return base
        return base + self.cross_domain_penalty_us


@dataclass(frozen=True, slots=True)
class IdentityScope:
    """The identity under which a block may be reused: model, tokenizer, adapter, tenant.

    The cache salt is not a separate field: the gateway folds it into the tenant id
    (and the block hashes), so two salts are two scopes.
    """

    model_id: str
    tokenizer_id: str
    adapter_id: str | None
    tenant_id: str

    @classmethod
    def from_key(cls, key: KvBlockKey) -> IdentityScope:
        return cls(key.model_id, key.tokenizer_id, key.adapter_id, key.tenant_id)

    def matches(self, key: KvBlockKey) -> bool:
        """Whether `key` belongs to this scope; adapter must match exactly, absence too."""
        return (
            self.model_id == key.model_id
            and self.tokenizer_id == key.tokenizer_id
            and self.adapter_id == key.adapter_id
            and self.tenant_id == key.tenant_id
        )

    def mismatch(self, key: KvBlockKey) -> str | None:
        """The first identity field on which `key` differs, or None when it matches."""
        if self.model_id != key.model_id:
            return "model"
        if self.tokenizer_id != key.tokenizer_id:
            return "tokenizer"
        if self.adapter_id != key.adapter_id:
            return "adapter"
        if self.tenant_id != key.tenant_id:
            return "tenant"
        return None


@dataclass(slots=True)
class IndexMetrics:
    resident_blocks: int = 0
    resident_bytes: int = 0
    puts: int = 0
    removes: int = 0
    prefix_scans: int = 0
    bytes_written: int = 0
