"""Turn one engine's decoded KV events into residency records in the index.

An engine's block hashes are opaque to us (vLLM seeds them per deployment), so the
translator re-hashes the reported token ids with QuillCache's own chained hashing,
under `identity.keys.block_identity(model, tokenizer, cache_salt=S, adapter_id=L)`:
the model and tokenizer of the engine's registry record, the block's cache salt S and
LoRA L. The gateway calls the same function with the same record's model and
tokenizer and the salt it sends the engine, so both sides arrive at the same hashes
for the same tokens.

A block with a parent inherits the parent's identity and continues its chain: the
translator keeps, per engine, engine hash -> our KvBlockKey for every block the engine
still holds. Entries leave with their blocks (BlockRemoved, AllBlocksCleared), and the
map is capped (`max_tracked`); blocks past the cap are counted and not indexed, since
a record we could not map back could never be removed.

Batches are applied as runs: consecutive BlockStored events that continue one chain
(each one's parent is the previous one's last block, same block size, medium and
group, as vLLM reports a growing sequence) are hashed in one call over the batch's
packed token ids, added to the map with one dict update and put in the index with one
`put_chain` (which builds the keys and records in C-level passes). A batch that is
one such run as a whole comes from the decoder as a `StoredRun` (its per-event ops
are then never built). Whenever a run's blocks are not all new to the map and under
the cap, its events are applied one by one instead, with exactly the same result.

One translator per engine. Not thread-safe: the owner serialises calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from quillcache_core.identity.chain import chain_keys
from quillcache_core.identity.hashing import ROOT_PARENT, packed_block_hashes
from quillcache_core.identity.keys import block_identity, identity_tokenizer
from quillcache_core.index.base import Chain, IndexBackend
from quillcache_core.kvevents.bulk import (
    OP_CLEARED,
    OP_REMOVED,
    OP_STORED,
    BulkBatch,
    EngineKey,
    StoredRun,
    bulk_from_events,
    engine_hash,
    engine_key,
    split_blocks,
    stored_shape,
)
from quillcache_core.kvevents.events import DecodedBatch, EventError
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
# What we know about one engine block: our key's (block_hash, prefix_hash, block_index,
# token_count), its identity and the engine copies. A plain tuple of strings, ints and
# shared tuples of those: CPython stops tracking such a tuple in its cyclic GC after one
# collection, which matters with millions of entries. A change of holders replaces the
# entry.
_Entry = tuple[str, str, int, int, _Identity, tuple[_Holder, ...]]
_HASH, _PREFIX, _INDEX, _SIZE, _IDENT, _HOLDERS = range(6)
# A block stored by a bulk run is mapped to an int instead: its run's number times _SPAN
# plus its offset in the run, what the run's blocks share kept once in `_runs`. An int
# is no object for the cycle collector (a new tuple is, until a collection untracks it)
# and costs the map nothing beyond its slot. Its _Entry is derived on demand; a change
# of the block replaces the int with an _Entry. A run goes when its last block does, or
# hands its remaining blocks their own _Entry once fewer than a quarter of its blocks
# are left, so a run's shared lists never hold more than 4x the blocks still mapped.
_SPAN_BITS = 20
_SPAN = 1 << _SPAN_BITS
# [our hashes, first block's prefix, first index, block size, identity, holders, blocks
# still mapped to the run, engine keys]
_Run = list[Any]
_LIVE = 6
_HBM = CacheTier.HBM.value  # the tier of an engine's own cache
_TIERS = {tier.value: tier for tier in CacheTier}  # CacheTier(value) without the enum call

_new = tuple.__new__
_StoredOp = tuple[Any, ...]


class EngineEventTranslator:
    def __init__(
        self,
        index: IndexBackend,
        engine_id: str,
        model_id: str,
        tokenizer_id: str,
        *,
        bytes_per_block: int = 2 * MIB,
        max_tracked: int = DEFAULT_MAX_TRACKED,
        block_tokens: int = 0,
        engine_block_tokens: int = 0,
        on_released: Callable[[str | None], None] | None = None,
    ) -> None:
        """`block_tokens` is the index's block size: an engine reporting larger blocks (a
        multiple of it) has each split into sub-blocks of that size (`split_blocks`), so
        its blocks key the same as a gateway's request hashed at that size. 0 applies the
        engine's blocks as they come. `engine_block_tokens` is the engine's own block size
        (its record's, 0 = learn it from its BlockStored events), by which removals split.
        `on_released(our_hash)` hears of each of our blocks the engine's HBM no longer
        holds (None: all of them), for the conductor's optimistic overlay."""
        self.on_released = on_released
        self.index = index
        self.block_tokens = block_tokens
        self.engine_block_tokens = engine_block_tokens
        self.engine_id = engine_id
        self.model_id = model_id
        # The identity's tokenizer: the record's, or the model's own when it names none.
        self.tokenizer_id = identity_tokenizer(model_id, tokenizer_id)
        self.bytes_per_block = bytes_per_block
        self.max_tracked = max_tracked
        self.stats = TranslatorStats()
        self._blocks: dict[EngineKey, _Entry | int] = {}
        self._runs: dict[int, _Run] = {}
        self._next_run = 0
        # tier value -> our block hash -> engine copies mapped to it on that tier. Two
        # engine blocks can map to one of ours (e.g. the same placeholder tokens with
        # different images); the index record goes only when the last of them does.
        self._refs: dict[str, dict[str, int]] = {}
        self._identities: dict[tuple[str | None, str | None], _Identity] = {}

    def __len__(self) -> int:
        """Engine blocks currently mapped."""
        return len(self._blocks)

    def key_for(self, engine_hash: str) -> KvBlockKey | None:
        """Our key for a (normalized) engine hash the engine still holds."""
        value = self._blocks.get(engine_key(engine_hash))
        if value is None:
            return None
        entry = self._entry(value)
        ident = entry[_IDENT]
        return KvBlockKey(
            self.model_id,
            self.tokenizer_id,
            ident[0],
            ident[1],
            entry[_PREFIX],
            entry[_HASH],
            entry[_INDEX],
            entry[_SIZE],
        )

    def identity(self, lora_name: str | None, cache_salt: str | None) -> _Identity:
        """The identity of a root block with this LoRA and salt (cached)."""
        ident = self._identities.get((lora_name, cache_salt))
        if ident is None:
            found = block_identity(
                self.model_id, self.tokenizer_id, cache_salt=cache_salt, adapter_id=lora_name
            )
            ident = (found.adapter_id, found.tenant_id, found.cache_salt, found.digest)
            if len(self._identities) < 65_536:
                self._identities[(lora_name, cache_salt)] = ident
        return ident

    # --- applying ----------------------------------------------------------------------

    def apply(self, batch: DecodedBatch | BulkBatch) -> ApplyResult:
        """Apply a decoded batch in order; a rejected event never stops the others.

        Takes decode_bulk's BulkBatch (the fast path) or a DecodedBatch of event
        objects; both apply the same way.
        """
        if type(batch) is not BulkBatch:
            batch = bulk_from_events(batch)
        if self.block_tokens:
            batch = self._split(batch)
        result = ApplyResult(applied=0, rejected=list(batch.errors))
        stamp = int(batch.ts * 1000) if batch.ts is not None and batch.ts > 0 else 0
        tokens = batch.tokens
        run = batch.run
        if run is not None and self._apply_run(run, batch, stamp, result):
            ops: list[Any] = []  # done
        else:
            ops = batch.ops
        position, end = 0, len(ops)
        while position < end:
            op = ops[position]
            kind = op[0]
            if kind == OP_STORED:
                position = self._stored_from(ops, position, tokens, stamp, result)
                continue
            position += 1
            if kind == OP_REMOVED:
                self._removed(op)
            elif kind == OP_CLEARED:
                self.reset()
            else:
                result.rejected.append(EventError(op[1], "bad_type", op[2]))
                continue
            result.applied += 1
        self.stats.events_applied += result.applied
        self.stats.events_rejected += len(result.rejected)
        return result

    def _split(self, batch: BulkBatch) -> BulkBatch:
        """The batch in the index's block size; learns the engine's from its stored blocks."""
        sizes = batch.stored_sizes()
        if len(sizes) == 1 and not self.engine_block_tokens:
            self.engine_block_tokens = next(iter(sizes))
        return split_blocks(batch, self.block_tokens, self.engine_block_tokens)

    def reset(self) -> int:
        """The engine holds nothing (AllBlocksCleared, or it restarted): drop its records."""
        self.stats.clears += 1
        self._blocks.clear()
        self._runs.clear()
        self._refs.clear()
        if self.on_released is not None:
            self.on_released(None)
        return self.index.clear_worker(self.engine_id)

    def _entry(self, value: _Entry | int) -> _Entry:
        """The _Entry of a value of the map."""
        if type(value) is not int:
            return value
        run = self._runs[value >> _SPAN_BITS]
        offset = value & (_SPAN - 1)
        ours = run[0]
        prefix = ours[offset - 1] if offset else run[1]
        return (ours[offset], prefix, run[2] + offset, run[3], run[4], run[5])

    def _forget(self, value: _Entry | int) -> None:
        """A value left the map (its block is gone, or it is replaced by an _Entry)."""
        if type(value) is not int:
            return
        run_id = value >> _SPAN_BITS
        run = self._runs[run_id]
        run[_LIVE] -= 1
        if not run[_LIVE]:
            del self._runs[run_id]
        elif run[_LIVE] * 4 < len(run[0]):
            # Few blocks left: give them their own entries and let the run's lists go.
            blocks = self._blocks
            base = run_id << _SPAN_BITS
            for value_of_block, key_of_engine in enumerate(run[7], base):
                if blocks.get(key_of_engine) == value_of_block:
                    blocks[key_of_engine] = self._entry(value_of_block)
            del self._runs[run_id]

    def _apply_run(self, run: StoredRun, batch: BulkBatch, stamp: int, result: ApplyResult) -> bool:
        """Apply a batch that is one chain (the decoder's StoredRun): in one step when its
        blocks are all new and fit, else event by event. Returns False, having changed
        nothing, if the chain's first parent is unknown (the general loop then rejects
        event by event)."""
        resolved = self._resolve(run.parent, run.lora_name, run.cache_salt)
        if resolved is None:
            return False
        tokens = batch.tokens
        if self._store_run(
            run.keys, run.block_size, run.tier, run.group_idx, 0, resolved, tokens, stamp
        ):
            result.applied += run.events
        else:
            for op in batch.ops:
                self._stored_one(op, tokens, stamp, result)
        return True

    def _resolve(
        self, parent: EngineKey | None, lora_name: str | None, cache_salt: str | None
    ) -> tuple[_Identity, str | None, int] | None:
        """(identity, our parent hash, first block index) of a stored event, None if its
        parent is unknown."""
        if parent is None:
            return self.identity(lora_name, cache_salt), None, 0
        value = self._blocks.get(parent)
        if value is None:
            return None
        entry = self._entry(value)
        return entry[_IDENT], entry[_HASH], entry[_INDEX] + 1

    def _unknown_parent(self, op: _StoredOp, result: ApplyResult) -> None:
        self.stats.unknown_parent += 1
        detail = f"parent {engine_hash(op[3])} is not a block we know"
        result.rejected.append(EventError(op[1], "unknown_parent", detail))

    def _stored_from(
        self, ops: list[Any], first: int, tokens: bytes, stamp: int, result: ApplyResult
    ) -> int:
        """Apply the run of stored events starting at ops[first]; returns the next
        position."""
        op = ops[first]
        resolved = self._resolve(op[3], op[7], op[8])
        if resolved is None:
            self._unknown_parent(op, result)
            return first + 1
        stop = first + 1
        shape = stored_shape(op)
        engine_keys = op[2]
        last = engine_keys[-1]
        # Consecutive stored ops' token ids are consecutive, so only the chain and the
        # shape decide.
        for nxt in ops[first + 1 :]:
            if nxt[0] != OP_STORED or nxt[3] != last or stored_shape(nxt) != shape:
                break
            if stop == first + 1:
                engine_keys = list(engine_keys)
            engine_keys += nxt[2]
            last = engine_keys[-1]
            stop += 1
        if self._store_run(engine_keys, op[4], op[5], op[6], op[9], resolved, tokens, stamp):
            result.applied += stop - first
            return stop
        for position in range(first, stop):
            self._stored_one(ops[position], tokens, stamp, result)
        return stop

    def _store_run(
        self,
        engine_keys: list[EngineKey],
        size: int,
        tier: CacheTier,
        group_idx: int | None,
        first_token: int,
        resolved: tuple[_Identity, str | None, int],
        tokens: bytes,
        stamp: int,
    ) -> bool:
        """Map and index a run of blocks (token ids from `first_token` of `tokens`) in
        bulk if they are all new and fit under the cap (then it is what applying its
        events one by one would do); else change nothing and return False."""
        blocks = self._blocks
        count = len(engine_keys)
        if len(blocks) + count > self.max_tracked or not blocks.keys().isdisjoint(engine_keys):
            return False
        ident, parent_hash, first_index = resolved
        ours = packed_block_hashes(
            tokens, size, ident[3], parent_hash, first_token=first_token, count=count
        )
        if len(ours) != count:
            return False  # too few token ids: the per-event path raises the error
        tier_value = tier._value_
        refs = self._refs.get(tier_value)
        if refs is None:
            refs = self._refs[tier_value] = {}
        # A chain's own hashes never repeat (each folds in its parent), so new engine
        # keys and our hashes unseen on this tier make every block a plain insert.
        if not refs.keys().isdisjoint(ours):
            return False
        parent = parent_hash if parent_hash is not None else ROOT_PARENT
        holders = ((tier_value, group_idx),)
        run_id = self._next_run
        values: Any
        if count < _SPAN:
            values = range(run_id << _SPAN_BITS, (run_id << _SPAN_BITS) + count)
        else:
            prefixes = [parent, *ours[:-1]]
            values = zip(
                ours,
                prefixes,
                range(first_index, first_index + count),
                repeat(size),
                repeat(ident),
                repeat(holders),
            )
        before = len(blocks)
        blocks.update(zip(engine_keys, values, strict=True))
        if len(blocks) - before != count:
            # An engine key repeats within the run: undo (all were new), go event by event.
            for key_of_engine in engine_keys:
                blocks.pop(key_of_engine, None)
            return False
        if count < _SPAN:
            self._runs[run_id] = [
                ours,
                parent,
                first_index,
                size,
                ident,
                holders,
                count,
                engine_keys,
            ]
            self._next_run = run_id + 1
        refs.update(zip(ours, repeat(1)))
        scope = (self.model_id, self.tokenizer_id, ident[0], ident[1])
        self.index.put_chain(
            Chain(
                scope,
                parent,
                ours,
                first_index,
                size,
                self.engine_id,
                tier,
                self.bytes_per_block,
                stamp,
            )
        )
        self.stats.blocks_stored += count
        return True

    def _stored_one(self, op: _StoredOp, tokens: bytes, stamp: int, result: ApplyResult) -> None:
        """Apply one stored event block by block (the general path)."""
        resolved = self._resolve(op[3], op[7], op[8])
        if resolved is None:
            self._unknown_parent(op, result)
            return
        ident, parent_hash, first_index = resolved
        engine_keys, size, tier = op[2], op[4], op[5]
        ours = packed_block_hashes(
            tokens, size, ident[3], parent_hash, first_token=op[9], count=len(engine_keys)
        )
        blocks = self._blocks
        adapter, tenant = ident[0], ident[1]
        model_id, tokenizer_id = self.model_id, self.tokenizer_id
        holder = (tier._value_, op[6])
        holders = (holder,)
        refs = self._refs.get(holder[0])
        if refs is None:
            refs = self._refs[holder[0]] = {}
        engine_id, nbytes = self.engine_id, self.bytes_per_block
        keys = chain_keys(
            (model_id, tokenizer_id, adapter, tenant),
            ours,
            parent=parent_hash if parent_hash is not None else ROOT_PARENT,
            first_index=first_index,
            token_count=size,
        )
        residencies = []
        for key_of_engine, our_hash, key in zip(engine_keys, ours, keys, strict=True):
            mine = (our_hash, key[4], key[6], size, ident, holders)  # prefix_hash, block_index
            value = blocks.get(key_of_engine)
            entry = None if value is None else self._entry(value)
            if entry is None:
                if len(blocks) >= self.max_tracked:
                    self.stats.overflow += 1
                    continue
                blocks[key_of_engine] = mine
            elif entry[:4] != mine[:4] or entry[_IDENT][:2] != ident[:2]:
                # The engine reused a hash for other content: forget the old mapping.
                self._drop_entry(key_of_engine, entry)
                blocks[key_of_engine] = mine
            elif holder not in entry[_HOLDERS]:
                self._forget(value)
                blocks[key_of_engine] = (*entry[:_HOLDERS], (*entry[_HOLDERS], holder))
            else:
                residencies.append(CacheResidency(key, engine_id, tier, nbytes, stamp))
                continue
            refs[our_hash] = refs.get(our_hash, 0) + 1
            residencies.append(CacheResidency(key, engine_id, tier, nbytes, stamp))
        self.index.put_many(residencies)
        self.stats.blocks_stored += len(residencies)
        result.applied += 1

    def _removed(self, op: tuple[Any, ...]) -> None:
        blocks = self._blocks
        holder = (op[3]._value_, op[4])
        runs = self._runs
        only = (holder,)
        release = self._release
        stats = self.stats
        for key_of_engine in op[2]:
            value = blocks.get(key_of_engine)
            if type(value) is int:
                # A bulk run's block: its hash and holders are the run's (no _Entry built).
                run = runs[value >> _SPAN_BITS]
                if run[_HOLDERS] == only:
                    del blocks[key_of_engine]
                    self._forget(value)  # after the del: its block is no longer mapped
                    release(run[0][value & (_SPAN - 1)], holder[0])
                    stats.blocks_removed += 1
                    continue
            entry = None if value is None else self._entry(value)
            if entry is None or holder not in entry[_HOLDERS]:
                stats.unknown_removed += 1
                continue
            holders = entry[_HOLDERS]
            self._forget(value)
            if len(holders) == 1:
                del blocks[key_of_engine]
            else:
                at = holders.index(holder)
                blocks[key_of_engine] = (*entry[:_HOLDERS], holders[:at] + holders[at + 1 :])
            release(entry[_HASH], holder[0])
            stats.blocks_removed += 1

    def _release(self, our_hash: str, tier: str) -> None:
        """One engine copy of our block on `tier` is gone; drop the record with the last."""
        refs = self._refs.get(tier)
        count = (0 if refs is None else refs.get(our_hash, 0)) - 1
        if count > 0:
            refs[our_hash] = count
            return
        if refs is not None:
            refs.pop(our_hash, None)
        self.index.remove_tier(self.engine_id, our_hash, _TIERS[tier])
        if self.on_released is not None and tier == _HBM:
            self.on_released(our_hash)

    def _drop_entry(self, key_of_engine: EngineKey, entry: _Entry) -> None:
        for tier, _group in entry[_HOLDERS]:
            self._release(entry[_HASH], tier)
        self._forget(self._blocks.pop(key_of_engine))
