"""Who may report KV events over gRPC (`EventRouter.check_source`, `ingest_proto`), the
per-process certificates that name a caller (`certs.make_instance_credentials`), and
the sim engine's private event socket directory."""

from __future__ import annotations

import random
import stat

import pytest

from quillcache.v1 import conductor_pb2
from quillcache_conductor.events import EventRouter, SourceRefused
from quillcache_conductor.state import ConductorState
from quillcache_core.errors import InvalidArgument, NotFound
from quillcache_core.index import MemoryIndex
from quillcache_core.model import CostModel
from quillcache_core.process.metrics import MetricsRegistry
from quillcache_core.registry import NodeRecord
from quillcache_core.routing.planner import CostPlanner
from quillcache_core.security.certs import instance_uri, make_certs, make_instance_credentials
from quillcache_core.security.tls import PeerIdentity
from quillcache_simengine.config import SimEngineConfig
from quillcache_simengine.events import private_dir

pytestmark = pytest.mark.unit


def router() -> EventRouter:
    state = ConductorState(
        MemoryIndex(), CostPlanner(CostModel()), clock=lambda: 1000.0, rng=random.Random(1)
    )
    state.engine_joined(NodeRecord("engine", "e0", "", "r", base_url="http://e0", model="m"))
    state.store_joined(NodeRecord("store", "s0", "127.0.0.1:1", "r"))
    return EventRouter(state, MetricsRegistry(), subscribe_zmq=False)


def cleared(node: str, source: str) -> conductor_pb2.KvEventBatch:
    batch = conductor_pb2.KvEventBatch(engine_id=node, source_kind=source)
    batch.events.add().cleared.CopyFrom(conductor_pb2.AllBlocksCleared())
    return batch


@pytest.mark.parametrize(
    ("role", "instance", "node", "source", "refusal"),
    [
        ("engine", "e0", "e0", "engine", ""),  # an engine for itself
        ("engine", "e0", "e0", "", ""),  # "" is "engine"
        ("engine", "e1", "e0", "engine", "other_instance"),
        ("engine", "", "e0", "engine", "no_instance"),  # engines publish over ZMQ
        ("engine", "e0", "e0", "store", "role"),
        ("store", "s0", "s0", "store", ""),  # a store for itself
        ("store", "", "s0", "store", ""),  # a store certificate of the whole role
        ("store", "s1", "s0", "store", "other_instance"),
        ("store", "s0", "e0", "engine", "role"),  # a store never for an engine
        ("store", "", "e0", "engine", "role"),
    ],
)
def test_a_batch_is_taken_only_from_the_node_it_reports_for(role, instance, node, source, refusal):
    events = router()
    batch = cleared(node, source)
    if refusal:
        with pytest.raises(SourceRefused):
            events.check_source(batch, PeerIdentity(role, instance))
        kind = source or "engine"
        assert list(events.refused.samples()) == [((kind, refusal), 1.0)]
    else:
        events.check_source(batch, PeerIdentity(role, instance))
        assert events.ingest_proto(batch) == (1, [])


@pytest.mark.parametrize(("node", "source"), [("ghost", "engine"), ("e0", "store")])
def test_a_batch_for_an_unregistered_node_applies_nothing_and_is_counted(node, source):
    events = router()
    batch = cleared(node, source)
    batch.identity.model_id = "m"
    with pytest.raises(NotFound):
        events.ingest_proto(batch)
    assert list(events.refused.samples()) == [((source, "unregistered"), 1.0)]
    assert events.applied_total() == 0


def test_a_process_credential_directory_holds_its_own_pair_the_ca_and_its_secrets(tmp_path):
    certs = make_certs(tmp_path / "certs")
    gateway = make_instance_credentials(certs, tmp_path / "gw", "gateway", "gateway")
    store = make_instance_credentials(certs, tmp_path / "s0", "store", "store-0")
    assert sorted(p.name for p in gateway.iterdir()) == [
        "ca.pem", "engine-api-key", "gateway-key.pem", "gateway.pem", "tenant-secret",
    ]  # fmt: skip
    assert sorted(p.name for p in store.iterdir()) == ["ca.pem", "store-key.pem", "store.pem"]
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    assert stat.S_IMODE((store / "store-key.pem").stat().st_mode) == 0o600
    kept = (store / "store.pem").read_bytes()
    assert make_instance_credentials(certs, store, "store", "store-0") == store
    assert (store / "store.pem").read_bytes() == kept  # kept while the CA is the same
    with pytest.raises(ValueError):
        instance_uri("store", "a/b")


def test_the_event_socket_directory_is_private_or_refused(tmp_path):
    made = private_dir(str(tmp_path / "ipc"))
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(InvalidArgument):
        private_dir(str(shared))


@pytest.mark.parametrize(
    "flags",
    [
        {"kv_events_dir": "/tmp/q", "kv_events_port": 5557},  # one or the other
        {"kv_events_dir": "/tmp/" + "d" * 120},  # longer than a unix socket's path
    ],
)
def test_the_sim_engine_refuses_event_socket_flags_that_cannot_hold(flags):
    with pytest.raises(InvalidArgument):
        SimEngineConfig(insecure=True, **flags)
