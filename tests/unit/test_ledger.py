"""The reservation ledger: what a reservation charges its engine, and when each part of
it comes back (prefill when due, the rest at close or expiry), its overlay records."""

from __future__ import annotations

import pytest

from quillcache_conductor.ledger import ReservationLedger
from quillcache_conductor.records import Reservation
from quillcache_core.model import CacheResidency, CacheTier, WorkerState
from tests.unit.factories import make_request

pytestmark = pytest.mark.unit


def reservation(rid: str, *, engine: str = "e0", prefill: int = 100, blocks: int = 4,
                expires: float = 60.0) -> Reservation:  # fmt: skip
    return Reservation(rid, engine, prefill, blocks, created_s=0.0, expires_s=expires)


def load(w: WorkerState) -> tuple[int, int, int, int]:
    return w.inflight_requests, w.running_decodes, w.queued_prefill_tokens, w.inflight_blocks


def records(engine: str, n: int) -> list[CacheResidency]:
    return [CacheResidency(k, engine, CacheTier.HBM, 1) for k in make_request(n).blocks]


def test_a_reservation_charges_its_engine_until_due_and_closed():
    worker = WorkerState(id="e0", locality_domain="r")
    ledger = ReservationLedger({})
    ledger.add(reservation("a"), worker, prefill_due_s=5.0)
    assert load(worker) == (1, 1, 100, 4) and "a" in ledger
    assert ledger.advance(4.9) == [] and load(worker)[2] == 100
    assert ledger.advance(5.0) == [] and load(worker) == (1, 1, 0, 4)  # prefill released
    closed = ledger.close("a")
    assert closed is not None and load(worker) == (0, 0, 0, 0) and len(ledger) == 0
    assert ledger.close("a") is None  # once


def test_no_due_time_releases_the_prefill_at_once_and_expiry_closes_it():
    worker = WorkerState(id="e0", locality_domain="r")
    ledger = ReservationLedger({})
    ledger.add(reservation("b", expires=10.0), worker, prefill_due_s=None)
    assert load(worker) == (1, 1, 0, 4)
    expired = ledger.advance(10.0)
    assert [r.id for r in expired] == ["b"] and load(worker) == (0, 0, 0, 0)


def test_a_resolving_ledger_releases_the_entry_the_engine_has_now():
    """The state's ledger: an engine that rejoined has a new entry; a close releases it
    there (and tells the owner), not on the entry charged at open."""
    old, new = WorkerState(id="e0", locality_domain="r"), WorkerState(id="e0", locality_domain="r")
    current = {"e0": old}
    released = []
    ledger = ReservationLedger({}, resolve=lambda res: current.get(res.engine_id),
                               on_release=lambda res, w: released.append((res.id, w is new)))  # fmt: skip
    ledger.add(reservation("c"), old, prefill_due_s=1.0)
    current["e0"] = new
    new.inflight_requests, new.running_decodes, new.queued_prefill_tokens = 1, 1, 100
    new.inflight_blocks = 4
    ledger.close("c")
    assert load(new) == (0, 0, 0, 0) and load(old) == (1, 1, 100, 4)
    assert released == [("c", True)]
    # An engine gone altogether: nothing to release, nothing breaks.
    current.clear()
    ledger.add(reservation("d"), old, prefill_due_s=1.0)
    assert ledger.close("d") is not None


def test_overlay_records_linger_after_a_close_and_go_with_the_engines_cache():
    overlay: dict = {}
    worker = WorkerState(id="e0", locality_domain="r")
    ledger = ReservationLedger(overlay)
    ledger.add(reservation("e"), worker, 1.0, records("e0", 3))
    ledger.add(reservation("f", engine="e1"), None, 1.0, records("e1", 2))
    assert sum(len(v) for v in overlay.values()) == 5
    ledger.linger(ledger.close("e"), until_s=3.0)
    ledger.advance(2.9)
    assert sum(len(v) for v in overlay.values()) == 5  # still lingering
    ledger.advance(3.0)
    assert {r.worker_id for v in overlay.values() for r in v} == {"e1"}
    ledger.forget_engine("e1")  # its cache was emptied: the open one's records go too
    assert overlay == {} and "f" in ledger


def test_a_split_shrinks_the_prefill_its_decode_engine_still_computes():
    worker = WorkerState(id="e0", locality_domain="r")
    ledger = ReservationLedger({})
    res = reservation("g", prefill=100)
    ledger.add(res, worker, 9.0)
    ledger.shrink_prefill(res, worker, 16)
    assert worker.queued_prefill_tokens == 16 and res.prefill_tokens == 16
    ledger.advance(9.0)
    assert worker.queued_prefill_tokens == 0
