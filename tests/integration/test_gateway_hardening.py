"""Every client mistake gets an OpenAI-shaped 4xx from the gateway, never a 5xx.

The regression cases are requests that once made the gateway answer 500 (a number the
conductor's protos cannot hold, JSON nested thousands deep, a lone surrogate reaching
the built-in tokenizer, ...); the fuzz test sends ten thousand generated bodies and
headers and then a valid request.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import re
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.gateway_fakes import MODEL, chat, completion, gateway_setup

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
SLO = "x-quillcache-ttft-slo-ms"
MAX_BODY = 64 * 1024


def dumps(payload) -> bytes:
    return json.dumps(payload).encode()


def raw_with(field: str, literal: str, base: dict | None = None) -> bytes:
    """A completion body with `field` set to a raw JSON literal (NaN, 1e999, ...)."""
    body = dumps(base or completion())
    return body[:-1] + f', "{field}": {literal}}}'.encode()


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (what, route, body, headers, status); headers default to a valid JSON request.
CASES = [
    ("max_tokens 1e12 as an int", COMPLETIONS, dumps(completion(max_tokens=10**12)), {}, 400),
    ("max_tokens 10**30", COMPLETIONS, dumps(completion(max_tokens=10**30)), {}, 400),
    ("max_tokens 1e12 as a float", COMPLETIONS, raw_with("max_tokens", "1e12"), {}, 400),
    ("max_tokens over the limit", CHAT, dumps(chat(max_tokens=1_000_001)), {}, 400),
    ("max_completion_tokens 10**30", CHAT, dumps(chat(max_completion_tokens=10**30)), {}, 400),
    ("max_tokens 0", COMPLETIONS, dumps(completion(max_tokens=0)), {}, 400),
    ("max_tokens a string", COMPLETIONS, dumps(completion(max_tokens="5")), {}, 400),
    ("max_tokens true", COMPLETIONS, dumps(completion(max_tokens=True)), {}, 400),
    ("slo header 1e30", COMPLETIONS, dumps(completion()), {SLO: "1e30"}, 400),
    ("slo header a huge integer", COMPLETIONS, dumps(completion()), {SLO: "9" * 30}, 400),
    ("slo header over an hour", COMPLETIONS, dumps(completion()), {SLO: "3600001"}, 400),
    ("slo header 2**32", COMPLETIONS, dumps(completion()), {SLO: str(2**32)}, 400),
    ("slo header negative", COMPLETIONS, dumps(completion()), {SLO: "-5"}, 400),
    ("slo header zero", COMPLETIONS, dumps(completion()), {SLO: "0"}, 400),
    ("slo header 1_000", COMPLETIONS, dumps(completion()), {SLO: "1_000"}, 400),
    ("body nested 5000 deep", COMPLETIONS, raw_with("x", nested(5000)), {}, 400),
    ("body nested 65 deep", COMPLETIONS, raw_with("x", nested(64)), {}, 400),
    ("a body that is only nesting", CHAT, nested(30_000).encode(), {}, 400),
    ("unbalanced nesting", CHAT, b"[" * 60_000, {}, 400),
    ("nested objects", CHAT, b'{"a":' * 3000 + b"1" + b"}" * 3000, {}, 400),
    (
        "lone surrogate in a prompt",
        COMPLETIONS,
        b'{"model": "sim-model", "prompt": "hi \\ud800 there"}',
        {},
        400,
    ),
    (
        "lone low surrogate in a prompt list",
        COMPLETIONS,
        b'{"model": "sim-model", "prompt": ["\\udc00"]}',
        {},
        400,
    ),
    (
        "lone surrogate in a chat message",
        CHAT,
        b'{"model": "sim-model", "messages": [{"role": "user", "content": "\\ud800"}]}',
        {},
        400,
    ),
    (
        "lone surrogate in a content part",
        CHAT,
        b'{"model": "sim-model", "messages": [{"role": "user", "content": '
        b'[{"type": "text", "text": "a\\uDBFF"}]}]}',
        {},
        400,
    ),
    ("NaN", COMPLETIONS, raw_with("temperature", "NaN"), {}, 400),
    ("Infinity", COMPLETIONS, raw_with("top_p", "Infinity"), {}, 400),
    ("-Infinity", COMPLETIONS, raw_with("seed", "-Infinity"), {}, 400),
    ("1e999", COMPLETIONS, raw_with("temperature", "1e999"), {}, 400),
    ("an integer of 5000 digits", COMPLETIONS, raw_with("seed", "9" * 5000), {}, 400),
    ("a seed over 2**64", COMPLETIONS, dumps(completion(seed=2**70)), {}, 400),
    ("not UTF-8", COMPLETIONS, b'{"model": "sim-model", "prompt": "\xff\xfe"}', {}, 400),
    ("a UTF-8 BOM", COMPLETIONS, b"\xef\xbb\xbf" + dumps(completion()), {}, 400),
    ("UTF-8 of a surrogate", COMPLETIONS, b'{"model": "m", "prompt": "\xed\xa0\x80"}', {}, 400),
    ("garbage gzip", COMPLETIONS, b"not gzip at all", {"Content-Encoding": "gzip"}, 400),
    ("a multipart body", COMPLETIONS, b"--x--", {"Content-Type": "multipart/form-data"}, 415),
    (
        "a UTF-16 charset",
        COMPLETIONS,
        dumps(completion()),
        {"Content-Type": "application/json; charset=utf-16"},
        415,
    ),
    ("over the size limit", COMPLETIONS, b" " * (MAX_BODY + 1), {}, 413),
    ("an unknown model", CHAT, dumps(chat(model="nope")), {}, 404),
    ("no API key", COMPLETIONS, dumps(completion()), {"Authorization": "Basic x"}, 401),
    ("an array body", COMPLETIONS, b"[1, 2]", {}, 400),
    ("a string body", COMPLETIONS, b'"prompt"', {}, 400),
    ("null", CHAT, b"null", {}, 400),
    ("an empty body", CHAT, b"", {}, 400),
    ("no model", COMPLETIONS, dumps({"prompt": "x"}), {}, 400),
    ("a model that is a number", COMPLETIONS, dumps(completion(model=5)), {}, 400),
    ("a prompt that is a number", COMPLETIONS, dumps(completion(prompt=5)), {}, 400),
    ("a prompt of mixed types", COMPLETIONS, dumps(completion(prompt=["a", 1])), {}, 400),
    ("an empty prompt list", COMPLETIONS, dumps(completion(prompt=[])), {}, 400),
    ("a token id over 2**32", COMPLETIONS, dumps(completion(prompt=[2**40])), {}, 400),
    ("a prompt that is null", COMPLETIONS, dumps(completion(prompt=None)), {}, 400),
    ("messages a string", CHAT, dumps(chat(messages="hi")), {}, 400),
    ("messages empty", CHAT, dumps(chat(messages=[])), {}, 400),
    ("a message not an object", CHAT, dumps(chat(messages=[1])), {}, 400),
    ("a message without a role", CHAT, dumps(chat(messages=[{"content": "x"}])), {}, 400),
    ("a role that is no role", CHAT, dumps(chat(messages=[{"role": "x", "content": ""}])), {}, 400),
    ("content a number", CHAT, dumps(chat(messages=[{"role": "user", "content": 5}])), {}, 400),
    ("stream a string", COMPLETIONS, dumps(completion(stream="yes")), {}, 400),
    ("stream_options a list", CHAT, dumps(chat(stream=True, stream_options=[])), {}, 400),
    ("temperature a string", COMPLETIONS, dumps(completion(temperature="hot")), {}, 400),
    ("temperature 1e300", CHAT, dumps(chat(temperature=1e300)), {}, 400),
    ("top_p 2", CHAT, dumps(chat(top_p=2)), {}, 400),
    ("n 0", COMPLETIONS, dumps(completion(n=0)), {}, 400),
    ("n 10**20", CHAT, dumps(chat(n=10**20)), {}, 400),
    ("n a float", CHAT, dumps(chat(n=1.5)), {}, 400),
    ("stop a number", COMPLETIONS, dumps(completion(stop=5)), {}, 400),
    ("stop a list of numbers", CHAT, dumps(chat(stop=[1, 2])), {}, 400),
    ("stop a thousand strings", CHAT, dumps(chat(stop=["x"] * 1000)), {}, 400),
    ("logit_bias out of range", CHAT, dumps(chat(logit_bias={"5": 1e9})), {}, 400),
    ("logprobs a string", COMPLETIONS, dumps(completion(logprobs="5")), {}, 400),
    ("logprobs a number on chat", CHAT, dumps(chat(logprobs=5)), {}, 400),
    ("presence_penalty -3", CHAT, dumps(chat(presence_penalty=-3)), {}, 400),
    ("user a number", CHAT, dumps(chat(user=5)), {}, 400),
]


async def post(session, url: str, route: str, body: bytes, headers: dict) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", **headers}
    async with session.post(url + route, data=body, headers=headers) as reply:
        return reply.status, await reply.read()


def assert_openai_error(status: int, data: bytes, what: str = "") -> dict:
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}, what
    assert isinstance(error["message"], str) and error["message"], what
    return error


def test_known_500s_and_other_mistakes_get_openai_shaped_4xx_and_plan_nothing():
    async def main():
        async with gateway_setup(max_body_bytes=MAX_BODY) as s:
            for what, route, body, headers, expected in CASES:
                status, data = await post(s.session, s.url, route, body, headers)
                assert status == expected, (what, status, data[:300])
                assert_openai_error(status, data, what)
            assert s.conductor.plans == []
            # What is fine still is: a surrogate pair (one character), nesting at the
            # limit, nulls for optional fields, a prompt of token ids, the longest SLO.
            fine = [
                (COMPLETIONS, b'{"model": "sim-model", "prompt": "smile \\ud83d\\ude00"}', {}),
                (COMPLETIONS, raw_with("x", nested(63)), {}),
                (CHAT, dumps(chat(stream=None, temperature=None, stop=None, n=None)), {}),
                (COMPLETIONS, dumps(completion(prompt=list(range(40)), stream=True)), {}),
                (CHAT, dumps(chat(max_tokens=1_000_000, stop=["a"] * 4)), {SLO: "3600000"}),
                (COMPLETIONS, gzip.compress(dumps(completion())), {"Content-Encoding": "gzip"}),
                (CHAT, dumps(chat()), {"Content-Type": "text/plain; charset=UTF-8"}),
            ]
            for route, body, headers in fine:
                status, data = await post(s.session, s.url, route, body, headers)
                assert status == 200, (body[:100], data[:300])
            assert len(s.conductor.plans) == len(fine)
            longest = s.conductor.plans[4]
            assert (longest.slo.ttft_ms, longest.expected_decode_tokens) == (3_600_000, 10**6)
            text = await s.metrics()
            assert not re.search(r'gateway_requests_total\{[^}]*status="5', text)

    asyncio.run(main())


# --- the fuzz test -------------------------------------------------------------------

FIELDS = [
    "model", "prompt", "messages", "stream", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "n", "stop", "seed", "logprobs", "top_logprobs", "echo",
    "stream_options", "logit_bias", "user", "presence_penalty", "cache_salt",
    "kv_transfer_params", "best_of", "suffix", "tools",
]  # fmt: skip
NASTY_STRINGS = ["", "sim-model", "\ud800", "a\udfff", "\ud83d\ude00", "\x00", "é" * 3, "}"]
numbers = st.one_of(
    st.integers(),
    st.integers(min_value=1, max_value=2**70),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([0, -1, 1, 2**31, 2**32, 2**63, 2**64, 10**12, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
)
EDGES = [0, -1, 1, 2.5, 2**31, 2**32, 2**63, 2**64, 10**12, 10**30, 1e300, -1e300, True]
strings = st.one_of(st.text(max_size=12), st.sampled_from(NASTY_STRINGS))
scalars = st.one_of(st.none(), st.booleans(), numbers, strings)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(strings, inner, max_size=3),
    max_leaves=6,
)
message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "system", "assistant", "tool", "nobody"]) | values,
        "content": strings | values,
    },
)
prompts = st.one_of(strings, st.lists(strings, max_size=3), st.lists(numbers, max_size=4), values)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from([MODEL, MODEL, "other"]) | values,
        "prompt": prompts,
        "messages": st.lists(message, max_size=3) | values,
        **{name: numbers | scalars | values for name in FIELDS[3:]},
    },
)
HEADER_TEXT = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
    max_size=24,
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "Authorization": st.sampled_from(["Bearer k-acme", "Bearer nope", "bearer k-acme", ""])
        | HEADER_TEXT,
        SLO: st.sampled_from(["1", "800", "1e30", "9" * 40, "-1", "0x10", " 7 ", "3600000"])
        | HEADER_TEXT,
        "Content-Type": st.sampled_from(
            [
                "application/json",
                "text/plain",
                "multipart/form-data; boundary=x",
                "application/json; charset=latin-1",
                "application/json; charset=",
                ";;;",
            ]
        )
        | HEADER_TEXT,
    },
)


def mutate(body: bytes, rng: random.Random) -> bytes:
    """A raw-bytes variant: deep nesting, NaN, truncation, garbage, an odd size."""
    cut = body[: rng.randrange(len(body) + 1)]
    choices = [
        lambda: body[:-1] + b', "x": ' + nested(rng.choice([63, 64, 65, 5000])).encode() + b"}",
        lambda: body[:-1] + b', "temperature": ' + rng.choice([b"NaN", b"-Infinity", b"1e999"]) + b"}",
        lambda: body.replace(b'"', b"'", 1),
        lambda: cut,
        lambda: cut + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8))),
        lambda: body[:-1] + b', "prompt": "\\ud800"}',
        lambda: body[:-1] + b', "seed": ' + b"7" * rng.choice([20, 4400]) + b"}",
        lambda: b"[" * rng.randrange(1, 60_000),
        lambda: b" " * (MAX_BODY + rng.randrange(1, 100)),
        lambda: b"\xef\xbb\xbf" + body,
        lambda: b"\xff" + body,
    ]  # fmt: skip
    return rng.choice(choices)()


POOL = 5  # bodies and headers hypothesis draws an example
BATCH = 50  # requests an example sends, each a variant of its pool's
EXAMPLES = 200


NUMERIC = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed",
           "logprobs", "top_logprobs", "presence_penalty", "best_of"]  # fmt: skip


def variants(pool: list[tuple[dict, dict]], edges: list, rng: random.Random):
    """BATCH requests (route, raw body, headers) from a pool, by a fast loop: a valid
    body with one of a pool body's fields (so each odd value reaches the later checks
    and the plan), a valid body under a whole pool body, two crossed, a pool body as
    it is; and a third of them mutated as raw bytes."""
    for _ in range(BATCH):
        body, hdrs = rng.choice(pool)
        route = rng.choice([COMPLETIONS, CHAT])
        roll = rng.random()
        base = completion() if route == COMPLETIONS else chat()
        if roll < 0.15:  # an edge number in a numeric field of a valid body
            body = {**base, rng.choice(NUMERIC): rng.choice(edges)}
        elif roll < 0.35 and body:  # one odd field: it reaches the plan unless refused
            name = rng.choice(sorted(body))
            body = {**base, name: body[name]}
        elif roll < 0.5:
            body = {**base, **body}
        elif roll < 0.65:
            other, more = rng.choice(pool)
            body = {**body, **{k: v for k, v in other.items() if rng.random() < 0.5}}
            hdrs = {**hdrs, **more}
        if rng.random() < 0.5:  # the session's valid key: more of them get past it
            hdrs = {k: v for k, v in hdrs.items() if k != "Authorization"}
        raw = json.dumps(body).encode()
        if rng.random() < 0.3:
            raw = mutate(raw, rng)
        yield route, raw, hdrs


def test_ten_thousand_fuzzed_requests_get_no_5xx_and_the_gateway_serves_on():
    loop = asyncio.new_event_loop()
    counts = {"sent": 0, "statuses": {}}
    started = time.perf_counter()

    async def fire(s, pool, edges, seed):
        sem = asyncio.Semaphore(16)

        async def one(route, raw, hdrs):
            async with sem, s.session.post(s.url + route, data=raw, headers=hdrs) as reply:
                data = await reply.read()
            counts["sent"] += 1
            counts["statuses"][reply.status] = counts["statuses"].get(reply.status, 0) + 1
            assert reply.status < 500, (route, raw[:300], hdrs, reply.status, data[:300])
            if reply.status >= 400:
                assert_openai_error(reply.status, data, raw[:200])

        requests = variants(pool, edges, random.Random(seed))
        await asyncio.gather(*(one(*request) for request in requests))

    async def start():
        manager = gateway_setup(max_body_bytes=MAX_BODY)
        return manager, await manager.__aenter__()

    manager, s = loop.run_until_complete(start())
    try:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(
            pool=st.lists(st.tuples(bodies, headers), min_size=POOL, max_size=POOL),
            edges=st.lists(numbers, min_size=3, max_size=3),
            seed=st.integers(0, 2**32),
        )
        def send(pool, edges, seed):
            loop.run_until_complete(fire(s, pool, edges + EDGES, seed))

        send()
        assert counts["sent"] >= 10_000, counts
        # Some of each: served, refused, refused for its key, too large.
        assert {200, 400, 401, 413} <= set(counts["statuses"]), counts

        async def still_serving():
            for route, body in ((COMPLETIONS, completion(stream=True)), (CHAT, chat())):
                async with s.session.post(s.url + route, json=body) as reply:
                    assert reply.status == 200
                    await reply.read()
            await asyncio.sleep(0.05)
            assert len(s.gateway.open_plans) == 0
            assert not re.search(r'gateway_requests_total\{[^}]*status="5', await s.metrics())

        loop.run_until_complete(still_serving())
    finally:
        loop.run_until_complete(manager.__aexit__(None, None, None))
        loop.close()
    print(f"fuzz: {counts} in {time.perf_counter() - started:.1f} s")
