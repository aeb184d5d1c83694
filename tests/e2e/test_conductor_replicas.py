"""`quillcache up --conductors 2` (LocalCluster(conductors=2)): the endpoints list both
replicas, both index the stores' residency, each streams the other's reservations
(over the cluster's mutual TLS), the one the gateway does not plan on stands by (its
ingest waits and takes the engines' batches together), and kill -9 of the other leaves
every request planned by it (no fallback, no failure) from an index as warm: the
prompts served before the kill hit after it."""

from __future__ import annotations

import signal
import time
import urllib.request

import pytest

from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.security.credentials import operator_tls
from quillcache_core.security.tls import grpc_channel
from tests.e2e.test_cluster import chat, client_for
from tests.support.services import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _metric(endpoints, url: str, series: str) -> float:
    """One series of a /metrics page, e.g. 'name' or 'name{label="value"}'."""
    context = operator_tls(endpoints).client_context()
    with urllib.request.urlopen(url, timeout=5, context=context) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(series + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not on {url}")


def _records(endpoints, address: str) -> int:
    with grpc_channel(address, operator_tls(endpoints), aio=False) as channel:
        stub = conductor_pb2_grpc.ConductorStub(channel)
        return stub.Stats(conductor_pb2.StatsRequest(), timeout=5).resident_records


def system(n: int) -> str:
    """One of three system prompts, several blocks long."""
    return f"You are assistant number {n % 3} of the pool. " * 8


def test_two_conductors_both_index_and_one_killed_costs_no_request(tmp_path):
    lc = LocalCluster(tmp_path, conductors=2, time_scale=0.02, log=lambda *_: None)
    endpoints = lc.start()
    try:
        replicas = endpoints["conductors"]
        assert len(replicas) == 2 and endpoints["conductor"] == replicas[0]
        client = client_for(endpoints)
        for n in range(6):
            headers, _, text = chat(client, f"question {n}", system=system(n))
            assert "x-quillcache-plan" not in headers and text, headers
        wait_until(
            lambda: all(_records(endpoints, a) > 0 for a in replicas),
            timeout_s=10,
            what="both replicas indexing residency",
        )
        for name in ("conductor", "conductor-1"):
            url = endpoints["metrics"][name]
            assert _metric(endpoints, url, "quillcache_replica_peers_streaming") == 1, name
            received = 'quillcache_replica_sync_messages_total{direction="received"}'
            assert _metric(endpoints, url, received) > 0, f"{name} heard nothing from its peer"
        standby = endpoints["metrics"]["conductor-1"]
        assert _metric(endpoints, standby, "quillcache_standing_by") == 1
        lingered = 'quillcache_standby_lingers_total{end="begun"}'
        assert _metric(endpoints, standby, lingered) > 0, "the standby's ingest never waited"
        primary = endpoints["metrics"]["conductor"]
        assert _metric(endpoints, primary, "quillcache_standing_by") == 0
        conductor = next(c for c in lc.children if c.name == "conductor")
        conductor.proc.send_signal(signal.SIGKILL)
        conductor.proc.wait(timeout=5)
        started = time.monotonic()
        failures, fallbacks, hits = [], 0, []
        for n in range(20):
            try:
                headers, _, text = chat(client, f"after {n}", system=system(n))
            except Exception as exc:  # noqa: BLE001 - counted and shown below
                failures.append(exc)
                continue
            fallbacks += headers.get("x-quillcache-plan") == "fallback"
            hits.append(int(headers.get("x-quillcache-hit-blocks", "0")))
        assert failures == [], failures[:3]
        assert fallbacks == 0, "the live replica planned every request"
        assert time.monotonic() - started < 30
        # Its first plans found the system prompts served before the kill.
        assert all(hit > 0 for hit in hits[:3]), hits
        assert _metric(endpoints, standby, "quillcache_standing_by") == 0
    finally:
        lc.stop()
