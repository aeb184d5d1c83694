"""Engine events -> residency in the index, under the gateway's own block hashes."""

from __future__ import annotations

from collections import Counter

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache_core.identity.keys import request_blocks
from quillcache_core.index.memory import MemoryIndex
from quillcache_core.kvevents.bulk_decode import decode_bulk
from quillcache_core.kvevents.decode import decode_batch
from quillcache_core.kvevents.events import DecodedBatch, EngineBlockRemoved, EngineBlockStored
from quillcache_core.kvevents.translate import EngineEventTranslator
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


def test_sglang_salted_blocks_get_exactly_the_gateway_hashes():
    """SGLang's own hashes and its metadata-carried salt: the translator recomputes
    what the gateway derives for that tenant."""
    index, tr = make()
    blocks = len(PROMPT) // BS
    event = ["BlockStored", list(range(11, 11 + blocks)), None, PROMPT[: blocks * BS], BS]
    event += [None, "GPU", {"cache_salt": "acme"}]
    result = tr.apply(decode_bulk(msgpack.packb([1.0, [event], 0])))
    assert result.applied == 1 and result.rejected == []
    assert engine_keys(index) == set(gateway_keys(PROMPT, "acme"))


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


# --- the bulk path (decode_bulk, runs) does exactly what per-event application does ----


class PerBlockTranslator(EngineEventTranslator):
    """The reference: never the bulk run path, every event applied block by block."""

    def _store_run(self, *args, **kwargs) -> bool:
        return False


def state(index, tr) -> tuple:
    stats = tr.stats
    return (
        Counter(index.snapshot()),
        len(tr),
        (stats.blocks_stored, stats.blocks_removed, stats.unknown_parent, stats.overflow),
        (stats.unknown_removed, stats.events_applied, stats.events_rejected),
    )


def assert_runs_bounded(tr) -> None:
    """The translator keeps a bulk run's shared facts exactly while blocks of it are
    mapped: memory follows the blocks the engine holds."""
    live = Counter(v >> 20 for v in tr._blocks.values() if type(v) is int)
    assert {run_id: run[6] for run_id, run in tr._runs.items()} == dict(live)
    assert all(4 * run[6] >= len(run[0]) for run in tr._runs.values())


@pytest.mark.parametrize("salt", [None, "acme"])
def test_one_block_events_chained_get_the_gateway_hashes_through_the_bulk_path(salt):
    """The benchmark's shape: each event one block, chained to the previous event."""
    index, tr = make()
    enc = encoder()
    tokens = PROMPT[: 5 * BS]
    events = [enc.stored_event(tokens[: (n + 1) * BS], salt=salt) for n in range(5)]
    bulk = decode_bulk(enc.batch(events, ts=1700000000.0))
    assert [len(op[2]) for op in bulk.ops] == [1] * 5
    result = tr.apply(bulk)
    assert result.applied == 5 and result.rejected == []
    expected = gateway_keys(tokens, salt)
    assert engine_keys(index) == set(expected)
    for key in expected:
        (res,) = index.locate(key)
        assert (res.worker_id, res.tier, res.last_access_ms) == (
            ENGINE,
            CacheTier.HBM,
            1700000000000,
        )
    assert [tr.key_for(f"u:{e[1][0]:016x}") for e in events] == expected
    # The engine evicts the last two blocks, then the rest: the records go with them.
    tr.apply(decode_bulk(enc.batch([enc.removed_event(tokens, salt=salt, last=2)])))
    assert engine_keys(index) == set(expected[:3]) and len(tr) == 3
    assert_runs_bounded(tr)
    tr.apply(decode_bulk(enc.batch([enc.removed_event(tokens[: 3 * BS], salt=salt)])))
    assert len(index) == 0 and len(tr) == 0 and tr._runs == {}


def test_a_run_with_few_blocks_left_lets_its_shared_lists_go():
    index, tr = make()
    enc = encoder()
    tokens = [(7 * i) % 1000 for i in range(8 * BS)]
    events = [enc.stored_event(tokens[: (n + 1) * BS]) for n in range(8)]
    tr.apply(decode_bulk(enc.batch(events)))
    expected = gateway_keys(tokens, None)
    assert len(tr._runs) == 1
    # The engine evicts the tail: with one block of eight left the run is unpacked.
    tr.apply(decode_bulk(enc.batch([enc.removed_event(tokens, last=7)])))
    assert tr._runs == {} and len(tr) == 1
    assert tr.key_for(f"u:{events[0][1][0]:016x}") == expected[0]
    assert engine_keys(index) == {expected[0]}
    # A longer prompt continues the chain from that block, and the block still goes.
    more = [enc.stored_event(tokens[: 2 * BS])]
    tr.apply(decode_bulk(enc.batch(more)))
    assert engine_keys(index) == set(expected[:2])
    tr.apply(decode_bulk(enc.batch([enc.removed_event(tokens[: 2 * BS])])))
    assert len(index) == 0 and len(tr) == 0 and tr._runs == {}


_POOL = st.integers(1, 12)  # engine hashes from a small pool: reuse, repeats, unknown parents


@st.composite
def _histories(draw: st.DrawFn) -> list[bytes]:
    """Batches of raw vLLM events: chains (often one block an event), removals, clears."""
    payloads = []
    for _ in range(draw(st.integers(1, 4))):
        events: list = []
        last = None
        for _ in range(draw(st.integers(1, 8))):
            what = draw(st.sampled_from(["chain", "chain", "chain", "root", "removed", "clear"]))
            medium = draw(st.sampled_from(["GPU", "GPU", "CPU"]))
            if what == "removed":
                events.append(["BlockRemoved", draw(st.lists(_POOL, max_size=3)), medium])
                continue
            if what == "clear":
                events.append(["AllBlocksCleared"])
                continue
            blocks = draw(st.integers(1, 3))
            hashes = draw(st.lists(_POOL, min_size=blocks, max_size=blocks))
            parent = last if what == "chain" else draw(st.none() | _POOL)
            tokens = draw(st.lists(st.integers(0, 3), min_size=2 * blocks, max_size=2 * blocks))
            salt = draw(st.sampled_from([None, [["acme"]]]))
            events.append(["BlockStored", hashes, parent, tokens, 2, None, medium, None, salt])
            last = hashes[-1]
        payloads.append(msgpack.packb([1.0, events, 0]))
    return payloads


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_histories(), st.integers(2, 40))
def test_bulk_path_equals_per_block_application(payloads, max_tracked):
    fast_index, fast = make(max_tracked=max_tracked)
    ref_index = MemoryIndex()
    ref = PerBlockTranslator(ref_index, ENGINE, MODEL, TOKENIZER, max_tracked=max_tracked)
    for payload in payloads:
        got = fast.apply(decode_bulk(payload))
        want = ref.apply(decode_batch(payload))
        assert (got.applied, got.rejected) == (want.applied, want.rejected)
        assert state(fast_index, fast) == state(ref_index, ref)
        assert_runs_bounded(fast)
    for engine_hash in {f"u:{h:016x}" for h in range(1, 13)}:
        assert fast.key_for(engine_hash) == ref.key_for(engine_hash)
