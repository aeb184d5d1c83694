"""A peer replica's reservations, sent through the wire format and counted in this
replica's load and overlay: they release at the peer's close, linger as it asks, and
expire when the peer falls silent or its reservation's TTL passes."""

from __future__ import annotations

import pytest

from quillcache_conductor.peer_load import ClosedLoad, PeerLoad
from quillcache_conductor.records import OPTIMISTIC_LINGER_S
from quillcache_conductor.replica_sync import (
    ReplicaLog,
    _opened_to_proto,
    apply_deltas,
    opened_from_proto,
)
from tests.unit.factories import engine_record, make_request
from tests.unit.test_conductor_optimistic import make_state

pytestmark = pytest.mark.unit


class Wire:
    """A's listener: each open and close goes to B's PeerLoad through the protos."""

    def __init__(self, peers: PeerLoad) -> None:
        self.peers = peers

    def opened(self, res, prefill_s: float) -> None:
        msg = _opened_to_proto(
            res.id, res.engine_id, res.prefill_tokens, res.blocks, prefill_s, 300.0, res.optimistic
        )
        self.peers.apply("a", 1.0, snapshot=False, opened=[opened_from_proto(msg)])

    def closed(self, res, linger_s: float, resident: bool) -> None:
        self.peers.apply("a", 1.0, snapshot=False, closed=[ClosedLoad(res.id, linger_s, resident)])

    def prefilled(self, res) -> None:
        self.peers.apply("a", 1.0, snapshot=False, prefilled=[res.id])


def pair(events: bool = True, silence_s: float = 2.0):
    a, clock = make_state(events)
    b, _ = make_state(events)
    b.clock = a.clock = clock
    peers = PeerLoad(b, clock=clock, silence_s=silence_s)
    a.listener = Wire(peers)
    return a, b, peers, clock


def load(state, engine: str) -> tuple[int, int, int]:
    w = state.engines[engine].state
    return w.inflight_requests, w.queued_prefill_tokens, w.inflight_blocks


def test_a_plan_on_a_counts_on_b_and_its_finish_releases_it():
    a, b, peers, clock = pair()
    outcome = a.plan(make_request(8))
    engine = outcome.decision.engine.id
    assert load(b, engine) == load(a, engine)
    assert load(b, engine)[0] == 1 and load(b, engine)[2] == 8
    # B's repeat of the prompt goes where A's is about to be computed, and hits.
    repeat = b.plan(make_request(8))
    assert (repeat.decision.engine.id, repeat.decision.chosen.hit_blocks) == (engine, 8)
    b.finish(repeat.reservation_id, "cancelled")
    clock.now += 1.0
    peers.tick()
    assert load(b, engine)[1] == 0, "prefill released after the plan's TTFT"
    a.finish(outcome.reservation_id, "success")
    assert load(b, engine) == (0, 0, 0)
    # The overlay lingers (the engine's events are on their way), then goes.
    probe = b.plan(make_request(8))
    assert probe.decision.chosen.hit_blocks == 8
    b.finish(probe.reservation_id, "cancelled")
    clock.now += OPTIMISTIC_LINGER_S + 0.1
    peers.tick()
    assert not b.optimistic


def test_without_events_a_success_makes_the_blocks_resident_on_b():
    a, b, peers, _ = pair(events=False)
    outcome = a.plan(make_request(8))
    a.finish(outcome.reservation_id, "success")
    assert not b.optimistic
    assert b.index.worker_block_count(outcome.decision.engine.id) == 8


@pytest.mark.parametrize("how", ["silence", "snapshot", "restart", "ttl"])
def test_a_peers_load_never_sticks(how):
    a, b, peers, clock = pair(silence_s=2.0)
    outcome = a.plan(make_request(8))
    engine = outcome.decision.engine.id
    assert load(b, engine)[0] == 1
    if how == "silence":
        clock.now += 1.0
        peers.tick()
        assert load(b, engine)[0] == 1, "a short silence keeps it"
        clock.now += 1.5
    elif how == "snapshot":
        peers.apply("a", 1.0, snapshot=True)  # a's open reservations: none
    elif how == "restart":
        peers.apply("a", 2.0, snapshot=False)  # another run of a
    else:
        for _ in range(4):  # heartbeats keep a alive, but its reservation's TTL ends
            clock.now += 100.0
            peers.apply("a", 1.0, snapshot=False)
    peers.tick()
    assert load(b, engine) == (0, 0, 0)
    assert not b.optimistic
    assert peers.open_reservations() == 0


@pytest.mark.parametrize("shape", ["chain", "gaps", "odd hashes"])
def test_the_wire_keeps_every_overlay_record(shape):
    """A chain travels as packed hashes and its first parent and index; anything else
    (blocks skipped because the engine held them, hashes that are not 32 hex digits)
    column by column. Either way the peer rebuilds the very same records."""
    a, _ = make_state()
    outcome = a.plan(make_request(12))
    records = list(a.reservations[outcome.reservation_id].optimistic)
    assert len(records) == 12
    if shape == "gaps":
        records = records[:3] + records[5:]
    elif shape == "odd hashes":
        records = [
            r._replace(key=r.key._replace(block_hash=f"H{i}")) for i, r in enumerate(records)
        ]
    msg = _opened_to_proto("r", records[0].worker_id, 10, 12, 0.1, 300.0, records)
    assert bool(msg.packed_hashes) == (shape != "odd hashes")
    assert (not msg.prefix_hashes) == (shape == "chain")
    assert opened_from_proto(msg).records == records


def test_a_snapshot_carries_open_reservations_and_lingering_overlays():
    """What a replica that (re)connects receives: the load of the open reservations and
    the overlay of the finished ones still waiting for their engine's events."""
    a, b, peers, clock = pair()
    a.listener = None  # only the snapshot travels
    running = a.plan(make_request(8, seed=1))
    done = a.plan(make_request(8, seed=2))
    a.finish(done.reservation_id, "success")  # its overlay lingers on A
    clock.now += 0.5
    for message in ReplicaLog(a, "a", 1.0).snapshot():
        apply_deltas(peers, "a", message)
    engine = running.decision.engine.id
    assert sum(load(b, e)[0] for e in b.engines) == 1 and load(b, engine)[0] == 1
    for seed, outcome in ((1, running), (2, done)):
        probe = b.plan(make_request(8, seed=seed))
        chosen = (probe.decision.engine.id, probe.decision.chosen.hit_blocks)
        assert chosen == (outcome.decision.engine.id, 8), seed
        b.finish(probe.reservation_id, "cancelled")
    clock.now += OPTIMISTIC_LINGER_S  # past the linger that remained
    peers.tick()
    probe = b.plan(make_request(8, seed=2))
    assert probe.decision.chosen.hit_blocks == 0


def test_an_engine_restart_ends_the_peers_overlay_on_it():
    a, b, peers, _ = pair()
    running = a.plan(make_request(8, seed=1))
    engine = running.decision.engine.id
    b.engine_joined(engine_record(engine, events=True, start_time_s=200.0))  # a new run
    peers.engine_restarted(engine)
    assert not b.optimistic
    assert load(b, engine)[0] == 1  # its request is still counted until A closes it
    a.finish(running.reservation_id, "error")
    assert load(b, engine) == (0, 0, 0)


def test_a_first_token_reported_on_a_releases_the_prefill_on_b():
    a, b, peers, clock = pair()
    outcome = a.plan(make_request(8), first_token_reported=True)
    engine = outcome.decision.engine.id
    queued = load(a, engine)[1]
    assert queued > 0 and load(b, engine)[1] == queued
    clock.now += 1.0  # past the estimate: held on both until the report
    peers.tick()
    a.tick()
    assert load(a, engine)[1] == queued and load(b, engine)[1] == queued
    a.prefilled(outcome.reservation_id, 0.2)
    assert load(a, engine) == load(b, engine) == (1, 0, 8)  # still running: decoding
    a.finish(outcome.reservation_id, "success", ttft_s=0.2)
    assert load(b, engine) == (0, 0, 0)


def test_a_plan_on_b_weighs_as_released_what_a_reserved_whose_prefill_is_due_with_no_tick():
    a, b, peers, clock = pair()
    b.release_peers = peers.release_due  # as the conductor wires it
    outcome = a.plan(make_request(8))
    engine = outcome.decision.engine.id
    assert load(b, engine)[1] > 0
    clock.now += 1.0  # past the plan's TTFT: A's prefill is due; no clock has ticked
    b.finish(b.plan(make_request(2, seed=9)).reservation_id, "cancelled")
    assert load(b, engine)[1] == 0, "the plan released the peer's due prefill first"
    assert load(b, engine)[0] == 1  # the reservation itself stays open until A closes it
