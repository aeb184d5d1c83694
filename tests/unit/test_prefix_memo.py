"""PrefixMemo: the kept sequence sharing the most whole chunks of a new one's opening."""

from __future__ import annotations

import random

import pytest

from quillcache_core.identity.prefix_memo import PrefixMemo

pytestmark = pytest.mark.unit


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1000)}" for _ in range(n))


def _keep(memo: PrefixMemo, scope: str, text: str, payload) -> None:
    memo.keep(memo.lookup(scope, text), text, payload)


def test_a_conversation_finds_its_own_last_turn_among_many_with_the_same_opening():
    rng = random.Random(3)
    memo = PrefixMemo(size=64, chunk=64)
    system = _words(rng, 300)  # every conversation of the tenant opens with it
    turns = {c: system + _words(rng, 80) for c in range(20)}
    for c, text in turns.items():
        _keep(memo, "tenant", text, c)
    for c, text in turns.items():
        nxt = text + _words(rng, 40)
        found = memo.lookup("tenant", nxt)
        assert found.payload == c and found.shared == len(text)
        assert found.extends is not None
        memo.keep(found, nxt, c)
        turns[c] = nxt
    assert len(memo) == 20  # each next turn replaced the turn it extends


def test_no_match_across_scopes_or_without_a_whole_chunk():
    memo = PrefixMemo(size=8, chunk=16)
    text = "x" * 100
    _keep(memo, "a", text, 1)
    assert memo.lookup("b", text).payload is None
    assert memo.keys("a", "x" * 15) == []
    assert memo.lookup("a", "y" + text).payload is None
    found = memo.lookup("a", text[:40] + "z")
    assert found.payload == 1 and found.shared == 40 and found.extends is None


def test_a_key_of_another_scope_is_never_taken_even_on_a_hash_collision():
    memo = PrefixMemo(size=8, chunk=16)
    text = "x" * 100
    _keep(memo, "a", text, 1)
    # Every scope's chain made a's (a collision of the two chains): "b" still gets nothing.
    memo.keys = lambda scope, seq: PrefixMemo.keys(memo, "a", seq)
    assert memo.lookup("b", text).payload is None
    assert memo.lookup("a", text).payload == 1


def test_bounded_and_an_evicted_sequence_is_never_proposed():
    memo = PrefixMemo(size=3, chunk=8)
    texts = [f"{i:08d}" + "common-tail-" * 4 for i in range(10)]
    for i, text in enumerate(texts):
        _keep(memo, "s", text, i)
    assert len(memo) == 3
    for i, text in enumerate(texts):
        found = memo.lookup("s", text)
        assert (found.payload is not None) == (i >= 7)
        if found.payload is not None:
            assert found.payload == i
    with pytest.raises(ValueError):
        PrefixMemo(size=3, chunk=0)
