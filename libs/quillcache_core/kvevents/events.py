"""Normalized engine KV events: what every decoder turns vLLM's and SGLang's wire into.

Engine hashes are opaque and become canonical strings: `"u:<16 hex>"` for integers,
`"b:<hex>"` for bytes. `medium` becomes a CacheTier (missing means GPU, i.e. HBM).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quillcache_core.errors import InvalidArgument
from quillcache_core.model import CacheTier

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
