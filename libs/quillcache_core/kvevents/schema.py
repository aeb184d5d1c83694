"""Typed decoders (msgspec) for the commonest KV-event batch: BlockStored events only.

Pure: no sockets, no clock. msgspec checks every type and range while it decodes,
in C (a token id is an int in [0, 2**32), never a bool; a block size is a positive
int; a hash is an int or bytes; optional fields are None or their type), so a batch
that passes needs no per-value checks in Python. Anything else (another event
type, a missing field, one bad value anywhere) fails here and the caller decodes
the batch the general way, which reports each bad event; nothing is decided here.

Both batch forms (positional array, map) and both event forms (tag-first array,
map with "type") are accepted, in the field order of `fields.STORED_FIELDS`;
fields appended after the known ones are ignored, missing trailing ones default to
None, as the general decoder does.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, TypeVar

import msgspec
from msgspec.structs import astuple

__all__ = [
    "CACHE_SALT",
    "EXTRA_KEYS",
    "GROUP",
    "HASHES",
    "LORA_NAME",
    "MEDIUM",
    "METADATA",
    "PARENT",
    "SIZE",
    "TOKENS",
    "stored_columns",
]

_TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
_BlockSize = Annotated[int, msgspec.Meta(gt=0)]
_Hash = int | bytes  # a msgpack int is always within i64 or u64
_Event = TypeVar("_Event")


class _Stored(msgspec.Struct, kw_only=True, gc=False):
    """BlockStored's fields in the order of fields.STORED_FIELDS, the columns'
    order (see stored_columns). In the array form the first four are required, so
    parent_block_hash's default never applies there."""

    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None = None
    token_ids: list[_TokenId]
    block_size: _BlockSize
    lora_id: Any = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _StoredArray(_Stored, tag="BlockStored", array_like=True, kw_only=True):
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: Any = None
    # Elements a newer engine appends after these are ignored.


class _StoredMap(_Stored, tag="BlockStored", tag_field="type", kw_only=True):
    cache_salt: str | None = None  # SGLang's field; the array form has none
    metadata: Any = None  # SGLang's salt map: the caller leaves such events to the general path


class _ArrayBatch(msgspec.Struct, Generic[_Event], array_like=True, gc=False):
    ts: float | None
    events: list[_Event]
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct, Generic[_Event], gc=False):
    events: list[_Event]
    ts: float | None = None
    data_parallel_rank: int | None = None
    attn_dp_rank: int | None = None  # SGLang's name


# Tried in this order for each batch form: the event form that comes with it first.
_DECODERS = {
    "array": tuple(
        msgspec.msgpack.Decoder(_ArrayBatch[event]) for event in (_StoredArray, _StoredMap)
    ),
    "map": tuple(msgspec.msgpack.Decoder(_MapBatch[event]) for event in (_StoredMap, _StoredArray)),
}


def _form(first: int) -> str | None:
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        return "array"
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return "map"
    return None


# The columns of stored_columns: every event's value of one field.
HASHES, PARENT, TOKENS, SIZE = range(4)
MEDIUM, LORA_NAME, EXTRA_KEYS, GROUP, CACHE_SALT, METADATA = range(5, 11)


def stored_columns(
    payload: bytes,
) -> tuple[float | None, int | None, list[tuple[Any, ...]], bool] | None:
    """(ts, data-parallel rank, columns, map form) of a batch of one or more events,
    each a valid BlockStored, else None.

    `columns[HASHES][i]` is event i's block_hashes, and so on (the constants above);
    `columns[CACHE_SALT]` and `columns[METADATA]` are only there in the map form (the
    flag says which).
    """
    if not payload:
        return None
    form = _form(payload[0])
    if form is None:
        return None
    for decoder in _DECODERS[form]:
        try:
            batch = decoder.decode(payload)
        except Exception:  # noqa: BLE001 - a bad value, bad UTF-8, bad msgpack: the
            continue  # general decoder reads it again and reports what is wrong
        events = batch.events
        if not events:
            return None
        rank = batch.data_parallel_rank
        if rank is None and form == "map":
            rank = batch.attn_dp_rank
        columns = list(zip(*map(astuple, events)))  # noqa: B905 - one Struct type
        return batch.ts, rank, columns, type(events[0]) is _StoredMap
    return None
