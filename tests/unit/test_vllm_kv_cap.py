"""How `quillcache up --engine vllm --engine-kv-tokens N` sizes an engine's KV cache: the
blocks it asks vLLM for, the longest context vLLM then admits, the KV space, the record's
capacity; and the flag refused, naming it, where N cannot be a vLLM cache."""

from __future__ import annotations

import json

import pytest

from quillcache_core.launch import up, vllm_env
from quillcache_core.launch.vllm_engine import (
    GIB,
    EngineKv,
    ModelKv,
    engine_kv,
    kv_cache_blocks,
    serve_args,
    serve_env,
)

pytestmark = pytest.mark.unit

TINY = ModelKv(context_tokens=2048, bytes_per_token=2 * 2 * 4 * 32 * 2)  # 1 KiB a token
BENCH = ModelKv(context_tokens=8192, bytes_per_token=8 * 2 * 8 * 128 * 2)  # 32 KiB a token


@pytest.mark.parametrize(("tokens", "blocks"), [(64, 2), (768, 24), (12_288, 384)])
def test_a_multiple_of_the_block_size_is_that_many_blocks(tokens, blocks):
    assert kv_cache_blocks(tokens) == blocks


@pytest.mark.parametrize("tokens", [0, -32, 100, 31, 32, 800.0, True])
def test_anything_else_is_refused_naming_the_flag(tokens):
    """32 is one block: vLLM keeps one back, and with none left it refuses to start."""
    with pytest.raises(ValueError, match="--engine-kv-tokens"):
        kv_cache_blocks(tokens)


@pytest.mark.parametrize(
    ("model", "tokens", "expected"),
    [
        # vLLM keeps a block back: a request of the whole cache would not start it
        (TINY, 768, EngineKv(24, 736, 1, 768 * 1024)),
        # 384 MiB of KV fit the default space; the model's context fits the cache
        (BENCH, 12_288, EngineKv(384, 8192, 1, 384 * 1024**2)),
        (BENCH, 8192, EngineKv(256, 8160, 1, 256 * 1024**2)),
        # 2 GiB of KV: the space grows to hold them
        (BENCH, 65_536, EngineKv(2048, 8192, 2, 2 * GIB)),
        (BENCH, 65_536 + 32, EngineKv(2049, 8192, 3, 2 * GIB + 32 * 32 * 1024)),
        # no cap: what 1 GiB holds, the model's context
        (TINY, None, EngineKv(None, 2048, 1, GIB)),
        (BENCH, None, EngineKv(None, 8192, 1, GIB)),
        # a config that does not say its KV size: its context, capacity not said
        (ModelKv(4096, 0), None, EngineKv(None, 4096, 1, 0)),
    ],
)
def test_the_cache_the_context_and_the_space(model, tokens, expected):
    assert engine_kv(model, tokens) == expected


def test_the_model_s_figures_come_from_its_config(tmp_path):
    config = {
        "num_hidden_layers": 8,
        "hidden_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelKv.of(tmp_path) == BENCH
    config |= {"head_dim": 32, "num_key_value_heads": 2, "torch_dtype": "float32"}
    del config["dtype"], config["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelKv.of(tmp_path) == ModelKv(2048, 8 * 2 * 2 * 32 * 4)


def test_the_server_is_told_the_blocks_the_context_and_the_space(tmp_path):
    kv = engine_kv(BENCH, 65_536)
    args = serve_args(
        tmp_path,
        "bench",
        port=1,
        events_port=2,
        replay_port=3,
        max_model_len=kv.max_model_len,
        kv_blocks=kv.blocks,
    )
    assert args[args.index("--num-gpu-blocks-override") + 1] == "2048"
    assert args[args.index("--max-model-len") + 1] == "8192"
    assert serve_env(kv_space_gib=kv.kv_space_gib)["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "--num-gpu-blocks-override" not in serve_args(
        tmp_path, "bench", port=1, events_port=2, replay_port=3
    )
    assert serve_env()["VLLM_CPU_KVCACHE_SPACE"] == "1"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--engine", "vllm", "--engine-kv-tokens", "100"], "multiple of the engines' block"),
        (["--engine", "vllm", "--engine-kv-tokens", "0"], "at least 64"),
        (["--engine-kv-tokens", "768"], "--engine vllm"),
    ],
)
def test_quillcache_up_refuses_a_bad_cap_at_once(argv, says, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(up.signal, "signal", lambda *_: None)
    with pytest.raises(SystemExit) as exited:
        up.main(["--data-dir", str(tmp_path), *argv])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "--engine-kv-tokens" in error and says in error
    assert not (tmp_path / "logs").exists()  # nothing started


def test_the_bench_model_lives_beside_the_tiny_one_under_its_shape(monkeypatch, tmp_path):
    monkeypatch.setenv("QC_VLLM_MODEL", str(tmp_path / "tiny-llama-v1"))
    assert vllm_env.bench_model_dir() == tmp_path / "bench-llama-8x1024-ctx8192-v1"


def test_vllm_env_check_reports_no_bench_model_without_vllm(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("QC_VLLM_VENV", str(tmp_path / "no-venv"))
    assert vllm_env.main(["--check", "--bench-model"]) == 1
    assert json.loads(capsys.readouterr().out) == {
        "python": None,
        "model_dir": None,
        "bench_model_dir": None,
    }
