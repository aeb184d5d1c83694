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
    memo.keys = lambda scope, seq, chunk=0: PrefixMemo.keys(memo, "a", seq, chunk)
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


def test_bounded_in_bytes_and_a_sequence_too_large_alone_is_never_kept():
    memo = PrefixMemo(size=1000, chunk=64, max_bytes=200_000)
    for i in range(40):  # 40 texts of about 20 KB, each with a 10 KB payload
        text = f"{i:08d}" + "x" * 20_000
        memo.keep(memo.lookup("s", text), text, i, payload_bytes=10_000)
        assert memo.nbytes <= 200_000
    assert len(memo) >= 2  # the newest ones (each costs about 67 KB with its keys)
    assert memo.lookup("s", "00000039" + "x" * 20_000).payload == 39
    assert memo.lookup("s", "00000000" + "x" * 20_000).payload is None
    huge = "y" * 300_000
    memo.keep(memo.lookup("s", huge), huge, "huge")
    assert memo.lookup("s", huge).payload is None and memo.nbytes <= 200_000
