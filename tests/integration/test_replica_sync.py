"""Conductor replicas share their reservations: a plan on one counts on the other within
milliseconds (in-flight requests, the optimistic blocks a repeat of the prompt hits),
its Finish releases it there too, and the load of a replica killed with -9 expires
on the other instead of sticking.

Real processes: a TLS+RBAC etcd and two conductors finding each other through it;
the engines are registry records (nothing calls them here)."""

from __future__ import annotations

import time
import urllib.request

import pytest

from quillcache.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from quillcache_core.identity.keys import request_blocks
from tests.support.etcdctl import etcdctl, put_engine
from tests.support.services import wait_until
from tests.support.tls import client_context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL, TOKENIZER, BS = "sim-model", "builtin-v1", 16
SILENCE_S = 1.0


def request(n: int, request_id: str, exclude=(), blocks: int = 64) -> conductor_pb2.PlanRequest:
    tokens = list(range(100_000 * n, 100_000 * n + blocks * BS))
    keys = request_blocks(
        tokens,
        BS,
        model_id=MODEL,
        tokenizer_id=TOKENIZER,
        adapter_id=None,
        tenant_id="acme",
        cache_salt=None,
    )
    return conductor_pb2.PlanRequest(
        request_id=request_id,
        identity=common_pb2.Identity(model_id=MODEL, tokenizer_id=TOKENIZER, tenant_id="acme"),
        blocks=[common_pb2.BlockRef(block_hash=k.block_hash, token_count=BS) for k in keys],
        prompt_tokens=len(tokens),
        expected_decode_tokens=16,
        exclude_engines=list(exclude),
    )


def inflight(stub) -> dict[str, int]:
    reply = stub.Stats(conductor_pb2.StatsRequest(), timeout=5)
    return {e.engine_id: e.inflight_requests for e in reply.engines}


def finish(stub, reservation_id: str, *, success: bool = False) -> None:
    outcome = (
        conductor_pb2.FinishRequest.SUCCESS if success else conductor_pb2.FinishRequest.CANCELLED
    )
    stub.Finish(
        conductor_pb2.FinishRequest(reservation_id=reservation_id, outcome=outcome), timeout=5
    )


FLAGS = ["--replica-silence-s", str(SILENCE_S), "--replica-heartbeat-s", "0.1"]


def engines(etcd_server) -> None:
    lease = etcdctl(etcd_server, "lease", "grant", "600").split()[1]
    for engine in ("e1", "e2"):
        put_engine(etcd_server, engine, model=MODEL, tokenizer=TOKENIZER, lease=lease)


def streaming(*procs) -> None:
    for proc in procs:
        wait_until(
            lambda p=proc: p.metric("quillcache_replica_peers_streaming") == 1,
            timeout_s=10,
            what=f"{proc.name} streaming its peer's reservations",
        )


@pytest.fixture
def replicas(etcd_server, fleet):
    engines(etcd_server)
    a = fleet.conductor("--node-id", "conductor-a", *FLAGS, name="conductor-a")
    b = fleet.conductor("--node-id", "conductor-b", *FLAGS, name="conductor-b")
    streaming(a, b)
    with a.channel("gateway") as ca, b.channel("gateway") as cb:
        yield a, conductor_pb2_grpc.ConductorStub(ca), conductor_pb2_grpc.ConductorStub(cb)


def test_a_reservation_on_one_replica_counts_on_the_other(replicas):
    _, on_a, on_b = replicas
    # Six long requests on A, all on e1 (the others excluded, as after a failure).
    opened = [on_a.Plan(request(n, f"a{n}", exclude=["e2"]), timeout=5) for n in range(6)]
    assert {p.engine_id for p in opened} == {"e1"}
    started = time.monotonic()
    wait_until(
        lambda: inflight(on_b).get("e1") == 6, timeout_s=2, interval_s=0.001, what="A's load on B"
    )
    print(f"six reservations visible on the other replica after {time.monotonic() - started:.3f}s")
    # B spreads its own plans away from the engine A loaded.
    for n in range(10, 14):
        plan = on_b.Plan(request(n, f"b{n}"), timeout=5)
        assert plan.engine_id == "e2", plan
        finish(on_b, plan.reservation_id)
    # While A's requests run, a repeat of one of its prompts planned on B finds the
    # blocks A's plan is putting on e1 (there only, as e2 is excluded: e1's queue is
    # longer than the prompt).
    repeat = on_b.Plan(request(0, "b-repeat", exclude=["e2"]), timeout=5)
    assert (repeat.engine_id, repeat.hit_blocks) == ("e1", 64)
    finish(on_b, repeat.reservation_id)
    for plan in opened:
        finish(on_a, plan.reservation_id, success=True)
    started = time.monotonic()
    wait_until(lambda: inflight(on_b).get("e1") == 0, timeout_s=2, interval_s=0.001, what="on B")
    print(f"six finishes visible on the other replica after {time.monotonic() - started:.3f}s")
    # Served: e1 holds the prompts now (it publishes no events: the plan's blocks are
    # resident at Finish), for B as for A.
    again = on_b.Plan(request(3, "b-again"), timeout=5)
    assert (again.engine_id, again.hit_blocks) == ("e1", 64)
    finish(on_b, again.reservation_id)
    wait_until(lambda: inflight(on_a) == {"e1": 0, "e2": 0}, timeout_s=2, what="all released")


def test_the_load_of_a_killed_replica_expires_on_the_other(replicas):
    a, on_a, on_b = replicas
    for n in range(3):
        on_a.Plan(request(n, f"a{n}", exclude=["e2"]), timeout=5)
    wait_until(lambda: inflight(on_b).get("e1") == 3, timeout_s=2, what="A's load on B")
    a.kill()
    killed = time.monotonic()
    wait_until(lambda: inflight(on_b).get("e1") == 0, timeout_s=SILENCE_S + 3, what="expired")
    waited = time.monotonic() - killed
    print(f"the dead replica's load dropped after {waited:.2f}s")
    assert waited >= SILENCE_S * 0.5  # not at the first hiccup: a short silence is allowed
    # Its blocks are no longer promised either: a repeat of its prompt is a miss on B.
    repeat = on_b.Plan(request(1, "b-repeat"), timeout=5)
    assert repeat.hit_blocks == 0, repeat


def test_a_replica_started_later_gets_every_open_reservation(etcd_server, fleet):
    """The snapshot a new (or restarted) replica receives: 320 open reservations of
    1,024-block prompts (over 5 MB of overlay, more than one gRPC message may carry)."""
    engines(etcd_server)
    a = fleet.conductor("--node-id", "conductor-a", *FLAGS, name="conductor-a")
    with a.channel("gateway") as channel:
        on_a = conductor_pb2_grpc.ConductorStub(channel)
        for n in range(320):
            on_a.Plan(request(n, f"a{n}", blocks=1024), timeout=10)
        b = fleet.conductor("--node-id", "conductor-b", *FLAGS, name="conductor-b")
        streaming(b)
        with b.channel("gateway") as channel_b:
            on_b = conductor_pb2_grpc.ConductorStub(channel_b)
            wait_until(lambda: sum(inflight(on_b).values()) == 320, timeout_s=5, what="all")
            assert inflight(on_b) == inflight(on_a)
            # And the overlay came with them: a repeat of the last prompt hits on B.
            repeat = on_b.Plan(request(319, "b-repeat", blocks=1024), timeout=10)
            assert repeat.hit_blocks == 1024, repeat


def _labelled(proc, name: str) -> float | None:
    """A series of `name` with labels (the first), None if absent."""
    url = proc.metrics_url + "/metrics"
    with urllib.request.urlopen(url, timeout=5, context=client_context("operator")) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.split()[-1])
    return None


def test_every_replica_learns_the_engines_speed_from_every_replica_s_requests(replicas, fleet):
    """Requests planned and finished on A only, each with its measured TTFT (200 us a
    prompt token, as a slow engine would take): B, which planned none of them, learns
    the same prefill speed from the samples A's closes carry."""
    a, on_a, _ = replicas
    b = next(p for p in fleet.procs if p.name == "conductor-b")
    for n in range(24):
        blocks = 16 + 3 * n  # token counts spread out, as the fit needs
        plan = on_a.Plan(request(200 + n, f"s{n}", blocks=blocks), timeout=5)
        on_a.Finish(
            conductor_pb2.FinishRequest(
                reservation_id=plan.reservation_id,
                outcome=conductor_pb2.FinishRequest.SUCCESS,
                ttft_ms=blocks * BS * 0.2,
            ),
            timeout=5,
        )
    wait_until(
        lambda: b.metric("quillcache_replica_speed_samples_total") == 24,
        timeout_s=5,
        what="A's samples on B",
    )
    learned_a = _labelled(a, "quillcache_prefill_seconds_per_token")
    learned_b = _labelled(b, "quillcache_prefill_seconds_per_token")
    assert learned_a == pytest.approx(200e-6, rel=0.02)
    assert learned_b == pytest.approx(learned_a, rel=1e-6)
