"""Prefill/decode disaggregation with two real vLLM engines and the QuillCache connector.

engine-0 is registered as `prefill`, engine-1 as `decode`, each on its own store node.
Through the gateway, a request is prefilled on engine-0 (its connector writes the prompt's
KV to store-0 before the prefill call answers; its first token is the client's first
token), prefetched into store-1 by the transfer service, and continued by engine-1 (a
completions call over the prompt's ids and the first token's), whose connector loads the
prompt's KV instead of recomputing it. The greedy output equals a colocated run of the
same request on one engine, token for token, and so does its first streamed token.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import urllib.request
from pathlib import Path

import pytest

from quillcache_bench.live_systems import process_tree
from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.launch.vllm_engine import VLLM_NICE
from quillcache_core.security.credentials import tenant_context
from tests.e2e.test_vllm import env, post, text  # noqa: F401 - env is the fixture
from tests.e2e.test_vllm_connector import connector, metric
from tests.support.services import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "tiny"
ENGINE_BLOCK = 32


@pytest.fixture(scope="module")
def pd_fleet(env, tmp_path_factory):  # noqa: F811 - the fixture of test_vllm
    cluster = LocalCluster(
        tmp_path_factory.mktemp("vllm-disagg"),
        engines=2,
        stores=2,
        log=lambda *_: None,
        engine_kind="vllm",
        model=MODEL,
        engine_options={0: {"role": "prefill"}, 1: {"role": "decode"}},
    )
    try:
        yield cluster, cluster.start(timeout_s=120)
    finally:
        cluster.stop()


def body(kind: str, content: str, stream: bool) -> dict:
    common = {"model": MODEL, "max_tokens": 16, "temperature": 0, "stream": stream}
    if stream:
        common["stream_options"] = {"include_usage": True}
    if kind == "chat":
        return {
            **common,
            "messages": [
                {"role": "system", "content": content},
                {"role": "user", "content": "Which engine holds this prompt?"},
            ],
        }
    return {**common, "prompt": content}


def through_gateway(
    endpoints, path: str, payload: dict, extra: dict | None = None
) -> tuple[dict, str, dict, list[str]]:
    """(headers, output text, usage, streamed pieces) of one request through the gateway
    as acme; a streamed answer's usage also holds its choice's `finish_reason`."""
    request = urllib.request.Request(
        endpoints["gateway_url"] + path,
        data=json.dumps(payload).encode(),
        headers={
            "Authorization": f"Bearer {endpoints['api_keys']['acme']}",
            "Content-Type": "application/json",
            **(extra or {}),
        },
    )
    context: ssl.SSLContext | None = tenant_context(endpoints)
    with urllib.request.urlopen(request, timeout=120, context=context) as reply:
        headers, raw = dict(reply.headers), reply.read()
    if not payload["stream"]:
        answer = json.loads(raw)
        return headers, output_of(answer["choices"][0]), answer["usage"], []
    pieces, usage, finish = [], {}, None
    assert raw.rstrip().endswith(b"data: [DONE]")
    for line in raw.decode().splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices") or []:
            pieces.append(output_of(choice))
            finish = choice.get("finish_reason") or finish
    return headers, "".join(pieces), {**usage, "finish_reason": finish}, [p for p in pieces if p]


def engines_idle(endpoints) -> None:
    """Wait until no engine runs or queues a request. vLLM's numerics depend on what a
    step batches (another request decoding beside this one changes its logits a little),
    and the tiny random model's near-ties then pick other tokens: a run compared token
    for token with another must be alone on its engine, as the reference was."""

    def idle() -> bool:
        return all(
            metric(endpoints, endpoints["metrics"][f"engine-{i}"], name) == 0
            for i in range(len(endpoints["engines"]))
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
        )

    wait_until(idle, timeout_s=30, interval_s=0.05, what="the engines idle")


def output_of(choice: dict) -> str:
    if "message" in choice:
        return choice["message"]["content"] or ""
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


@pytest.mark.parametrize(
    ("kind", "stream", "seed"),
    [
        ("completion", False, 101),
        ("completion", True, 102),
        ("chat", False, 103),
        ("chat", True, 104),
    ],
)
def test_a_split_request_decodes_from_the_pool_and_equals_a_colocated_run(
    pd_fleet, kind, stream, seed
):
    cluster, endpoints = pd_fleet
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    prompt = text(seed, 300)
    # The colocated run: the whole request on one engine (engine-0), nothing from the pool.
    engines_idle(endpoints)
    reference = post(cluster, endpoints["engines"][0] + path, body(kind, prompt, False))
    expected = output_of(reference["choices"][0])
    loaded = connector(endpoints, "engine-1", "blocks_loaded")
    engines_idle(endpoints)
    headers, got, usage, pieces = through_gateway(endpoints, path, body(kind, prompt, stream))
    blocks = usage["prompt_tokens"] // ENGINE_BLOCK  # whole vLLM blocks, its last token aside
    loaded_now = connector(endpoints, "engine-1", "blocks_loaded") - loaded
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    print(
        f"{kind} stream={stream}: {headers['x-quillcache-disagg']}; prefill "
        f"{headers.get('x-quillcache-prefill-ms')} ms, transfer "
        f"{headers.get('x-quillcache-transfer-blocks')} blocks "
        f"{headers.get('x-quillcache-transfer-ms')} ms; decode engine loaded {loaded_now} "
        f"blocks, cached {cached} of {usage['prompt_tokens']} prompt tokens"
    )
    assert headers["x-quillcache-disagg"].startswith("split; decode-only engine")
    assert headers["x-quillcache-prefill-engine"] == "engine-0"
    assert headers["x-quillcache-engine"] == headers["x-quillcache-decode-engine"] == "engine-1"
    assert headers["x-quillcache-first-token"] == "prefill"  # engine-1 continued from it
    assert got == expected  # token for token
    # one answer, counted as the colocated run's (the first token is output, not prompt)
    reference_usage = reference["usage"]
    assert usage["prompt_tokens"] == reference_usage["prompt_tokens"]
    assert usage["completion_tokens"] == reference_usage["completion_tokens"]
    if stream:  # the first streamed token (the prefill's) is a colocated stream's first
        colocated = {"x-quillcache-disagg": "colocated"}
        engines_idle(endpoints)
        _, _, ended, alone = through_gateway(endpoints, path, body(kind, prompt, stream), colocated)
        print(f"colocated stream: {len(alone)} pieces, finish_reason {ended['finish_reason']}")
        # Only its first token is compared, and as the start of its text: a stream's
        # pieces are not its tokens. vLLM merges the deltas a slow reader has not taken
        # yet into one (its output collector aggregates them), so a short answer from
        # cached KV can arrive as a single piece holding all 16 tokens (seen in CI: one
        # piece, finish_reason length). The split run's first piece is the prefill's one
        # token. The stream must still end as an answer does (a finish reason, usage).
        assert "".join(alone).startswith(pieces[0])
        assert ended["finish_reason"] in ("stop", "length")
        assert ended["completion_tokens"] >= len(alone)
    # engine-1 loaded the prompt's KV (16-token store blocks) instead of computing it
    assert loaded_now >= 2 * (blocks - 1)
    assert cached >= ENGINE_BLOCK * (blocks - 1)


def test_the_two_engines_compute_on_their_own_cores(pd_fleet):
    """vLLM's CPU worker binds a thread to every core unless told which: two engines on
    one machine would then compute on the same cores. What each engine bound, from the
    binding it logs at start."""
    cluster, _ = pd_fleet
    bound = []
    for name in ("engine-0", "engine-1"):
        log = (cluster.data_dir / "logs" / f"{name}.log").read_text(errors="replace")
        found = re.findall(r"local_rank=0, core ids=\[([\d, ]*)\]", log)
        assert found, f"{name} logged no thread binding"
        bound.append({int(c) for c in found[-1].split(",")})
    assert bound[0] and bound[1]
    if len(os.sched_getaffinity(0)) >= 2:
        assert not bound[0] & bound[1], f"both engines on cores {bound[0] & bound[1]}"


def test_every_process_of_an_engine_stays_on_its_cores(pd_fleet):
    """Not only the compute threads: the HTTP frontend and the engine-core process too,
    so two engines on one machine do not take each other's cores, as on two hosts."""
    cluster, _ = pd_fleet
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to share out")
    kept = []
    for name in ("engine-0", "engine-1"):
        child = next(c for c in cluster.children if c.name == name)
        tree = process_tree(child.proc.pid)
        assert len(tree) >= 2, f"{name}: no vLLM engine process under the server"
        affinities = {frozenset(os.sched_getaffinity(pid)) for pid in tree}
        assert len(affinities) == 1, f"{name}'s processes run on {affinities}"
        kept.append(set(affinities.pop()))
    assert kept[0] and kept[1] and not kept[0] & kept[1]
    assert kept[0] | kept[1] <= os.sched_getaffinity(0)


def test_the_engines_give_way_to_the_control_processes(pd_fleet):
    """On one machine the gateway and conductors go first: the engines run niced."""
    cluster, _ = pd_fleet
    engines = [c for c in cluster.children if c.name in ("engine-0", "engine-1")]
    assert len(engines) == 2
    for child in engines:
        assert os.getpriority(os.PRIO_PROCESS, child.proc.pid) == VLLM_NICE
        group = Path(f"/proc/{child.proc.pid}/autogroup")  # where the kernel has autogroups
        if group.exists():  # its session's group too, or the group's niceness would rule
            assert group.read_text().split()[-1] == str(VLLM_NICE)
    gateway = next(c for c in cluster.children if c.name == "gateway")
    assert os.getpriority(os.PRIO_PROCESS, gateway.proc.pid) == os.getpriority(os.PRIO_PROCESS, 0)
