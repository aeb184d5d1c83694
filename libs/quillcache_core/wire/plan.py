"""The compact forms of a Plan on the wire: packed block hashes and action runs.

A 128-block prompt as 128 `BlockRef` messages costs the conductor one message object
and one string per block to read; as `packed_hashes` it is one bytes field. Likewise
a reply with `action_runs` says "blocks 0-63 are hits on e1, 64-127 are recomputed"
in two actions instead of 128.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from quillcache_core.errors import InvalidArgument

HASH_BYTES = 16
_HEX = HASH_BYTES * 2


def pack_hashes(hashes: Sequence[str]) -> bytes:
    """Hex block hashes (32 characters each) as one run of 16-byte digests."""
    try:
        packed = bytes.fromhex("".join(hashes))
    except ValueError as exc:
        raise InvalidArgument(f"block hashes must be hex: {exc}") from None
    if len(packed) != HASH_BYTES * len(hashes):
        raise InvalidArgument(f"block hashes must be {_HEX} hex characters each")
    return packed


def digest_count(packed: bytes) -> int:
    """How many digests `packed` holds; InvalidArgument if it is not whole 16-byte
    digests."""
    if len(packed) % HASH_BYTES:
        raise InvalidArgument(
            f"packed_hashes holds {len(packed)} bytes, not a multiple of {HASH_BYTES}"
        )
    return len(packed) // HASH_BYTES


def unpack_hashes(packed: bytes) -> list[str]:
    """The hex hashes of `packed`; InvalidArgument if it is not whole 16-byte digests."""
    digest_count(packed)
    # hex() puts a space between digests; split() cuts there, all in C.
    return packed.hex(" ", HASH_BYTES).split()


def expand_runs(actions) -> Iterator[tuple[int, object]]:
    """(block index, action) for every block a reply's actions cover, runs or not."""
    for action in actions:
        for offset in range(action.block_count or 1):
            yield action.block_index + offset, action
