"""The DRAM tier with its memory taken up front (`--dram-prefault`): blocks land in the
touched arena, stay correct through reuse and eviction, and a node's memory stays within
its capacity when buffers of another size class push the arena's out."""

from __future__ import annotations

import os
import resource
import time

import pytest

from quillcache_core.model import KvBlockKey
from quillcache_core.storeclient.blockcodec import payload_checksum
from quillcache_store.tiers.dram import DramTier
from quillcache_store.tiers.dram_arena import DramArena

pytestmark = pytest.mark.unit

KIB = 1024
MIB = 1024 * KIB


def key(i: int) -> KvBlockKey:
    return KvBlockKey("m", "tok", None, "acme", f"p{i}", f"b{i}", i, 16)


def ready(tier: DramTier) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = tier.stats()
        if stats["prefault_bytes"] >= stats["capacity"]:
            return stats
        time.sleep(0.01)
    raise AssertionError(f"the arena was not touched in 10 s: {tier.stats()}")


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_blocks_are_stored_in_the_touched_arena_and_read_back_intact():
    tier = DramTier(8 * MIB, prefault=True)
    stats = ready(tier)
    assert stats["prefault_bytes"] == 8 * MIB
    blocks = {i: os.urandom(512 * KIB) for i in range(12)}  # 6 MiB
    for i, data in blocks.items():
        tier.put(key(i), data, payload_checksum(data))
    stats = tier.stats()
    assert stats["prefault_carved_bytes"] == 12 * 512 * KIB  # every buffer from the arena
    for i, data in blocks.items():
        got, _ = tier.get(key(i))
        assert got == data


def test_eviction_reuses_arena_buffers_and_nothing_is_lost_or_mixed():
    tier = DramTier(4 * MIB, prefault=True)
    ready(tier)
    payloads = {}
    for i in range(40):  # 20 MiB through a 4 MiB tier: the coldest evicted
        payloads[i] = bytes([i]) * (512 * KIB)
        tier.put(key(i), payloads[i], payload_checksum(payloads[i]))
    stats = tier.stats()
    assert stats["blocks"] == 8 and stats["evictions"] == 32
    assert stats["prefault_carved_bytes"] == 4 * MIB  # reused after, never carved again
    for i in range(32, 40):
        assert tier.get(key(i))[0] == payloads[i]
    assert tier.get(key(0)) is None


def test_a_new_size_class_gives_the_arena_pages_back():
    tier = DramTier(4 * MIB, prefault=True)
    ready(tier)
    for i in range(8):
        data = b"a" * (512 * KIB)
        tier.put(key(i), data, payload_checksum(data))
    for i in range(8):
        tier.delete(key(i))
    before = rss_bytes()
    big = b"b" * (1 * MIB)
    for i in range(100, 104):  # 1 MiB blocks: the 512 KiB buffers are dropped
        tier.put(key(i), big, payload_checksum(big))
    stats = tier.stats()
    assert stats["prefault_released_bytes"] == 4 * MIB
    assert stats["pool_bytes"] <= stats["capacity"]
    # The fresh 1 MiB buffers took about what the released arena pages gave back.
    assert rss_bytes() - before < 2 * MIB
    for i in range(100, 104):
        assert tier.get(key(i))[0] == big


def test_a_block_larger_than_a_chunk_is_allocated_as_without_the_arena():
    arena = DramArena(2 * MIB, chunk_bytes=1 * MIB)
    assert arena.done.wait(10)
    assert arena.carve(2 * MIB) is None
    first, second = arena.carve(1 * MIB), arena.carve(1 * MIB)
    assert first is not None and second is not None and arena.carve(4 * KIB) is None
    first[:] = b"x" * MIB
    assert bytes(second[:4]) == b"\0\0\0\0"
