"""The gateway's request checks and tenant buckets, without sockets."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache_core.process.metrics import MetricsRegistry
from quillcache_gateway.errors import ApiError
from quillcache_gateway.limits import TenantLimit, TenantLimiter
from quillcache_gateway.validate import check_content_type, check_depth, loads, parse_slo

pytestmark = pytest.mark.unit


def depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


json_values = st.recursive(
    st.none() | st.integers() | st.text(alphabet='[]{}"\\ab\n\u00e9', max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(value=json_values, limit=st.integers(1, 8))
def test_the_depth_scan_agrees_with_the_parsed_depth(value, limit):
    raw = json.dumps(value, ensure_ascii=False).encode()
    if depth(value) <= limit:
        check_depth(raw, limit)
    else:
        with pytest.raises(ApiError, match="deeper than"):
            check_depth(raw, limit)


def test_brackets_in_strings_do_not_nest_and_deep_bodies_are_refused_fast():
    check_depth(json.dumps({"a": "[[[[{{{{" * 100, "b": '\\"[[[[\n"'}).encode(), 2)
    # Nesting that stays near the limit over many chunks of brackets.
    check_depth(b"[" * 62 + b"[[]]" * 1000 + b"]" * 62, 64)
    with pytest.raises(ApiError):
        check_depth(b"[" * 63 + b"[[]]" * 1000 + b"]" * 63, 64)
    with pytest.raises(ApiError):
        check_depth(b"[]" * 1000 + b"[" * 65 + b"]" * 65, 64)
    for body in ("[" * 100_000 + "]" * 100_000, "[" * 200_000, '{"a":' * 50_000):
        with pytest.raises(ApiError) as refused:
            loads(body.encode(), 64)
        assert refused.value.status == 400


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": NaN}',
        b'{"a": -Infinity}',
        b'{"a": 1e400}',
        b'{"a": ' + b"1" * 5000 + b"}",
        b'{"a": "\\ud800"}',
        b'{"\\udfff": 1}',
        b"\xff",
        b"[]",
        b"",
    ],
)
def test_bodies_that_are_no_json_object_are_400(raw):
    with pytest.raises(ApiError) as refused:
        loads(raw, 64)
    assert refused.value.status == 400


def test_a_surrogate_pair_is_one_character():
    assert loads(b'{"a": "\\ud83d\\ude00"}', 64) == {"a": "\U0001f600"}


def test_slo_header_bounds():
    assert parse_slo(None, 800, 3_600_000, "h") == 800
    assert parse_slo(" 250 ", 800, 3_600_000, "h") == 250
    for bad in ("0", "-1", "1e3", "3600001", "9" * 40, "١٢", "1_0", "", "0x10"):
        with pytest.raises(ApiError):
            parse_slo(bad, 800, 3_600_000, "h")


def test_content_types():
    for fine in (None, "", "application/json", "text/plain; charset=UTF-8", "x/y; charset="):
        check_content_type(fine)
    for bad in ("multipart/form-data; boundary=x", "application/json; charset=utf-16"):
        with pytest.raises(ApiError) as refused:
            check_content_type(bad)
        assert refused.value.status == 415


def test_buckets_refill_at_their_rate_and_say_how_long_to_wait():
    now = [100.0]
    metrics = MetricsRegistry()
    limiter = TenantLimiter(
        {"a": TenantLimit(rps=2, tpm=120, concurrent=0)},
        TenantLimit(concurrent=1),
        metrics,
        clock=lambda: now[0],
    )
    limiter.enter("a")
    limiter.enter("a")
    with pytest.raises(ApiError) as refused:
        limiter.enter("a")
    assert (refused.value.status, refused.value.headers) == (429, {"Retry-After": "1"})
    now[0] += 0.5  # one request's worth
    limiter.enter("a")
    limiter.charge("a", 100)
    with pytest.raises(ApiError) as refused:
        limiter.charge("a", 30)  # 20 left, 2 a second: 5 s to wait
    assert refused.value.headers == {"Retry-After": "5"} and refused.value.type == "tokens"
    now[0] += 5
    limiter.charge("a", 30)
    # The default: one in flight.
    limiter.enter("b")
    with pytest.raises(ApiError):
        limiter.enter("b")
    limiter.leave("b")
    limiter.enter("b")
    text = metrics.render()
    assert 'quillcache_gateway_tenant_rejected_total{limit="rps",tenant="a"} 1' in text
    assert 'quillcache_gateway_tenant_rejected_total{limit="tpm",tenant="a"} 1' in text
    assert 'quillcache_gateway_tenant_rejected_total{limit="concurrent",tenant="b"} 1' in text
    assert 'quillcache_gateway_tenant_prompt_tokens_total{tenant="a"} 130' in text
    assert 'quillcache_gateway_tenant_in_flight{tenant="a"} 3' in text
