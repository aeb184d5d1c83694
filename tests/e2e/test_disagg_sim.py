"""Prefill/decode disaggregation on the local cluster with sim engines: engine-0 prefills,
engine-1 decodes, on two store nodes with the transfer service between them.

A split request is prefilled on engine-0 (which stores the prompt's KV bytes in its store
node before it answers, and samples the answer's first token, which the client gets at
once), the KV moves to engine-1's store node, and engine-1 continues from the first
token, loading the prompt's KV (byte for byte checked against the block's content)
instead of recomputing it; whatever breaks on the way, the client still gets its answer,
colocated, the same as a colocated run's.
"""

from __future__ import annotations

import json
import signal
import ssl
import time
import urllib.error
import urllib.request

import pytest

from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.security.credentials import tenant_context
from tests.support.cluster import https

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PROMPT = "The pool keeps the prompt's KV so the decode engine need not compute it. " * 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    lc = LocalCluster(
        tmp_path_factory.mktemp("disagg"),
        time_scale=0.05,
        engine_options={
            0: {"role": "prefill", "sim_args": ["--kv-layers", "2", "--kv-heads", "2"]},
            1: {"role": "decode", "sim_args": ["--kv-layers", "2", "--kv-heads", "2"]},
        },
        log=lambda *_: None,
    )
    endpoints = lc.start()
    try:
        yield lc, endpoints
    except BaseException:
        for child in lc.children:
            print(f"--- {child.name}\n{child.log_tail(20)}")
        raise
    finally:
        lc.stop()


def acme_request(endpoints, path: str, body: dict, headers: dict | None = None):
    """A POST of `body` to the gateway as acme."""
    return urllib.request.Request(
        endpoints["gateway_url"] + path,
        data=json.dumps(body).encode(),
        headers={
            "Authorization": f"Bearer {endpoints['api_keys']['acme']}",
            "Content-Type": "application/json",
            **(headers or {}),
        },
    )


def post(endpoints, path: str, body: dict, headers: dict | None = None):
    """(status, headers, body bytes) of one gateway call, errors included."""
    request = acme_request(endpoints, path, body, headers)
    context: ssl.SSLContext | None = tenant_context(endpoints)
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def sim_stats(endpoints, i: int) -> dict:
    with urllib.request.urlopen(
        endpoints["engines"][i] + "/sim/stats", timeout=5, context=https(endpoints)
    ) as reply:
        return json.loads(reply.read())


def completion(prompt: str = PROMPT, **extra) -> dict:
    return {"model": "sim-model", "prompt": prompt, "max_tokens": 48, "temperature": 0, **extra}


def sse_pieces(raw: bytes, key: str) -> list[str]:
    """The content of each streamed event with a choice, in order."""
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: {") and json.loads(line[6:])["choices"]:
            choice = json.loads(line[6:])["choices"][0]
            out.append(choice["delta"].get("content") or "" if key == "chat" else choice["text"])
    return out


def sse_text(raw: bytes, key: str) -> str:
    return "".join(sse_pieces(raw, key))


def sse_usage(raw: bytes) -> dict:
    lines = [line for line in raw.decode().splitlines() if line.startswith("data: {")]
    return next(u for u in (json.loads(line[6:]).get("usage") for line in reversed(lines)) if u)


def counts(usage: dict) -> tuple[int, int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def test_a_split_request_is_decoded_from_the_kv_the_prefill_engine_stored(cluster):
    _, endpoints = cluster
    before = [sim_stats(endpoints, i) for i in (0, 1)]
    status, headers, body = post(endpoints, "/v1/completions", completion())
    assert status == 200, body
    assert headers["x-quillcache-disagg"].startswith("split; decode-only engine")
    assert headers["x-quillcache-prefill-engine"] == "engine-0"
    assert headers["x-quillcache-decode-engine"] == headers["x-quillcache-engine"] == "engine-1"
    assert headers["x-quillcache-first-token"] == "prefill"  # engine-1 continued from it
    answer = json.loads(body)
    prompt_tokens = answer["usage"]["prompt_tokens"]
    loadable = (prompt_tokens - 1) // 16
    assert int(headers["x-quillcache-transfer-blocks"]) == loadable
    assert int(headers["x-quillcache-fetch-blocks"]) == loadable
    # engine-1 loaded every full block of the prompt and computed only the rest
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == loadable * 16
    after = [sim_stats(endpoints, i) for i in (0, 1)]
    assert after[1]["engine"]["fetched_blocks"] - before[1]["engine"]["fetched_blocks"] == loadable
    assert after[1]["store"]["fetch_mismatches"] == 0
    # both sides in one exchange with their store's data port, not one RPC per block
    assert after[1]["store"]["batched_fetches"] - before[1]["store"]["batched_fetches"] == loadable
    assert after[0]["store"]["batched_puts"] - before[0]["store"]["batched_puts"] == loadable
    assert (
        after[0]["engine"]["written_through_blocks"] - before[0]["engine"]["written_through_blocks"]
        == loadable
    )
    # the same request colocated (asked for): the same greedy answer, all computed
    status, headers, body = post(
        endpoints, "/v1/completions", completion(), {"x-quillcache-disagg": "colocated"}
    )
    assert status == 200 and headers["x-quillcache-disagg"] == "colocated; asked for"
    colocated = json.loads(body)
    assert colocated["choices"][0]["text"] == answer["choices"][0]["text"]
    # one answer, counted as the colocated one: the first token is output, not prompt
    assert (
        counts(answer["usage"])
        == counts(colocated["usage"])
        == (prompt_tokens, 48, prompt_tokens + 48)
    )


def test_a_streamed_chat_is_split_and_streams_as_before(cluster):
    _, endpoints = cluster
    body = {
        "model": "sim-model",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 40,
        "messages": [{"role": "user", "content": PROMPT + " (chat)"}],
    }
    status, headers, raw = post(endpoints, "/v1/chat/completions", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert headers["x-quillcache-disagg"].startswith("split")
    assert headers["x-quillcache-first-token"] == "prefill"
    assert raw.rstrip().endswith(b"data: [DONE]")
    split_headers, split_pieces, split_usage = headers, sse_pieces(raw, "chat"), sse_usage(raw)
    lines = raw.decode().splitlines()
    ids = {json.loads(line[6:])["id"] for line in lines if line.startswith("data: {")}
    assert len(ids) == 1  # one answer, not two engines' answers
    status, headers, raw = post(
        endpoints, "/v1/chat/completions", body, {"x-quillcache-disagg": "colocated"}
    )
    assert status == 200 and headers["x-quillcache-disagg"].startswith("colocated")
    colocated = sse_pieces(raw, "chat")
    assert "".join(colocated) == "".join(split_pieces) and colocated[1]
    assert split_pieces[1] == colocated[1]  # the first token (after the role's chunk)
    assert counts(split_usage) == counts(sse_usage(raw))
    loadable = (split_usage["prompt_tokens"] - 1) // 16
    assert split_usage["prompt_tokens_details"]["cached_tokens"] == loadable * 16  # loaded
    # The headers went out with the first token, before the KV moved between the two
    # store nodes: what engine-1 is to load, no transfer figures yet.
    assert int(split_headers["x-quillcache-fetch-blocks"]) == loadable
    assert "x-quillcache-transfer-blocks" not in split_headers


def open_stream(endpoints, path: str, body: dict):
    request = acme_request(endpoints, path, body)
    return urllib.request.urlopen(request, timeout=30, context=tenant_context(endpoints))


def test_the_first_token_streams_while_the_decode_engine_answers_nothing(cluster):
    lc, endpoints = cluster
    body = completion(PROMPT + " (first)", stream=True, max_tokens=24)
    decode = next(c for c in lc.children if c.name == "engine-1")
    decode.proc.send_signal(signal.SIGSTOP)  # engine-1 (the decode engine) is frozen
    try:
        started = time.perf_counter()
        reply = open_stream(endpoints, "/v1/completions", body)
        line = b""
        while not line.startswith(b"data: {"):
            line = reply.readline()
        first_s = time.perf_counter() - started
    finally:
        decode.proc.send_signal(signal.SIGCONT)
    with reply:
        headers, rest = dict(reply.headers), line + reply.read()
    assert headers["x-quillcache-first-token"] == "prefill"
    assert headers["x-quillcache-decode-engine"] == "engine-1"
    # the rest came from engine-1 once it ran again, continuing from the first token
    status, _, raw = post(endpoints, "/v1/completions", body, {"x-quillcache-disagg": "colocated"})
    assert status == 200
    assert sse_pieces(rest, "completion")[0] == sse_pieces(raw, "completion")[0]
    assert sse_text(rest, "completion") == sse_text(raw, "completion")
    assert len(sse_text(rest, "completion").split()) == 24
    print(f"first token while the decode engine was stopped: {first_s * 1000:.1f} ms")


@pytest.mark.parametrize("stream", [False, True])
def test_a_first_token_that_ends_the_answer_is_the_prefill_engines_alone(cluster, stream):
    _, endpoints = cluster
    body = completion(PROMPT + " (one)", max_tokens=1, stream=stream)
    status, headers, raw = post(endpoints, "/v1/completions", body)
    assert status == 200
    assert headers["x-quillcache-disagg"] == "colocated; the first token ended the answer"
    assert headers["x-quillcache-engine"] == "engine-0"
    _, _, colocated = post(endpoints, "/v1/completions", body, {"x-quillcache-disagg": "colocated"})
    if stream:
        assert raw.rstrip().endswith(b"data: [DONE]")
        assert sse_text(raw, "completion") == sse_text(colocated, "completion")
    else:
        answer, expected = json.loads(raw), json.loads(colocated)
        assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
        assert answer["choices"][0]["finish_reason"] == "length"
        assert counts(answer["usage"]) == counts(expected["usage"])
        assert "token_ids" not in answer["choices"][0]  # the gateway asked, not the client


def test_a_request_a_continuation_cannot_honour_keeps_the_decode_engines_first_token(cluster):
    _, endpoints = cluster
    body = completion(PROMPT + " (seeded)", seed=7)
    status, headers, raw = post(endpoints, "/v1/completions", body)
    assert status == 200
    assert headers["x-quillcache-disagg"].startswith("split")
    assert headers["x-quillcache-first-token"] == "decode; seed given"
    _, _, colocated = post(endpoints, "/v1/completions", body, {"x-quillcache-disagg": "colocated"})
    assert json.loads(raw)["choices"][0]["text"] == json.loads(colocated)["choices"][0]["text"]


def test_the_conductor_prices_the_next_transfers_with_what_the_last_ones_measured(cluster):
    _, endpoints = cluster
    reasons = []
    for i in range(10):  # the prefills' Finish calls travel in the background
        status, headers, _ = post(endpoints, "/v1/completions", completion(f"{i} {PROMPT}"))
        assert status == 200
        reasons.append(headers["x-quillcache-disagg"])
        if "assumed" not in reasons[-1]:
            break
    assert "MB/s)" in reasons[-1] and "assumed" not in reasons[-1], reasons


def test_a_bad_disagg_header_is_a_client_error(cluster):
    _, endpoints = cluster
    status, _, body = post(endpoints, "/v1/completions", completion(), {"x-quillcache-disagg": "x"})
    assert status == 400
    assert json.loads(body)["error"]["param"] == "x-quillcache-disagg"


def test_a_decode_engine_that_fails_the_continuation_leaves_it_to_the_prefill_engine(cluster):
    lc, endpoints = cluster
    body = completion(PROMPT + " (decode engine down)", max_tokens=20)
    decode = next(c for c in lc.children if c.name == "engine-1")
    decode.paused = True
    decode.proc.send_signal(signal.SIGKILL)  # its record stays until its lease expires
    decode.proc.wait(10)
    try:
        status, headers, raw = post(endpoints, "/v1/completions", body)
    finally:
        lc.restart("engine-1")
    assert status == 200, raw
    assert headers["x-quillcache-first-token"] == "prefill"
    assert headers["x-quillcache-disagg"].startswith("colocated; fallback: decode engine engine-1")
    assert headers["x-quillcache-engine"] == "engine-0"
    _, _, colocated = post(endpoints, "/v1/completions", body, {"x-quillcache-disagg": "colocated"})
    assert json.loads(raw)["choices"][0]["text"] == json.loads(colocated)["choices"][0]["text"]
    assert counts(json.loads(raw)["usage"]) == counts(json.loads(colocated)["usage"])


def test_a_failed_transfer_or_prefill_falls_back_to_colocated(cluster):
    lc, endpoints = cluster
    transfer = next(c for c in lc.children if c.name == "transfer")
    transfer.paused = True
    transfer.proc.send_signal(signal.SIGKILL)
    transfer.proc.wait(10)
    status, headers, body = post(endpoints, "/v1/completions", completion(PROMPT + " again"))
    assert status == 200, body
    # The KV could not move: engine-0, which holds it, decodes.
    assert headers["x-quillcache-disagg"].startswith("colocated; fallback: transfer failed")
    assert headers["x-quillcache-engine"] == "engine-0"
    assert json.loads(body)["choices"][0]["text"]
    # Streamed: the first token went out before the transfer failed; engine-0 continues
    # from it (the answer is the colocated one, not restarted: no token twice).
    chat = {
        "model": "sim-model",
        "stream": True,
        "max_tokens": 20,
        "messages": [{"role": "user", "content": PROMPT + " streamed again"}],
    }
    status, headers, raw = post(endpoints, "/v1/chat/completions", chat)
    assert status == 200 and headers["x-quillcache-first-token"] == "prefill"
    assert raw.rstrip().endswith(b"data: [DONE]")
    _, _, colocated = post(
        endpoints, "/v1/chat/completions", chat, {"x-quillcache-disagg": "colocated"}
    )
    assert sse_text(raw, "chat") == sse_text(colocated, "chat")
    assert len(sse_text(raw, "chat").split()) == 20
    engine0 = next(c for c in lc.children if c.name == "engine-0")
    engine0.paused = True
    engine0.proc.send_signal(signal.SIGKILL)  # its record stays until its lease expires
    engine0.proc.wait(10)
    status, headers, body = post(endpoints, "/v1/completions", completion(PROMPT + " third"))
    assert status == 200, body
    assert headers["x-quillcache-disagg"].startswith("colocated; fallback: prefill")
    assert headers["x-quillcache-engine"] == "engine-1"
    assert json.loads(body)["choices"][0]["text"]
