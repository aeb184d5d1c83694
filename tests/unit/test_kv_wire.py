"""Decoding vLLM/SGLang KV-event payloads: every encoding, every validation error."""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache_core.errors import InvalidArgument
from quillcache_core.kvevents.bulk import BulkBatch, engine_hash, engine_key
from quillcache_core.kvevents.bulk_decode import _typed_bulk, decode_bulk
from quillcache_core.kvevents.decode import decode_batch, normalize_hash
from quillcache_core.kvevents.events import (
    DecodedBatch,
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    WireError,
)
from quillcache_core.kvevents.schema import _StoredArray, stored_columns
from quillcache_core.model import CacheTier
from tests.support.vllm_publisher import (
    ENCODINGS,
    HASH_STYLES,
    STORED_FIELDS,
    VllmEventEncoder,
    encode_batch,
    encode_event,
)

pytestmark = pytest.mark.unit

BS = 4
PROMPT = list(range(100, 100 + 3 * BS))
LONGER = PROMPT + list(range(500, 500 + 2 * BS))


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _scenario(event_encoding: str, batch_encoding: str, hash_style: str) -> DecodedBatch:
    """The same engine history in any encoding: store, extend (chained), remove, clear."""
    enc = VllmEventEncoder(
        encoding=event_encoding, hash_style=hash_style, block_size=BS, seed=b"s" * 16
    )
    events = [
        enc.stored_event(PROMPT, salt="acme", lora="lora-a"),
        enc.stored_event(LONGER, salt="acme", lora="lora-a", medium="CPU"),
        enc.removed_event(LONGER, salt="acme", lora="lora-a", last=1),
        enc.cleared_event(),
    ]
    return decode_batch(encode_batch(events, batch_encoding, ts=12.5, dp_rank=3))


def _canonical(batch: DecodedBatch) -> list[Any]:
    """Events with each hash cut to its low 64 bits, the part all three styles share."""

    def low(h: str | None) -> str | None:
        return None if h is None else h[-16:]

    out: list[Any] = []
    for ev in batch.events:
        if isinstance(ev, EngineBlockStored):
            out.append(
                (
                    "stored",
                    tuple(low(h) for h in ev.block_hashes),
                    low(ev.parent),
                    ev.token_ids,
                    ev.block_size,
                    ev.tier,
                    ev.lora_name,
                    ev.cache_salt,
                )
            )
        elif isinstance(ev, EngineBlockRemoved):
            out.append(("removed", tuple(low(h) for h in ev.block_hashes), ev.tier))
        else:
            out.append(("cleared",))
    return out


@pytest.mark.parametrize("hash_style", HASH_STYLES)
@pytest.mark.parametrize("batch_encoding", ENCODINGS)
@pytest.mark.parametrize("event_encoding", ENCODINGS)
def test_every_encoding_decodes_to_the_same_events(event_encoding, batch_encoding, hash_style):
    batch = _scenario(event_encoding, batch_encoding, hash_style)
    assert batch.errors == []
    assert batch.ts == 12.5 and batch.dp_rank == 3
    assert batch.positions == [0, 1, 2, 3]
    reference = _canonical(_scenario("array", "array", "u64"))
    assert _canonical(batch) == reference
    stored, extended, removed, cleared = batch.events
    assert isinstance(stored, EngineBlockStored) and isinstance(extended, EngineBlockStored)
    assert stored.parent is None and len(stored.block_hashes) == 3
    assert stored.token_ids == tuple(PROMPT) and stored.block_size == BS
    assert (stored.tier, stored.lora_name, stored.cache_salt) == (CacheTier.HBM, "lora-a", "acme")
    # The extension reports only the new blocks, chained from the last cached one.
    assert extended.parent == stored.block_hashes[-1]
    assert extended.token_ids == tuple(LONGER[3 * BS :])
    assert extended.tier is CacheTier.CPU_DRAM and extended.cache_salt is None
    assert isinstance(removed, EngineBlockRemoved)
    assert removed.block_hashes == (extended.block_hashes[-1],)
    assert isinstance(cleared, EngineAllCleared)
    prefix = "b:" if hash_style == "bytes32" else "u:"
    assert all(h.startswith(prefix) for h in stored.block_hashes)


def test_hash_styles_normalize():
    assert normalize_hash(-1) == normalize_hash(2**64 - 1) == "u:ffffffffffffffff"
    assert normalize_hash(-(2**63)) == normalize_hash(2**63) == "u:8000000000000000"
    assert normalize_hash(5) == "u:0000000000000005"
    digest = hashlib.sha256(b"x").digest()
    assert normalize_hash(digest) == "b:" + digest.hex()
    assert normalize_hash(b"\x01") == "b:01"
    for bad in (b"", b"\x00" * 65, "abc", 1.5, True, None, 2**64, -(2**63) - 1):
        with pytest.raises(InvalidArgument):
            normalize_hash(bad)


def test_i64_and_u64_of_one_hash_decode_equal():
    u = VllmEventEncoder(hash_style="u64", block_size=BS, seed=b"k" * 16)
    i = VllmEventEncoder(hash_style="i64", block_size=BS, seed=b"k" * 16)
    tokens = list(range(20 * BS))
    wire_u = [u.wire_hash(d) for d in u.digests(tokens)]
    wire_i = [i.wire_hash(d) for d in i.digests(tokens)]
    assert any(h < 0 for h in wire_i), "some i64 hashes must be negative for this test"
    assert wire_u != wire_i
    a = decode_batch(u.batch([u.stored_event(tokens)]))
    b = decode_batch(i.batch([i.stored_event(tokens)]))
    assert a.events == b.events


def test_missing_trailing_fields_take_defaults():
    hashes, tokens = [7], list(range(BS))
    payload = _pack(
        [
            1.0,
            [
                ["BlockStored", hashes, None, tokens, BS],
                {"type": "BlockStored", "block_hashes": [8], "token_ids": tokens, "block_size": BS},
                ["BlockRemoved", hashes],
                {"type": "BlockRemoved", "block_hashes": [8]},
                ["AllBlocksCleared"],
                {"type": "AllBlocksCleared"},
            ],
        ]
    )
    batch = decode_batch(payload)
    assert batch.errors == [] and batch.dp_rank is None and batch.ts == 1.0
    s1, s2, r1, r2, c1, c2 = batch.events
    assert s1 == EngineBlockStored(
        ("u:0000000000000007",), None, tuple(tokens), BS, CacheTier.HBM, None, None
    )
    assert s2.parent is None and s2.tier is CacheTier.HBM and s2.group_idx is None
    assert r1 == EngineBlockRemoved(("u:0000000000000007",), CacheTier.HBM)
    assert r2.tier is CacheTier.HBM
    assert c1 == c2 == EngineAllCleared()


def test_fields_a_newer_engine_appends_are_ignored():
    tokens = list(range(BS))
    array_event = ["BlockStored", [1], None, tokens, BS, None, "GPU", None, None, 0, "full", None]
    array_event += ["future-field", {"x": 1}]
    map_event = {"type": "BlockRemoved", "block_hashes": [1], "future": [1, 2]}
    batch = decode_batch(
        _pack([0.0, [array_event, ["BlockRemoved", [1], None, 0, "x"], map_event], 0, "more"])
    )
    assert batch.errors == [] and len(batch.events) == 3


def test_positional_batch_without_rank_and_with_null_rank():
    assert decode_batch(_pack([2.0, []])).dp_rank is None
    assert decode_batch(_pack([2.0, [], None])).dp_rank is None
    assert decode_batch(_pack({"ts": 2.0, "events": []})).dp_rank is None
    assert decode_batch(_pack({"events": []})).ts is None


def test_all_fields_present_including_vllm_spec_metadata():
    tokens = list(range(2 * BS))
    event = ["BlockStored", [1, 2], 99, tokens, BS, 3, "DISK", "lora-b"]
    event += [[["lora-b", "acme"], ["lora-b"]], 1, "sliding_window", 128]
    batch = decode_batch(_pack([0.5, [event], 0]))
    assert batch.errors == []
    (ev,) = batch.events
    assert ev.parent == "u:0000000000000063" and ev.tier is CacheTier.LOCAL_SSD
    assert (ev.lora_name, ev.cache_salt, ev.group_idx) == ("lora-b", "acme", 1)


def test_sglang_map_with_cache_salt_and_attn_dp_rank():
    tokens = list(range(2 * BS))
    sglang_event = {
        "type": "BlockStored",
        "block_hashes": [-5, 6],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "CPU_PINNED",
        "cache_salt": "acme",
        "session_id": "sess-1",
    }
    removed = {"type": "BlockRemoved", "block_hashes": [6], "medium": "EXTERNAL"}
    batch = decode_batch(_pack({"ts": 3.25, "events": [sglang_event, removed], "attn_dp_rank": 2}))
    assert batch.errors == [] and batch.dp_rank == 2 and batch.ts == 3.25
    stored, gone = batch.events
    assert stored.block_hashes == ("u:fffffffffffffffb", "u:0000000000000006")
    assert stored.cache_salt == "acme" and stored.tier is CacheTier.CPU_DRAM
    assert gone.tier is CacheTier.OBJECT_STORE


@pytest.mark.parametrize(
    ("extra_keys", "lora_name", "salt"),
    [
        (None, None, None),
        ([], None, None),
        ([None, None], None, None),
        ([["acme"], None], None, "acme"),
        ([["lora-a", "acme"], ["lora-a"]], "lora-a", "acme"),
        ([["lora-a"], ["lora-a"]], "lora-a", None),
        # The salt may equal the LoRA name: only a leading LoRA name is skipped.
        ([["same", "same"]], "same", "same"),
        # Multimodal keys are arrays (identifier, offset); embedding digests are bytes.
        ([[["mm-hash-1", 0], "acme"], None], None, "acme"),
        ([["lora-a", ["mm-hash-1", 0], ["mm-hash-2", 5], "acme"]], "lora-a", "acme"),
        ([[["mm-hash-1", 0]]], None, None),
        ([["acme", b"\x01" * 32]], None, "acme"),
        ([["lora-a", ["mm", 0], "acme", b"\x02" * 32]], "lora-a", "acme"),
        # Only the first block's entry can hold the salt.
        ([None, ["acme"]], None, None),
        ([[""]], None, None),
    ],
)
def test_salt_extraction_from_extra_keys(extra_keys, lora_name, salt):
    tokens = list(range(2 * BS))
    event = ["BlockStored", [1, 2], None, tokens, BS, None, "GPU", lora_name, extra_keys]
    batch = decode_batch(_pack([0.0, [event]]))
    assert batch.errors == []
    assert batch.events[0].cache_salt == salt
    assert batch.events[0].lora_name == lora_name


def test_sglang_array_events_carry_the_salt_in_their_metadata_map():
    """SGLang's array form: [tag, hashes, parent, tokens, block_size, lora_id, medium]
    and, for a salted request, a metadata map {"cache_salt": ...} after medium; its
    batch is [ts, events, attn_dp_rank]."""
    tokens = list(range(3 * BS))
    salted = [
        "BlockStored",
        [7, 8],
        None,
        tokens[: 2 * BS],
        BS,
        None,
        "GPU",
        {"cache_salt": "acme"},
    ]
    plain = ["BlockStored", [9], 8, tokens[2 * BS :], BS, None, "CPU_PINNED"]
    payload = _pack([1.5, [salted, plain], 3])
    batch = decode_batch(payload)
    assert batch.errors == [] and batch.dp_rank == 3
    first, second = batch.events
    assert (first.cache_salt, first.lora_name, first.tier) == ("acme", None, CacheTier.HBM)
    assert (second.cache_salt, second.tier) == (None, CacheTier.CPU_DRAM)
    _assert_bulk_matches(payload)
    # The map form may carry the same metadata by name.
    mapped = {"type": "BlockStored", "block_hashes": [1], "token_ids": tokens[:BS]}
    mapped |= {"block_size": BS, "metadata": {"cache_salt": "globex"}}
    assert decode_batch(_pack([0.0, [mapped]])).events[0].cache_salt == "globex"
    bad = [*salted[:7], {"cache_salt": 5}]
    errors = decode_batch(_pack([0.0, [bad]])).errors
    assert [(e.index, e.reason) for e in errors] == [(0, "bad_cache_salt")]
    _assert_bulk_matches(_pack([0.0, [bad, plain]]))


def test_sglang_cache_salt_field_wins_over_extra_keys():
    event = {
        "type": "BlockStored",
        "block_hashes": [1],
        "token_ids": list(range(BS)),
        "block_size": BS,
        "extra_keys": [["other"]],
        "cache_salt": "acme",
    }
    assert decode_batch(_pack([0.0, [event]])).events[0].cache_salt == "acme"


def _stored_values(**overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": list(range(2 * BS)),
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    values.update(overrides)
    return values


_BAD_EVENTS: list[tuple[str, Any, str]] = [
    ("scalar", 42, "bad_type"),
    ("string", "BlockStored", "bad_type"),
    ("empty array", [], "bad_type"),
    ("int tag", [5, [1]], "bad_type"),
    ("map without type", {"block_hashes": [1]}, "bad_type"),
    ("unknown tag", ["BlockTeleported", [1]], "unknown_event"),
    ("unknown map tag", {"type": "KVCacheCreated"}, "unknown_event"),
    ("too few fields", ["BlockStored", [1], None], "missing_field"),
    (
        "map lacks tokens",
        {"type": "BlockStored", "block_hashes": [1], "block_size": 4},
        "missing_field",
    ),
    ("removed lacks hashes", ["BlockRemoved"], "missing_field"),
    ("hash is text", _stored_values(block_hashes=[1, "x"]), "bad_hash"),
    ("hashes not array", _stored_values(block_hashes=7), "bad_hash"),
    ("empty bytes hash", _stored_values(block_hashes=[b"", 1]), "bad_hash"),
    ("65-byte hash", _stored_values(block_hashes=[b"\x00" * 65, 1]), "bad_hash"),
    ("float hash", _stored_values(block_hashes=[1.0, 2]), "bad_hash"),
    ("bool hash", _stored_values(block_hashes=[True, 2]), "bad_hash"),
    ("parent is text", _stored_values(parent_block_hash="p"), "bad_hash"),
    ("no blocks", _stored_values(block_hashes=[], token_ids=[]), "no_blocks"),
    ("negative token", _stored_values(token_ids=[-1] + list(range(2 * BS - 1))), "bad_tokens"),
    ("token 2**32", _stored_values(token_ids=[2**32] + list(range(2 * BS - 1))), "bad_tokens"),
    ("float token", _stored_values(token_ids=[1.5] + list(range(2 * BS - 1))), "bad_tokens"),
    ("bool token", _stored_values(token_ids=[True] + list(range(2 * BS - 1))), "bad_tokens"),
    ("tokens not array", _stored_values(token_ids="abc"), "bad_tokens"),
    ("block size 0", _stored_values(block_size=0), "bad_block_size"),
    ("block size negative", _stored_values(block_size=-4), "bad_block_size"),
    ("block size text", _stored_values(block_size="4"), "bad_block_size"),
    ("partial block", _stored_values(token_ids=list(range(2 * BS - 1))), "token_count_mismatch"),
    ("extra tokens", _stored_values(token_ids=list(range(3 * BS))), "token_count_mismatch"),
    ("unknown medium", _stored_values(medium="TAPE"), "bad_medium"),
    ("medium not text", _stored_values(medium=3), "bad_medium"),
    ("lora name not text", _stored_values(lora_name=5), "bad_lora_name"),
    ("extra keys not array", _stored_values(extra_keys="salt"), "bad_extra_keys"),
    ("group not int", _stored_values(group_idx="g"), "bad_group_idx"),
]


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize(
    ("bad", "reason"), [(b, r) for _, b, r in _BAD_EVENTS], ids=[n for n, _, _ in _BAD_EVENTS]
)
def test_a_bad_event_is_reported_and_the_others_decode(encoding, bad, reason):
    if isinstance(bad, dict) and "block_hashes" in bad and "type" not in bad and len(bad) > 1:
        bad = encode_event("BlockStored", bad, encoding)  # a field-level defect, both forms
    good_before = encode_event("BlockStored", _stored_values(), encoding)
    good_after = encode_event("BlockRemoved", {"block_hashes": [11], "medium": "GPU"}, encoding)
    payload = encode_batch([good_before, bad, good_after], encoding, ts=1.0)
    batch = decode_batch(payload)
    assert [(e.index, e.reason) for e in batch.errors] == [(1, reason)]
    assert batch.errors[0].detail
    assert batch.positions == [0, 2]
    assert isinstance(batch.events[0], EngineBlockStored)
    assert isinstance(batch.events[1], EngineBlockRemoved)


def test_removed_with_bad_fields():
    payload = _pack(
        [
            0.0,
            [
                ["BlockRemoved", "x"],
                ["BlockRemoved", [1], "TAPE"],
                ["BlockRemoved", [1], None, 1.5],
            ],
        ]
    )
    batch = decode_batch(payload)
    assert [(e.index, e.reason) for e in batch.errors] == [
        (0, "bad_hash"),
        (1, "bad_medium"),
        (2, "bad_group_idx"),
    ]
    assert batch.events == []


def test_sglang_bad_cache_salt():
    event = dict(_stored_values(), type="BlockStored", cache_salt=5)
    batch = decode_batch(_pack([0.0, [event]]))
    assert [e.reason for e in batch.errors] == ["bad_cache_salt"]


def test_batch_level_field_errors_keep_the_events():
    event = ["AllBlocksCleared"]
    batch = decode_batch(_pack(["yesterday", [event], "rank-0"]))
    assert batch.ts is None and batch.dp_rank is None
    assert [(e.index, e.reason) for e in batch.errors] == [(-1, "bad_ts"), (-1, "bad_dp_rank")]
    assert batch.events == [EngineAllCleared()]
    assert decode_batch(_pack([True, []])).errors[0].reason == "bad_ts"


@pytest.mark.parametrize("ts", [float("nan"), float("inf"), float("-inf"), 1e300, -1e17])
def test_a_ts_that_is_no_time_is_reported_and_the_events_still_apply(ts):
    enc = VllmEventEncoder(block_size=BS, seed=b"n" * 16)
    payload = encode_batch([enc.stored_event(PROMPT)], "array", ts=ts)
    bulk = _assert_bulk_matches(payload)
    assert bulk.ts is None and [(e.index, e.reason) for e in bulk.errors] == [(-1, "bad_ts")]
    assert bulk.event_count == 1


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "not_msgpack"),
        (b"\xc1", "not_msgpack"),
        (b"\x92\x01", "not_msgpack"),  # truncated array
        (msgpack.packb([1.0, []]) + b"\x00", "not_msgpack"),  # trailing bytes
        (b"\x92\xa1\xff\x90", "not_msgpack"),  # invalid UTF-8 in a str
        (msgpack.packb(5), "not_a_batch"),
        (msgpack.packb("batch"), "not_a_batch"),
        (msgpack.packb(None), "not_a_batch"),
        (msgpack.packb([]), "not_a_batch"),
        (msgpack.packb([1.0]), "not_a_batch"),
        (msgpack.packb([1.0, 5]), "not_a_batch"),
        (msgpack.packb([1.0, {"type": "AllBlocksCleared"}]), "not_a_batch"),
        (msgpack.packb({"ts": 1.0}), "not_a_batch"),
        (msgpack.packb({"ts": 1.0, "events": None}), "not_a_batch"),
    ],
)
def test_wire_errors(payload, reason):
    with pytest.raises(WireError) as info:
        decode_batch(payload)
    assert info.value.reason == reason and info.value.detail
    assert isinstance(info.value, InvalidArgument)


# --- the decoder never raises anything but WireError ----------------------------------

_TAGS = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "GPU"])
_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.integers(min_value=-3, max_value=40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6)
    | st.binary(max_size=70)
    | _TAGS
)
_KEYS = (
    st.sampled_from([*STORED_FIELDS, "type", "ts", "events", "cache_salt"])
    | st.text(max_size=4)
    | st.integers(-2, 2)
)
_VALUES = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(_KEYS, inner, max_size=6),
    max_leaves=30,
)
_ARRAY_EVENTS = st.builds(lambda tag, rest: [tag, *rest], _TAGS, st.lists(_VALUES, max_size=12))
_MAP_EVENTS = st.builds(
    lambda tag, rest: {"type": tag, **rest},
    _TAGS,
    st.dictionaries(
        st.sampled_from(STORED_FIELDS + ("cache_salt", "metadata")), _VALUES, max_size=11
    ),
)
_EVENTS = st.lists(_ARRAY_EVENTS | _MAP_EVENTS | _VALUES, max_size=5)
_BATCHES = (
    st.builds(lambda ts, ev, rank: [ts, ev, rank], _VALUES, _EVENTS, _VALUES)
    | st.builds(lambda ts, ev: [ts, ev], _VALUES, _EVENTS)
    | st.builds(
        lambda ts, ev, rank, key: {"ts": ts, "events": ev, key: rank},
        _VALUES,
        _EVENTS,
        _VALUES,
        st.sampled_from(["data_parallel_rank", "attn_dp_rank", "other"]),
    )
    | _VALUES
)


def _decode_or_wire_error(payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except WireError as exc:
        with pytest.raises(WireError) as bulk_exc:
            decode_bulk(payload)
        assert bulk_exc.value.reason == exc.reason
        return
    _assert_bulk_matches(payload, batch)
    assert isinstance(batch, DecodedBatch)
    assert len(batch.positions) == len(batch.events)
    for event in batch.events:
        assert isinstance(event, EngineBlockStored | EngineBlockRemoved | EngineAllCleared)
    for error in batch.errors:
        assert error.reason and error.reason != "bad_event", error


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_BATCHES)
def test_decoder_never_raises_on_structures(obj):
    _decode_or_wire_error(msgpack.packb(obj, use_bin_type=True))


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_decoder_never_raises_on_bytes(payload):
    _decode_or_wire_error(payload)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=40), st.integers(min_value=0, max_value=200))
def test_decoder_never_raises_on_mangled_valid_payloads(noise, where):
    enc = VllmEventEncoder(block_size=BS, seed=b"m" * 16)
    payload = enc.batch([enc.stored_event(LONGER, salt="acme"), enc.cleared_event()])
    where %= len(payload)
    _decode_or_wire_error(payload[:where] + noise + payload[where + len(noise) :])


# --- decode_bulk: the conductor's fast path decodes exactly what decode_batch does -------


def _assert_bulk_matches(payload: bytes, reference: DecodedBatch | None = None) -> BulkBatch:
    reference = reference if reference is not None else decode_batch(payload)
    bulk = decode_bulk(payload)
    assert isinstance(bulk, BulkBatch)
    assert (bulk.ts, bulk.dp_rank) == (reference.ts, reference.dp_rank)
    assert bulk.errors == reference.errors
    assert bulk.positions == reference.positions
    assert bulk.event_count == len(reference.events)
    assert bulk.events == reference.events
    return bulk


@pytest.mark.parametrize("hash_style", HASH_STYLES)
@pytest.mark.parametrize("batch_encoding", ENCODINGS)
@pytest.mark.parametrize("event_encoding", ENCODINGS)
def test_bulk_decodes_every_encoding_like_the_reference(event_encoding, batch_encoding, hash_style):
    enc = VllmEventEncoder(
        encoding=event_encoding, hash_style=hash_style, block_size=BS, seed=b"s" * 16
    )
    events = [
        enc.stored_event(PROMPT, salt="acme", lora="lora-a"),
        enc.stored_event(LONGER, salt="acme", lora="lora-a", medium="CPU"),
        enc.removed_event(LONGER, salt="acme", lora="lora-a", last=1),
        enc.cleared_event(),
        enc.malformed_event(),
    ]
    _assert_bulk_matches(encode_batch(events, batch_encoding, ts=12.5, dp_rank=3))


@pytest.mark.parametrize("hash_style", HASH_STYLES)
def test_bulk_decodes_a_chain_of_one_block_events_column_by_column(hash_style):
    """The shape the benchmark sends: one event per block, each chained to the last."""
    enc = VllmEventEncoder(hash_style=hash_style, block_size=BS, seed=b"c" * 16)
    tokens = list(range(1000, 1000 + 40 * BS))
    events = [enc.stored_event(tokens[: (n + 1) * BS], salt="acme") for n in range(40)]
    run = decode_bulk(enc.batch(events)).run
    bulk = _assert_bulk_matches(enc.batch(events))
    keys = [op[2][0] for op in bulk.ops]
    assert [op[3] for op in bulk.ops[1:]] == keys[:-1]
    assert bulk.tokens == b"".join(t.to_bytes(4, "little") for t in tokens)
    # The whole batch is one chain: the translator gets it as one StoredRun.
    assert run is not None and bulk.run == run
    assert (run.keys, run.parent, run.events) == (keys, None, 40)
    assert (run.block_size, run.tier, run.group_idx) == (BS, CacheTier.HBM, None)
    assert (run.lora_name, run.cache_salt) == (None, "acme")


def _chain_events(**changes: Any) -> list[Any]:
    """Four chained one-block array-form events; `changes` maps an event number to a
    (field, value) it gets instead."""
    enc = VllmEventEncoder(block_size=BS, seed=b"r" * 16)
    tokens = list(range(2000, 2000 + 4 * BS))
    events = [enc.stored_event(tokens[: (n + 1) * BS]) for n in range(4)]
    for n, (name, value) in changes.items():
        events[int(n[1:])][1 + STORED_FIELDS.index(name)] = value
    return events


@pytest.mark.parametrize(
    "changes",
    [
        {"e2": ("parent_block_hash", None)},  # a second root
        {"e2": ("parent_block_hash", 12345)},  # a parent from elsewhere
        {"e3": ("medium", "CPU")},  # another tier
        {"e1": ("parent_block_hash", 1.5)},  # not a hash: the event is rejected
    ],
)
def test_a_batch_that_is_not_one_chain_of_one_shape_has_no_run(changes):
    payload = _pack([0.5, _chain_events(**changes)])
    assert decode_bulk(payload).run is None
    _assert_bulk_matches(payload)


def test_a_run_chained_from_a_known_parent_keeps_it():
    events = _chain_events()[1:]
    payload = _pack([0.5, events])
    run = decode_bulk(payload).run
    assert run is not None and run.parent == events[0][2] and run.events == 3
    _assert_bulk_matches(payload)


def test_engine_keys_round_trip():
    for text in ("u:0000000000000007", "u:ffffffffffffffff", "b:" + "ab" * 32, "s:opaque"):
        assert engine_hash(engine_key(text)) == text
    assert engine_key(normalize_hash(-1)) == engine_key(normalize_hash(2**64 - 1)) == 2**64 - 1


def _column_value(name: str) -> Any:
    """Values one field of an array-form BlockStored takes: mostly valid, sometimes not."""
    valid = {
        "parent": st.none() | st.integers(0, 5),
        "medium": st.sampled_from([None, "GPU", "CPU", "DISK"]),
        "lora": st.sampled_from([None, "lora-a"]),
        "extra": st.sampled_from([None, [["acme"]], [["lora-a", "acme"]], [None]]),
        "group": st.sampled_from([None, 0, 1]),
    }[name]
    invalid = st.sampled_from(["", "TAPE", 1.5, True, -1, [1], b"x", 2**32])
    return st.one_of(valid, valid, valid, invalid)


@st.composite
def _uniform_stored_batches(draw: st.DrawFn) -> bytes:
    """Array-form BlockStored events of one width (the columnar path), mostly valid."""
    width = draw(st.integers(5, 12))
    events = []
    for _ in range(draw(st.integers(1, 6))):
        blocks = draw(st.integers(0, 3))
        size = draw(st.sampled_from([BS, BS, 2, 0]))
        hashes = draw(
            st.lists(st.integers(-(2**63), 2**64 - 1), min_size=blocks, max_size=blocks)
            | st.lists(st.binary(min_size=32, max_size=32), min_size=blocks, max_size=blocks)
            | st.lists(st.sampled_from([1, True, "h", b""]), min_size=blocks, max_size=blocks)
        )
        count = blocks * size + draw(st.sampled_from([0, 0, 0, 1]))
        tokens = draw(
            st.lists(st.integers(0, 2**32 - 1), min_size=count, max_size=count)
            | st.lists(st.sampled_from([0, 1, True, -1, 2**32, 7]), min_size=count, max_size=count)
        )
        event = ["BlockStored", hashes, draw(_column_value("parent")), tokens, size, None]
        event += [draw(_column_value(name)) for name in ("medium", "lora", "extra", "group")]
        event += [None, None]
        events.append(event[:width])
    return msgpack.packb([1.0, events, 0], use_bin_type=True)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_uniform_stored_batches())
def test_bulk_matches_the_reference_on_uniform_stored_batches(payload):
    _assert_bulk_matches(payload)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_ARRAY_EVENTS | _MAP_EVENTS, max_size=6))
def test_bulk_matches_the_reference_on_mixed_events(events):
    _assert_bulk_matches(msgpack.packb([0.5, events], use_bin_type=True))


# --- the typed decoders (kv_schema): the first try for a batch of BlockStored only ----


@st.composite
def _stored_batches_any_form(draw: st.DrawFn) -> bytes:
    """BlockStored-only batches in every batch and event form, mostly valid, so most
    take the typed decoders and the rest show they fall back to the same result."""
    map_events = draw(st.booleans())
    map_batch = draw(st.booleans())
    events: list[Any] = []
    parent: Any = draw(st.none() | st.integers(0, 5))
    for _ in range(draw(st.integers(1, 5))):
        blocks = draw(st.sampled_from([1, 1, 2, 0]))
        size = draw(st.sampled_from([BS, BS, 2, 0]))
        hashes = draw(
            st.lists(st.integers(-(2**63), 2**64 - 1), min_size=blocks, max_size=blocks)
            | st.lists(st.binary(min_size=1, max_size=65), min_size=blocks, max_size=blocks)
        )
        count = blocks * size + draw(st.sampled_from([0, 0, 0, 1]))
        tokens = draw(
            st.lists(st.integers(0, 2**32 - 1), min_size=count, max_size=count)
            | st.lists(st.sampled_from([0, 1, 7, True, -1, 2**32]), min_size=count, max_size=count)
        )
        fields = {
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": size,
            "lora_id": draw(st.none() | st.integers(0, 3) | st.text(max_size=2)),
            "medium": draw(_column_value("medium")),
            "lora_name": draw(_column_value("lora")),
            "extra_keys": draw(_column_value("extra")),
            "group_idx": draw(_column_value("group")),
        }
        if hashes and draw(st.integers(0, 3)):  # mostly one chain
            parent = hashes[-1]
        if map_events:
            event: Any = {"type": "BlockStored"}
            event.update((k, v) for k, v in fields.items() if v is not None or draw(st.booleans()))
            salt = draw(st.sampled_from([None, None, "acme", "", 5]))
            if salt is not None:
                event["cache_salt"] = salt
            metadata = draw(st.sampled_from([None, None, {"cache_salt": "globex"}, {"x": 1}]))
            if metadata is not None:
                event["metadata"] = metadata
        else:
            event = ["BlockStored", *fields.values()][: draw(st.integers(5, 10))]
        events.append(event)
    ts = draw(st.sampled_from([1.5, 3, None, True, "x"]))
    rank = draw(st.sampled_from([None, 0, 2, "r"]))
    if map_batch:
        key = draw(st.sampled_from(["data_parallel_rank", "attn_dp_rank"]))
        return msgpack.packb({"ts": ts, "events": events, key: rank}, use_bin_type=True)
    return msgpack.packb([ts, events, rank], use_bin_type=True)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_stored_batches_any_form())
def test_bulk_matches_the_reference_on_stored_batches_of_every_form(payload):
    _assert_bulk_matches(payload)


@pytest.mark.parametrize("batch_encoding", ENCODINGS)
@pytest.mark.parametrize("event_encoding", ENCODINGS)
def test_valid_stored_batches_take_the_typed_decoders(event_encoding, batch_encoding):
    """The fast path is live for every form a publisher sends: vLLM's array and map
    forms, SGLang's cache_salt and attn_dp_rank."""
    enc = VllmEventEncoder(encoding=event_encoding, block_size=BS, seed=b"t" * 16)
    tokens = list(range(500, 500 + 6 * BS))
    events = [enc.stored_event(tokens[: (n + 1) * BS], salt="acme") for n in range(6)]
    payload = encode_batch(events, batch_encoding, ts=2.0, dp_rank=1)
    decoded = stored_columns(payload)
    assert decoded is not None
    ts, rank, columns, map_form = decoded
    assert (ts, rank, map_form) == (2.0, 1, event_encoding == "map")
    bulk = _assert_bulk_matches(payload)
    assert bulk.run is not None and bulk.run.events == 6 and bulk.run.cache_salt == "acme"
    sglang = {"ts": 1.0, "attn_dp_rank": 4, "events": [
        {"type": "BlockStored", "block_hashes": [9], "token_ids": list(range(BS)),
         "block_size": BS, "medium": "CPU_PINNED", "cache_salt": "globex", "session_id": "s"}
    ]}  # fmt: skip
    assert stored_columns(_pack(sglang)) is not None
    bulk = _assert_bulk_matches(_pack(sglang))
    assert (bulk.dp_rank, bulk.run.cache_salt) == (4, "globex")


@pytest.mark.parametrize(
    "change",
    [
        ("token_ids", [True] * BS),  # a bool is no token id
        ("token_ids", [2**32] * BS),
        ("block_size", 0),
        ("block_hashes", [1.5]),
        ("medium", 7),
        ("lora_name", ""),  # "" means absent: the general decoder's rule
        ("group_idx", True),
    ],
)
def test_a_value_the_typed_decoders_refuse_goes_the_general_way(change):
    name, value = change
    events = _chain_events()
    events[2] += [None] * (1 + len(STORED_FIELDS) - len(events[2]))
    events[2][1 + STORED_FIELDS.index(name)] = value
    payload = _pack([0.5, events])
    assert _typed_bulk(payload) is None
    _assert_bulk_matches(payload)


def test_the_typed_array_form_reads_vllms_field_order():
    assert _StoredArray.__struct_fields__ == STORED_FIELDS
