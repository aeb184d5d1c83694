"""The general decoder: one vLLM/SGLang KV-event payload (msgpack) into normalized events.

Pure: no sockets, no clock. `decode_batch(payload)` accepts every encoding seen in the
wild (vLLM's publisher, `vllm/distributed/kv_events.py`, and SGLang's):

- the batch as a positional array `[ts, events, data_parallel_rank?]` or as a map
  `{"ts", "events", "data_parallel_rank" | "attn_dp_rank"}`;
- each event as a tagged array (tag first, trailing defaulted fields omitted) or as a
  tagged map (`{"type": "BlockStored", ...}`), vLLM's or SGLang's fields;
- block hashes as u64, i64 (same bits, two's complement) or bytes (1..64 long).

Only a payload that is not msgpack, or not a batch at all, raises WireError. Anything
wrong inside one event becomes an EventError for that event; the batch's other events
still decode. Batch-level oddities (a non-numeric `ts`, a non-integer rank) are
reported as EventErrors with index -1 and the field set to None.

The conductor's hot path (`bulk_decode.decode_bulk`) falls back to this decoder for
every event it does not take itself, so both accept and reject exactly the same things.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

from quillcache_core.errors import InvalidArgument
from quillcache_core.kvevents.events import (
    _I64_MIN,
    _MAX_HASH_BYTES,
    _TOKEN_END,
    _U64_END,
    _U64_MASK,
    DecodedBatch,
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEvent,
    EventError,
    WireError,
)
from quillcache_core.kvevents.fields import REMOVED_FIELDS, STORED_FIELDS
from quillcache_core.model import CacheTier


class _Reject(Exception):
    """Internal: one event is bad. Never escapes this module."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def normalize_hash(value: Any) -> str:
    """Canonical string of an engine block hash; raises InvalidArgument if it is not one.

    An i64 and the u64 with the same bits give the same string.
    """
    try:
        return _hash(value, "hash")
    except _Reject as exc:
        raise InvalidArgument(exc.detail) from None


def _hash(value: Any, what: str) -> str:
    kind = type(value)
    if kind is int:
        if _I64_MIN <= value < _U64_END:
            return f"u:{value & _U64_MASK:016x}"
        raise _Reject("bad_hash", f"{what} out of 64-bit range: {value}")
    if kind is bytes:
        if 0 < len(value) <= _MAX_HASH_BYTES:
            return "b:" + value.hex()
        raise _Reject("bad_hash", f"{what} is {len(value)} bytes (1..{_MAX_HASH_BYTES})")
    raise _Reject("bad_hash", f"{what} is not an int or bytes: {_short(value)}")


def _hashes(value: Any) -> tuple[str, ...]:
    if type(value) is not list:
        raise _Reject("bad_hash", f"block_hashes is not an array: {_short(value)}")
    # The common shape (all plain ints, in range) takes one pass in C for the check.
    if (
        value
        and set(map(type, value)) == {int}
        and min(value) >= _I64_MIN
        and max(value) < _U64_END
    ):
        mask = _U64_MASK
        return tuple([f"u:{h & mask:016x}" for h in value])
    return tuple([_hash(h, f"block_hashes[{i}]") for i, h in enumerate(value)])


def _tokens(value: Any) -> tuple[int, ...]:
    if type(value) is not list:
        raise _Reject("bad_tokens", f"token_ids is not an array: {_short(value)}")
    if not value:
        return ()
    if set(map(type, value)) != {int}:  # excludes bool, float, str, ...
        bad = next(t for t in value if type(t) is not int)
        raise _Reject("bad_tokens", f"token id is not an int: {_short(bad)}")
    low, high = min(value), max(value)
    if low < 0 or high >= _TOKEN_END:
        raise _Reject("bad_tokens", f"token id out of [0, 2**32): {low if low < 0 else high}")
    return tuple(value)


_TIER_CACHE: dict[str | None, CacheTier] = {None: CacheTier.HBM}
for _medium in ("GPU", "CPU", "CPU_PINNED", "DISK", "EXTERNAL"):
    _TIER_CACHE[_medium] = CacheTier.parse(_medium)


def _tier(value: Any) -> CacheTier:
    if value is None:
        return CacheTier.HBM
    if type(value) is not str:
        raise _Reject("bad_medium", f"medium is not a string: {_short(value)}")
    tier = _TIER_CACHE.get(value)
    if tier is None:
        try:
            tier = CacheTier.parse(value)
        except InvalidArgument:
            raise _Reject("bad_medium", f"unknown medium {_short(value)}") from None
        if len(_TIER_CACHE) < 256:
            _TIER_CACHE[value] = tier
    return tier


def _opt_str(value: Any, reason: str, what: str) -> str | None:
    if value is None or type(value) is str:
        return value or None  # "" means absent, as in vLLM (a falsy salt is not used)
    raise _Reject(reason, f"{what} is not a string: {_short(value)}")


def _opt_int(value: Any, reason: str, what: str) -> int | None:
    if value is None or type(value) is int:
        return value
    raise _Reject(reason, f"{what} is not an integer: {_short(value)}")


def _salt_from_extra_keys(extra_keys: Any, lora_name: str | None) -> str | None:
    """The cache salt in vLLM's per-block extra keys, or None.

    vLLM builds each block's entry as LoRA keys + multimodal keys + [cache_salt] (first
    block only) + prompt-embedding digests. Multimodal keys are arrays and embedding
    digests are bytes, so the salt is the last string after a leading LoRA name.
    """
    if extra_keys is None:
        return None
    if type(extra_keys) is not list:
        raise _Reject("bad_extra_keys", f"extra_keys is not an array: {_short(extra_keys)}")
    if not extra_keys:
        return None
    first = extra_keys[0]
    if type(first) is not list or not first:
        return None
    start = 1 if lora_name is not None and first[0] == lora_name else 0
    for item in reversed(first[start:]):
        if type(item) is str:
            return item or None
    return None


def _fields(event: Any, index: int, names: tuple[str, ...], required: int) -> list[Any]:
    """The event's fields in `names` order, missing optional ones as None."""
    if type(event) is list:
        # Fields a newer engine appends after the ones we know are ignored.
        values = event[1 : len(names) + 1]
        if len(values) < required:
            missing = names[len(values)]
            raise _Reject("missing_field", f"{event[0]} lacks {missing} (array form)")
        if len(values) < len(names):
            values = values + [None] * (len(names) - len(values))
        return values
    for name in names[:required]:
        if name not in event and name != "parent_block_hash":
            raise _Reject("missing_field", f"{event.get('type')} lacks {name} (map form)")
    get = event.get
    return [get(name) for name in names]


def _stored(event: Any, index: int) -> EngineBlockStored:
    (
        raw_hashes,
        raw_parent,
        raw_tokens,
        block_size,
        _lora_id,
        medium,
        lora_name,
        extra_keys,
        group_idx,
        _kind,
        _window,
    ) = _fields(event, index, STORED_FIELDS, 4)
    hashes = _hashes(raw_hashes)
    if not hashes:
        raise _Reject("no_blocks", "BlockStored with no block hashes")
    parent = None if raw_parent is None else _hash(raw_parent, "parent_block_hash")
    tokens = _tokens(raw_tokens)
    if type(block_size) is not int or block_size <= 0:
        raise _Reject("bad_block_size", f"block_size must be a positive int: {_short(block_size)}")
    if len(tokens) != len(hashes) * block_size:
        raise _Reject(
            "token_count_mismatch",
            f"{len(tokens)} tokens for {len(hashes)} blocks of {block_size}",
        )
    tier = _tier(medium)
    metadata = None
    if type(lora_name) is dict:
        # SGLang's BlockStoredWithMetadata: its metadata map ({"cache_salt": ...})
        # follows `medium`, where vLLM's array form has lora_name.
        metadata, lora_name = lora_name, None
    elif type(event) is dict and type(event.get("metadata")) is dict:
        metadata = event["metadata"]
    lora = _opt_str(lora_name, "bad_lora_name", "lora_name")
    salt = None
    if type(event) is dict:
        salt = _opt_str(event.get("cache_salt"), "bad_cache_salt", "cache_salt")
    if salt is None and metadata is not None:
        salt = _opt_str(metadata.get("cache_salt"), "bad_cache_salt", "metadata.cache_salt")
    extra_salt = _salt_from_extra_keys(extra_keys, lora)
    if salt is None:
        salt = extra_salt
    group = _opt_int(group_idx, "bad_group_idx", "group_idx")
    return EngineBlockStored(hashes, parent, tokens, block_size, tier, lora, salt, group)


def _removed(event: Any, index: int) -> EngineBlockRemoved:
    raw_hashes, medium, group_idx = _fields(event, index, REMOVED_FIELDS, 1)
    hashes = _hashes(raw_hashes)
    group = _opt_int(group_idx, "bad_group_idx", "group_idx")
    return EngineBlockRemoved(hashes, _tier(medium), group)


_ALL_CLEARED = EngineAllCleared()


def _cleared(event: Any, index: int) -> EngineAllCleared:
    return _ALL_CLEARED


_DECODERS = {
    "BlockStored": _stored,
    "BlockRemoved": _removed,
    "AllBlocksCleared": _cleared,
}


def _event(event: Any, index: int) -> EngineEvent:
    kind = type(event)
    if kind is list:
        if not event:
            raise _Reject("bad_type", "empty event array")
        tag = event[0]
    elif kind is dict:
        if "type" not in event:
            raise _Reject("bad_type", "event map has no 'type' tag")
        tag = event["type"]
    else:
        raise _Reject("bad_type", f"event is neither an array nor a map: {_short(event)}")
    if type(tag) is not str:
        raise _Reject("bad_type", f"event tag is not a string: {_short(tag)}")
    decoder = _DECODERS.get(tag)
    if decoder is None:
        raise _Reject("unknown_event", f"unknown event type {_short(tag)}")
    return decoder(event, index)


def decode_events(raw_events: list[Any], out: DecodedBatch) -> None:
    """Decode already-unpacked events into `out.events`, errors into `out.errors`."""
    events = out.events
    errors = out.errors
    positions = out.positions
    for index, raw in enumerate(raw_events):
        try:
            events.append(_event(raw, index))
            positions.append(index)
        except _Reject as exc:
            errors.append(EventError(index, exc.reason, exc.detail))
        except Exception as exc:  # defensive: a decoder bug must not drop the batch
            errors.append(EventError(index, "bad_event", f"{type(exc).__name__}: {exc}"))


def _unpack(payload: bytes) -> tuple[Any, list[Any], Any]:
    """(ts, raw events, rank) of a batch payload, unchecked but the events array."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise WireError("not_msgpack", f"{type(exc).__name__}: {exc}") from None
    kind = type(obj)
    if kind is list:
        if len(obj) < 2:
            raise WireError("not_a_batch", f"batch array has {len(obj)} fields, need ts and events")
        ts, raw_events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    elif kind is dict:
        if "events" not in obj:
            raise WireError("not_a_batch", "batch map has no 'events'")
        ts, raw_events = obj.get("ts"), obj["events"]
        rank = obj.get("data_parallel_rank")
        if rank is None:
            rank = obj.get("attn_dp_rank")
    else:
        raise WireError("not_a_batch", f"payload is a {kind.__name__}, not an array or map")
    if type(raw_events) is not list:
        raise WireError("not_a_batch", f"events is not an array: {_short(raw_events)}")
    return ts, raw_events, rank


# A batch's ts in seconds must be finite and, as milliseconds, an exact int64 (an
# index record's last_access_ms): +-2**53 ms, about 285,000 years either way.
_TS_LIMIT_S = 2.0**53 / 1000


def _ts_ok(ts: float) -> bool:
    return math.isfinite(ts) and -_TS_LIMIT_S < ts < _TS_LIMIT_S


def _batch_fields(ts: Any, rank: Any, errors: list[EventError]) -> tuple[float | None, int | None]:
    """The batch's ts and rank, each None (and reported in `errors`) if malformed."""
    out_ts = out_rank = None
    if type(ts) in (float, int):
        out_ts = float(ts)
        if not _ts_ok(out_ts):
            errors.append(EventError(-1, "bad_ts", f"ts is no time in seconds: {ts}"))
            out_ts = None
    elif ts is not None:
        errors.append(EventError(-1, "bad_ts", f"ts is not a number: {_short(ts)}"))
    if type(rank) is int:
        out_rank = rank
    elif rank is not None:
        errors.append(EventError(-1, "bad_dp_rank", f"rank is not an int: {_short(rank)}"))
    return out_ts, out_rank


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one msgpack payload; raises WireError only if it is not a batch at all."""
    ts, raw_events, rank = _unpack(payload)
    out = DecodedBatch(ts=None, dp_rank=None)
    out.ts, out.dp_rank = _batch_fields(ts, rank, out.errors)
    decode_events(raw_events, out)
    return out
