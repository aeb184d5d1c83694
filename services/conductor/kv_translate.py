"""Turn one engine's decoded KV events into residency records in the index.

An engine's block hashes are opaque to us (vLLM seeds them per deployment), so the
translator re-hashes the reported token ids with QuillCache's own chained hashing,
under the identity the gateway uses for the same request:

- a salted block (cache salt S, LoRA L or none): tenant S, adapter L, cache salt S;
- an unsalted block: tenant `default_tenant`, adapter L, no cache salt.

The gateway hashes a tenant T's prompt with `request_blocks(..., adapter_id=None,
tenant_id=T, cache_salt=T)` and sends `cache_salt=T` to the engine, so both sides
arrive at the same hashes for the same tokens.

A block with a parent inherits the parent's identity and continues its chain: the
translator keeps, per engine, engine hash -> our KvBlockKey for every block the engine
still holds. Entries leave with their blocks (BlockRemoved, AllBlocksCleared), and the
map is capped (`max_tracked`); blocks past the cap are counted and not indexed, since
a record we could not map back could never be removed.

One translator per engine. Not thread-safe: the owner serialises calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quillcache_conductor.kv_wire import (
    DecodedBatch,
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    EventError,
)
from quillcache_core.hashing import block_hashes, identity_digest
from quillcache_core.index.base import IndexBackend
from quillcache_core.model import MIB, CacheResidency, CacheTier, KvBlockKey

__all__ = ["ApplyResult", "EngineEventTranslator", "TranslatorStats"]

DEFAULT_MAX_TRACKED = 4_000_000


@dataclass(slots=True)
class ApplyResult:
    """Events applied, and every rejected event of the batch.

    `rejected` starts with the decoder's errors (`batch.errors`, already reported by
    the subscriber) followed by the translator's own (e.g. "unknown_parent").
    """

    applied: int
    rejected: list[EventError] = field(default_factory=list)


@dataclass(slots=True)
class TranslatorStats:
    events_applied: int = 0
    events_rejected: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    unknown_parent: int = 0
    # BlockRemoved for a block we never saw stored (we started late or missed events).
    unknown_removed: int = 0
    # Blocks not indexed because the engine-hash map was full.
    overflow: int = 0


# (adapter_id, tenant_id, cache_salt, identity digest): shared by every block of it.
_Identity = tuple[str | None, str, str | None, bytes]
# (tier value, group_idx): one engine copy of a block.
_Holder = tuple[str, int | None]


class _Entry:
    """What we know about one engine block: our key, its identity, who holds it."""

    __slots__ = ("holders", "ident", "key")

    def __init__(self, key: KvBlockKey, ident: _Identity) -> None:
        self.key = key
        self.ident = ident
        self.holders: list[_Holder] = []


class EngineEventTranslator:
    def __init__(
        self,
        index: IndexBackend,
        engine_id: str,
        model_id: str,
        tokenizer_id: str,
        *,
        default_tenant: str = "default",
        bytes_per_block: int = 2 * MIB,
        max_tracked: int = DEFAULT_MAX_TRACKED,
    ) -> None:
        self.index = index
        self.engine_id = engine_id
        self.model_id = model_id
        self.tokenizer_id = tokenizer_id
        self.default_tenant = default_tenant
        self.bytes_per_block = bytes_per_block
        self.max_tracked = max_tracked
        self.stats = TranslatorStats()
        self._blocks: dict[str, _Entry] = {}
        # (our block hash, tier value) -> engine copies mapped to it. Two engine blocks
        # can map to one of ours (e.g. the same placeholder tokens with different
        # images); the index record goes only when the last of them does.
        self._refs: dict[tuple[str, str], int] = {}
        self._identities: dict[tuple[str | None, str | None], _Identity] = {}

    def __len__(self) -> int:
        """Engine blocks currently mapped."""
        return len(self._blocks)

    def key_for(self, engine_hash: str) -> KvBlockKey | None:
        """Our key for a (normalized) engine hash the engine still holds."""
        entry = self._blocks.get(engine_hash)
        return None if entry is None else entry.key

    def identity(self, lora_name: str | None, cache_salt: str | None) -> _Identity:
        """The identity of a root block with this LoRA and salt (cached)."""
        ident = self._identities.get((lora_name, cache_salt))
        if ident is None:
            tenant = cache_salt if cache_salt is not None else self.default_tenant
            digest = identity_digest(
                self.model_id, self.tokenizer_id, lora_name, tenant, cache_salt
            )
            ident = (lora_name, tenant, cache_salt, digest)
            if len(self._identities) < 65_536:
                self._identities[(lora_name, cache_salt)] = ident
        return ident

    # --- applying ----------------------------------------------------------------------

    def apply(self, batch: DecodedBatch) -> ApplyResult:
        """Apply a decoded batch in order; a rejected event never stops the others."""
        result = ApplyResult(applied=0, rejected=list(batch.errors))
        stamp = int(batch.ts * 1000) if batch.ts is not None and batch.ts > 0 else 0
        positions = batch.positions
        for position, event in enumerate(batch.events):
            if type(event) is EngineBlockStored:
                error = self._stored(event, stamp)
                if error is not None:
                    wire_index = positions[position] if position < len(positions) else position
                    result.rejected.append(EventError(wire_index, error[0], error[1]))
                    continue
            elif type(event) is EngineBlockRemoved:
                self._removed(event)
            elif type(event) is EngineAllCleared:
                self.reset()
            else:
                wire_index = positions[position] if position < len(positions) else position
                result.rejected.append(EventError(wire_index, "bad_type", type(event).__name__))
                continue
            result.applied += 1
        self.stats.events_applied += result.applied
        self.stats.events_rejected += len(result.rejected)
        return result

    def reset(self) -> int:
        """The engine holds nothing (AllBlocksCleared, or it restarted): drop its records."""
        self.stats.clears += 1
        self._blocks.clear()
        self._refs.clear()
        return self.index.clear_worker(self.engine_id)

    def _stored(self, event: EngineBlockStored, stamp: int) -> tuple[str, str] | None:
        blocks = self._blocks
        if event.parent is None:
            ident = self.identity(event.lora_name, event.cache_salt)
            parent_hash = None
            first_index = 0
        else:
            parent = blocks.get(event.parent)
            if parent is None:
                self.stats.unknown_parent += 1
                return ("unknown_parent", f"parent {event.parent} is not a block we know")
            ident = parent.ident
            parent_hash = parent.key.block_hash
            first_index = parent.key.block_index + 1
        ours = block_hashes(event.token_ids, event.block_size, ident[3], parent_hash)
        adapter, tenant = ident[0], ident[1]
        model_id, tokenizer_id = self.model_id, self.tokenizer_id
        tier = event.tier
        holder = (tier._value_, event.group_idx)
        engine_id, nbytes = self.engine_id, self.bytes_per_block
        refs = self._refs
        prefix = parent_hash if parent_hash is not None else "root"
        residencies = []
        for offset, (engine_hash, our_hash) in enumerate(
            zip(event.block_hashes, ours, strict=True)
        ):
            key = KvBlockKey(
                model_id,
                tokenizer_id,
                adapter,
                tenant,
                prefix,
                our_hash,
                first_index + offset,
                event.block_size,
            )
            prefix = our_hash
            entry = blocks.get(engine_hash)
            if entry is None:
                if len(blocks) >= self.max_tracked:
                    self.stats.overflow += 1
                    continue
                entry = blocks[engine_hash] = _Entry(key, ident)
            elif entry.key != key:
                # The engine reused a hash for other content: forget the old mapping.
                self._drop_entry(engine_hash, entry)
                entry = blocks[engine_hash] = _Entry(key, ident)
            if holder not in entry.holders:
                entry.holders.append(holder)
                slot = (our_hash, holder[0])
                refs[slot] = refs.get(slot, 0) + 1
            residencies.append(CacheResidency(key, engine_id, tier, nbytes, stamp))
        self.index.put_many(residencies)
        self.stats.blocks_stored += len(residencies)
        return None

    def _removed(self, event: EngineBlockRemoved) -> None:
        blocks = self._blocks
        holder = (event.tier._value_, event.group_idx)
        for engine_hash in event.block_hashes:
            entry = blocks.get(engine_hash)
            if entry is None or holder not in entry.holders:
                self.stats.unknown_removed += 1
                continue
            entry.holders.remove(holder)
            self._release(entry.key.block_hash, holder[0])
            self.stats.blocks_removed += 1
            if not entry.holders:
                del blocks[engine_hash]

    def _release(self, our_hash: str, tier: str) -> None:
        """One engine copy of our block on `tier` is gone; drop the record with the last."""
        slot = (our_hash, tier)
        count = self._refs.get(slot, 0) - 1
        if count > 0:
            self._refs[slot] = count
            return
        self._refs.pop(slot, None)
        self.index.remove_tier(self.engine_id, our_hash, CacheTier(tier))

    def _drop_entry(self, engine_hash: str, entry: _Entry) -> None:
        for tier, _group in entry.holders:
            self._release(entry.key.block_hash, tier)
        entry.holders.clear()
        del self._blocks[engine_hash]
