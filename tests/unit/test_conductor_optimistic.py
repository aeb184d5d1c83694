"""The conductor's optimistic overlay: what a planned request is about to put in its
engine's HBM is visible to the next plans, and for an engine that publishes KV events it
outlives a successful Finish until those events have had time to arrive."""

from __future__ import annotations

import random

import pytest

from quillcache.v1 import common_pb2, conductor_pb2
from quillcache_conductor.events import EventRouter
from quillcache_conductor.records import OPTIMISTIC_LINGER_S
from quillcache_conductor.servicer import ConductorServicer
from quillcache_conductor.state import ConductorState
from quillcache_core.errors import InvalidArgument
from quillcache_core.index import MemoryIndex
from quillcache_core.model import CostModel
from quillcache_core.process.metrics import MetricsRegistry
from quillcache_core.routing.planner import CostPlanner
from quillcache_core.wire.plan import pack_hashes
from tests.unit.factories import MODEL, TENANT, TOKENIZER, engine_record, make_request

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_state(events: bool = True) -> tuple[ConductorState, Clock]:
    clock = Clock()
    state = ConductorState(
        MemoryIndex(), CostPlanner(CostModel()), clock=clock, rng=random.Random(1)
    )
    for node in ("e0", "e1"):
        state.engine_joined(engine_record(node, events=events))
    return state, clock


def hits(state: ConductorState, seed: int = 0) -> tuple[str, int]:
    outcome = state.plan(make_request(8, seed=seed))
    state.finish(outcome.reservation_id, "cancelled")  # probes leave no overlay behind
    return outcome.decision.engine.id, outcome.decision.chosen.hit_blocks


def test_a_finished_request_still_counts_until_its_engines_events_can_have_come():
    state, clock = make_state(events=True)
    first = state.plan(make_request(8))
    engine = first.decision.engine.id
    state.finish(first.reservation_id, "success")
    # The engine's events for the request have not arrived: the repeat still hits there.
    assert hits(state) == (engine, 8)
    clock.now += OPTIMISTIC_LINGER_S + 0.1
    state.tick()
    # Nothing confirmed them: the overlay is gone, no block is claimed for ever.
    assert hits(state)[1] == 0
    assert state.optimistic == {}


def test_failed_requests_leave_nothing_and_an_engine_that_leaves_takes_its_overlay():
    state, _ = make_state(events=True)
    failed = state.plan(make_request(8))
    state.finish(failed.reservation_id, "error")
    assert hits(state)[1] == 0
    done = state.plan(make_request(8, seed=3))
    state.finish(done.reservation_id, "success")
    state.engine_left(done.decision.engine.id)
    assert state.optimistic == {}
    assert hits(state, seed=3)[1] == 0


def test_an_engine_without_events_has_the_finished_blocks_recorded_for_good():
    state, clock = make_state(events=False)
    first = state.plan(make_request(8))
    state.finish(first.reservation_id, "success")
    clock.now += 10 * OPTIMISTIC_LINGER_S
    state.tick()
    assert hits(state) == (first.decision.engine.id, 8)


def test_an_eviction_the_engine_reports_ends_the_overlay_at_once():
    state, _ = make_state(events=True)
    request = make_request(8)
    first = state.plan(request)
    engine = first.decision.engine.id
    state.finish(first.reservation_id, "success")
    # The engine's events: it evicted the prompt's first block (e.g. other work filled it).
    state.overlay_released(engine, request.blocks[0].block_hash)
    assert hits(state)[1] == 0  # a prefix broken at its first block has no hit
    # AllBlocksCleared (or a restart): nothing of that engine stays claimed.
    again = state.plan(make_request(8, seed=5))
    state.finish(again.reservation_id, "success")
    state.overlay_released(again.decision.engine.id, None)
    assert hits(state, seed=5)[1] == 0


@pytest.mark.parametrize("events", [False, True])
def test_a_finish_records_its_observed_blocks_only_for_an_engine_without_events(events):
    """A Finish's observed prefix is the record of an engine that does not report its
    cache; an engine's own events are the truth (its observed hashes are checked and
    left unread)."""
    state, _ = make_state(events=events)
    servicer = ConductorServicer(
        state, EventRouter(state, MetricsRegistry(), subscribe_zmq=False), max_blocks=8
    )
    request = make_request(6)
    identity = common_pb2.Identity(model_id=MODEL, tokenizer_id=TOKENIZER, tenant_id=TENANT)
    packed = pack_hashes([key.block_hash for key in request.blocks])

    def finish(observed: bytes) -> str:
        outcome = state.plan(request)
        servicer.finish(
            conductor_pb2.FinishRequest(
                reservation_id=outcome.reservation_id,
                outcome=conductor_pb2.FinishRequest.SUCCESS,
                identity=identity,
                observe_packed_hashes=observed,
                observe_block_tokens=16,
            )
        )
        return outcome.decision.engine.id

    engine_id = finish(packed)
    assert state.index.worker_block_count(engine_id) == (0 if events else 6)
    for bad, reason in ((packed[:-1], "multiple of 16"), (packed * 2, "limit of 8")):
        with pytest.raises(InvalidArgument, match=reason):
            finish(bad)
