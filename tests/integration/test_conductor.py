"""The conductor as a real process with a real etcd: registry, plans, load, KV events."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from quillcache.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from quillcache_core.identity.keys import request_blocks
from quillcache_core.launch.etcd_server import find_etcd_binary
from tests.support.etcdctl import etcdctl
from tests.support.etcdctl import put_engine as support_put_engine
from tests.support.services import ServiceProcess, wait_until
from tests.support.tls import certs_dir, grpcurl_args

pytestmark = pytest.mark.integration

MODEL, TOKENIZER = "llama-3-8b", "llama-3"


def put_engine(etcd, engine_id: str, lease: str | None = None, **fields) -> None:
    support_put_engine(etcd, engine_id, model=MODEL, tokenizer=TOKENIZER, lease=lease, **fields)


@pytest.fixture
def conductor(etcd_server, tmp_path):
    procs = []

    def start(*extra: str, name: str = "conductor") -> ServiceProcess:
        proc = ServiceProcess(
            "conductor",
            ["--registry", etcd_server.client_url, "--seed", "7", *extra],
            tmp_path,
            name,
        )
        procs.append(proc)
        return proc.start()

    yield start
    for proc in procs:
        proc.stop()


def stub(proc: ServiceProcess):
    return conductor_pb2_grpc.ConductorStub(proc.channel("gateway"))


def identity(tenant: str = "acme") -> common_pb2.Identity:
    return common_pb2.Identity(
        model_id=MODEL, tokenizer_id=TOKENIZER, tenant_id=tenant, cache_salt=tenant
    )


def gateway_blocks(tokens, tenant: str = "acme"):
    """The block refs the gateway sends for these tokens (its own hashing)."""
    keys = request_blocks(
        tokens,
        16,
        model_id=MODEL,
        tokenizer_id=TOKENIZER,
        adapter_id=None,
        tenant_id=tenant,
        cache_salt=tenant,
    )
    return [common_pb2.BlockRef(block_hash=k.block_hash, token_count=16) for k in keys]


def plan(client, tokens, tenant="acme", **kw) -> conductor_pb2.PlanResponse:
    return client.Plan(
        conductor_pb2.PlanRequest(
            request_id="t",
            identity=identity(tenant),
            blocks=gateway_blocks(tokens, tenant),
            prompt_tokens=len(tokens),
            expected_decode_tokens=kw.pop("decode", 16),
            **kw,
        ),
        timeout=5,
    )


def engine_ids(client) -> set[str]:
    return {e.engine_id for e in client.Stats(conductor_pb2.StatsRequest(), timeout=5).engines}


# --- registry -----------------------------------------------------------------------


def test_engines_join_through_etcd_and_a_lease_expiry_removes_one(etcd_server, conductor):
    proc = conductor()
    client = stub(proc)
    put_engine(etcd_server, "e-static")
    lease = etcdctl(etcd_server, "lease", "grant", "1").split()[1]
    put_engine(etcd_server, "e-leased", lease=lease)
    keepalive = subprocess.Popen(
        [
            find_etcd_binary("etcdctl"),
            "--endpoints",
            etcd_server.endpoint,
            "lease",
            "keep-alive",
            lease,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_until(lambda: engine_ids(client) == {"e-static", "e-leased"}, what="both engines")
        # Both engines are named by plans while alive.
        tokens = list(range(64))
        seen = {plan(client, tokens).engine_id for _ in range(40)}
        assert seen == {"e-static", "e-leased"}
    finally:
        keepalive.kill()
        keepalive.wait()
    killed_at = time.monotonic()
    wait_until(lambda: engine_ids(client) == {"e-static"}, timeout_s=5, what="lease expiry")
    assert time.monotonic() - killed_at <= 1 + 1 + 0.5, "gone within TTL + 1 s (+ poll slack)"
    assert {plan(client, list(range(64))).engine_id for _ in range(30)} == {"e-static"}


def test_grpcurl_lists_describes_and_calls_plan(etcd_server, conductor):
    proc = conductor()
    put_engine(etcd_server, "e1")
    wait_until(lambda: engine_ids(stub(proc)) == {"e1"}, what="engine")
    grpcurl = os.path.join(os.path.dirname(sys.executable), "grpcurl")

    def run(*args: str) -> str:
        return subprocess.run(
            [grpcurl, *grpcurl_args("gateway"), *args],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout

    assert "quillcache.v1.Conductor" in run(proc.grpc_address, "list").split()
    described = run(proc.grpc_address, "describe", "quillcache.v1.Conductor.Plan")
    assert (
        "rpc Plan ( .quillcache.v1.PlanRequest ) returns ( .quillcache.v1.PlanResponse )"
        in described
    )
    body = json.dumps(
        {
            "identity": {"model_id": MODEL, "tokenizer_id": TOKENIZER, "tenant_id": "acme"},
            "blocks": [
                {"block_hash": "aa", "token_count": 16},
                {"block_hash": "bb", "token_count": 16},
            ],
            "expected_decode_tokens": 8,
        }
    )
    reply = json.loads(run("-d", body, proc.grpc_address, "quillcache.v1.Conductor/Plan"))
    assert reply["engine_id"] == "e1"
    assert [a["kind"] for a in reply["actions"]] == ["RECOMPUTE", "RECOMPUTE"]
    assert reply["reservation_id"]


# --- load feedback ----------------------------------------------------------------------


def test_concurrent_plans_without_finish_spread_instead_of_piling_on_the_hot_engine(
    etcd_server, conductor
):
    proc = conductor()
    client = stub(proc)
    for i in range(4):
        put_engine(etcd_server, f"e{i}")
    wait_until(lambda: len(engine_ids(client)) == 4, what="4 engines")
    system = list(range(100_000, 100_000 + 8 * 16))  # a shared 8-block system prompt
    warm = client.Plan(
        conductor_pb2.PlanRequest(
            identity=identity(), blocks=gateway_blocks(system), prompt_tokens=len(system)
        ),
        timeout=5,
    )
    client.Observe(
        conductor_pb2.ObserveRequest(
            engine_id=warm.engine_id, identity=identity(), blocks=gateway_blocks(system)
        ),
        timeout=5,
    )
    client.Finish(
        conductor_pb2.FinishRequest(
            reservation_id=warm.reservation_id, outcome=conductor_pb2.FinishRequest.SUCCESS
        ),
        timeout=5,
    )

    def one(n: int) -> conductor_pb2.PlanResponse:
        tokens = system + [n * 1000 + j for j in range(24 * 16)]
        return plan(client, tokens)

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(one, range(200)))
    first = replies[0]
    assert first.hit_blocks == 8 or any(r.hit_blocks == 8 for r in replies[:16]), (
        "the hot prefix is used"
    )
    inflight = {
        e.engine_id: e.inflight_requests for e in client.Stats(conductor_pb2.StatsRequest()).engines
    }
    assert sum(inflight.values()) == 201 - 1  # every Plan reserved, the warm-up was finished
    mean = sum(inflight.values()) / 4
    assert max(inflight.values()) / mean <= 1.5, inflight
    # Under a burst load dominates: the hot engine takes about its share, no less (its
    # prefix is 8 of a request's 32 blocks).
    assert inflight[warm.engine_id] >= 0.9 * mean, inflight


def test_max_others_trims_the_reply_to_the_cheapest_other_engines(etcd_server, conductor):
    proc = conductor("--plan-alternatives", "2")
    client = stub(proc)
    for i in range(4):
        put_engine(etcd_server, f"e{i}")
    wait_until(lambda: len(engine_ids(client)) == 4, what="4 engines")
    tokens = list(range(5 * 16))

    def others(**kw) -> list[conductor_pb2.EngineCost]:
        reply = plan(client, tokens, **kw)
        client.Finish(
            conductor_pb2.FinishRequest(
                reservation_id=reply.reservation_id, outcome=conductor_pb2.FinishRequest.CANCELLED
            ),
            timeout=5,
        )
        assert reply.engine_id and reply.chosen.engine_id == reply.engine_id
        assert reply.chosen.cost_us > 0, "the chosen engine's breakdown is always there"
        assert reply.engine_id not in {o.engine_id for o in reply.others}
        costs = [o.cost_us for o in reply.others]
        assert costs == sorted(costs) and all(c >= reply.chosen.cost_us for c in costs)
        return list(reply.others)

    assert len(others()) == 2  # unset: the conductor's --plan-alternatives
    assert others(max_others=0) == []
    assert len(others(max_others=1)) == 1
    assert len(others(max_others=10)) == 2  # the conductor's cap still holds


def test_finish_releases_and_unfinished_reservations_expire(etcd_server, conductor):
    proc = conductor("--reservation-ttl-s", "1")
    client = stub(proc)
    put_engine(etcd_server, "e1")
    wait_until(lambda: engine_ids(client) == {"e1"}, what="engine")
    a = plan(client, list(range(64)))
    b = plan(client, list(range(64)))
    stats = lambda: {e.engine_id: e for e in client.Stats(conductor_pb2.StatsRequest()).engines}  # noqa: E731
    assert stats()["e1"].inflight_requests == 2
    client.Finish(
        conductor_pb2.FinishRequest(
            reservation_id=a.reservation_id,
            outcome=conductor_pb2.FinishRequest.SUCCESS,
            ttft_ms=12.5,
        )
    )
    assert stats()["e1"].inflight_requests == 1
    with pytest.raises(grpc.RpcError) as err:
        client.Finish(
            conductor_pb2.FinishRequest(
                reservation_id=a.reservation_id, outcome=conductor_pb2.FinishRequest.SUCCESS
            )
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    wait_until(lambda: stats()["e1"].inflight_requests == 0, timeout_s=5, what="expiry of b")
    assert client.Stats(conductor_pb2.StatsRequest()).reservations_expired == 1
    assert proc.metric("quillcache_reservations_expired_total") == 1
    del b


# --- bad input ---------------------------------------------------------------------------


def test_bad_requests_get_clear_status_codes_and_the_server_lives_on(etcd_server, conductor):
    proc = conductor("--max-blocks-per-request", "64")
    client = stub(proc)
    put_engine(etcd_server, "e1")
    wait_until(lambda: engine_ids(client) == {"e1"}, what="engine")

    def code_of(call, request):
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=5)
        return err.value.code(), err.value.details()

    ok_blocks = gateway_blocks(list(range(32)))
    cases = [
        (
            client.Plan,
            conductor_pb2.PlanRequest(blocks=ok_blocks),
            grpc.StatusCode.INVALID_ARGUMENT,
            "model_id",
        ),
        (
            client.Plan,
            conductor_pb2.PlanRequest(
                identity=common_pb2.Identity(model_id=MODEL, tokenizer_id=TOKENIZER),
                blocks=ok_blocks,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "tenant_id",
        ),
        (
            client.Plan,
            conductor_pb2.PlanRequest(identity=identity()),
            grpc.StatusCode.INVALID_ARGUMENT,
            "nothing to plan",
        ),
        (
            client.Plan,
            conductor_pb2.PlanRequest(
                identity=identity(), blocks=gateway_blocks(list(range(65 * 16)))
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "exceed the limit of 64",
        ),
        (
            client.Plan,
            conductor_pb2.PlanRequest(
                identity=identity(), blocks=[common_pb2.BlockRef(token_count=16)]
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "block_hash is empty",
        ),
        (
            client.Plan,
            conductor_pb2.PlanRequest(
                identity=common_pb2.Identity(
                    model_id="other-model", tokenizer_id="t", tenant_id="a"
                ),
                blocks=ok_blocks,
            ),
            grpc.StatusCode.UNAVAILABLE,
            "no engine available",
        ),
        (
            client.Finish,
            conductor_pb2.FinishRequest(
                reservation_id="nope", outcome=conductor_pb2.FinishRequest.SUCCESS
            ),
            grpc.StatusCode.NOT_FOUND,
            "nope",
        ),
        (
            client.Finish,
            conductor_pb2.FinishRequest(reservation_id="x"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "outcome",
        ),
        (
            client.Observe,
            conductor_pb2.ObserveRequest(engine_id="ghost", identity=identity(), blocks=ok_blocks),
            grpc.StatusCode.NOT_FOUND,
            "ghost",
        ),
    ]
    for call, request, code, text in cases:
        got_code, details = code_of(call, request)
        assert got_code == code, (request, details)
        assert text in details
    assert plan(client, list(range(32))).engine_id == "e1", "still serving after bad input"
    # A prompt shorter than one block has no blocks to reuse but is still planned.
    short = client.Plan(conductor_pb2.PlanRequest(identity=identity(), prompt_tokens=5), timeout=5)
    assert short.engine_id == "e1" and list(short.actions) == []


def test_unknown_policy_missing_lmdb_path_or_no_tls_refuses_to_start(tmp_path):
    tls_dir = ["--tls-dir", str(certs_dir())]
    for args, text in (
        (["--policy", "fastest", *tls_dir], "invalid choice: 'fastest'"),
        (["--index-backend", "lmdb", *tls_dir], "--index-path is required"),
        ([], "TLS is required: pass --tls-dir DIR"),  # secure by default
    ):
        done = subprocess.run(
            [sys.executable, "-m", "quillcache_core.launch.cli", "conductor", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 2
        assert text in done.stderr


# --- persistence -----------------------------------------------------------------------------


def test_restarted_conductor_with_lmdb_keeps_its_residency(etcd_server, conductor, tmp_path):
    args = ("--index-backend", "lmdb", "--index-path", str(tmp_path / "index"))
    proc = conductor(*args)
    client = stub(proc)
    put_engine(etcd_server, "e0")
    put_engine(etcd_server, "e1")
    wait_until(lambda: len(engine_ids(client)) == 2, what="engines")
    tokens = list(range(5000, 5000 + 12 * 16))
    client.Observe(
        conductor_pb2.ObserveRequest(
            engine_id="e1", identity=identity(), blocks=gateway_blocks(tokens)
        ),
        timeout=5,
    )
    proc.stop()

    proc = conductor(*args, name="conductor-restarted")
    client = stub(proc)
    wait_until(lambda: len(engine_ids(client)) == 2, what="engines after restart")
    reply = plan(client, tokens)
    assert reply.engine_id == "e1"
    assert reply.hit_blocks == 12
    assert client.Stats(conductor_pb2.StatsRequest()).index_backend == "lmdb"


def test_a_node_that_left_while_the_conductor_was_down_loses_its_residency(
    etcd_server, conductor, tmp_path
):
    """An lmdb index reopened after downtime still names nodes that left meanwhile;
    once --departed-sweep-s has passed, their records go and the others stay."""
    args = ("--index-backend", "lmdb", "--index-path", str(tmp_path / "index"))
    proc = conductor(*args)
    client = stub(proc)
    put_engine(etcd_server, "e-stays")
    lease = etcdctl(etcd_server, "lease", "grant", "60").split()[1]
    put_engine(etcd_server, "e-leaves", lease=lease)
    wait_until(lambda: engine_ids(client) == {"e-stays", "e-leaves"}, what="engines")
    tokens = {
        "e-stays": list(range(7000, 7000 + 6 * 16)),
        "e-leaves": list(range(9000, 9000 + 6 * 16)),
    }
    for engine, engine_tokens in tokens.items():
        client.Observe(
            conductor_pb2.ObserveRequest(
                engine_id=engine, identity=identity(), blocks=gateway_blocks(engine_tokens)
            ),
            timeout=5,
        )
    proc.stop()
    etcdctl(etcd_server, "lease", "revoke", lease)  # e-leaves is gone while nobody watches

    def holders(engine_tokens) -> list[set[str]]:
        hashes = [b.block_hash for b in gateway_blocks(engine_tokens)]
        reply = client.Locate(
            conductor_pb2.LocateRequest(identity=identity(), block_hashes=hashes), timeout=5
        )
        return [{loc.node_id for loc in block.locations} for block in reply.blocks]

    proc = conductor(*args, "--departed-sweep-s", "3", name="conductor-restarted")
    client = stub(proc)
    # Reopened as it was: both engines' records, though one engine is gone (Locate and
    # Plan name registered nodes only, so the record count shows it).
    assert proc.metric("quillcache_index_resident_records") == 12
    wait_until(
        lambda: proc.metric("quillcache_departed_records_dropped_total") == 6,
        timeout_s=10,
        what="the sweep",
    )
    assert proc.metric("quillcache_index_resident_records") == 6
    assert holders(tokens["e-leaves"]) == [set()] * 6
    assert holders(tokens["e-stays"]) == [{"e-stays"}] * 6
    assert engine_ids(client) == {"e-stays"}
    reply = plan(client, tokens["e-stays"])
    assert (reply.engine_id, reply.hit_blocks) == ("e-stays", 6)


def test_an_engine_that_restarted_loses_its_residency_live_and_across_downtime(
    etcd_server, conductor, tmp_path
):
    """An engine record with another start_time_s is a new run with an empty cache:
    seen live, or found by a conductor that reopens its lmdb index after downtime."""
    args = ("--index-backend", "lmdb", "--index-path", str(tmp_path / "index"))
    proc = conductor(*args)
    client = stub(proc)
    put_engine(etcd_server, "e0", start_time_s=100.0)
    put_engine(etcd_server, "e1", start_time_s=100.0)
    wait_until(lambda: engine_ids(client) == {"e0", "e1"}, what="engines")
    tokens = {"e0": list(range(3000, 3000 + 5 * 16)), "e1": list(range(4000, 4000 + 5 * 16))}

    def observe(engine: str) -> None:
        client.Observe(
            conductor_pb2.ObserveRequest(
                engine_id=engine, identity=identity(), blocks=gateway_blocks(tokens[engine])
            ),
            timeout=5,
        )

    def holders(engine: str) -> list[set[str]]:
        hashes = [b.block_hash for b in gateway_blocks(tokens[engine])]
        reply = client.Locate(
            conductor_pb2.LocateRequest(identity=identity(), block_hashes=hashes), timeout=5
        )
        return [{loc.node_id for loc in block.locations} for block in reply.blocks]

    observe("e0")
    observe("e1")
    assert (holders("e0"), holders("e1")) == ([{"e0"}] * 5, [{"e1"}] * 5)
    # Live: e0 restarts and registers its new run.
    put_engine(etcd_server, "e0", start_time_s=200.0)
    wait_until(
        lambda: proc.metric("quillcache_restart_records_dropped_total") == 5, what="e0 dropped"
    )
    assert (holders("e0"), holders("e1")) == ([set()] * 5, [{"e1"}] * 5)
    observe("e0")  # e0's new run caches its prompt again
    proc.stop()

    # Across downtime: e1 restarts while no conductor runs; e0 does not.
    put_engine(etcd_server, "e1", start_time_s=300.0)
    proc = conductor(*args, name="conductor-restarted")
    client = stub(proc)
    wait_until(
        lambda: proc.metric("quillcache_restart_records_dropped_total") == 5, what="e1 dropped"
    )
    assert (holders("e0"), holders("e1")) == ([{"e0"}] * 5, [set()] * 5)
    assert proc.metric("quillcache_index_resident_records") == 5
