"""quillcache_core.hotpath: the compiled half answers exactly as the Python half."""

from __future__ import annotations

import random

import pytest

from quillcache_core import hotpath
from quillcache_core.model import CacheResidency, CacheTier, KvBlockKey

pytestmark = pytest.mark.unit

compiled = pytest.mark.skipif(
    hotpath.compiled is None, reason="the C extension is not built (pip install -e . builds it)"
)
PENDING = "pending chain"


def _key(rng: random.Random, i: int) -> KvBlockKey:
    tenant = rng.choice(["acme", "acme", "acme", "other"])
    return KvBlockKey("m", "t", rng.choice([None, None, "lora"]), tenant, f"p{i}", f"h{i}", i, 16)


def _record(rng: random.Random, key: KvBlockKey) -> CacheResidency:
    return CacheResidency(
        key, rng.choice(["e0", "e1", "s0"]), rng.choice(list(CacheTier)), rng.choice([1, 2, 3])
    )


def _by_hash(rng: random.Random, n: int) -> dict:
    """Cells as MemoryIndex holds them: a record, {key: {slot: record}} (one key or
    several), or a pending chain's {PENDING: ..., "blocks left": n}."""
    cells: dict = {}
    for i in range(n):
        kind = rng.random()
        key = _key(rng, i)
        if kind < 0.15:
            continue
        if kind < 0.6:
            cells[key.block_hash] = _record(rng, key)
        elif kind < 0.8:
            records = [_record(rng, key) for _ in range(rng.randint(1, 3))]
            cells[key.block_hash] = {key: {(r.worker_id, r.tier.value): r for r in records}}
        elif kind < 0.9:
            other = key._replace(tenant_id="zz")
            cells[key.block_hash] = {
                key: {("e0", "hbm"): _record(rng, key)},
                other: {("e1", "hbm"): _record(rng, other)},
            }
        else:
            cells[key.block_hash] = {PENDING: object(), "blocks left": 3}
    return cells


@compiled
@pytest.mark.parametrize("seed", range(200))
def test_locate_answers_as_the_python_half(seed):
    rng = random.Random(seed)
    n = rng.randint(0, 40)
    cells = _by_hash(rng, n)
    hashes = [f"h{i}" for i in range(n)] + rng.choice([[], ["missing"], ["h0", "x"]])
    for stop in (True, False):
        assert hotpath.compiled.locate(cells, hashes, stop, PENDING) == hotpath.locate_py(
            cells, hashes, stop, PENDING
        )


@compiled
@pytest.mark.parametrize("seed", range(200))
def test_same_scope_and_block_runs_answer_as_the_python_half(seed):
    rng = random.Random(seed)
    runs = []
    for i in range(rng.randint(0, 30)):
        if runs and rng.random() < 0.6:  # the same copies as the block before
            runs.append([r._replace(key=_key(rng, i)) for r in runs[-1]])
        else:
            runs.append([_record(rng, _key(rng, i)) for _ in range(rng.choice([0, 1, 1, 2, 3]))])
    want = ("m", "t", None, "acme")
    assert hotpath.compiled.same_scope(runs, want) == hotpath.same_scope_py(runs, want)
    assert hotpath.compiled.block_runs(runs) == hotpath.block_runs_py(runs)


@compiled
def test_the_compiled_half_leaves_what_it_does_not_know_to_python():
    record = CacheResidency(
        KvBlockKey("m", "t", None, "a", "r", "h", 0, 16), "e0", CacheTier.HBM, 1
    )
    assert hotpath.compiled.same_scope([(record,)], ("m", "t", None, "a")) is None
    assert hotpath.compiled.same_scope([["not a record"]], ("m", "t", None, "a")) is None
    assert hotpath.compiled.block_runs([(record,), (record,)]) is None
    assert hotpath.compiled.block_runs([[record], ["x"]]) is None
    assert hotpath.compiled.block_runs([]) == [] == hotpath.block_runs_py([])
    with pytest.raises(TypeError):
        hotpath.compiled.locate([], ["h"], True, PENDING)


def test_use_selects_a_half():
    try:
        hotpath.use(False)
        assert hotpath.block_runs is hotpath.block_runs_py
        hotpath.use(True)
        expected = (
            hotpath.block_runs_py if hotpath.compiled is None else hotpath.compiled.block_runs
        )
        assert hotpath.block_runs is expected
    finally:
        hotpath.use(True)
