"""`OutcomeBatches`: pull outcomes from worker threads reach the event loop in batches,
each exactly once, without waiting longer than the linger, and at once when a batch is
full or the last outcome is in."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from quillcache_store.datapath.pull import OutcomeBatches, PullOutcome

pytestmark = pytest.mark.unit

LONG_LINGER_S = 60.0  # never reached by a passing test: a batch is due before it
DEADLINE_S = 10.0


async def _collect(batches: OutcomeBatches, expected: int) -> list[list[int]]:
    out: list[list[int]] = []
    async with asyncio.timeout(DEADLINE_S):
        while sum(map(len, out)) < expected:
            out.append([o.index for o in await batches.next_batch()])
    return out


def _add_from_threads(batches: OutcomeBatches, indices: list[int], threads: int, seed: int):
    rng = random.Random(seed)
    shares = [indices[t::threads] for t in range(threads)]
    pauses = [[rng.random() * 0.002 for _ in share] for share in shares]

    def work(share: list[int], waits: list[float]) -> None:
        for i, wait in zip(share, waits, strict=True):
            time.sleep(wait)  # outcomes trickle in, as blocks finish
            batches.add(PullOutcome(i, True, bytes=1))

    workers = [
        threading.Thread(target=work, args=(share, waits))
        for share, waits in zip(shares, pauses, strict=True)
    ]
    for w in workers:
        w.start()
    return workers


@pytest.mark.parametrize(
    ("expected", "max_batch", "linger_s", "threads", "seed"),
    [
        (1, 16, LONG_LINGER_S, 1, 1),
        (50, 1, 0.0, 2, 2),
        (200, 16, 0.005, 2, 3),
        (200, 64, LONG_LINGER_S, 4, 4),
        (37, 5, 0.0, 3, 5),
    ],
)
def test_every_outcome_is_handed_over_exactly_once(expected, max_batch, linger_s, threads, seed):
    async def scenario():
        batches = OutcomeBatches(
            asyncio.get_running_loop(), expected, max_batch=max_batch, linger_s=linger_s
        )
        workers = _add_from_threads(batches, list(range(expected)), threads, seed)
        try:
            return await _collect(batches, expected)
        finally:
            for w in workers:
                w.join()

    got = asyncio.run(scenario())
    assert sorted(i for batch in got for i in batch) == list(range(expected))
    assert all(batch for batch in got)


def test_a_full_batch_and_the_last_outcome_do_not_wait_for_the_linger():
    async def scenario():
        batches = OutcomeBatches(asyncio.get_running_loop(), 6, max_batch=4, linger_s=LONG_LINGER_S)
        for i in range(4):
            batches.add(PullOutcome(i, True))
        first = await _collect(batches, 4)
        # The last two arrive from a thread while the loop waits.
        worker = threading.Thread(
            target=lambda: [batches.add(PullOutcome(i, True)) for i in (4, 5)]
        )
        worker.start()
        rest = await _collect(batches, 2)
        worker.join()
        return first, rest

    first, rest = asyncio.run(scenario())
    assert first == [[0, 1, 2, 3]]
    assert sorted(i for batch in rest for i in batch) == [4, 5]


def test_a_lone_outcome_waits_no_longer_than_the_linger():
    async def scenario():
        loop = asyncio.get_running_loop()
        batches = OutcomeBatches(loop, 10, max_batch=8, linger_s=0.05)
        threading.Thread(
            target=batches.add, args=(PullOutcome(3, False, code="NOT_FOUND"),)
        ).start()
        started = loop.time()
        async with asyncio.timeout(DEADLINE_S):
            batch = await batches.next_batch()
        return batch, loop.time() - started

    batch, waited = asyncio.run(scenario())
    assert [(o.index, o.ok, o.code) for o in batch] == [(3, False, "NOT_FOUND")]
    assert waited >= 0.04  # it did linger for company, then went alone


def test_asking_past_the_expected_outcomes_is_an_error():
    async def scenario():
        batches = OutcomeBatches(asyncio.get_running_loop(), 1, max_batch=4, linger_s=0.0)
        batches.add(PullOutcome(0, True))
        await batches.next_batch()
        await batches.next_batch()

    with pytest.raises(RuntimeError, match="already handed over"):
        asyncio.run(scenario())


def test_producers_that_stop_early_end_the_wait_with_their_error():
    async def scenario():
        batches = OutcomeBatches(asyncio.get_running_loop(), 5, max_batch=4, linger_s=LONG_LINGER_S)
        batches.add(PullOutcome(0, True))
        # A pull thread that raised: the rest of its outcomes will never come.
        threading.Thread(target=batches.fail, args=(RuntimeError("pull crashed"),)).start()
        async with asyncio.timeout(DEADLINE_S):
            first = await batches.next_batch()
            with pytest.raises(RuntimeError, match="pull crashed"):
                await batches.next_batch()
        return first

    assert [o.index for o in asyncio.run(scenario())] == [0]
