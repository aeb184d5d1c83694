"""Engine events -> residency in the index, under the gateway's own block hashes."""

from __future__ import annotations

import pytest

from quillcache_conductor.kv_translate import EngineEventTranslator
from quillcache_conductor.kv_wire import (
    DecodedBatch,
    EngineBlockRemoved,
    EngineBlockStored,
    decode_batch,
)
from quillcache_core.hashing import request_blocks
from quillcache_core.index.memory import MemoryIndex
from quillcache_core.model import CacheTier, KvBlockKey
from tests.support.vllm_publisher import HASH_STYLES, VllmEventEncoder

pytestmark = pytest.mark.unit

MODEL = "llama-3-8b"
TOKENIZER = "llama-3"
BS = 16
ENGINE = "engine-a"
PROMPT = [(i * 7919) % 32000 for i in range(5 * BS + 3)]  # 5 full blocks + a partial


def gateway_keys(tokens, tenant: str | None, adapter: str | None = None) -> list[KvBlockKey]:
    """What the gateway computes for tenant T: tenant_id=T, cache_salt=T (or unsalted)."""
    return request_blocks(
        tokens,
        BS,
        model_id=MODEL,
        tokenizer_id=TOKENIZER,
        adapter_id=adapter,
        tenant_id=tenant if tenant is not None else "default",
        cache_salt=tenant,
    )


def make(index=None, engine=ENGINE, **kwargs):
    index = index if index is not None else MemoryIndex()
    return index, EngineEventTranslator(index, engine, MODEL, TOKENIZER, **kwargs)


def encoder(**kwargs) -> VllmEventEncoder:
    kwargs.setdefault("block_size", BS)
    kwargs.setdefault("seed", b"deploy-seed-0001")
    return VllmEventEncoder(**kwargs)


def apply(translator, enc, *events):
    return translator.apply(decode_batch(enc.batch(list(events), ts=1700000000.0)))


def engine_keys(index, engine=ENGINE) -> set[KvBlockKey]:
    return {r.key for r in index.snapshot() if r.worker_id == engine}


@pytest.mark.parametrize("hash_style", HASH_STYLES)
@pytest.mark.parametrize("encoding", ["array", "map"])
def test_salted_blocks_get_exactly_the_gateway_hashes(encoding, hash_style):
    index, tr = make()
    enc = encoder(encoding=encoding, hash_style=hash_style)
    result = apply(tr, enc, enc.stored_event(PROMPT, salt="acme"))
    assert result.applied == 1 and result.rejected == []
    expected = gateway_keys(PROMPT, "acme")
    assert len(expected) == 5
    assert engine_keys(index) == set(expected)
    for key in expected:
        (res,) = index.locate(key)
        assert (res.worker_id, res.tier, res.bytes) == (ENGINE, CacheTier.HBM, 2 * 1024 * 1024)
        assert res.last_access_ms == 1700000000000
        assert key.tenant_id == "acme" and key.adapter_id is None
    # Another tenant's gateway hashes (same tokens) must not match anything.
    assert all(index.locate(k) == [] for k in gateway_keys(PROMPT, "globex"))
    assert all(index.locate_hash(k.block_hash) == [] for k in gateway_keys(PROMPT, None))


def test_unsalted_blocks_use_the_default_tenant_without_salt():
    index, tr = make()
    enc = encoder()
    apply(tr, enc, enc.stored_event(PROMPT))
    assert engine_keys(index) == set(gateway_keys(PROMPT, None))
    assert {k.tenant_id for k in engine_keys(index)} == {"default"}


def test_lora_blocks_carry_the_adapter():
    index, tr = make()
    enc = encoder()
    apply(tr, enc, enc.stored_event(PROMPT, salt="acme", lora="sql-lora"))
    assert engine_keys(index) == set(gateway_keys(PROMPT, "acme", adapter="sql-lora"))


def test_every_hash_style_yields_the_same_index():
    contents = []
    for style in HASH_STYLES:
        index, tr = make()
        enc = encoder(hash_style=style)
        apply(tr, enc, enc.stored_event(PROMPT, salt="acme"))
        contents.append(engine_keys(index))
    assert contents[0] == contents[1] == contents[2]


def test_chained_events_across_batches_resolve_parents_and_inherit_identity():
    index, tr = make()
    enc = encoder()
    head = PROMPT[: 2 * BS]
    assert apply(tr, enc, enc.stored_event(head, salt="acme")).rejected == []
    # The engine reports only the 3 new blocks, chained from block 1, with no salt in
    # their extra keys: the tenant comes from the parent.
    second = enc.stored_event(PROMPT, salt="acme")
    batch = decode_batch(enc.batch([second]))
    (event,) = batch.events
    assert event.parent is not None and event.cache_salt is None and len(event.block_hashes) == 3
    assert tr.apply(batch).rejected == []
    expected = gateway_keys(PROMPT, "acme")
    assert engine_keys(index) == set(expected)
    assert [k.block_index for k in expected] == [0, 1, 2, 3, 4]
    assert tr.key_for(event.block_hashes[0]) == expected[2]
    assert expected[2].prefix_hash == expected[1].block_hash
    assert len(tr) == 5


def test_a_chain_within_one_batch():
    index, tr = make()
    enc = encoder()
    first = enc.stored_event(PROMPT[: 2 * BS], salt="acme")
    rest = enc.stored_event(PROMPT, salt="acme")
    assert apply(tr, enc, first, rest).applied == 2
    assert engine_keys(index) == set(gateway_keys(PROMPT, "acme"))


def test_removed_removes_only_those_blocks():
    index, tr = make()
    enc = encoder()
    apply(tr, enc, enc.stored_event(PROMPT, salt="acme"))
    keys = gateway_keys(PROMPT, "acme")
    result = apply(tr, enc, enc.removed_event(PROMPT, salt="acme", last=2))
    assert result.applied == 1 and result.rejected == []
    assert engine_keys(index) == set(keys[:3])
    assert all(index.locate(k) == [] for k in keys[3:])
    assert len(tr) == 3 and tr.stats.blocks_removed == 2
    # Removing blocks we never saw is counted, not an error.
    stray = EngineBlockRemoved(("u:00000000000000aa",), CacheTier.HBM)
    assert tr.apply(DecodedBatch(None, None, [stray])).rejected == []
    assert tr.stats.unknown_removed == 1 and len(index) == 3


def test_tier_comes_from_medium_and_tiers_are_removed_separately():
    index, tr = make()
    enc = encoder()
    tokens = PROMPT[: 2 * BS]
    keys = gateway_keys(tokens, "acme")
    apply(tr, enc, enc.stored_event(tokens, salt="acme", medium="CPU"))
    assert {r.tier for r in index.snapshot()} == {CacheTier.CPU_DRAM}
    # The same blocks also land on the GPU (vLLM reports each medium separately).
    apply(tr, enc, enc.stored_event(tokens, salt="acme", medium="GPU", only_new=False))
    assert {(r.key, r.tier) for r in index.snapshot()} == {
        (k, t) for k in keys for t in (CacheTier.CPU_DRAM, CacheTier.HBM)
    }
    apply(tr, enc, enc.removed_event(tokens, salt="acme", medium="CPU"))
    assert {(r.key, r.tier) for r in index.snapshot()} == {(k, CacheTier.HBM) for k in keys}
    assert len(tr) == 2, "still held on the GPU, so still mapped"
    apply(tr, enc, enc.removed_event(tokens, salt="acme", medium="GPU"))
    assert len(index) == 0 and len(tr) == 0


@pytest.mark.parametrize("medium", ["DISK", "EXTERNAL", "CPU_PINNED"])
def test_other_media(medium):
    index, tr = make()
    enc = encoder(medium=medium)
    apply(tr, enc, enc.stored_event(PROMPT))
    assert {r.tier for r in index.snapshot()} == {CacheTier.parse(medium)}


def test_all_cleared_empties_this_engine_only():
    index = MemoryIndex()
    _, tr_a = make(index, "engine-a")
    _, tr_b = make(index, "engine-b")
    enc_a, enc_b = encoder(), encoder(seed=b"other-deployment")
    apply(tr_a, enc_a, enc_a.stored_event(PROMPT, salt="acme"))
    apply(tr_b, enc_b, enc_b.stored_event(PROMPT, salt="acme"))
    assert index.worker_block_count("engine-a") == index.worker_block_count("engine-b") == 5
    result = apply(tr_a, enc_a, enc_a.cleared_event())
    assert result.applied == 1
    assert index.worker_block_count("engine-a") == 0 and len(tr_a) == 0
    assert index.worker_block_count("engine-b") == 5 and len(tr_b) == 5
    for key in gateway_keys(PROMPT, "acme"):
        assert [r.worker_id for r in index.locate(key)] == ["engine-b"]


def test_unknown_parent_is_counted_and_the_rest_of_the_batch_applies():
    index, tr = make()
    enc = encoder()
    enc.stored_event(PROMPT[: 2 * BS], salt="acme")  # published but never seen by us
    orphan = enc.stored_event(PROMPT, salt="acme")
    other = enc.stored_event(list(range(BS)), salt="globex")
    result = apply(tr, enc, enc.malformed_event(), orphan, other)
    assert result.applied == 1
    assert [(e.index, e.reason) for e in result.rejected] == [
        (0, "token_count_mismatch"),
        (1, "unknown_parent"),
    ]
    assert tr.stats.unknown_parent == 1
    assert engine_keys(index) == set(gateway_keys(list(range(BS)), "globex"))


def test_map_is_capped_and_overflow_is_counted():
    index, tr = make(max_tracked=3)
    enc = encoder()
    apply(tr, enc, enc.stored_event(PROMPT, salt="acme"))
    assert len(tr) == 3 and len(index) == 3 and tr.stats.overflow == 2
    assert engine_keys(index) == set(gateway_keys(PROMPT, "acme")[:3])


def test_two_engine_blocks_with_our_same_key_keep_the_record_until_both_go():
    # e.g. image placeholders: the same tokens, different engine hashes.
    index, tr = make()
    tokens = tuple(range(BS))
    a = EngineBlockStored(("u:01",), None, tokens, BS, CacheTier.HBM, None, None)
    b = EngineBlockStored(("u:02",), None, tokens, BS, CacheTier.HBM, None, None)
    tr.apply(DecodedBatch(None, None, [a, b]))
    (key,) = gateway_keys(list(tokens), None)
    assert len(index.locate(key)) == 1 and len(tr) == 2
    tr.apply(DecodedBatch(None, None, [EngineBlockRemoved(("u:01",), CacheTier.HBM)]))
    assert len(index.locate(key)) == 1
    tr.apply(DecodedBatch(None, None, [EngineBlockRemoved(("u:02",), CacheTier.HBM)]))
    assert index.locate(key) == [] and len(tr) == 0


def test_kv_cache_groups_hold_a_block_independently():
    index, tr = make()
    tokens = tuple(range(BS))
    stored = [
        EngineBlockStored(("u:01",), None, tokens, BS, CacheTier.HBM, None, None, group_idx=g)
        for g in (0, 1)
    ]
    tr.apply(DecodedBatch(None, None, stored))
    gone = EngineBlockRemoved(("u:01",), CacheTier.HBM, group_idx=1)
    tr.apply(DecodedBatch(None, None, [gone]))
    assert len(index) == 1 and len(tr) == 1
    tr.apply(DecodedBatch(None, None, [EngineBlockRemoved(("u:01",), CacheTier.HBM, group_idx=0)]))
    assert len(index) == 0 and len(tr) == 0


def test_restored_block_is_idempotent():
    index, tr = make()
    enc = encoder()
    event = enc.stored_event(PROMPT, salt="acme")
    apply(tr, enc, event)
    apply(tr, enc, event)
    assert len(index) == 5 and len(tr) == 5
    apply(tr, enc, enc.removed_event(PROMPT, salt="acme"))
    assert len(index) == 0 and len(tr) == 0


def test_decoder_errors_are_passed_through_first():
    _, tr = make()
    enc = encoder()
    result = apply(tr, enc, enc.stored_event(PROMPT), enc.malformed_event("bad_tokens"))
    assert result.applied == 1
    assert [(e.index, e.reason) for e in result.rejected] == [(1, "bad_tokens")]
    assert tr.stats.events_applied == 1 and tr.stats.events_rejected == 1
