"""BuiltinTokenizer(prefix_cache): a text that opens like a recent one reuses its ids up
to where they differ; the ids are always exactly those of a full pass."""

from __future__ import annotations

import random

import pytest

from quillcache_core.identity.prefix_memo import common_prefix as _common_prefix
from quillcache_core.identity.tokenize import (
    PREFIX_KEY_CHARS,
    BuiltinTokenizer,
    TokenMemo,
)

pytestmark = pytest.mark.unit

ALPHABET = ["w", "x", "é", "7", "_", " ", "  ", "\n", "\t", ".", ",", "!", "<|im_end|>", "ß"]


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def test_same_ids_as_a_full_pass_whatever_the_shared_prefix():
    rng = random.Random(19)
    plain, cached = BuiltinTokenizer(), BuiltinTokenizer(prefix_cache=4)
    base = _text(rng, PREFIX_KEY_CHARS + 3000)
    for _ in range(300):
        cut = rng.randrange(PREFIX_KEY_CHARS, len(base) + 1)
        text = base[:cut] + _text(rng, rng.randrange(0, 400))
        if rng.random() < 0.3:
            base = text  # the next ones share this one's opening
        assert cached.encode(text) == plain.encode(text), cut


def test_a_boundary_inside_a_word_or_a_space_run_is_split_again():
    plain, cached = BuiltinTokenizer(), BuiltinTokenizer(prefix_cache=2)
    head = "w " * PREFIX_KEY_CHARS
    for first, second in (
        (head + "abc def", head + "abcdef ghi"),
        (head + "abc  ", head + "abc    x"),
        (head + "abc.", head + "abc.. x"),
        (head + "abc", head + "ab"),
        (head + "abc", head + "abc"),
    ):
        assert cached.encode(first) == plain.encode(first)
        assert cached.encode(second) == plain.encode(second)


def test_entries_are_bounded_and_the_callers_list_is_its_own():
    cached = BuiltinTokenizer(prefix_cache=3)
    texts = [f"t{i} " + "w " * PREFIX_KEY_CHARS for i in range(10)]
    for text in texts:
        ids = cached.encode(text)
        ids.append(-1)  # the caller's to change
    assert len(cached._memo.texts) == 3
    assert cached.encode(texts[-1]) == BuiltinTokenizer().encode(texts[-1])


def test_short_texts_are_not_kept():
    cached = BuiltinTokenizer(prefix_cache=3)
    cached.encode("short text")
    assert not cached._memo.texts


def test_common_prefix():
    rng = random.Random(7)
    for _ in range(200):
        a = _text(rng, rng.randrange(0, 60))
        b = a[: rng.randrange(0, len(a) + 1)] + _text(rng, rng.randrange(0, 20))
        expect = 0
        while expect < min(len(a), len(b)) and a[expect] == b[expect]:
            expect += 1
        assert _common_prefix(a, b) == expect


def test_reuse_stays_within_a_scope():
    """A tenant's prompt never reuses another tenant's recent text (no timing channel)."""
    cached = BuiltinTokenizer(prefix_cache=4)
    text = "the same long document " * 200
    acme_memo, globex_memo = TokenMemo(), TokenMemo()
    acme, globex = cached.scoped(acme_memo), cached.scoped(globex_memo)
    ids = acme.encode(text)
    acme.commit()
    assert len(acme_memo.texts) == 1
    assert globex.encode(text) == ids == BuiltinTokenizer().encode(text)
    globex.commit()
    assert len(globex_memo.texts) == 1  # globex's did not find acme's: one each
    assert acme.name == cached.name
