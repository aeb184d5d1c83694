"""A decoded batch as compact ops (`BulkBatch`), the conductor's form of a batch.

Engine hashes stay machine values (`EngineKey`: the u64 as an int, bytes as bytes),
every stored event's token ids are packed once per batch into one little-endian u32
buffer, and a batch whose events all continue one chain with one shape (vLLM reporting
a growing sequence) also comes as a `StoredRun`, which the translator applies in one
step; its per-event ops are then built only if something asks for them.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np

from quillcache_core.errors import InvalidArgument
from quillcache_core.kvevents.decode import _ALL_CLEARED
from quillcache_core.kvevents.events import (
    DecodedBatch,
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEvent,
    EventError,
)
from quillcache_core.model import CacheTier

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

    def stored_sizes(self) -> set[int]:
        """The block sizes of the batch's stored events (from the run, if the ops are not
        built yet)."""
        if self._ops is None and self.run is not None:
            return {self.run.block_size}
        return {op[4] for op in self.ops if op[0] == OP_STORED}

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


# --- engines whose blocks are larger than the index's -----------------------------------

_SUB_SHIFT = 64  # an int engine key is a u64: derived keys live above it


def sub_key(key: EngineKey, part: int) -> EngineKey:
    """The key of sub-block `part` (every one but the last) of a split engine block.

    Never equal to an engine's own key: an int gets bits above the u64 range, bytes and
    strings a separator and the part number.
    """
    if type(key) is int:
        return key | ((part + 1) << _SUB_SHIFT)
    if type(key) is bytes:
        return key + b"#" + part.to_bytes(2, "big")
    return f"{key}#{part}"


def split_keys(keys: Sequence[EngineKey], parts: int) -> list[EngineKey]:
    """Each engine block's key as `parts` sub-block keys; the last keeps the engine's key,
    so a later event naming the block as its parent continues from its last sub-block."""
    if parts == 1:
        return list(keys)
    out: list[EngineKey] = []
    for key in keys:
        out.extend(sub_key(key, part) for part in range(parts - 1))
        out.append(key)
    return out


def split_blocks(batch: BulkBatch, block_tokens: int, engine_block_tokens: int) -> BulkBatch:
    """The batch in blocks of `block_tokens` tokens, the index's unit.

    An engine block of k * block_tokens tokens (vLLM on CPU keeps 32-token blocks) becomes
    k chained sub-blocks with keys from `split_keys`; the token ids stay where they are.
    BlockRemoved names no size, so its keys are split by `engine_block_tokens` (the
    engine's block size; 0 or `block_tokens` leaves them). A stored block whose size is
    not a positive multiple of `block_tokens` becomes an error ("block_size") and the
    rest of the batch still applies. A batch that needs nothing is returned as it is.
    """
    removed_parts = max(1, engine_block_tokens // block_tokens) if engine_block_tokens else 1
    # A run is stored events only: it has no removals to split.
    if batch.stored_sizes() <= {block_tokens} and (
        removed_parts == 1 or batch.run is not None or all(op[0] != OP_REMOVED for op in batch.ops)
    ):
        return batch
    ops = batch.ops
    errors = list(batch.errors)
    out: list[tuple[Any, ...]] = []
    for op in ops:
        kind = op[0]
        if kind == OP_STORED:
            _, index, keys, parent, size, tier, group, lora, salt, start = op
            if size <= 0 or size % block_tokens:
                errors.append(
                    EventError(
                        index,
                        "block_size",
                        f"engine block of {size} tokens is not a multiple of the index's "
                        f"{block_tokens}",
                    )
                )
                continue
            parts = size // block_tokens
            out.append(
                (
                    OP_STORED,
                    index,
                    split_keys(keys, parts),
                    parent,
                    block_tokens,
                    tier,
                    group,
                    lora,
                    salt,
                    start,
                )
            )
        elif kind == OP_REMOVED:
            out.append((OP_REMOVED, op[1], split_keys(op[2], removed_parts), *op[3:]))
        else:
            out.append(op)
    return BulkBatch(batch.ts, batch.dp_rank, out, batch.tokens, errors, run=_run_of(out))
