"""Scaling in and out without losing the cache, on a local cluster of sim engines.

Scale-in: an engine drained under steady docqa-like load (a few long shared document
prefixes) fails no request, takes no new one once drained, and its hot prefixes are
then served elsewhere as loads from the pool (saved there by the drain: the engines
here save nothing on their own, `--store-writes none`), about as fast as any pool load.
Scale-out: an engine added under load serves its first requests for the hot prefixes
from the pool, and is soon hitting as much as the fleet. `quillcache drain` is run as
the operator runs it, from the endpoints file.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.launch.process import write_private
from quillcache_core.security.credentials import as_gateway, operator_tls
from quillcache_core.security.tls import Tls, grpc_channel
from tests.support.cluster import https, openai_client
from tests.support.services import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

MODEL = "sim-model"
BLOCK = 16
DOC_TOKENS = 64 * BLOCK  # a long shared document
# Small KV blocks: the pool's loads cost little next to recomputing the document.
SMALL_KV = ["--kv-layers", "2", "--kv-heads", "2", "--head-dim", "32"]


def documents(first: int, count: int) -> list[list[int]]:
    return [list(range(first + i * 5000, first + i * 5000 + DOC_TOKENS)) for i in range(count)]


@dataclass
class Reply:
    doc: int
    started: float
    engine: str = ""
    plan_fetch: int = 0
    plan_hit: int = 0
    fetched: int = 0  # blocks the engine loaded from the pool
    hit: int = 0
    recomputed: int = 0
    latency_s: float = 0.0
    error: str = ""


class Load:
    """Requests for `docs` (one document and a fresh question each) at `rate_per_s` from
    a bounded pool of threads, every answer recorded."""

    def __init__(
        self,
        endpoints: dict,
        docs: list[list[int]],
        rate_per_s: float,
        *,
        question_blocks: int = 3,
        max_tokens: int = 32,
    ) -> None:
        self.client = openai_client(endpoints, max_retries=0)
        self.docs = docs
        self.interval_s = 1.0 / rate_per_s
        self.question_tokens = question_blocks * BLOCK
        self.max_tokens = max_tokens
        self.replies: list[Reply] = []
        self._rng = random.Random(7)
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=16)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(self.interval_s):
            n += 1
            doc = self._rng.randrange(len(self.docs))
            question = [self._rng.randrange(100, 30000) for _ in range(self.question_tokens)]
            self._pool.submit(self._one, doc, self.docs[doc] + question)

    def _one(self, doc: int, prompt: list[int]) -> None:
        reply = Reply(doc, time.monotonic())
        try:
            raw = self.client.completions.with_raw_response.create(
                model=MODEL, prompt=prompt, max_tokens=self.max_tokens
            )
            reply.latency_s = time.monotonic() - reply.started
            report = json.loads(raw.text)["usage"]["quillcache"]
            reply.engine = raw.headers["x-quillcache-engine"]
            reply.plan_fetch = int(raw.headers["x-quillcache-fetch-blocks"])
            reply.plan_hit = int(raw.headers["x-quillcache-hit-blocks"])
            reply.fetched, reply.hit = report["fetched_blocks"], report["hit_blocks"]
            reply.recomputed = report["recomputed_blocks"]
        except Exception as exc:  # every failure is what the test counts
            reply.error = f"{type(exc).__name__}: {exc}"
        self.replies.append(reply)

    def since(self, t: float) -> list[Reply]:
        return [r for r in list(self.replies) if r.started >= t]

    def wait_for(self, count: int, after: float, what: str) -> list[Reply]:
        wait_until(lambda: len(self.since(after)) >= count, timeout_s=60, what=what)
        return self.since(after)


def first_per_doc(replies: list[Reply]) -> dict[int, Reply]:
    """Each document's first request among `replies`."""
    firsts: dict[int, Reply] = {}
    for reply in sorted(replies, key=lambda r: r.started):
        firsts.setdefault(reply.doc, reply)
    return firsts


def spread(replies: list[Reply]) -> dict[str, int]:
    """Requests per engine."""
    counts: dict[str, int] = {}
    for reply in replies:
        counts[reply.engine] = counts.get(reply.engine, 0) + 1
    return counts


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    data = tmp_path_factory.mktemp("drain")
    no_saves = {"sim_args": [*SMALL_KV, "--store-writes", "none"]}
    lc = LocalCluster(
        data,
        engines=3,
        stores=2,
        conductors=2,
        time_scale=4.0,  # a document's prefill is 0.2 s, its pool load a few ms
        engine_options={0: no_saves, 1: no_saves, 2: no_saves, 3: {"sim_args": SMALL_KV}},
        log=lambda *_: None,
    )
    endpoints = lc.start(timeout_s=120)
    endpoints_file = data / "endpoints.json"
    write_private(endpoints_file, json.dumps(endpoints))
    try:
        yield lc, endpoints, endpoints_file
    finally:
        lc.stop()


def drain_cli(endpoints_file: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "quillcache_core.launch.cli", "drain", *args,
         "--endpoints", str(endpoints_file)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def engine_post(lc: LocalCluster, url: str, path: str, body: dict) -> dict:
    context, auth = as_gateway(lc.certs_dir)
    request = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **auth},
    )
    with urllib.request.urlopen(request, timeout=30, context=context) as reply:
        return json.loads(reply.read())


def engine_requests(endpoints: dict, url: str) -> int:
    with urllib.request.urlopen(url + "/sim/stats", timeout=10, context=https(endpoints)) as r:
        return json.loads(r.read())["engine"]["requests"]


def engine_urls(lc: LocalCluster) -> dict[str, str]:
    return {c.name: c.fields["http"] for c in lc.children if c.service == "sim-engine"}


def test_a_drained_engines_hot_prefixes_load_from_the_pool_and_no_request_fails(cluster):
    lc, endpoints, endpoints_file = cluster
    docs = documents(1000, 4)
    with Load(endpoints, docs, rate_per_s=8) as load:
        warm = load.wait_for(40, 0.0, "the warm-up requests")
        owners: dict[int, set[str]] = {}
        for reply in warm:
            owners.setdefault(reply.doc, set()).add(reply.engine)
        only = [(d, next(iter(e))) for d, e in owners.items() if len(e) == 1]
        assert only, f"every document spread over engines: {owners}"
        # The engine that alone holds the most documents is drained.
        drained = max({e for _, e in only}, key=lambda e: sum(o == e for _, o in only))
        its_docs = {d for d, e in only if e == drained}
        began = time.monotonic()
        result = drain_cli(endpoints_file, drained)
        done = time.monotonic()
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["saved_blocks"] >= DOC_TOKENS // BLOCK * len(its_docs), report
        assert (report["state"], report["not_in_pool"], report["open_requests"]) == (
            "drained",
            0,
            0,
        )
        served_when_drained = engine_requests(endpoints, engine_urls(lc)[drained])
        load.wait_for(40, done, "requests after the drain")
        # The first plans of its documents elsewhere, from the moment the drain began.
        moved = [r for r in load.since(began) if r.doc in its_docs and r.engine != drained]
        pool_loads = first_per_doc(moved)
        # A pool load's reference: the same documents loaded again once their new
        # engines forget them.
        for engine in {r.engine for r in pool_loads.values()}:
            engine_post(lc, engine_urls(lc)[engine], "/reset_prefix_cache", {})
        reset_at = time.monotonic()
        again = load.wait_for(40, reset_at, "requests after the reset")
        reference = first_per_doc([r for r in again if r.doc in its_docs])
    failed = [r.error for r in load.replies if r.error]
    assert not failed, failed[:5]
    assert all(r.engine != drained for r in load.since(done))
    assert all(r.engine != drained for r in load.since(began) if r.started > began + 1.0)
    assert engine_requests(endpoints, engine_urls(lc)[drained]) == served_when_drained
    for doc, reply in pool_loads.items():
        assert reply.plan_fetch >= DOC_TOKENS // BLOCK - 1, (doc, reply)
        assert reply.fetched == reply.plan_fetch, (doc, reply)  # loaded, not recomputed
        assert reply.recomputed <= 4, (doc, reply)  # the question's blocks alone
    assert set(reference) == set(pool_loads)
    drained_ttft = statistics.median(r.latency_s for r in pool_loads.values())
    pool_ttft = statistics.median(r.latency_s for r in reference.values())
    print(
        f"drained {drained}: {len(its_docs)} documents, pool-load latency after the drain "
        f"{drained_ttft * 1000:.0f} ms vs {pool_ttft * 1000:.0f} ms for a plain pool load"
    )
    assert drained_ttft <= 1.5 * pool_ttft, (drained_ttft, pool_ttft)


def test_an_engine_added_under_load_loads_hot_prefixes_from_the_pool(cluster):
    lc, endpoints, _ = cluster
    # The pool holds what the fleet computes; a slower model keeps the fleet busy (its
    # prefills queue), so another engine is worth its loads from the pool.
    busy = {"store_writes": "computed", "prefill_us_per_token": 100}
    for url in engine_urls(lc).values():
        engine_post(lc, url, "/sim/settings", busy)
    docs = documents(200_000, 4)
    # Long questions and answers: the fleet is busy enough that a new engine is worth it.
    with Load(endpoints, docs, rate_per_s=16, question_blocks=16, max_tokens=96) as load:
        load.wait_for(40, 0.0, "the warm-up requests")
        added_at = time.monotonic()
        new = lc.add_engine().name
        try:
            wait_until(
                lambda: sum(r.engine == new for r in load.since(added_at)) >= 12,
                timeout_s=30,
                what=f"{new} to take requests",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; per engine: {spread(load.since(added_at))}") from None
        replies = load.since(added_at)
        on_new = [r for r in replies if r.engine == new]
        firsts = first_per_doc(on_new)
        fleet = [r for r in replies if r.engine != new]
    failed = [r.error for r in load.replies if r.error]
    assert not failed, failed[:5]
    assert firsts, "the new engine served no document"
    doc_blocks = DOC_TOKENS // BLOCK
    # The document's blocks neither hit nor loaded were recomputed (the question's are new).
    recomputed = sum(max(0, doc_blocks - r.fetched - r.hit) for r in firsts.values())
    share = recomputed / (doc_blocks * len(firsts))
    print(f"{new}: first requests of {len(firsts)} documents recomputed {share:.1%} of them")
    for doc, reply in firsts.items():
        assert reply.fetched >= doc_blocks - 1, (doc, reply)
    assert share <= 0.05

    def hit_share(rs: list[Reply]) -> float:
        return sum(r.hit + r.fetched for r in rs) / max(
            1, sum(r.hit + r.fetched + r.recomputed for r in rs)
        )

    late = on_new[len(on_new) // 2 :]
    assert hit_share(late) >= hit_share(fleet) - 0.05, (hit_share(late), hit_share(fleet))


def test_drain_from_the_command_line_names_a_wrong_engine_clearly(cluster):
    _, _, endpoints_file = cluster
    result = drain_cli(endpoints_file, "no-such-engine")
    assert result.returncode == 2
    assert "NOT_FOUND" in result.stderr and "no-such-engine" in result.stderr
    assert "Traceback" not in result.stderr


def test_only_the_operator_may_drain_and_a_bad_drain_body_is_a_400(cluster):
    lc, endpoints, _ = cluster
    request = conductor_pb2.DrainRequest(engine_id="engine-1")
    with grpc_channel(
        endpoints["conductor"], Tls.from_dir(lc.certs_dir, "gateway"), aio=False
    ) as ch:
        with pytest.raises(grpc.RpcError) as denied:
            conductor_pb2_grpc.ConductorStub(ch).Drain(request, timeout=10)
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with grpc_channel(endpoints["conductor"], operator_tls(endpoints), aio=False) as ch:
        with pytest.raises(grpc.RpcError) as missing:
            conductor_pb2_grpc.ConductorStub(ch).Drain(conductor_pb2.DrainRequest(), timeout=10)
    assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    url = engine_urls(lc)["engine-1"] + "/sim/drain"
    gateway_cert = Tls.from_dir(lc.certs_dir, "gateway").client_context()
    for context, body, status in (
        (gateway_cert, {"phase": "stop"}, 401),  # a cluster certificate is not enough
        (https(endpoints), {"phase": "later"}, 400),
        (https(endpoints), {"phase": "save", "save_blocks": -1}, 400),
    ):
        post = urllib.request.Request(
            url, data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(post, timeout=10, context=context)
        assert refused.value.code == status, body


@pytest.fixture(scope="module")
def prewarming(tmp_path_factory):
    """Two sim engines behind a gateway that prewarms a new engine with 4 prefixes."""
    lc = LocalCluster(
        tmp_path_factory.mktemp("prewarm"),
        engines=2,
        stores=2,
        time_scale=4.0,
        engine_options={i: {"sim_args": SMALL_KV} for i in range(3)},
        extra_args={"gateway": ["--prewarm-top", "4"]},
        log=lambda *_: None,
    )
    endpoints = lc.start(timeout_s=120)
    try:
        yield lc, endpoints
    finally:
        lc.stop()


def test_a_prewarmed_engine_serves_its_first_hot_prefix_request_as_an_engine_hit(prewarming):
    lc, endpoints = prewarming
    docs = documents(400_000, 4)
    # Each document asked a few times: the gateway counts the prefixes the fleet reused.
    with Load(endpoints, docs, rate_per_s=8) as load:
        load.wait_for(24, 0.0, "the requests that make the documents hot")
    failed = [r.error for r in load.replies if r.error]
    assert not failed, failed[:5]
    new = lc.add_engine().name
    with Load(endpoints, docs, rate_per_s=8) as load:
        try:
            wait_until(
                lambda: sum(r.engine == new for r in list(load.replies)) >= 6,
                timeout_s=30,
                what=f"{new} to take requests",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; per engine: {spread(load.replies)}") from None
    failed = [r.error for r in load.replies if r.error]
    assert not failed, failed[:5]
    firsts = first_per_doc([r for r in load.replies if r.engine == new])
    doc_blocks = DOC_TOKENS // BLOCK
    print(f"{new}: first requests of {len(firsts)} documents: {list(firsts.values())}")
    for doc, reply in firsts.items():
        # Already in its own cache: neither loaded from the pool nor recomputed.
        assert reply.hit >= doc_blocks, (doc, reply)
        assert reply.fetched == 0 and reply.plan_hit >= doc_blocks, (doc, reply)
        assert reply.recomputed <= 4, (doc, reply)  # the question's blocks alone


def test_the_hot_prefixes_kept_are_the_most_hit_each_tenants_own_and_bounded():
    """The gateway's record of what to prewarm (pure: no cluster)."""
    from quillcache_gateway.prewarm import HASH_BYTES, HotPrefixes

    hot = HotPrefixes(max_prefixes=3, max_tokens=10 * BLOCK, decay_every=1000)
    ident, other = object(), object()

    def packed(doc: int, blocks: int) -> bytes:
        return b"".join(bytes([doc, i]) * (HASH_BYTES // 2) for i in range(blocks))

    def serve(tenant: str, doc: int, blocks: int, reused: int, times: int = 1, who=ident):
        tokens = list(range(doc * 1000, doc * 1000 + blocks * BLOCK))
        for _ in range(times):
            hot.record(tenant, MODEL, who, tokens, packed(doc, blocks), BLOCK, reused)

    serve("a", 1, 4, 2, times=5)  # document 1's first 2 blocks, 5 hits
    serve("a", 2, 4, 3, times=2)
    serve("a", 1, 4, 4, times=3)  # document 1 again, all 4 blocks: it opens with the first
    serve("b", 3, 4, 4, times=9)  # another tenant's
    [first, second] = hot.hottest("a", 2)
    # document 1's 4 blocks stand in for its 2-block opening (warming them warms both)
    assert (first.blocks, first.tokens.tolist()) == (4, list(range(1000, 1000 + 4 * BLOCK)))
    assert second.blocks == 3 and second.tokens.tolist()[0] == 2000
    assert [p.tokens[0] for p in hot.hottest("b", 4)] == [3000]
    assert hot.hottest("a", 4, model="another-model") == []
    serve("a", 4, 2, 2, times=1)  # a fourth: the coldest goes (3 kept at most)
    serve("a", 5, 2, 2, times=4)
    kept = {p.tokens[0] for p in hot.hottest("a", 10)}
    assert 5000 in kept and 4000 not in kept and len(kept) <= 3
    serve("a", 6, 12, 12)  # more tokens than a tenant keeps: not kept
    assert 6000 not in {p.tokens[0] for p in hot.hottest("a", 10)}
    serve("a", 7, 2, 0)  # nothing reused: nothing to count
    serve("a", 8, 2, 2, who=other)
    assert {p.ident for p in hot.hottest("a", 10)} == {ident, other}
