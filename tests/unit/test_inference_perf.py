"""The independent driver's side of the capacity race: its config asks for our docqa
shape, and its summary is read into the race's figures."""

from __future__ import annotations

import math

import pytest
import yaml

from quillcache_bench.capacity_workloads import DocqaShape
from quillcache_bench.inference_perf import CONFIG, figures

pytestmark = pytest.mark.unit


def test_the_config_asks_for_the_races_docqa_shape_at_its_rate():
    config = yaml.safe_load(CONFIG.read_text())
    shape, ours = config["data"]["shared_prefix"], DocqaShape()
    assert config["data"]["type"] == "shared_prefix" and config["api"]["streaming"] is True
    assert (shape["system_prompt_len"]["min"], shape["system_prompt_len"]["max"]) == ours.doc_tokens
    assert (shape["question_len"]["min"], shape["question_len"]["max"]) == ours.question_tokens
    assert (shape["output_len"]["min"], shape["output_len"]["max"]) == ours.answer_tokens
    assert shape["num_prompts_per_group"] == ours.questions_per_doc
    assert config["load"]["type"] == "poisson" and config["load"]["stages"][0]["rate"] == 0.5
    # W/C 2 on two engines of 12,288 tokens: 12 documents of 4,000 tokens on average.
    assert shape["num_groups"] * 4000 == pytest.approx(2 * 2 * 12288, rel=0.03)


def test_a_summary_in_seconds_becomes_milliseconds_and_missing_figures_nan():
    summary = {
        "successes": {
            "count": 73,
            "latency": {
                "time_to_first_token": {"mean": 1.25, "median": 0.5, "p90": 2.0, "p99": 4.0}
            },  # fmt: skip
        },
        "failures": {"count": 2},
    }
    got = figures(summary, 160.04)
    assert (got["ttft_mean_ms"], got["ttft_p50_ms"], got["ttft_p99_ms"]) == (1250, 500, 4000)
    assert (got["requests"], got["errors"], got["elapsed_s"]) == (73, 2, 160.0)
    empty = figures({"successes": {"count": 0}, "failures": {"count": 75}}, 1.0)
    assert math.isnan(empty["ttft_mean_ms"]) and empty["errors"] == 75
