"""The engine's plan has one codec (`wire.engine_plan`): what the gateway writes for a
request, a split's prefill and its continuation is what the connector and the sim
engine read back."""

from __future__ import annotations

import json

import pytest

from quillcache.v1 import common_pb2, conductor_pb2
from quillcache_core.errors import InvalidArgument
from quillcache_core.identity.keys import block_identity
from quillcache_core.wire import engine_plan
from quillcache_core.wire.engine_plan import EnginePlan

pytestmark = pytest.mark.unit

A = conductor_pb2.BlockAction
IDENTITY = block_identity("m", "tok", cache_salt="salt-1")
HASHES = [f"{i:032x}" for i in range(6)]


def reply() -> conductor_pb2.PlanResponse:
    return conductor_pb2.PlanResponse(
        reservation_id="r-decode",
        engine_id="e-decode",
        hit_blocks=1,
        fetch_blocks=2,
        recompute_blocks=3,
        actions=[
            A(kind=A.LOCAL_HIT, block_index=0, block_count=1),
            A(kind=A.FETCH, block_index=1, block_count=2, source_node="s1",
              source_address="h:1", source_tier=common_pb2.TIER_LOCAL_SSD),
            A(kind=A.RECOMPUTE, block_index=3, block_count=3),
        ],
    )  # fmt: skip


def test_a_plan_reads_back_as_written_with_one_fetch_entry_a_block():
    plan = EnginePlan.from_json(
        json.loads(json.dumps(engine_plan.plan_json(reply(), IDENTITY, 16, HASHES)))
    )
    assert (plan.reservation_id, plan.engine_id, plan.block_size) == ("r-decode", "e-decode", 16)
    assert (plan.tenant_id, plan.cache_salt) == (IDENTITY.tenant_id, "salt-1")
    assert [(f.block_index, f.block_hash, f.tier) for f in plan.fetch] == [
        (1, HASHES[1], "local_ssd"),
        (2, HASHES[2], "local_ssd"),
    ]
    assert plan.disagg == ""


def test_a_split_prefill_fetches_nothing_and_says_so():
    base = engine_plan.plan_json(reply(), IDENTITY, 16, HASHES)
    plan = EnginePlan.from_json(engine_plan.for_prefill(base, "r-prefill", "e-prefill"))
    assert (plan.reservation_id, plan.engine_id, plan.fetch, plan.disagg) == (
        "r-prefill", "e-prefill", (), "prefill"
    )  # fmt: skip
    assert base["engine_id"] == "e-decode" and base["fetch"]  # the decode plan is untouched


def test_attach_keeps_the_clients_other_transfer_params_and_a_continuation_says_its_split():
    plan = engine_plan.continued(engine_plan.plan_json(reply(), IDENTITY, 16, HASHES), 40, 1)
    body = engine_plan.attach({"model": "m", "kv_transfer_params": {"other": 1}}, plan)
    params = body["kv_transfer_params"]
    assert params["other"] == 1
    assert params[engine_plan.FIELD]["continues"] == {"prompt_tokens": 40, "output_tokens": 1}
    assert EnginePlan.from_json(params[engine_plan.FIELD]).engine_id == "e-decode"
    # A client's non-object kv_transfer_params is replaced, not merged.
    assert engine_plan.attach({"kv_transfer_params": 3}, plan)["kv_transfer_params"] == {
        engine_plan.FIELD: plan
    }


def test_what_the_connector_reads_from_a_requests_params_is_what_the_gateway_planned():
    written = engine_plan.plan_json(reply(), IDENTITY, 16, HASHES)
    plan = EnginePlan.from_params(
        engine_plan.attach({"kv_transfer_params": {"x": 1}}, written)["kv_transfer_params"]
    )
    assert plan is not None and plan.planned and not plan.prefill_for_another
    assert plan.fetch_indices() == {1, 2}
    assert plan.sources() == {HASHES[1]: "h:1", HASHES[2]: "h:1"}
    split = EnginePlan.from_json(engine_plan.for_prefill(written, "r-p", "e-p"))
    assert split.prefill_for_another and split.fetch_indices() == frozenset()
    # A request without a plan, or params that are not an object, carry none.
    assert EnginePlan.from_params(None) is None
    assert EnginePlan.from_params({"other": 1}) is None
    assert EnginePlan.from_params([1, 2]) is None
    # The gateway's own fallback plan holds no reservation: not the conductor's.
    assert not EnginePlan.from_json({**written, "reservation_id": ""}).planned


@pytest.mark.parametrize(
    "change",
    [
        {"hit_blocks": "3"},
        {"hit_blocks": True},
        {"block_size": 1.5},
        {"reservation_id": 7},
        {"fetch": [{"block_index": "1", "block_hash": "a", "source_node": "s",
                    "source_address": "h:1", "tier": "cpu_dram"}]},
        {"fetch": [{"block_index": 1, "block_hash": "a", "source_node": "s",
                    "source_address": "h:1", "tier": "cpu_dram", "extra": 1}]},
        {"fetch": [{"block_index": 1}]},
        {"fetch": [{"block_index": 1, "block_hash": "a", "source_node": "s",
                    "source_address": "h:1", "tier": "floppy"}]},
    ],
)  # fmt: skip
def test_a_plan_of_the_wrong_shape_is_refused_with_its_reason_never_read_half(change):
    written = {**engine_plan.plan_json(reply(), IDENTITY, 16, HASHES), **change}
    with pytest.raises(InvalidArgument):
        EnginePlan.from_params({engine_plan.FIELD: written})
