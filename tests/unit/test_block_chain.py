"""A prompt's block chain: one value for its digests, one function for its keys."""

from __future__ import annotations

import pytest

from quillcache_core.errors import InvalidArgument
from quillcache_core.identity.chain import BlockChain, chain_keys
from quillcache_core.identity.hashing import ROOT_PARENT, RecentChains
from quillcache_core.identity.keys import block_identity
from quillcache_core.model import KvBlockKey

pytestmark = pytest.mark.unit

IDENTITY = block_identity("m", "tok", cache_salt="s")
TOKENS = list(range(16 * 40 + 5))


def test_each_key_names_the_previous_block_as_its_parent():
    hashes = ["a" * 32, "b" * 32, "c" * 32]
    keys = chain_keys(IDENTITY.scope(), hashes, parent="p" * 32, first_index=7, token_count=8)
    assert keys == [
        KvBlockKey("m", "tok", None, "s", "p" * 32, "a" * 32, 7, 8),
        KvBlockKey("m", "tok", None, "s", "a" * 32, "b" * 32, 8, 8),
        KvBlockKey("m", "tok", None, "s", "b" * 32, "c" * 32, 9, 8),
    ]
    # A sender's explicit columns (a peer replica's) are taken as they are.
    given = chain_keys(("m", "tok", None, "s"), hashes[:2], parents=["x", "y"], indexes=[3, 9],
                       token_counts=[16, 4])  # fmt: skip
    assert [(k.prefix_hash, k.block_index, k.token_count) for k in given] == [
        ("x", 3, 16),
        ("y", 9, 4),
    ]
    assert chain_keys(IDENTITY.scope(), []) == []


def test_a_chain_of_tokens_is_the_identitys_own_hashing_with_or_without_the_memo():
    chain, hashes = BlockChain.of_tokens(IDENTITY, TOKENS, 16)
    assert len(chain) == 40 and hashes == IDENTITY.hashes(TOKENS, 16) == chain.hashes()
    assert chain.keys() == IDENTITY.keys(TOKENS, 16)
    assert chain.keys()[0].prefix_hash == ROOT_PARENT
    recent = RecentChains(key_blocks=4)
    for _ in range(2):  # the second time the opening comes from the memo
        again, memo_hashes = BlockChain.of_tokens(IDENTITY, TOKENS, 16, recent)
        assert again == chain and memo_hashes == hashes


def test_a_chain_refuses_digests_cut_short_and_empty_blocks():
    with pytest.raises(InvalidArgument, match="multiple of 16"):
        BlockChain(IDENTITY.scope(), 16, b"\0" * 17)
    with pytest.raises(InvalidArgument, match="block_tokens"):
        BlockChain(IDENTITY.scope(), 0, b"")
