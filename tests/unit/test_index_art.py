"""The adaptive radix tree under the art backend, against a dict: every node size, both ways."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache_core.index.art_index import ArtTree, _Leaf, _Node4, _Node16, _Node48, _Node256

pytestmark = pytest.mark.unit


def _node_kinds(tree: ArtTree) -> set[type]:
    kinds: set[type] = set()
    stack = [tree._root]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        kinds.add(type(node))
        if type(node) is _Node48 or type(node) is _Node256:
            stack.extend(c for c in node.children if c is not None)
        elif type(node) is not _Leaf:
            stack.extend(node.children)
    return kinds


def _check(tree: ArtTree, model: dict[bytes, int], probes: list[bytes]) -> None:
    assert len(tree) == len(model)
    assert tree.values() == [model[k] for k in sorted(model)]  # key order
    for prefix in probes:
        want = [model[k] for k in sorted(model) if k.startswith(prefix)]
        assert tree.prefix_values(prefix) == want, prefix


def test_grows_through_every_node_size_and_shrinks_back() -> None:
    rng = random.Random(7)
    tree, model = ArtTree(), {}
    # Keys are fixed length (so prefix-free), with a fan-out of 256, 40, 10 and 3 under
    # one byte each, and random ones that share only their head.
    keys = [
        head + bytes((b,)) + b"-long-tail"
        for head, fanout in ((b"A", 256), (b"B", 40), (b"C", 10), (b"D", 3))
        for b in range(fanout)
    ]
    keys += [b"E" + bytes(rng.randrange(256) for _ in range(11)) for _ in range(200)]
    keys = sorted(set(keys))
    rng.shuffle(keys)
    for i, key in enumerate(keys):
        assert tree.insert(key, i) is None
        model[key] = i
    assert {_Node4, _Node16, _Node48, _Node256, _Leaf} <= _node_kinds(tree)
    probes = [b"", b"A", b"B\x07", b"B\x07-long", b"C\x03-lonG", b"E", b"nothing"]
    probes += [k[:n] for k in keys[:20] for n in (2, 3, 7, 12)]
    _check(tree, model, probes)
    # Replacing returns the old value and keeps the size.
    assert tree.insert(keys[0], -1) == model[keys[0]]
    model[keys[0]] = -1
    assert tree.get(keys[0]) == -1 and tree.get(b"A\x00-long-tai!") is None
    # Delete all but a few, checking as the nodes shrink (256 -> 48 -> 16 -> 4 -> leaf).
    rng.shuffle(keys)
    for n, key in enumerate(keys[:-3]):
        assert tree.delete(key) == model.pop(key)
        assert tree.delete(key) is None
        if n % 37 == 0:
            _check(tree, model, probes)
    _check(tree, model, probes)
    assert _node_kinds(tree) <= {_Node4, _Leaf}
    for key in keys[-3:]:
        tree.delete(key)
    assert len(tree) == 0 and tree._root is None and tree.values() == []


fixed_keys = st.binary(min_size=6, max_size=6).map(lambda b: bytes(x % 5 for x in b))


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), fixed_keys), max_size=80),
    probes=st.lists(st.binary(max_size=7).map(lambda b: bytes(x % 5 for x in b)), max_size=6),
)
def test_matches_a_dict(ops: list[tuple[bool, bytes]], probes: list[bytes]) -> None:
    tree, model = ArtTree(), {}
    for n, (insert, key) in enumerate(ops):
        if insert:
            assert tree.insert(key, n) == model.get(key)
            model[key] = n
        else:
            assert tree.delete(key) == model.pop(key, None)
        assert tree.get(key) == model.get(key)
    _check(tree, model, probes)
