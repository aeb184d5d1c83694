"""The planner's fast paths against straightforward reference implementations.

Random fleets (engines, store nodes, domains, loads) and random copies, checked against
per-block definitions: the cost planner's engine, actions and costs against a brute
force over every engine and prefix, and the memory index's batched lookups against
one locate_hash per block. Each test runs over the compiled half of
quillcache_core.hotpath and over its Python half.
"""

from __future__ import annotations

import math
import random

import pytest

from quillcache_core import hotpath
from quillcache_core.index import MemoryIndex
from quillcache_core.index.base import Chain
from quillcache_core.model import MIB, CacheResidency, CacheTier, CostModel, WorkerState
from quillcache_core.routing.cost import actions_for_prefix, source_cost
from quillcache_core.routing.decide import plan_request
from quillcache_core.routing.planner import CostPlanner, block_runs
from quillcache_core.routing.policy import Fleet, LazyCosts
from tests.unit.factories import make_request

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True, params=["compiled", "python"])
def hot_half(request):
    """Every test here runs over both halves of quillcache_core.hotpath."""
    if request.param == "compiled" and hotpath.compiled is None:
        pytest.skip("the C extension is not built (pip install -e . builds it)")
    hotpath.use(request.param == "compiled")
    yield request.param
    hotpath.use(True)


CM = CostModel()
TIERS = list(CacheTier)
SIZES = [1, MIB, 2 * MIB, 3 * MIB + 5, 40 * MIB]


def _fleet(rng: random.Random) -> Fleet:
    domains = rng.randint(1, 3)
    stores = {f"s{j}": f"d{rng.randrange(domains)}" for j in range(rng.randint(0, 4))}
    engines = [
        WorkerState(
            id=f"e{i}",
            locality_domain=f"d{rng.randrange(domains)}",
            store_node_id=rng.choice([None, *stores]) if stores else None,
            queued_prefill_tokens=rng.choice([0, rng.randrange(4000)]),
            running_decodes=rng.randrange(4),
        )
        for i in range(rng.randint(1, 7))
    ]
    return Fleet(engines, stores)


def _usable(rng: random.Random, request, fleet: Fleet) -> list[list[CacheResidency]]:
    """Copies in contiguous ranges (so blocks form runs), on engines, stores and the dead."""
    workers = [w.id for w in fleet.engines] + list(fleet.store_domains) + ["dead"]
    usable: list[list[CacheResidency]] = [[] for _ in request.blocks]
    n = len(request.blocks)
    for _ in range(rng.randrange(7)):
        worker, tier, size = rng.choice(workers), rng.choice(TIERS), rng.choice(SIZES)
        first = rng.randrange(n + 1)
        for i in range(first, rng.randint(first, n)):
            usable[i].append(CacheResidency(request.blocks[i], worker, tier, size))
    return usable


def _reference(request, usable, fleet: Fleet, rng: random.Random):
    """Per engine the best prefix block by block (source_cost), the cheapest engine
    (exact ties at random), and actions_for_prefix at its best prefix."""
    totals, prefixes = [], []
    for worker in fleet.engines:
        best, best_k, fetch, reused = math.inf, 0, 0.0, 0
        for k in range(len(request.blocks) + 1):
            est = fetch + CM.prefill_cost_us(request.input_tokens() - reused)
            if est < best:
                best, best_k = est, k
            if k == len(request.blocks) or k == len(usable):
                break
            prices = [
                p[0]
                for r in usable[k]
                if (p := source_cost(CM, worker, r, fleet.store_domains)) is not None
            ]
            if not prices:
                break
            fetch += min(prices)
            reused += request.blocks[k].token_count
        queue = CM.queue_cost_us(worker)
        decode = CM.decode_cost_us(request.estimated_decode_tokens, worker.running_decodes)
        totals.append(queue + best + decode)
        prefixes.append(best_k)
    low = min(totals)
    ties = [i for i, total in enumerate(totals) if total == low]
    chosen = ties[0] if len(ties) == 1 else ties[rng.randrange(len(ties))]
    engine = fleet.engines[chosen]
    actions = actions_for_prefix(CM, request, engine, usable, fleet.store_domains, prefixes[chosen])
    return engine.id, actions, {w.id: t for w, t in zip(fleet.engines, totals, strict=True)}


@pytest.mark.parametrize("seed", range(300))
def test_cost_planner_equals_the_block_by_block_reference(seed):
    rng = random.Random(seed)
    fleet = _fleet(rng)
    request = make_request(
        rng.randint(0, 20), extra_tokens=rng.randrange(16), decode_tokens=rng.randrange(200)
    )
    usable = _usable(rng, request, fleet)
    decision = CostPlanner(CM).plan(request, usable, fleet, random.Random(seed))
    engine_id, actions, totals = _reference(request, usable, fleet, random.Random(seed))
    assert decision.engine.id == engine_id
    assert list(decision.actions) == actions
    got = {c.engine_id: c.cost_us for c in [decision.chosen, *decision.others]}
    assert got == totals  # integer-valued costs: exact


def _runs_reference(usable):
    runs, previous, first = [], None, 0
    for index, found in enumerate(usable):
        mark = tuple((r.worker_id, r.tier, r.bytes) for r in found)
        if index and mark != previous:
            runs.append((first, index - first))
            first = index
        previous = mark
    if usable:
        runs.append((first, len(usable) - first))
    return runs


@pytest.mark.parametrize("seed", range(100))
def test_block_runs_equal_the_reference(seed):
    rng = random.Random(seed)
    fleet = _fleet(rng)
    request = make_request(rng.randint(0, 20))
    usable = _usable(rng, request, fleet)
    assert block_runs(usable) == _runs_reference(usable)
    # One copy per block everywhere (the fast path).
    single = [[found[0]] if found else [] for found in usable]
    single = [f for f in single if f] or [[]]
    assert block_runs(single) == _runs_reference(single)


def test_others_are_built_when_read_from_the_values_of_the_plan():
    rng = random.Random(3)
    fleet = _fleet(rng)
    while len(fleet.engines) < 3:
        fleet = _fleet(rng)
    request = make_request(8)
    usable = _usable(rng, request, fleet)
    for alternatives in (None, 0, 1, 2, 10):
        planner = CostPlanner(CM, alternatives=alternatives)
        lazy = planner.plan(request, usable, fleet, random.Random(1)).others
        assert isinstance(lazy, LazyCosts)
        size = len(lazy)  # known before anything is built
        for worker in fleet.engines:  # load changed after the plan: not seen
            worker.queued_prefill_tokens += 1000
        again = CostPlanner(CM, alternatives=alternatives)
        for worker in fleet.engines:
            worker.queued_prefill_tokens -= 1000
        eager = list(again.plan(request, usable, fleet, random.Random(1)).others)
        assert lazy == eager and list(lazy) == eager and len(eager) == size
        assert [c.engine_id for c in lazy] == [c.engine_id for c in eager]
        assert lazy[:1] == eager[:1]


# --- the memory index's batched lookups ------------------------------------------------


def _index(rng: random.Random, requests) -> MemoryIndex:
    """Single records, several copies of a key, other identities with the same hash,
    pending chains (put_chain), some of them partly removed."""
    index = MemoryIndex()
    for request in requests:
        keys = request.blocks
        for _ in range(rng.randrange(4)):
            first = rng.randrange(len(keys) + 1)
            last = rng.randint(first, len(keys))
            worker, tier = rng.choice(["e0", "e1", "s0"]), rng.choice(TIERS)
            if rng.random() < 0.5 and index._by_hash.keys().isdisjoint(
                k.block_hash for k in keys[first:last]
            ):
                scope = tuple(keys[0][:4])
                parent = keys[first].prefix_hash if first < len(keys) else "root"
                chain = Chain(
                    scope,
                    parent,
                    [k.block_hash for k in keys[first:last]],
                    first,
                    16,
                    worker,
                    tier,
                    2 * MIB,
                )
                index.put_chain(chain)
            else:
                index.put_many(CacheResidency(k, worker, tier, 2 * MIB) for k in keys[first:last])
        for key in keys:
            if rng.random() < 0.1:
                index.remove_tier(rng.choice(["e0", "e1", "s0"]), key.block_hash, rng.choice(TIERS))
    return index


@pytest.mark.parametrize("seed", range(120))
def test_memory_index_batched_lookups_equal_one_locate_hash_per_block(seed):
    rng = random.Random(seed)
    requests = [
        make_request(rng.randint(1, 16), seed=s, tenant=t)
        for s, t in [(0, "acme"), (0, "other"), (1, "acme")]
    ]
    index = _index(random.Random(seed), requests)
    twin = _index(random.Random(seed), requests)  # the same index, looked up apart
    for request in requests:
        hashes = [k.block_hash for k in request.blocks] + ["missing", request.blocks[0].block_hash]
        expected = [twin.locate_hash(h) for h in hashes]
        assert index.locate_hashes(hashes) == expected
        assert index.locate_hashes(iter(hashes)) == expected
        extra = None
        if rng.random() < 0.5:
            key = rng.choice(request.blocks)
            extra = {key.block_hash: [CacheResidency(key, "e9", CacheTier.HBM, 1)], "x": []}
        prefix = []
        for h, found in zip(hashes, expected, strict=True):
            found = found + (extra or {}).get(h, [])
            if not found:
                break
            prefix.append(found)
        assert index.locate_prefix(hashes, extra) == prefix
        assert index.locate_prefix(tuple(hashes), extra) == prefix


@pytest.mark.parametrize("seed", range(60))
def test_plan_request_over_the_index_equals_the_reference(seed):
    rng = random.Random(seed)
    request = make_request(rng.randint(1, 16), seed=rng.randrange(2))
    fleet = Fleet(
        [
            WorkerState("e0", "d0", store_node_id="s0", queued_prefill_tokens=rng.randrange(900)),
            WorkerState("e1", "d1", queued_prefill_tokens=rng.randrange(900)),
        ],
        {"s0": "d0"},
    )
    index = _index(rng, [request, make_request(4, tenant="other")])
    decision = plan_request(index, CostPlanner(CM), request, fleet, random.Random(seed))
    usable = [index.locate_hash(k.block_hash) for k in request.blocks]
    usable = [[r for r in found if r.key[:4] == request.blocks[0][:4]] for found in usable]
    cut = next((i for i, found in enumerate(usable) if not found), len(usable))
    assert decision.usable == usable[:cut]
    engine_id, actions, _ = _reference(request, usable[:cut], fleet, random.Random(seed))
    assert decision.engine.id == engine_id
    assert list(decision.actions) == actions
