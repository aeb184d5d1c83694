"""One simulated engine: prefix cache, FETCH, scheduling, KV events, offload.

A request's life (each step on the event loop; nothing here blocks it):

1. `prepare`: hash the prompt's full blocks (engine hashes for the cache, QuillCache
   hashes for store keys), pin the longest cached prefix (local hits; blocks a prefill
   booked earlier is computing count too, as vLLM looks the cache up at scheduling
   time), then fetch the blocks the plan lists right after it (a contiguous run; the
   first failure ends it, the rest are recomputed). At least one token is always
   computed, as in vLLM, so at most (tokens - 1) // block_size blocks can be hits or
   fetches.
2. `prefill`: wait for the single prefill server, for the tokens not hit or fetched;
   then cache the request's blocks and publish BlockRemoved / BlockStored in one batch;
   the computed blocks are saved to the store node in the background (or, with
   `--store-writes evicted`, the evicted LRU blocks are offloaded).
3. The caller decodes (`scheduler.decode`) and streams the deterministic output.
4. `release`: unpin the request's blocks.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from quillcache_core.identity.keys import block_identity
from quillcache_core.model import KvBlockKey
from quillcache_core.wire.engine_plan import EnginePlan, FetchAction
from quillcache_simengine.events import (
    KvEventPublisher,
    all_cleared,
    block_removed,
    block_stored,
    stored_runs,
)
from quillcache_simengine.kvcache import CachedBlock, PrefixCache, engine_digests, wire_hash
from quillcache_simengine.offload import BlockMover
from quillcache_simengine.scheduler import Scheduler

__all__ = ["EngineStats", "Prepared", "SimEngine"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    requests: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    generation_tokens: int = 0
    hit_blocks: int = 0
    fetched_blocks: int = 0
    recomputed_blocks: int = 0
    fetch_fallback_blocks: int = 0  # planned fetches recomputed instead
    written_through_blocks: int = 0  # prompt blocks stored for a decode engine (prefill role)
    evicted_blocks: int = 0
    event_batches: int = 0
    resets: int = 0


@dataclass(slots=True)
class Prepared:
    """One prompt, planned: what is hit, fetched and recomputed."""

    tokens: tuple[int, ...]
    cache_salt: str | None
    hashes: list[int]
    keys: list[KvBlockKey]
    hit_blocks: int
    fetched_blocks: int
    fetch_fallback_blocks: int
    generation: int
    pinned: list[int] = field(default_factory=list)
    # Prefill for another engine (disaggregation): the prompt's blocks go to the store
    # node before the answer.
    write_through: bool = False

    @property
    def full_blocks(self) -> int:
        return len(self.hashes)

    @property
    def recomputed_blocks(self) -> int:
        return self.full_blocks - self.hit_blocks - self.fetched_blocks

    def cached_tokens(self, block_size: int) -> int:
        return (self.hit_blocks + self.fetched_blocks) * block_size

    def compute_tokens(self, block_size: int) -> int:
        return len(self.tokens) - self.cached_tokens(block_size)


class SimEngine:
    def __init__(
        self,
        *,
        engine_id: str,
        model_id: str,
        tokenizer_id: str,
        block_size: int,
        cache: PrefixCache,
        scheduler: Scheduler,
        publisher: KvEventPublisher,
        mover: BlockMover,
        seed: bytes | None = None,
        role: str = "both",
    ) -> None:
        self.engine_id = engine_id
        self.model_id = model_id
        self.tokenizer_id = tokenizer_id
        self.block_size = block_size
        self.cache = cache
        self.scheduler = scheduler
        self.publisher = publisher
        self.mover = mover
        self.seed = seed if seed is not None else os.urandom(32)
        self.role = role
        self.stats = EngineStats()
        # engine hash -> prefills booked that will cache it (a count: two may overlap)
        self._pending: dict[int, int] = {}

    # --- 1. plan ------------------------------------------------------------------------

    def block_keys(
        self, tokens: Sequence[int], cache_salt: str | None, plan: EnginePlan | None = None
    ) -> list[KvBlockKey]:
        """QuillCache keys of the prompt's full blocks (its store keys).

        With a plan, under the plan's identity (the gateway's keys, which FETCH names);
        without, as the conductor reads our KV events (the record's model and tokenizer, the salt)."""
        if plan is not None:
            identity = block_identity(
                plan.model_id,
                plan.tokenizer_id,
                cache_salt=plan.cache_salt,
                adapter_id=plan.adapter_id,
                tenant_id=plan.tenant_id,
            )
        else:
            identity = block_identity(self.model_id, self.tokenizer_id, cache_salt=cache_salt)
        return identity.keys(tokens, self.block_size)

    async def prepare(
        self, tokens: Sequence[int], cache_salt: str | None, plan: EnginePlan | None
    ) -> Prepared:
        bs = self.block_size
        tokens = tuple(tokens)
        hashes = [wire_hash(d) for d in engine_digests(self.seed, tokens, bs, cache_salt)]
        keys = self.block_keys(tokens, cache_salt, plan)
        usable = (len(tokens) - 1) // bs  # at least one token is always computed
        cached = self.cache.lookup(hashes[:usable])
        # vLLM looks the prefix cache up when it schedules a request, not when it arrives:
        # blocks an earlier request's prefill, booked ahead of this one on the single
        # prefill server, is computing are cached by this one's turn.
        hits, pending = cached, self._pending
        while hits < usable and hashes[hits] in pending:
            hits += 1
        prepared = Prepared(
            tokens=tokens,
            cache_salt=cache_salt,
            hashes=hashes,
            keys=keys,
            hit_blocks=hits,
            fetched_blocks=0,
            fetch_fallback_blocks=0,
            generation=self.cache.generation,
            pinned=self.cache.acquire(hashes[:cached]),
            write_through=self.role == "prefill" or (plan is not None and plan.disagg == "prefill"),
        )
        try:
            candidates = self._fetch_candidates(plan, keys, hits, usable)
            if candidates:
                results = await self.mover.fetch_many(
                    [(keys[i], a.source_node, a.source_address) for i, a in candidates]
                )
                fetched = 0
                while fetched < len(results) and results[fetched]:
                    fetched += 1
                prepared.fetched_blocks = fetched
                prepared.fetch_fallback_blocks = len(candidates) - fetched
        except BaseException:
            self.release(prepared)
            raise
        log.debug(
            "request of %d tokens: %d blocks, %d hit, %d fetched, %d recomputed (%d fallback)",
            len(tokens),
            prepared.full_blocks,
            prepared.hit_blocks,
            prepared.fetched_blocks,
            prepared.recomputed_blocks,
            prepared.fetch_fallback_blocks,
        )
        return prepared

    def _fetch_candidates(
        self, plan: EnginePlan | None, keys: list[KvBlockKey], hits: int, usable: int
    ) -> list[tuple[int, FetchAction]]:
        """The plan's FETCH actions for blocks hits, hits+1, ... (contiguous, ours)."""
        if plan is None or not plan.fetch:
            return []
        if plan.block_size != self.block_size:
            log.warning(
                "plan for block size %d ignored (engine uses %d)", plan.block_size, self.block_size
            )
            return []
        actions = {action.block_index: action for action in plan.fetch}
        out: list[tuple[int, FetchAction]] = []
        index = hits
        while index < usable and index in actions:
            action = actions[index]
            if action.block_hash != keys[index].block_hash:
                log.warning(
                    "plan names block %d as %s, the prompt's block is %s: not fetched",
                    index,
                    action.block_hash,
                    keys[index].block_hash,
                )
                break
            out.append((index, action))
            index += 1
        return out

    # --- 2. prefill ---------------------------------------------------------------------

    async def prefill(self, prepared: Prepared) -> float:
        """Queue for and run the prefill; cache the blocks. Returns the end time."""
        bs = self.block_size
        compute = prepared.compute_tokens(bs)
        saving = None
        if prepared.write_through:
            # A decode engine loads these next: they are in the store before we answer.
            # The save runs alongside the prefill, as vLLM's KV connector saves each
            # layer's KV while the next layers compute (save_kv_layer), the answer
            # waiting for the last (wait_for_save).
            started = asyncio.Event()
            saving = asyncio.ensure_future(self._write_through(prepared, started))
        # Booked now: a later request's lookup counts on these blocks (see `prepare`).
        computing = prepared.hashes[prepared.hit_blocks :]
        pending = self._pending
        for engine_hash in computing:
            pending[engine_hash] = pending.get(engine_hash, 0) + 1
        try:
            end = await self.scheduler.prefill(compute, started if saving else None)
        except BaseException:
            if saving is not None:
                saving.cancel()
            raise
        finally:
            for engine_hash in computing:
                left = pending.pop(engine_hash) - 1
                if left:
                    pending[engine_hash] = left
        self._account(prepared, compute)
        if saving is not None:
            self.stats.written_through_blocks += await saving
        if prepared.generation != self.cache.generation:
            return end  # the cache was reset meanwhile: our pins are void
        tokens, hashes, salt = prepared.tokens, prepared.hashes, prepared.cache_salt
        blocks = [
            CachedBlock(
                engine_hash=hashes[i],
                parent=hashes[i - 1] if i else None,
                index=i,
                token_ids=tokens[i * bs : (i + 1) * bs],
                key=prepared.keys[i],
                cache_salt=salt,
            )
            for i in range(prepared.hit_blocks, prepared.full_blocks)
        ]
        result = self.cache.insert(blocks)
        prepared.pinned.extend(result.pinned)
        events = []
        if result.evicted:
            self.stats.evicted_blocks += len(result.evicted)
            events.append(
                block_removed([b.engine_hash for b in result.evicted], self.publisher.encoding)
            )
            if self.mover.store_writes == "evicted":  # "computed": in the pool already
                for block in result.evicted:
                    self.mover.offload(block.key)
        for run in stored_runs(result.stored):
            events.append(block_stored(run, bs, self.publisher.encoding))
        if events:
            self.publisher.publish(events)
            self.stats.event_batches += 1
        if not prepared.write_through:
            # The blocks computed here go to the pool, as the KV connector saves them.
            first = prepared.hit_blocks + prepared.fetched_blocks
            self.mover.save_later(prepared.keys[first : prepared.full_blocks])
        return end

    async def _write_through(self, prepared: Prepared, started: asyncio.Event) -> int:
        """Store the prompt's full blocks (but for its last token's) once the prefill
        begins; returns how many are stored."""
        await started.wait()
        usable = (len(prepared.tokens) - 1) // self.block_size
        return await self.mover.store_now(prepared.keys[:usable])

    def _account(self, prepared: Prepared, computed: int) -> None:
        s = self.stats
        s.requests += 1
        s.prompt_tokens += len(prepared.tokens)
        s.computed_tokens += computed
        s.hit_blocks += prepared.hit_blocks
        s.fetched_blocks += prepared.fetched_blocks
        s.recomputed_blocks += prepared.recomputed_blocks
        s.fetch_fallback_blocks += prepared.fetch_fallback_blocks

    # --- 4. release, reset --------------------------------------------------------------

    def release(self, prepared: Prepared) -> None:
        pinned, prepared.pinned = prepared.pinned, []
        self.cache.release(pinned, prepared.generation)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block (no offload) and publish AllBlocksCleared."""
        count = self.cache.clear()
        self.publisher.publish([all_cleared(self.publisher.encoding)])
        self.stats.event_batches += 1
        self.stats.resets += 1
        log.info("prefix cache reset: %d blocks dropped", count)
        return count
