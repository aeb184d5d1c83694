"""Engines whose KV blocks are larger than the index's: split on the way in, reused whole."""

from __future__ import annotations

import random

import pytest

from quillcache_core.identity.keys import block_identity
from quillcache_core.index.memory import MemoryIndex
from quillcache_core.kvevents.bulk import bulk_from_events, split_blocks, split_keys, sub_key
from quillcache_core.kvevents.decode import decode_batch
from quillcache_core.kvevents.translate import EngineEventTranslator
from quillcache_core.model import CacheResidency, CacheTier, KvBlockKey
from quillcache_core.routing.decide import whole_engine_blocks
from tests.support.vllm_publisher import HASH_STYLES, VllmEventEncoder

pytestmark = pytest.mark.unit

MODEL, TOKENIZER, ENGINE = "tiny", "/models/tiny", "vllm-0"
PROMPT = [(i * 7919) % 4000 for i in range(5 * 32 + 7)]  # 5 whole 32-token blocks + a tail


def translator(index, **kwargs) -> EngineEventTranslator:
    return EngineEventTranslator(index, ENGINE, MODEL, TOKENIZER, block_tokens=16, **kwargs)


def encoder(hash_style: str = "u64") -> VllmEventEncoder:
    return VllmEventEncoder(block_size=32, seed=b"cpu-engine-seed0", hash_style=hash_style)


def on_engine(index) -> list[str]:
    keys = sorted(
        (r.key for r in index.snapshot() if r.worker_id == ENGINE), key=lambda k: k.block_index
    )
    return [k.block_hash for k in keys]


@pytest.mark.parametrize("hash_style", HASH_STYLES)
def test_a_32_token_engine_block_is_indexed_as_two_16_token_blocks_of_the_gateways_keys(
    hash_style,
):
    index = MemoryIndex()
    enc = encoder(hash_style)
    result = translator(index).apply(
        decode_batch(enc.batch([enc.stored_event(PROMPT, salt="acme")]))
    )
    assert result.rejected == []
    gateway = block_identity(MODEL, TOKENIZER, cache_salt="acme").hashes(PROMPT, 16)
    assert on_engine(index) == gateway[:10]  # the tail block is never cached


def test_a_later_event_continues_from_the_last_sub_block_and_removal_takes_both_halves():
    index = MemoryIndex()
    enc = encoder()
    tr = translator(index)
    tr.apply(decode_batch(enc.batch([enc.stored_event(PROMPT[:64], salt="acme")])))
    # The next event names the first one's last block as its parent.
    tr.apply(decode_batch(enc.batch([enc.stored_event(PROMPT[:160], salt="acme")])))
    gateway = block_identity(MODEL, TOKENIZER, cache_salt="acme").hashes(PROMPT, 16)
    assert on_engine(index) == gateway[:10]
    removed = enc.removed_event(PROMPT[:160], salt="acme", last=3)
    tr.apply(decode_batch(enc.batch([removed])))
    assert on_engine(index) == gateway[:4]  # split by the size learned from its stores


def test_blocks_that_are_no_multiple_of_the_index_block_are_rejected_and_counted():
    enc = VllmEventEncoder(block_size=24, seed=b"odd-engine-seed0")
    batch = decode_batch(enc.batch([enc.stored_event(PROMPT[:48])]))
    split = split_blocks(bulk_from_events(batch), 16, 24)
    assert [e.reason for e in split.errors] == ["block_size"]
    assert split.ops == []


def test_sub_keys_never_equal_an_engine_key_and_the_last_keeps_it():
    for key in (2**64 - 1, 0, b"\x01" * 32, "s:opaque"):
        parts = split_keys([key], 4)
        assert parts[-1] == key and len(set(parts)) == 4
        assert all(sub_key(key, j) != key for j in range(3))


def key(i: int) -> KvBlockKey:
    return KvBlockKey(MODEL, TOKENIZER, None, "acme", "root", f"{i:032x}", i, 16)


def test_an_engine_reuses_only_whole_blocks_of_its_own_size():
    rng = random.Random(3)
    for _ in range(200):
        held = {e: rng.randint(0, 9) for e in ("e32", "e16", "e64")}
        parts = {"e32": 2, "e16": 1, "e64": 4}
        located = [
            [CacheResidency(key(i), e, CacheTier.HBM, 1) for e, n in held.items() if i < n]
            + [CacheResidency(key(i), "store-0", CacheTier.CPU_DRAM, 1)]
            for i in range(10)
        ]
        out = whole_engine_blocks(located, parts)
        for engine, n in held.items():
            kept = sum(1 for found in out if any(r.worker_id == engine for r in found))
            assert kept == n - n % parts[engine]
        assert len(out) == 10  # the store copy keeps every block usable
