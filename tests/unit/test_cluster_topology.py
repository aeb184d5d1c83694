"""The local cluster is described as data (`LocalCluster.topology`) before anything
starts: what `quillcache up` will run, in which order, wired to what."""

from __future__ import annotations

import pytest

from quillcache_core.launch.cluster import LocalCluster, Ref, ServiceSpec

pytestmark = pytest.mark.unit


def names(specs: list[ServiceSpec], service: str) -> list[str]:
    return [s.name for s in specs if s.service == service]


def test_quillcache_up_starts_conductors_then_stores_transfer_engines_and_the_gateway(tmp_path):
    specs = LocalCluster(tmp_path, engines=3, stores=2, conductors=2).topology()
    assert [s.service for s in specs] == [
        "conductor", "conductor", "store", "store", "transfer",
        "sim-engine", "sim-engine", "sim-engine", "gateway",
    ]  # fmt: skip
    # Every store reports to both replicas, and the gateway plans over both.
    for spec in specs:
        if spec.service in ("store", "gateway"):
            assert Ref(("conductor", "conductor-1")) in spec.args
    # Engines are dealt over the store nodes in turn, each told its node.
    assert [s.store for s in specs if s.service == "sim-engine"] == [
        "store-0",
        "store-1",
        "store-0",
    ]
    fields = {
        "etcd": {"url": "https://127.0.0.1:2379"},
        "conductor": {"grpc": "127.0.0.1:1"},
        "conductor-1": {"grpc": "127.0.0.1:2"},
        "store-1": {"grpc": "127.0.0.1:4"},
    }
    engine = specs[6].resolve(fields)
    assert engine[:2] == ["--registry", "https://127.0.0.1:2379"]
    assert engine[engine.index("--store") + 1] == "127.0.0.1:4"
    gateway = specs[-1].resolve(fields)
    assert gateway[gateway.index("--conductor") + 1] == "127.0.0.1:1,127.0.0.1:2"


def test_without_a_pool_only_a_requests_path_is_started(tmp_path):
    specs = LocalCluster(tmp_path, engines=2, stores=0).topology()
    assert names(specs, "store") == names(specs, "transfer") == []
    assert all("--store" not in s.args for s in specs)
    assert [s.service for s in specs] == ["conductor", "sim-engine", "sim-engine", "gateway"]


def test_vllm_engines_are_specs_of_their_own_bound_to_a_store(tmp_path):
    specs = LocalCluster(tmp_path, engines=2, stores=1, engine_kind="vllm").topology()
    assert [(s.name, s.store) for s in specs if s.service == "vllm"] == [
        ("engine-0", "store-0"), ("engine-1", "store-0"),
    ]  # fmt: skip
