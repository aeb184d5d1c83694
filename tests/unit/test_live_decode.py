"""bench-live's decode-heavy workload: its sessions, the inter-token gaps read
from a stream, the ITL figures and the split goal; the sim scheduler's prefill start."""

from __future__ import annotations

import asyncio
import json

import pytest

from quillcache_bench.disagg import inter_token_s, latency_ms
from quillcache_bench.live_report import (
    FIELDS,
    ITL_FIELDS,
    SPLIT,
    itl_table,
    split_goals,
    split_goals_text,
    summarise,
)
from quillcache_bench.live_systems import EngineCounters
from quillcache_bench.live_workloads import Sample, _Timed, make_sessions
from quillcache_simengine.scheduler import Scheduler

pytestmark = pytest.mark.unit


def test_decode_sessions_are_single_long_outputs_with_distinct_prompts():
    sessions = make_sessions("decode", 30, 4.0, seed=3, nonce="n1")
    assert len(sessions) == 30 and all(len(s.turns) == 1 for s in sessions)
    turns = [s.turns[0] for s in sessions]
    assert all(200 <= t.max_tokens <= 400 and t.ignore_eos for t in turns)
    assert all(500 <= len(t.user.split()) <= 905 for t in turns)
    assert len({t.user for t in turns}) == 30
    assert all(s.system.startswith("[n1] ") for s in sessions)
    assert make_sessions("decode", 30, 4.0, seed=3, nonce="n1") == sessions
    assert not make_sessions("chat", 10, 4.0, seed=3, nonce="n1")[0].turns[0].ignore_eos


def test_the_gaps_are_between_chunks_with_content():
    lines = [
        b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}',
        b'data: {"choices":[{"delta":{"content":"a"}}]}',
        b"",
        b'data: {"choices":[{"delta":{"content":" b"}}]}',
        b'data: {"choices":[{"delta":{},"finish_reason":"length"}]}',
        b"data: [DONE]",
    ]

    async def source():
        for line in lines:
            yield line

    async def read():
        timed = _Timed(source())
        got = [line async for line in timed]
        return got, timed.content_arrivals()

    got, arrivals = asyncio.run(read())
    assert got == lines and len(arrivals) == 2 and arrivals[0] <= arrivals[1]
    assert inter_token_s([1.0, 1.5, 3.0]) == [0.5, 1.5]
    assert latency_ms([0.01, 0.03])["mean"] == 20.0


def _sample(ttft: float, gaps: list[float]) -> Sample:
    return Sample("t", sent_s=0.0, ttft_s=ttft, done_s=1.0, ok=True, itl_s=gaps)


def test_itl_figures_and_the_split_goal():
    served = [EngineCounters(1, 100, 0), EngineCounters(1, 100, 50)]
    colocated = summarise([_sample(0.1, [0.015] * 98 + [0.08] * 2)], served, 0.5, itl=True)
    assert set(colocated) == set(FIELDS) | set(ITL_FIELDS)
    assert set(summarise([_sample(0.1, [])], served, 0.5)) == set(FIELDS)
    split = summarise([_sample(0.105, [0.015] * 100)], served, 0.5, itl=True)
    assert round(split["itl_p99_ms"], 1) == 15.0 and colocated["itl_p99_ms"] > 70
    runs = [
        {"workload": "decode", "load": "heavy", "systems": {"quillcache": colocated, SPLIT: split}}
    ]
    found = split_goals(runs)
    assert found[0]["itl_met"] and found[0]["ttft_met"]  # 0.2x and 1.05x
    assert "met" in split_goals_text(found) and SPLIT in itl_table(runs)
    json.dumps(runs)
    assert (
        split_goals([{"workload": "chat", "load": "heavy", "systems": {"quillcache": split}}]) == []
    )


def test_the_scheduler_says_when_a_prefill_begins():
    now = [0.0]

    async def sleep(s: float) -> None:
        now[0] += s

    sched = Scheduler(
        prefill_us_per_token=1000, decode_us_per_token=0, time_scale=1.0,
        clock=lambda: now[0], sleep=sleep,
    )  # fmt: skip

    async def two():
        first, second = asyncio.Event(), asyncio.Event()
        a = asyncio.ensure_future(sched.prefill(100, first))
        b = asyncio.ensure_future(sched.prefill(50, second))
        await asyncio.sleep(0)
        return await a, await b, first.is_set(), second.is_set()

    end_a, end_b, first, second = asyncio.run(two())
    assert (round(end_a, 6), round(end_b, 6)) == (0.1, 0.15) and first and second
