"""Decode one vLLM/SGLang KV-event payload (msgpack) into normalized engine events.

Pure: no sockets, no clock. `decode_batch(payload)` accepts every encoding seen in the
wild (see ANCHORS.md, "vLLM KV events on the wire"):

- the batch as a positional array `[ts, events, data_parallel_rank?]` or as a map
  `{"ts", "events", "data_parallel_rank" | "attn_dp_rank"}`;
- each event as a tagged array (tag first, trailing defaulted fields omitted) or as a
  tagged map (`{"type": "BlockStored", ...}`), vLLM's or SGLang's fields;
- block hashes as u64, i64 (same bits, two's complement) or bytes (1..64 long).

Engine hashes are opaque and become canonical strings: `"u:<16 hex>"` for integers,
`"b:<hex>"` for bytes. `medium` becomes a CacheTier (missing means GPU, i.e. HBM).

Only a payload that is not msgpack, or not a batch at all, raises WireError. Anything
wrong inside one event becomes an EventError for that event; the batch's other events
still decode. Batch-level oddities (a non-numeric `ts`, a non-integer rank) are
reported as EventErrors with index -1 and the field set to None.

`decode_bulk(payload)` is the conductor's hot path: the same events, errors and
positions, as a `BulkBatch` of compact ops instead of one object per event. A batch
of valid BlockStored events only (the common one) is read by typed msgspec decoders
(`kv_schema`) that check every value while decoding; any other batch, and any batch
they refuse, takes the route below. Engine
hashes stay machine values (`EngineKey`: the u64 as an int, bytes as bytes), every
stored event's token ids are packed once per batch into one little-endian u32
buffer, and the type and range checks run once per batch in C (`set(map(type, ..))`,
`min`, `max`, `array("I", ..)`). Any event that is not in the common valid shape, and
any batch whose bulk checks fail, goes through the per-event decoder above, so both
functions accept and reject exactly the same things (a property test holds them
equal). A batch whose events all continue one chain with one shape (vLLM reporting a
growing sequence) also comes as a `StoredRun`, which the translator applies in one
step; its per-event ops are then built only if something asks for them.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, repeat
from operator import itemgetter, mul
from typing import Any

import msgpack
import numpy as np

from quillcache_conductor.kv_schema import (
    CACHE_SALT,
    EXTRA_KEYS,
    GROUP,
    HASHES,
    LORA_NAME,
    MEDIUM,
    METADATA,
    PARENT,
    SIZE,
    TOKENS,
    stored_columns,
)
from quillcache_core.errors import InvalidArgument
from quillcache_core.model import CacheTier
from quillcache_core.vllm_events import REMOVED_FIELDS, STORED_FIELDS

__all__ = [
    "OP_CLEARED",
    "OP_INVALID",
    "OP_REMOVED",
    "OP_STORED",
    "BulkBatch",
    "StoredRun",
    "stored_shape",
    "DecodedBatch",
    "EngineKey",
    "EngineAllCleared",
    "EngineBlockRemoved",
    "EngineBlockStored",
    "EngineEvent",
    "EventError",
    "WireError",
    "bulk_from_events",
    "decode_batch",
    "decode_bulk",
    "decode_events",
    "engine_hash",
    "engine_key",
    "normalize_hash",
]

_U64_MASK = (1 << 64) - 1
_I64_MIN = -(1 << 63)
_U64_END = 1 << 64
_TOKEN_END = 1 << 32
_MAX_HASH_BYTES = 64


class WireError(InvalidArgument):
    """The payload is not msgpack, or not a KV-event batch at all."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class EventError:
    """One rejected event: its position in the batch (-1: the batch itself) and why."""

    index: int
    reason: str
    detail: str


@dataclass(frozen=True, slots=True)
class EngineBlockStored:
    """Full blocks newly cached by the engine, chained from `parent` (None: a root).

    `cache_salt` is the request's salt when the event reported one (SGLang's field, or
    the first block's vLLM `extra_keys` entry). `group_idx` is vLLM's KV-cache group.
    """

    block_hashes: tuple[str, ...]
    parent: str | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: CacheTier
    lora_name: str | None
    cache_salt: str | None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class EngineBlockRemoved:
    block_hashes: tuple[str, ...]
    tier: CacheTier
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class EngineAllCleared:
    pass


EngineEvent = EngineBlockStored | EngineBlockRemoved | EngineAllCleared


@dataclass(slots=True)
class DecodedBatch:
    ts: float | None
    dp_rank: int | None
    events: list[EngineEvent] = field(default_factory=list)
    errors: list[EventError] = field(default_factory=list)
    # The wire index (position in the payload's event array) of each decoded event.
    positions: list[int] = field(default_factory=list)


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


# --- bulk decoding: the conductor's hot path ---------------------------------------------

# An engine hash as a dict key: a u64 hash as its unsigned int, a bytes hash as the bytes,
# an opaque string (gRPC events, "s:...") as itself. The three never compare equal.
EngineKey = int | bytes | str

# A BulkBatch's ops are plain tuples (built in bulk, C-level), first the kind, then the
# event's position in the payload:
#   (OP_STORED, index, keys, parent, block_size, tier, group_idx, lora_name, cache_salt,
#    token_start)  - `keys` a list of EngineKey, `parent` an EngineKey or None; the
#                    event's token ids are the block_size * len(keys) ids of the batch's
#                    packed buffer from id `token_start` on
#   (OP_REMOVED, index, keys, tier, group_idx)
#   (OP_CLEARED, index)
#   (OP_INVALID, index, detail)   - bulk_from_events only: an object that is no event
# Consecutive stored ops' token ids are consecutive in the buffer.
OP_STORED, OP_REMOVED, OP_CLEARED, OP_INVALID = 0, 1, 2, 3

_BIG_ENDIAN = sys.byteorder == "big"
_umin = np.minimum.reduce  # np.min without its Python-level wrapper
_last = itemgetter(-1)
_first = itemgetter(0)
# A stored op's kind, keys, parent and (block_size, tier, group_idx): events that
# continue one chain in one run have the same shape.
_kind_of = itemgetter(0)
_keys_of = itemgetter(2)
_parent_of = itemgetter(3)
stored_shape = itemgetter(4, 5, 6)


def engine_key(engine_hash: str) -> EngineKey:
    """The EngineKey of a canonical engine-hash string ("u:<hex>", "b:<hex>" or opaque)."""
    tag = engine_hash[:2]
    try:
        if tag == "u:":
            return int(engine_hash[2:], 16)
        if tag == "b:":
            return bytes.fromhex(engine_hash[2:])
    except ValueError:
        pass
    return engine_hash


def engine_hash(key: EngineKey) -> str:
    """The canonical string of an EngineKey (the inverse of engine_key)."""
    if type(key) is int:
        return f"u:{key:016x}"
    if type(key) is bytes:
        return "b:" + key.hex()
    return key


def _pack_tokens(flat: list[int]) -> bytes:
    packed = array("I", flat)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _unpack_tokens(packed: bytes, start: int, count: int) -> tuple[int, ...]:
    ids = array("I")
    ids.frombytes(packed[start * 4 : (start + count) * 4])
    if _BIG_ENDIAN:
        ids.byteswap()
    return tuple(ids.tolist())


@dataclass(frozen=True, slots=True)
class StoredRun:
    """A batch whose events are all BlockStored, each continuing the previous one's
    chain with the same block size, tier and group: vLLM reporting a growing sequence,
    which the translator applies in one step.

    Later events inherit the identity through the chain, so only the first event's
    parent, LoRA name and salt are kept. The blocks' token ids are the batch's whole
    packed buffer, in order.
    """

    keys: list[EngineKey]  # every block's engine key, in chain order
    parent: EngineKey | None  # the first event's parent
    block_size: int
    tier: CacheTier
    group_idx: int | None
    lora_name: str | None
    cache_salt: str | None
    events: int


class BulkBatch:
    """A decoded batch as ops in wire order (tuples, layout above).

    `tokens` packs every stored op's token ids as little-endian u32. When the whole
    batch is one chain (`run` is set), the ops are built only if asked for. `events`
    and `positions` materialize the same events decode_batch returns (on first
    access), so a BulkBatch reads like a DecodedBatch.
    """

    __slots__ = ("ts", "dp_rank", "tokens", "errors", "run", "_ops", "_make_ops", "_events")

    def __init__(
        self,
        ts: float | None,
        dp_rank: int | None,
        ops: list[tuple[Any, ...]] | None = None,
        tokens: bytes = b"",
        errors: list[EventError] | None = None,
        *,
        run: StoredRun | None = None,
        make_ops: Callable[[], list[tuple[Any, ...]]] | None = None,
    ) -> None:
        self.ts = ts
        self.dp_rank = dp_rank
        self.tokens = tokens
        self.errors = [] if errors is None else errors
        self.run = run
        if make_ops is None:
            self._ops: list[tuple[Any, ...]] | None = [] if ops is None else ops
        else:
            self._ops = None
        self._make_ops: Callable[[], list[tuple[Any, ...]]] = make_ops or list
        self._events: list[EngineEvent] | None = None

    def __repr__(self) -> str:
        return (
            f"BulkBatch(ts={self.ts!r}, dp_rank={self.dp_rank!r}, events={self.event_count}, "
            f"errors={self.errors!r}, run={self.run is not None})"
        )

    @property
    def ops(self) -> list[tuple[Any, ...]]:
        if self._ops is None:
            self._ops = self._make_ops()
            self._make_ops = list
        return self._ops

    @property
    def event_count(self) -> int:
        return self.run.events if self._ops is None and self.run is not None else len(self.ops)

    @property
    def positions(self) -> list[int]:
        return [op[1] for op in self.ops]

    @property
    def events(self) -> list[EngineEvent]:
        if self._events is None:
            self._events = [self._event(op) for op in self.ops]
        return self._events

    def _event(self, op: tuple[Any, ...]) -> EngineEvent:
        if op[0] == OP_STORED:
            _, _, keys, parent, size, tier, group, lora, salt, start = op
            return EngineBlockStored(
                tuple(map(engine_hash, keys)),
                None if parent is None else engine_hash(parent),
                _unpack_tokens(self.tokens, start, len(keys) * size),
                size,
                tier,
                lora,
                salt,
                group,
            )
        if op[0] == OP_REMOVED:
            return EngineBlockRemoved(tuple(map(engine_hash, op[2])), op[3], op[4])
        return _ALL_CLEARED


def _op_from_event(event: Any, index: int, flat: list[int]) -> tuple[Any, ...]:
    """The op of one decoded event; a stored event's token ids go to the end of `flat`."""
    kind = type(event)
    if kind is EngineBlockStored:
        op = (
            OP_STORED,
            index,
            list(map(engine_key, event.block_hashes)),
            None if event.parent is None else engine_key(event.parent),
            event.block_size,
            event.tier,
            event.group_idx,
            event.lora_name,
            event.cache_salt,
            len(flat),
        )
        flat.extend(event.token_ids)
        return op
    if kind is EngineBlockRemoved:
        keys = list(map(engine_key, event.block_hashes))
        return (OP_REMOVED, index, keys, event.tier, event.group_idx)
    if kind is EngineAllCleared:
        return (OP_CLEARED, index)
    return (OP_INVALID, index, kind.__name__)


def bulk_from_events(batch: DecodedBatch) -> BulkBatch:
    """A DecodedBatch's events as ops (for the translator's one apply path).

    Raises InvalidArgument if a stored event's token ids are not all in [0, 2**32).
    """
    flat: list[int] = []
    positions = batch.positions
    ops = [
        _op_from_event(event, positions[i] if i < len(positions) else i, flat)
        for i, event in enumerate(batch.events)
    ]
    try:
        tokens = _pack_tokens(flat)
    except (OverflowError, TypeError) as exc:
        raise InvalidArgument(f"token ids must be integers in [0, 2**32): {exc}") from None
    return BulkBatch(batch.ts, batch.dp_rank, ops, tokens, list(batch.errors), run=_run_of(ops))


def _run_of(ops: list[tuple[Any, ...]]) -> StoredRun | None:
    """The StoredRun of `ops` if they are all stored events forming one chain of one
    shape (checked a column at a time, in C), else None."""
    count = len(ops)
    if not count or list(map(_kind_of, ops)).count(OP_STORED) != count or ops[0][9] != 0:
        return None
    parents = list(map(_parent_of, ops))
    lasts = list(map(_last, map(_keys_of, ops)))
    if parents[1:] != lasts[:-1]:
        return None
    shapes = list(map(stored_shape, ops))
    if shapes.count(shapes[0]) != count:
        return None
    keys = ops[0][2] if count == 1 else list(chain.from_iterable(map(_keys_of, ops)))
    _, _, _, parent, size, tier, group, lora, salt, _ = ops[0]
    return StoredRun(keys, parent, size, tier, group, lora, salt, count)


_Ops = tuple[list[tuple[Any, ...]], bytes, list[EventError]]
# (a function building the ops, the StoredRun if the batch is one)
_Made = tuple[Callable[[], list[tuple[Any, ...]]], StoredRun | None]
_Columnar = tuple[bytes, _Made]  # (packed token ids, _Made)


def _reference_ops(raw_events: list[Any]) -> _Ops:
    """Every event through the per-event decoder (exact errors), as ops."""
    decoded = DecodedBatch(ts=None, dp_rank=None)
    decode_events(raw_events, decoded)
    flat: list[int] = []
    ops = [
        _op_from_event(event, index, flat)
        for event, index in zip(decoded.events, decoded.positions, strict=True)
    ]
    return ops, _pack_tokens(flat), decoded.errors


def _columnar_ops(raw_events: list[Any]) -> _Columnar | None:
    """A batch of array-form BlockStored events of one length, decoded field by field.

    Every check runs over a whole column in C. Returns (the packed token ids, (a
    function building the ops, the StoredRun if the batch is one)), or None if the
    batch is not that shape or any value needs the per-event decoder (a wrong type, an
    empty LoRA name).
    """
    count = len(raw_events)
    if set(map(type, raw_events)) != {list}:
        return None
    width = len(raw_events[0])
    if width < 5:
        return None
    try:
        columns = list(zip(*raw_events, strict=True))
    except ValueError:  # events of different lengths
        return None
    if columns[0].count("BlockStored") != count:
        return None
    hashes, parents, tokens, sizes = columns[1], columns[2], columns[3], columns[4]
    if (
        set(map(type, hashes)) != {list}
        or set(map(type, tokens)) != {list}
        or set(map(type, sizes)) != {int}
        or min(sizes) <= 0
    ):
        return None
    lengths = list(map(len, hashes))
    token_counts = list(map(len, tokens))
    if min(lengths) == 0 or token_counts != list(map(mul, lengths, sizes)):
        return None
    optional = {type(None), str}
    if width > 6:
        try:
            media = set(columns[6])
        except TypeError:  # an unhashable medium
            return None
        # The cache's keys are None and names already parsed: anything else (another
        # type, a name never seen) goes to the per-event decoder.
        if not _TIER_CACHE.keys() >= media:
            return None
        if len(media) == 1:
            tiers: Any = [_TIER_CACHE[next(iter(media))]] * count
        else:
            tiers = list(map(_TIER_CACHE.__getitem__, columns[6]))
    else:
        tiers = [CacheTier.HBM] * count
    loras: Any = None
    if width > 7:
        if not set(map(type, columns[7])) <= optional or "" in columns[7]:
            return None
        loras = columns[7]
    extras: Any = None
    if width > 8:
        extra_types = set(map(type, columns[8]))
        if not extra_types <= {type(None), list}:
            return None
        if list in extra_types:
            extras = columns[8]
    groups: Any = None
    if width > 9:
        if not set(map(type, columns[9])) <= {type(None), int}:
            return None
        groups = columns[9]
    packed = _checked_tokens(_flatten(tokens))
    if packed is None:
        return None
    made = _from_columns(hashes, parents, sizes, token_counts, tiers, loras, extras, groups, None)
    return None if made is None else (packed, made)


def _from_columns(
    hashes: Sequence[list[Any]],
    parents: Sequence[Any],
    sizes: Sequence[int],
    token_counts: list[int],
    tiers: list[CacheTier],
    loras: Sequence[str | None] | None,
    extras: Sequence[Any] | None,
    groups: Sequence[int | None] | None,
    salts: Sequence[str | None] | None,
) -> _Made | None:
    """The ops (and StoredRun) of BlockStored events given column by column, every
    value already of its right type and their token ids packed by the caller; checks
    what spans columns (hash kinds, the chain). `salts` are map-form events' own cache_salt
    fields (None: none has one); a missing salt comes from `extras`."""
    count = len(hashes)
    keys = (
        list(map(_first, hashes))
        if max(map(len, hashes)) == 1
        else list(chain.from_iterable(hashes))
    )
    lasts = keys if len(keys) == count else list(map(_last, hashes))
    # One chain: each event's parent is the previous event's last block. Equal values
    # of one hash type (checked next) are equal hashes, so only the first parent needs
    # its own check.
    one_chain = list(parents[1:]) == lasts[:-1]
    if not one_chain:
        checked = keys + [p for p in parents if p is not None]
    elif parents[0] is not None:
        checked = [*keys, parents[0]]
    else:
        checked = keys
    kind = _hash_kind(checked)
    if kind is None:
        return None
    if one_chain and count > 1:
        # Equal is not enough: 1.0 and True equal 1 but are no hashes.
        if set(map(type, parents[1:])) != {bytes if kind == "bytes" else int}:
            return None
    if kind == "i64":
        hashes = [[h & _U64_MASK for h in ks] for ks in hashes]
        parents = [None if p is None else p & _U64_MASK for p in parents]
        keys = list(chain.from_iterable(hashes))

    def salt_of(position: int) -> str | None:
        own = salts[position] if salts is not None else None
        if own is not None or extras is None or extras[position] is None:
            return own
        return _salt_from_extra_keys(extras[position], loras[position] if loras else None)

    def make_ops() -> list[tuple[Any, ...]]:
        plain = salts is None and extras is None
        return list(
            zip(
                repeat(OP_STORED),
                range(count),
                hashes,
                parents,
                sizes,
                tiers,
                repeat(None, count) if groups is None else groups,
                repeat(None, count) if loras is None else loras,
                repeat(None, count) if plain else map(salt_of, range(count)),
                accumulate(token_counts, initial=0),
            )
        )

    run = None
    if (
        one_chain
        and sizes.count(sizes[0]) == count
        and tiers.count(tiers[0]) == count
        and (groups is None or groups.count(groups[0]) == count)
    ):
        run = StoredRun(
            keys,
            parents[0],
            sizes[0],
            tiers[0],
            None if groups is None else groups[0],
            None if loras is None else loras[0],
            salt_of(0),
            count,
        )
    return make_ops, run


def _flatten(token_lists: Sequence[list[int]]) -> list[int]:
    """Every event's token ids, in order, in one list."""
    flat: list[int] = []
    add = flat.extend
    for ids in token_lists:
        add(ids)
    return flat


def _columnar_batch(
    ts: float | None, rank: int | None, columnar: _Columnar, errors: list[EventError]
) -> BulkBatch:
    packed, (make_ops, run) = columnar
    if run is not None:
        return BulkBatch(ts, rank, None, packed, errors, run=run, make_ops=make_ops)
    return BulkBatch(ts, rank, make_ops(), packed, errors)


def _fast_ops(raw_events: list[Any]) -> _Ops | None:
    """Ops of the events, the common valid shapes decoded inline and checked in bulk.

    Returns None when a bulk check fails (a hash or token id of the wrong type or out
    of range somewhere); the caller then decodes the batch event by event. An event
    in an uncommon shape goes to the per-event decoder right away.
    """
    ops: list[tuple[Any, ...]] = []
    flat: list[int] = []
    errors: list[EventError] = []
    hash_values: list[Any] = []  # every hash and parent of the inline-decoded events
    inline: list[int] = []  # positions in `ops` of the inline-decoded events
    add_op, add_inline, add_hashes = ops.append, inline.append, hash_values.extend
    add_tokens = flat.extend
    tiers = _TIER_CACHE
    for index, event in enumerate(raw_events):
        kind = type(event)
        stored = False
        salt: Any = None
        if kind is list:
            n = len(event)
            tag = event[0] if n else None
            if tag == "BlockStored" and n >= 5:
                stored = True
                hashes, parent, tokens, size = event[1], event[2], event[3], event[4]
                if n >= 10:
                    medium, lora, extra, group = event[6], event[7], event[8], event[9]
                else:
                    medium = event[6] if n > 6 else None
                    lora = event[7] if n > 7 else None
                    extra = event[8] if n > 8 else None
                    group = None
            elif tag == "BlockRemoved" and n >= 2:
                hashes = event[1]
                medium = event[2] if n > 2 else None
                group = event[3] if n > 3 else None
            elif tag == "AllBlocksCleared":
                add_op((OP_CLEARED, index))
                continue
            else:
                _slow_event(event, index, ops, flat, errors)
                continue
        elif kind is dict:
            get = event.get
            tag = get("type")
            hashes = get("block_hashes")
            medium = get("medium")
            group = get("group_idx")
            if tag == "BlockStored" and "metadata" not in event:  # (SGLang's: per event)
                stored = True
                parent = get("parent_block_hash")
                tokens = get("token_ids")
                size = get("block_size")
                lora = get("lora_name")
                extra = get("extra_keys")
                salt = get("cache_salt")
            elif tag != "BlockRemoved" or "block_hashes" not in event:
                _slow_event(event, index, ops, flat, errors)
                continue
        else:
            _slow_event(event, index, ops, flat, errors)
            continue
        # Inline only if every field has its valid type; anything else is decoded (and
        # rejected with its exact reason) event by event.
        tier = tiers.get(medium) if medium is None or type(medium) is str else None
        if tier is None or not (group is None or type(group) is int) or type(hashes) is not list:
            _slow_event(event, index, ops, flat, errors)
            continue
        if not stored:
            add_hashes(hashes)
            add_inline(len(ops))
            add_op((OP_REMOVED, index, hashes, tier, group))
            continue
        if not (
            hashes
            and type(tokens) is list
            and type(size) is int
            and size > 0
            and len(tokens) == len(hashes) * size
            and (lora is None or type(lora) is str)
            and (salt is None or type(salt) is str)
            and (extra is None or type(extra) is list)
            and (parent is None or type(parent) is int or type(parent) is bytes)
        ):
            _slow_event(event, index, ops, flat, errors)
            continue
        lora = lora or None  # "" means absent, as in the per-event decoder
        salt = salt or None
        if extra is not None:
            extra_salt = _salt_from_extra_keys(extra, lora)
            if salt is None:
                salt = extra_salt
        add_hashes(hashes)
        if parent is not None:
            hash_values.append(parent)
        add_inline(len(ops))
        add_op((OP_STORED, index, hashes, parent, size, tier, group, lora, salt, len(flat)))
        add_tokens(tokens)

    kind_of_hashes = _hash_kind(hash_values) if hash_values else "u64"
    if kind_of_hashes is None:
        return None
    packed = _checked_tokens(flat)
    if packed is None:
        return None
    if kind_of_hashes == "i64":
        # i64 hashes: the key is the u64 with the same bits.
        for position in inline:
            op = ops[position]
            keys = [h & _U64_MASK for h in op[2]]
            if op[0] == OP_STORED:
                parent = None if op[3] is None else op[3] & _U64_MASK
                ops[position] = (*op[:2], keys, parent, *op[4:])
            else:
                ops[position] = (*op[:2], keys, *op[3:])
    return ops, packed, errors


def _slow_event(
    event: Any, index: int, ops: list[tuple[Any, ...]], flat: list[int], errors: list[EventError]
) -> None:
    try:
        ops.append(_op_from_event(_event(event, index), index, flat))
    except _Reject as exc:
        errors.append(EventError(index, exc.reason, exc.detail))
    except Exception as exc:  # defensive, as in decode_events
        errors.append(EventError(index, "bad_event", f"{type(exc).__name__}: {exc}"))


def _hash_kind(values: list[Any]) -> str | None:
    """ "u64" or "i64" (all ints, some negative) or "bytes" (all 1..64 bytes long) if
    every value is a hash the per-event decoder accepts, else None."""
    types = set(map(type, values))
    if types == {int}:
        try:
            array("Q", values)  # every value in [0, 2**64): the common case, one C pass
            return "u64"
        except OverflowError:
            pass
        low = min(values)
        if low < _I64_MIN or max(values) >= _U64_END:
            return None
        return "i64" if low < 0 else "u64"
    if types == {bytes}:
        lengths = set(map(len, values))
        return "bytes" if min(lengths) > 0 and max(lengths) <= _MAX_HASH_BYTES else None
    return None


def _checked_tokens(flat: list[int]) -> bytes | None:
    """The ids packed as little-endian u32 if all are ints in [0, 2**32), else None."""
    try:
        packed = array("I", flat)  # rejects floats, strings, None, negatives, >= 2**32
    except (OverflowError, TypeError):
        return None
    # ... but not bools, which pack as 0 and 1: only then look at every type.
    if flat and int(_umin(np.frombuffer(packed, dtype=np.uint32))) <= 1:
        if set(map(type, flat)) != {int}:
            return None
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def decode_bulk(payload: bytes) -> BulkBatch:
    """decode_batch's events, errors and positions as a BulkBatch (see the module doc).

    Raises WireError only if the payload is not a batch at all.
    """
    typed = _typed_bulk(payload)
    if typed is not None:
        return typed
    ts, raw_events, rank = _unpack(payload)
    errors: list[EventError] = []
    out_ts, out_rank = _batch_fields(ts, rank, errors)
    if raw_events:
        columnar = _columnar_ops(raw_events)
        if columnar is not None:
            return _columnar_batch(out_ts, out_rank, columnar, errors)
    result = _fast_ops(raw_events) if raw_events else None
    if result is None:
        result = _reference_ops(raw_events)
    ops, packed, event_errors = result
    errors.extend(event_errors)
    return BulkBatch(out_ts, out_rank, ops, packed, errors, run=_run_of(ops))


def _typed_bulk(payload: bytes) -> BulkBatch | None:
    """The BulkBatch of a valid batch of BlockStored events only, through the typed
    decoders (kv_schema), or None if the payload is anything else or holds any value
    the per-event decoder would reject or treat specially."""
    decoded = stored_columns(payload)
    if decoded is None:
        return None
    ts, rank, columns, map_form = decoded
    if ts is not None and not _ts_ok(ts):
        return None  # reported by the general path
    hashes, tokens, sizes = columns[HASHES], columns[TOKENS], columns[SIZE]
    count = len(hashes)
    lengths = list(map(len, hashes))
    token_counts = list(map(len, tokens))
    if min(lengths) == 0 or token_counts != list(map(mul, lengths, sizes)):
        return None
    media = columns[MEDIUM]
    if media.count(media[0]) == count:
        tier = _TIER_CACHE.get(media[0])
        if tier is None:
            return None
        tiers = [tier] * count
    else:
        tiers = list(map(_TIER_CACHE.get, media))
        if None in tiers:
            return None
    loras: Sequence[str | None] | None = columns[LORA_NAME]
    if loras.count(None) == count:
        loras = None
    elif "" in loras:
        return None
    extras: Sequence[Any] | None = columns[EXTRA_KEYS]
    if extras.count(None) == count:
        extras = None
    groups: Sequence[int | None] | None = columns[GROUP]
    if groups.count(None) == count:
        groups = None
    salts: Sequence[str | None] | None = None
    if map_form:
        if columns[METADATA].count(None) != count:
            return None  # SGLang's metadata map: the general path reads its salt
        salts = columns[CACHE_SALT]
        if salts.count(None) == count:
            salts = None
        elif "" in salts:
            return None
    made = _from_columns(
        hashes, columns[PARENT], sizes, token_counts, tiers, loras, extras, groups, salts
    )
    if made is None:
        return None
    # The decoder checked every token id, so they pack as they are.
    packed = _pack_tokens(_flatten(tokens))
    return _columnar_batch(None if ts is None else float(ts), rank, (packed, made), [])
