"""A split answer's first token from the prefill call: which requests are continued, the
continuation's body, and the client's one answer put together (continuation.py)."""

from __future__ import annotations

import json

import pytest

from quillcache_core.wire import engine_plan
from quillcache_gateway.continuation import (
    StreamShaper,
    continuable,
    continuation_body,
    read_first_token,
    whole_answer,
)

pytestmark = pytest.mark.unit

PROMPT_IDS = [1, 5, 9, 12]


def prefill_answer(chat: bool, *, finish: str = "length", text: str = " Hello") -> bytes:
    """A prefill engine's whole answer with token ids, as vLLM gives it."""
    usage = {
        "prompt_tokens": 4,
        "completion_tokens": 1,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
            "token_ids": [42],
        }
        body = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 7,
            "model": "m",
            "choices": [choice],
            "prompt_token_ids": PROMPT_IDS,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "finish_reason": finish,
            "token_ids": [42],
            "prompt_token_ids": PROMPT_IDS,
        }
        body = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m"}
        body["choices"] = [choice]
    return json.dumps({**body, "usage": usage}).encode()


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ({"model": "m", "prompt": "p", "max_tokens": 9, "temperature": 0.7}, ""),
        ({"model": "m", "messages": [], "stream": True, "ignore_eos": True}, ""),
        ({"model": "m", "prompt": "p", "n": 1, "stop": [], "logprobs": None}, ""),
        ({"model": "m", "messages": [], "logprobs": False, "presence_penalty": 0}, ""),
        ({"model": "m", "prompt": "p", "seed": 3}, "seed given"),
        ({"model": "m", "prompt": "p", "logprobs": 0}, "logprobs given"),
        ({"model": "m", "messages": [], "logprobs": True}, "logprobs given"),
        ({"model": "m", "prompt": "p", "n": 2}, "n given"),
        ({"model": "m", "prompt": "p", "n": True}, "n given"),
        ({"model": "m", "prompt": "p", "stop": ["\n"]}, "stop given"),
        ({"model": "m", "prompt": "p", "frequency_penalty": 0.5}, "frequency_penalty given"),
        ({"model": "m", "messages": [], "tools": [{"type": "function"}]}, "tools given"),
        ({"model": "m", "prompt": "p", "echo": True}, "echo given"),
        ({"model": "m", "prompt": "p", "some_extension": 1}, "some_extension given"),
    ],
)
def test_only_requests_a_continuation_answers_faithfully_are_continued(payload, why):
    assert continuable(payload) == why


@pytest.mark.parametrize("chat", [False, True])
def test_the_first_token_and_the_ids_are_read_from_the_prefill_answer(chat):
    first = read_first_token(prefill_answer(chat), chat=chat)
    assert first is not None
    assert (first.text, first.token_ids, first.prompt_token_ids) == (" Hello", [42], PROMPT_IDS)
    assert (first.prompt_tokens, first.completion_tokens) == (4, 1)
    assert not first.ends_answer({"max_tokens": 2})
    assert not first.ends_answer({})  # the engine's default budget
    assert first.ends_answer({"max_tokens": 1})
    ended = read_first_token(prefill_answer(chat, finish="stop"), chat=chat)
    assert ended.ends_answer({"max_tokens": 50})


@pytest.mark.parametrize(
    "data", [b"{}", b"not json", b'{"choices": []}', prefill_answer(False).replace(b"42", b'"x"')]
)
def test_an_answer_without_token_ids_cannot_be_continued(data):
    assert read_first_token(data, chat=False) is None


def test_the_continuation_is_a_completion_over_the_prompt_and_the_first_token():
    first = read_first_token(prefill_answer(True), chat=True)
    payload = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 30,
        "max_tokens": 99,
        "min_tokens": 4,
        "temperature": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"x": 1},
        "kv_transfer_params": {"other": 1},
    }
    plan = engine_plan.continued(
        {"engine_id": "e1", "fetch": []}, len(first.prompt_token_ids), first.completion_tokens
    )
    body = json.loads(continuation_body(payload, first, "salt", plan))
    assert body["prompt"] == PROMPT_IDS + [42]
    assert body["max_tokens"] == 29 and body["min_tokens"] == 3
    assert body["temperature"] == 0.5 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert "messages" not in body and "chat_template_kwargs" not in body
    assert body["cache_salt"] == "salt"
    quillcache = body["kv_transfer_params"]["quillcache"]
    assert quillcache["continues"] == {"prompt_tokens": 4, "output_tokens": 1}
    assert body["kv_transfer_params"]["other"] == 1
    # no budget given: the engine's default, which counts the continuation's prompt
    body = json.loads(continuation_body({"model": "m", "prompt": "p"}, first, "s", plan))
    assert "max_tokens" not in body


def sse(events: list[dict | str]) -> bytes:
    return b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


def parse(raw: bytes) -> list:
    out = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            data = block[6:]
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def continuation_stream(usage: bool) -> bytes:
    events = [
        {"id": "cmpl-9", "object": "text_completion", "created": 8, "model": "m",
         "choices": [{"index": 0, "text": " world", "finish_reason": None}]},
        {"id": "cmpl-9", "object": "text_completion", "created": 8, "model": "m",
         "choices": [{"index": 0, "text": "!", "finish_reason": "length",
                      "stop_reason": None}], "quillcache": {"engine_id": "e1"}},
    ]  # fmt: skip
    if usage:
        events.append(
            {"id": "cmpl-9", "object": "text_completion", "created": 8, "model": "m",
             "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                      "total_tokens": 7,
                                      "prompt_tokens_details": {"cached_tokens": 4}}}
        )  # fmt: skip
    return sse([*events, "[DONE]"])


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("cut", [1, 7, 40, 10_000])
def test_a_streamed_answer_is_one_stream_in_the_clients_format(chat, cut):
    first = read_first_token(prefill_answer(chat), chat=chat)
    shaper = StreamShaper(first, include_usage=True)
    raw = shaper.first_events(False)
    stream = continuation_stream(usage=True)
    for i in range(0, len(stream), cut):  # however the engine's bytes are cut
        raw += shaper.feed(stream[i : i + cut])
    raw += shaper.close()
    events = parse(raw)
    assert events[-1] == "[DONE]" and raw.endswith(b"data: [DONE]\n\n")
    chunks = events[:-1]
    kind = "chat.completion.chunk" if chat else "text_completion"
    assert {(c["id"], c["object"], c["created"]) for c in chunks} == {(first.body["id"], kind, 7)}
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == " Hello world!"
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "length" and set(finish[:-1]) == {None}
    assert chunks[-2]["quillcache"] == {"engine_id": "e1"}  # the decode engine's extras
    # usage as one run's: the first token is output, not prompt; cached: the decode engine's
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


@pytest.mark.parametrize("chat", [False, True])
def test_a_first_token_that_ends_the_answer_is_the_whole_stream(chat):
    first = read_first_token(prefill_answer(chat, finish="stop"), chat=chat)
    events = parse(StreamShaper(first, include_usage=True).first_events(True))
    assert events[-1] == "[DONE]"
    last_choice = [e for e in events[:-1] if e["choices"]][-1]["choices"][0]
    assert last_choice["finish_reason"] == "stop"
    assert events[-2]["usage"]["completion_tokens"] == 1
    without = parse(StreamShaper(first, include_usage=False).first_events(True))
    assert all("usage" not in e for e in without[:-1])


@pytest.mark.parametrize("chat", [False, True])
def test_a_whole_answer_joins_the_first_token_and_the_continuation(chat):
    first = read_first_token(prefill_answer(chat), chat=chat)
    continuation = {
        "id": "cmpl-9",
        "object": "text_completion",
        "choices": [{"index": 0, "text": " world", "finish_reason": "length", "token_ids": None}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        "quillcache": {"engine_id": "e1"},
    }
    body = json.loads(whole_answer(first, json.dumps(continuation).encode()))
    choice = body["choices"][0]
    assert (choice["message"]["content"] if chat else choice["text"]) == " Hello world"
    assert choice["finish_reason"] == "length"
    assert "token_ids" not in choice and "prompt_token_ids" not in choice
    assert "prompt_token_ids" not in body  # asked by the gateway, not the client
    assert body["id"] == first.body["id"]
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    assert body["quillcache"] == {"engine_id": "e1"}
    with pytest.raises(ValueError):
        whole_answer(first, b'{"choices": []}')
    alone = json.loads(whole_answer(first, None))
    assert alone["usage"] == first.body["usage"] and "token_ids" not in alone["choices"][0]
