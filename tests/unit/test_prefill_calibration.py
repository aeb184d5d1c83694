"""The engines' prefill speed learned from measured TTFTs (`routing/calibrate.py`), and
the conductor pricing its plans with it."""

from __future__ import annotations

import dataclasses
import random
import statistics
import subprocess
import sys

import numpy as np
import pytest

from quillcache_conductor.state import ConductorState
from quillcache_core.index import MemoryIndex
from quillcache_core.model import CacheResidency, CacheTier, CostModel
from quillcache_core.registry import NodeRecord
from quillcache_core.routing.calibrate import (
    FetchPrice,
    ModelSpeeds,
    PrefillSpeed,
    median_of,
    scaled,
)
from quillcache_core.routing.planner import CostPlanner
from tests.unit.factories import MODEL, engine_record, make_request
from tests.unit.test_conductor_optimistic import Clock

pytestmark = pytest.mark.unit


def samples(us_per_token: float, intercept_us: float, n: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n):
        tokens = rng.randrange(16, 2000)
        yield tokens, (intercept_us + us_per_token * tokens) * rng.uniform(0.9, 1.1)


def test_the_slope_and_intercept_of_noisy_samples_are_learned():
    speed = PrefillSpeed(45.0)
    for tokens, ttft in samples(800.0, 15_000.0, 200):
        speed.observe(tokens, ttft)
    assert speed.us_per_token == pytest.approx(800.0, rel=0.08)
    assert speed.intercept_us == pytest.approx(15_000.0, rel=0.5)


def theil_sen(points: list[tuple[float, float]], min_pairs: int) -> tuple[float, float] | None:
    """The fit PrefillSpeed makes, pair by pair: the median slope between a sample of
    the shorter half and one of the longer half at least a tenth of the mean apart,
    and the median intercept under it (before the slope is clamped)."""
    points = sorted(points)
    gap = 0.1 * sum(x for x, _ in points) / len(points)
    half = len(points) // 2
    slopes = [
        (y2 - y1) / (x2 - x1)
        for x1, y1 in points[:half]
        for x2, y2 in points[half:]
        if x2 - x1 >= gap and x2 > x1
    ]
    if len(slopes) < min_pairs:
        return None
    slope = statistics.median(slopes)
    return slope, max(0.0, statistics.median(y - slope * x for x, y in points))


@pytest.mark.parametrize("seed", range(6))
def test_each_refit_is_the_median_of_the_pairs_slopes(seed):
    rng = random.Random(seed)
    speed, window, fits = PrefillSpeed(500.0, window=64, every=1), [], 0
    for n in range(150):  # some with repeated lengths, so ties and empty pairs happen
        tokens = rng.choice((64, 512, 520, rng.randrange(16, 4000)))
        ttft = (2_000 + 480.0 * tokens) * rng.uniform(0.7, 1.4) + (5e6 if n % 11 == 0 else 0)
        speed.observe(tokens, ttft)
        window = [*window, (float(tokens), ttft)][-64:]
        expected = theil_sen(window, speed.min_samples) if len(window) >= 16 else None
        if expected is not None and expected[0] > 0:  # (an estimate moves past 1%)
            assert abs(expected[0] - speed.us_per_token) <= 0.01 * speed.us_per_token
            assert speed.intercept_us == expected[1]
            fits += 1
    assert fits > 100


def test_stalls_of_seconds_do_not_drag_the_estimate():
    speed = PrefillSpeed(45.0)
    for n, (tokens, ttft) in enumerate(samples(800.0, 15_000.0, 200, seed=3)):
        speed.observe(tokens, ttft + (8e6 if n % 7 == 0 else 0.0))  # every 7th stalls 8 s
    assert speed.us_per_token == pytest.approx(800.0, rel=0.15)


def test_the_default_holds_until_enough_samples_with_enough_spread():
    speed = PrefillSpeed(45.0, min_samples=16)
    for tokens, ttft in samples(800.0, 0.0, 15):
        speed.observe(tokens, ttft)
    assert speed.us_per_token == 45.0  # 15 samples: not yet
    same = PrefillSpeed(45.0)
    for _ in range(100):
        same.observe(512, 400_000.0)  # one prompt length: slope and intercept unknowable
    assert same.us_per_token == 45.0


def test_bad_samples_are_ignored():
    speed = PrefillSpeed(45.0)
    for tokens, ttft in [(-1, 10.0), (10, 0.0), (10, float("nan")), (10, float("inf"))]:
        assert not speed.observe(tokens, ttft)
    assert speed.samples == 0


def test_a_fleet_that_gets_faster_is_followed():
    speed = PrefillSpeed(45.0)
    for tokens, ttft in samples(800.0, 5_000.0, 200, seed=1):
        speed.observe(tokens, ttft)
    for tokens, ttft in samples(200.0, 5_000.0, 300, seed=2):
        speed.observe(tokens, ttft)
    assert speed.us_per_token == pytest.approx(200.0, rel=0.1)


def test_the_learned_speed_scales_compute_terms_but_not_transfers():
    base = CostModel().queue_at_prefill_speed()
    cm = scaled(base, 450.0)
    assert cm.prefill_us_per_token == 450.0
    assert cm.queue_us_per_prefill_token == pytest.approx(450.0)
    assert cm.decode_us_per_token == pytest.approx(800.0)
    assert cm.running_decode_penalty_us == pytest.approx(15_000.0)
    assert cm.cpu_dram_us_per_mb == base.cpu_dram_us_per_mb
    assert cm.cross_domain_penalty_us == base.cross_domain_penalty_us
    slow = scaled(base, 450.0, fetch_factor=100.0)
    assert slow.cpu_dram_us_per_mb == pytest.approx(100 * base.cpu_dram_us_per_mb)
    assert slow.local_ssd_us_per_mb == pytest.approx(100 * base.local_ssd_us_per_mb)
    assert slow.cross_domain_penalty_us == pytest.approx(100 * base.cross_domain_penalty_us)
    assert slow.prefill_us_per_token == 450.0


def test_the_fetch_price_is_the_median_factor_once_there_are_enough():
    price = FetchPrice(min_samples=8)
    for factor in [100.0] * 7:
        price.observe(factor)
    assert price.factor == 1.0
    for factor in [90.0, 110.0, 5000.0, float("nan")]:
        price.observe(factor)
    assert price.factor == pytest.approx(100.0)


def test_a_fetch_is_never_priced_below_the_default():
    """Requests whose TTFT the prefill line (its intercept) already exceeds read a factor
    of at most 0: the price stays at the default, not at the clamp (fetches looked free
    on real vLLM and the planner fetched where holders were the cheaper wait)."""
    price = FetchPrice(min_samples=8)
    for factor in [-3.0, -0.5, 0.0, 0.2, -1.0, 0.01, -7.0, 40.0, 0.5]:
        price.observe(factor)
    assert price.factor == 1.0
    for factor in [30.0] * 12:
        price.observe(factor)
    assert price.factor == pytest.approx(30.0)


def test_fetches_are_priced_at_what_they_cost_beyond_the_prefill_line():
    base = CostModel().queue_at_prefill_speed()
    speeds = ModelSpeeds(base)
    speeds.observe(MODEL, 100, 1e6, fetch_us=1000.0)  # no prefill line yet: no sample
    assert MODEL not in speeds.fetches
    for tokens, ttft in samples(800.0, 3_000.0, 64, seed=4):
        speeds.observe(MODEL, tokens, ttft)
    rng = random.Random(5)
    for _ in range(16):
        tokens, fetch_us = rng.randrange(16, 400), rng.uniform(500, 5000)
        ttft = (3_000 + 800 * tokens + 100 * fetch_us) * rng.uniform(0.95, 1.05)
        speeds.observe(MODEL, tokens, ttft, fetch_us=fetch_us)
    assert speeds.fetch_factor(MODEL) == pytest.approx(100.0, rel=0.3)
    cm = speeds.cost_model(MODEL)
    assert cm.cpu_dram_us_per_mb == pytest.approx(
        base.cpu_dram_us_per_mb * speeds.fetch_factor(MODEL)
    )
    assert cm.prefill_us_per_token == pytest.approx(800.0, rel=0.08)


def make_state(calibrate: bool = True) -> ConductorState:
    state = ConductorState(
        MemoryIndex(),
        CostPlanner(CostModel().queue_at_prefill_speed()),
        clock=Clock(),
        rng=random.Random(1),
        calibrate=calibrate,
    )
    for node in ("e0", "e1"):
        state.engine_joined(engine_record(node, events=False))
    return state


def run(state: ConductorState, us_per_token: float, n: int = 40) -> list[float]:
    """Plan and finish `n` requests one at a time whose TTFT is the engines' real
    speed; returns the TTFT each plan estimated."""
    estimates = []
    for seed in range(n):
        request = make_request(8 + seed % 24, seed=1000 + seed)
        outcome = state.plan(request)
        estimates.append(outcome.decision.chosen.est_ttft_us)
        tokens = outcome.decision.recompute_tokens(request)
        state.finish(
            outcome.reservation_id, "success", ttft_s=(3_000 + us_per_token * tokens) / 1e6
        )
    return estimates


def test_the_conductor_prices_plans_at_the_speed_its_engines_show():
    state = make_state()
    estimates = run(state, 800.0)
    first = make_request(8, seed=1000).input_tokens()
    assert estimates[0] == pytest.approx(45.0 * first, rel=0.1)  # the default at first
    request = make_request(20, seed=99)
    tokens = request.input_tokens()
    outcome = state.plan(request)
    assert state.speeds.speeds[MODEL].us_per_token == pytest.approx(800.0, rel=0.05)
    assert outcome.decision.chosen.est_ttft_us == pytest.approx(800.0 * tokens, rel=0.1)


def test_nothing_is_learned_without_calibration_nor_from_a_split_request():
    state = make_state(calibrate=False)
    run(state, 800.0)
    assert state.speeds is None
    assert state.policy.cost_model.prefill_us_per_token == 45
    learning = make_state()
    outcome = learning.plan(make_request(8, seed=5))
    learning.reservations[outcome.reservation_id].sample_tokens = -1  # as a split's
    learning.finish(outcome.reservation_id, "success", ttft_s=1.0)
    assert learning.speeds.speeds == {}


def test_a_busy_engine_s_request_is_a_sample_counted_with_the_tokens_queued_ahead():
    state = make_state()
    outcomes = [state.plan(make_request(8, seed=s)) for s in range(3)]  # 3 on 2 engines
    reservations = [state.reservations[o.reservation_id] for o in outcomes]
    first, _, third = reservations
    assert [r.sample_ahead for r in reservations[:2]] == [0, 0]  # each alone on its engine
    ahead = [r for r in reservations[:2] if r.engine_id == third.engine_id]
    assert third.sample_ahead == ahead[0].prefill_tokens == first.prefill_tokens
    for outcome in outcomes:
        state.finish(outcome.reservation_id, "success", ttft_s=0.5)
    assert state.speeds.speeds[MODEL].samples == 3


def test_the_speed_is_learned_under_load_from_what_waits_ahead():
    """One engine prefilling its requests in order at 150 us a token plus 5 ms each,
    under a load that keeps a queue: the conductor, which counts the tokens queued ahead
    of each request (released at the TTFT it estimates with the speed being learned),
    learns about that speed and prices a queued engine near what it costs."""
    state = ConductorState(
        MemoryIndex(),
        CostPlanner(CostModel().queue_at_prefill_speed()),
        clock=Clock(),
        rng=random.Random(1),
    )
    state.engine_joined(engine_record("e0", events=False))
    rng = random.Random(8)
    busy_until, pending = state.clock.now, []
    for seed in range(300):
        state.clock.now += rng.expovariate(1 / 0.12)  # about 8 requests a second
        for done_at, reservation, ttft in [p for p in pending if p[0] <= state.clock.now]:
            state.finish(reservation, "success", ttft_s=ttft)
            pending.remove((done_at, reservation, ttft))
        request = make_request(rng.randrange(4, 64), seed=10_000 + seed)
        outcome = state.plan(request)
        tokens = outcome.decision.recompute_tokens(request)
        busy_until = max(busy_until, state.clock.now) + 0.005 + 150e-6 * tokens
        pending.append((busy_until, outcome.reservation_id, busy_until - state.clock.now))
    assert state.speeds.speeds[MODEL].us_per_token == pytest.approx(150.0, rel=0.35)


def test_a_plan_that_fetches_on_an_idle_engine_is_a_sample_of_the_fetch_price():
    state = ConductorState(
        MemoryIndex(),
        CostPlanner(CostModel().queue_at_prefill_speed()),
        clock=Clock(),
        rng=random.Random(1),
    )
    state.store_joined(NodeRecord(kind="store", id="s0", address="s0:1", locality_domain="rack-a"))
    record = engine_record("e0", events=False)
    state.engine_joined(dataclasses.replace(record, store_node="s0"))
    run(state, 800.0, n=64)  # the prefill line first (one engine: every plan idle)
    request = make_request(24, seed=7)
    state.index.put_many(
        [CacheResidency(k, "s0", CacheTier.CPU_DRAM, request.block_bytes) for k in request.blocks]
    )
    outcome = state.plan(request)
    chosen = outcome.decision.chosen
    assert chosen.fetch_blocks > 0
    res = state.reservations[outcome.reservation_id]
    assert res.sample_fetch_us == pytest.approx(chosen.fetch_us)
    state.finish(outcome.reservation_id, "success", ttft_s=0.5)
    assert state.speeds.fetches[MODEL].samples == 1


def test_a_long_prefill_is_priced_at_what_long_prefills_cost():
    """On a CPU attention makes a long prompt's tokens dearer: the line must price the
    long prefills (which make the queues) near their cost, not at a short one's rate."""
    speed = PrefillSpeed(45.0)
    rng = random.Random(6)
    cost = lambda x: 15_000 + 50 * x + 0.5 * x * x  # noqa: E731
    for _ in range(64):
        x = rng.choice([rng.randrange(16, 200), rng.randrange(800, 2000)])
        speed.observe(x, cost(x) * rng.uniform(0.9, 1.1))
    for x in (1200, 1800):  # the long prompts' range
        assert speed.intercept_us + speed.us_per_token * x == pytest.approx(cost(x), rel=0.3)


def test_a_reported_first_token_holds_the_prefill_until_it_comes():
    """With the gateway reporting first tokens, a plan's queued prefill stays on its
    engine past its estimated TTFT (the estimate of a speed learned too low would free
    a busy engine early) and leaves at the report, which is also the TTFT learned."""
    state = make_state()
    engine = next(iter(state.engines.values())).state
    request = make_request(40, seed=5)
    outcome = state.plan(request, first_token_reported=True)
    res = state.reservations[outcome.reservation_id]
    queued = res.prefill_tokens
    assert queued > 0 and engine.queued_prefill_tokens == queued
    state.clock.now += 4 * outcome.decision.chosen.est_ttft_us / 1e6  # well past it
    state.tick()
    assert engine.queued_prefill_tokens == queued  # still computing, as far as we know
    assert state.prefilled(outcome.reservation_id, 0.25)
    assert engine.queued_prefill_tokens == 0
    assert state.speeds.speeds[MODEL].samples == 1
    state.finish(outcome.reservation_id, "success", ttft_s=0.25)
    assert state.speeds.speeds[MODEL].samples == 1  # learned once
    assert not state.prefilled(outcome.reservation_id, 0.25)  # finished: nothing left
    # Without the report the estimate releases it, as before; and a report that never
    # comes is bounded too.
    plain = state.plan(make_request(40, seed=6))
    state.clock.now += 2 * plain.decision.chosen.est_ttft_us / 1e6 + 1e-3
    state.tick()
    assert engine.queued_prefill_tokens == 0
    lost = state.plan(make_request(40, seed=7), first_token_reported=True)
    state.clock.now += 4 * lost.decision.chosen.est_ttft_us / 1e6 + 2.5
    state.tick()
    assert engine.queued_prefill_tokens == 0


def test_median_of_is_numpys_median():
    rng = np.random.default_rng(5)
    for n in (1, 2, 3, 4, 63, 64, 1024):
        values = rng.normal(50.0, 20.0, n)
        assert median_of(values) == float(np.median(values))
        assert median_of(np.sort(values)) == float(np.median(values))


def test_a_refit_does_not_import_numpy_ma():
    """np.median's first call imports numpy.ma: tens of milliseconds inside a live
    conductor's first refit, with every other call on its loop waiting."""
    code = (
        "import sys\n"
        "from quillcache_core.routing.calibrate import PrefillSpeed\n"
        "speed = PrefillSpeed(45.0)\n"
        "for i in range(64):\n"
        "    speed.observe(100 + 37 * i, 1000.0 + 45.0 * (100 + 37 * i))\n"
        "assert speed.fitted, 'no refit ran'\n"
        "print('numpy.ma' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
