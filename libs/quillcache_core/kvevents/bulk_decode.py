"""`decode_bulk(payload)`: the conductor's hot path, a payload straight into a `BulkBatch`.

The same events, errors and positions as `decode.decode_batch`. A batch of valid
BlockStored events only (the common one) is read by typed msgspec decoders
(`schema`) that check every value while decoding; any other batch, and any batch
they refuse, takes the columnar route: the type and range checks run once per batch
in C (`set(map(type, ..))`, `min`, `max`, `array("I", ..)`). Any event that is not in
the common valid shape, and any batch whose bulk checks fail, goes through the
per-event decoder, so both functions accept and reject exactly the same things (a
property test holds them equal).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import accumulate, chain, repeat
from operator import mul
from typing import Any

import numpy as np

from quillcache_core.kvevents.bulk import (
    _BIG_ENDIAN,
    OP_CLEARED,
    OP_REMOVED,
    OP_STORED,
    BulkBatch,
    StoredRun,
    _Columnar,
    _first,
    _last,
    _Made,
    _op_from_event,
    _Ops,
    _pack_tokens,
    _run_of,
    _umin,
)
from quillcache_core.kvevents.decode import (
    _TIER_CACHE,
    _batch_fields,
    _event,
    _Reject,
    _salt_from_extra_keys,
    _ts_ok,
    _unpack,
    decode_events,
)
from quillcache_core.kvevents.events import (
    _I64_MIN,
    _MAX_HASH_BYTES,
    _U64_END,
    _U64_MASK,
    DecodedBatch,
    EventError,
)
from quillcache_core.kvevents.schema import (
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
from quillcache_core.model import CacheTier


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
    decoders (`schema`), or None if the payload is anything else or holds any value
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
