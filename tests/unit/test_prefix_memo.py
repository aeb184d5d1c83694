"""PrefixMemo: the kept sequence sharing the most whole chunks of a new one's opening."""

from __future__ import annotations

import random

import pytest

from quillcache_core.identity.prefix_memo import PrefixMemo


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1000)}" for _ in range(n))


def test_a_conversation_finds_its_own_last_turn_among_many_with_the_same_opening():
    rng = random.Random(3)
    memo = PrefixMemo(size=64, chunk=64)
    system = _words(rng, 300)  # every conversation of the tenant opens with it
    turns = {c: system + _words(rng, 80) for c in range(20)}
    for c, text in turns.items():
        memo.put("tenant", memo.keys("tenant", text), text, c)
    for c, text in turns.items():
        nxt = text + _words(rng, 40)
        serial, seq, payload = memo.find("tenant", memo.keys("tenant", nxt))
        assert payload == c and seq == text
        memo.put("tenant", memo.keys("tenant", nxt), nxt, c, replaces=serial)
        turns[c] = nxt
    assert len(memo) == 20  # each next turn replaced the turn it extends


def test_no_match_across_scopes_or_without_a_whole_chunk():
    memo = PrefixMemo(size=8, chunk=16)
    text = "x" * 100
    memo.put("a", memo.keys("a", text), text, 1)
    assert memo.find("b", memo.keys("b", text)) is None
    assert memo.keys("a", "x" * 15) == []
    assert memo.find("a", memo.keys("a", "y" + text)) is None
    assert memo.find("a", memo.keys("a", text[:40] + "z"))[2] == 1


def test_a_key_of_another_scope_is_never_taken_even_on_a_hash_collision():
    memo = PrefixMemo(size=8, chunk=16)
    text = "x" * 100
    keys = memo.keys("a", text)
    memo.put("a", keys, text, 1)
    # "b" presenting exactly a's keys (a collision of the two chains) still gets nothing.
    assert memo.find("b", keys) is None
    assert memo.find("a", keys)[2] == 1


def test_bounded_and_an_evicted_sequence_is_never_proposed():
    memo = PrefixMemo(size=3, chunk=8)
    texts = [f"{i:08d}" + "common-tail-" * 4 for i in range(10)]
    for i, text in enumerate(texts):
        memo.put("s", memo.keys("s", text), text, i)
    assert len(memo) == 3
    for i, text in enumerate(texts):
        found = memo.find("s", memo.keys("s", text))
        assert (found is not None) == (i >= 7)
        if found:
            assert found[2] == i
    with pytest.raises(ValueError):
        PrefixMemo(size=3, chunk=0)
