"""The gateway's side of a split plan that needs no process: the client's header, the
prefill call's body, the answer's headers."""

from __future__ import annotations

import json

import pytest

from quillcache.v1 import conductor_pb2
from quillcache_gateway.disagg import answer_headers, prefill_body, requested_mode
from quillcache_gateway.errors import ApiError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("value", "mode"), [(None, ""), ("", ""), (" Split ", "split"), ("colocated", "colocated")]
)
def test_the_clients_header_names_a_mode(value, mode):
    assert requested_mode(value) == mode


@pytest.mark.parametrize("value", ["both", "split;", "auto\r\nx: y", "ｓplit"])
def test_any_other_header_is_a_400_naming_it(value):
    with pytest.raises(ApiError) as err:
        requested_mode(value)
    assert err.value.status == 400


def test_the_prefill_call_is_the_request_cut_to_one_token_whole_and_salted():
    payload = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 300,
        "max_completion_tokens": 300,
        "n": 2,
        "kv_transfer_params": {"other": 1},
        "cache_salt": "client's",
    }
    body = json.loads(prefill_body(payload, "tenant-salt", {"disagg": "prefill"}))
    assert body["stream"] is False and "stream_options" not in body
    assert body["max_tokens"] == body["max_completion_tokens"] == body["n"] == 1
    assert body["cache_salt"] == "tenant-salt"
    assert body["kv_transfer_params"] == {"other": 1, "quillcache": {"disagg": "prefill"}}
    assert body["messages"] == payload["messages"]
    assert payload["stream"] is True  # the client's own body is untouched


def test_the_answer_says_what_was_chosen_then_what_was_done():
    assert answer_headers(conductor_pb2.PlanResponse(), {}) == {}
    plan = conductor_pb2.PlanResponse(disagg="split", disagg_reason="split; cheaper")
    assert answer_headers(plan, {}) == {"x-quillcache-disagg": "split; cheaper"}
    done = {"x-quillcache-disagg": "colocated; fallback: transfer failed"}
    assert answer_headers(plan, done)["x-quillcache-disagg"].startswith("colocated; fallback")
