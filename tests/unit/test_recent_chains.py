"""RecentChains: a prompt opening like a recent one reuses its hashes for the shared whole
blocks; every answer equals block_hashes (and its packed form)."""

from __future__ import annotations

import random

import pytest

from quillcache_core.errors import InvalidArgument
from quillcache_core.identity.hashing import (
    RecentChains,
    block_hashes,
    identity_digest,
)
from quillcache_core.identity.prefix_memo import common_prefix
from quillcache_core.wire.plan import pack_hashes

pytestmark = pytest.mark.unit

A = identity_digest("m", "t", None, "tenant-a")
B = identity_digest("m", "t", None, "tenant-b")


def test_equal_to_block_hashes_whatever_the_prompts_share():
    rng = random.Random(19)
    chains = RecentChains(size=4, key_blocks=4, chunk_bytes=128)
    base = [rng.randrange(32000) for _ in range(16 * 40)]
    for _ in range(300):
        cut = rng.randrange(0, len(base) + 1)
        tokens = base[:cut] + [rng.randrange(32000) for _ in range(rng.randrange(0, 200))]
        if rng.random() < 0.3:
            base = tokens
        identity = A if rng.random() < 0.8 else B
        size = 16 if rng.random() < 0.9 else 8
        hashes, packed = chains.hashes(tokens, size, identity)
        assert hashes == block_hashes(tokens, size, identity)
        assert packed == pack_hashes(hashes)


def test_another_identity_never_takes_the_hashes():
    chains = RecentChains(size=4, key_blocks=2, chunk_bytes=64)
    tokens = list(range(16 * 10))
    first, _ = chains.hashes(tokens, 16, A)
    second, _ = chains.hashes(tokens, 16, B)
    assert second == block_hashes(tokens, 16, B) != first


def test_bounded_and_short_prompts_not_kept():
    chains = RecentChains(size=2, key_blocks=2, chunk_bytes=64)
    chains.hashes(list(range(16 * 2)), 16, A)  # not more than key_blocks blocks
    assert not chains._recent
    for i in range(5):
        chains.hashes([i] + list(range(16 * 5)), 16, A)
    assert len(chains._recent) == 2
    with pytest.raises(InvalidArgument):
        chains.hashes([1, 2], 0, A)


def test_common_prefix_of_bytes_and_str():
    rng = random.Random(7)
    for _ in range(200):
        a = bytes(rng.randrange(3) for _ in range(rng.randrange(0, 50)))
        b = a[: rng.randrange(0, len(a) + 1)] + bytes(rng.randrange(3) for _ in range(5))
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix(a, b) == n
        assert common_prefix(a.decode("latin-1"), b.decode("latin-1")) == n
