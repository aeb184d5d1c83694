"""The peers' command lines (`quillcache_bench.live_peers`): pure, no process started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quillcache_bench import live_peers
from quillcache_bench.live_peers import (
    PeerUnavailable,
    lmcache_env_and_args,
    native_offload_args,
    smg_argv,
    vllm_grpc_serve_argv,
    vllm_router_kv_aware_argv,
)

pytestmark = pytest.mark.unit

WORKERS = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_smg_launch_keeps_its_defaults_but_listeners_policy_and_log_level():
    argv = smg_argv("/venv/bin/smg", WORKERS, 9000, 9001)
    assert argv[:2] == ["/venv/bin/smg", "launch"]
    assert flag(argv, "--host") == "127.0.0.1" and flag(argv, "--port") == "9000"
    assert argv[argv.index("--worker-urls") + 1 : argv.index("--worker-urls") + 3] == WORKERS
    assert flag(argv, "--policy") == "cache_aware"
    assert flag(argv, "--prometheus-port") == "9001"
    assert flag(argv, "--prometheus-host") == "127.0.0.1"
    assert flag(argv, "--log-level") == "warn"
    tuned = {"--cache-threshold", "--balance-abs-threshold", "--block-size", "--kv-index"}
    assert not tuned & set(argv)


def test_smg_event_driven_index_is_picked_by_name_and_never_fed_zmq_endpoints():
    grpc = ["grpc://127.0.0.1:8001"]
    assert flag(smg_argv("smg", grpc, 1, 2, kv_index="chain"), "--kv-index") == "chain"
    with pytest.raises(ValueError, match="SubscribeKvEvents"):
        smg_argv("smg", WORKERS, 1, 2, kv_events=["tcp://127.0.0.1:5557"])


def test_smg_defaults_are_the_ones_its_start_up_line_printed():
    defaults = live_peers.SMG_CACHE_AWARE_DEFAULTS
    assert defaults["cache_threshold"] == 0.3
    assert (defaults["balance_abs_threshold"], defaults["balance_rel_threshold"]) == (64, 1.5)
    assert defaults["cache_index"] == "tree" and defaults["kv_index"] == "positional"


def test_vllm_router_kv_aware_gets_one_source_per_worker_and_the_engines_block_size():
    events = {
        WORKERS[0]: ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),
        WORKERS[1]: ("tcp://127.0.0.1:5567", None),
    }
    argv = vllm_router_kv_aware_argv(WORKERS, 9000, 9001, events, "tiny")
    assert flag(argv, "--policy") == "kv_aware"
    sources = [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-event-source"]
    assert sources == [f"{WORKERS[0]}=tcp://127.0.0.1:5557", f"{WORKERS[1]}=tcp://127.0.0.1:5567"]
    replays = [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-event-replay-source"]
    assert replays == [f"{WORKERS[0]}=tcp://127.0.0.1:5558"]
    assert flag(argv, "--kv-event-block-size") == "32"
    assert flag(argv, "--kv-event-model") == "tiny"
    assert "kv_aware" in live_peers.VLLM_ROUTER_POLICIES
    with pytest.raises(ValueError, match="every worker"):
        vllm_router_kv_aware_argv(WORKERS, 9000, 9001, {WORKERS[0]: events[WORKERS[0]]}, "x")


def test_the_grpc_engine_publishes_events_and_drops_the_flag_its_entrypoint_refuses():
    argv = vllm_grpc_serve_argv(
        "/venv/bin/python", Path("/m"), "tiny", port=50051, events_port=5557, replay_port=5558
    )
    assert argv[:3] == ["/venv/bin/python", "-m", live_peers.VLLM_GRPC_MODULE]
    assert "--enable-prompt-tokens-details" not in argv
    events = json.loads(flag(argv, "--kv-events-config"))
    assert events["endpoint"] == "tcp://*:5557" and events["replay_endpoint"] == "tcp://*:5558"
    assert flag(argv, "--port") == "50051" and flag(argv, "--block-size") == "32"


def test_the_cpu_tiers_that_do_not_run_here_raise_quoting_their_errors():
    with pytest.raises(PeerUnavailable, match="only supported on CUDA-alike"):
        native_offload_args(1)
    with pytest.raises(PeerUnavailable, match="No supported cpu connector found"):
        lmcache_env_and_args(1)


def test_smg_is_ready_only_when_its_readiness_says_so(monkeypatch):
    answers = {
        "/readiness": '{"status":"not ready","reason":"tokenizer not yet registered"}',
    }
    monkeypatch.setattr(live_peers, "metric_text", lambda url: answers[url[len("http://x") :]])
    router = live_peers.SmgProcess("smg", [], "http://x", Path("/dev/null"))
    assert not router._ready(1)
    answers["/readiness"] = '{"status":"ready","healthy_workers":1,"total_workers":2}'
    assert router._ready(1) and not router._ready(2)
