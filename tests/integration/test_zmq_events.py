"""KV events over real ZMQ sockets from a vLLM-style publisher in another process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from quillcache_conductor.zmq_sub import EngineSubscriber
from quillcache_core.identity.keys import request_blocks
from quillcache_core.index.memory import MemoryIndex
from quillcache_core.kvevents.events import DecodedBatch
from quillcache_core.kvevents.translate import ApplyResult, EngineEventTranslator

pytestmark = pytest.mark.integration

PUBLISHER = Path(__file__).resolve().parents[1] / "support" / "vllm_publisher.py"
MODEL, TOKENIZER, BS, ENGINE = "llama-3-8b", "llama-3", 16, "vllm-0"


def run(coro: Coroutine[Any, Any, None], timeout_s: float = 60.0) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(timeout_s):
            await coro

    asyncio.run(bounded())


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def gateway_keys(tokens: list[int], tenant: str | None) -> list:
    return request_blocks(
        tokens,
        BS,
        model_id=MODEL,
        tokenizer_id=TOKENIZER,
        adapter_id=None,
        tenant_id=tenant or "default",
        cache_salt=tenant,
    )


class Publisher:
    """The publisher script in a subprocess, driven by JSON lines on its stdin."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.endpoint = ""
        self.replay_endpoint = ""

    @classmethod
    async def start(cls, *args: str) -> Publisher:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(PUBLISHER),
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        pub = cls(proc)
        line = await pub._line(timeout_s=20.0)
        assert line.startswith("READY "), line
        pub.endpoint, pub.replay_endpoint = line.split()[1:3]
        return pub

    async def _line(self, timeout_s: float = 10.0) -> str:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        if not raw:
            raise AssertionError(f"publisher exited (code {self.proc.returncode})")
        return raw.decode().strip()

    async def send(self, **cmd: Any) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        answer = await self._line()
        assert answer.startswith("OK "), answer
        return int(answer.split()[1])

    async def close(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(Exception):
                await self.send(op="quit")
            try:
                await asyncio.wait_for(self.proc.wait(), 5.0)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


class Harness:
    """Subscriber + translator + MemoryIndex, recording what the callbacks saw."""

    def __init__(self, pub: Publisher) -> None:
        self.index = MemoryIndex()
        self.translator = EngineEventTranslator(self.index, ENGINE, MODEL, TOKENIZER)
        self.results: list[tuple[int, ApplyResult]] = []
        self.errors: list[tuple[str, int | None, str, str]] = []
        self.lost_resets: list[int] = []  # records dropped at each loss
        self.sub = EngineSubscriber(
            ENGINE,
            pub.endpoint,
            pub.replay_endpoint,
            on_batch=self.on_batch,
            on_error=self.on_error,
            on_reset=lambda engine_id: self.translator.reset(),
            on_lost=lambda engine_id, missing: self.lost_resets.append(self.translator.reset()),
        )

    def on_batch(self, engine_id: str, seq: int, batch: DecodedBatch) -> None:
        assert engine_id == ENGINE
        self.results.append((seq, self.translator.apply(batch)))

    def on_error(self, engine_id: str, seq: int | None, reason: str, detail: str) -> None:
        self.errors.append((engine_id, seq, reason, detail))

    @property
    def applied_seqs(self) -> list[int]:
        return [seq for seq, _ in self.results]

    def holds(self, tokens: list[int], tenant: str | None) -> bool:
        keys = gateway_keys(tokens, tenant)
        return bool(keys) and all(
            any(r.worker_id == ENGINE for r in self.index.locate(k)) for k in keys
        )


def prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 32000 for i in range(blocks * BS + 5)]


@pytest.mark.parametrize(
    ("encoding", "hash_style"),
    [("array", "u64"), ("map", "i64"), ("map", "bytes32"), ("sglang", "i64")],
)
def test_events_fill_the_index_and_survive_corruption_gaps_and_clears(encoding, hash_style):
    async def scenario() -> None:
        pub = await Publisher.start(
            "--encoding", encoding, "--hash-style", hash_style, "--block-size", str(BS)
        )
        harness = Harness(pub)
        try:
            harness.sub.start()
            await warm_up_and_track(pub, harness)

            # Stored events fill the index under the gateway's hashes.
            a, b = prompt(1, 4), prompt(2, 3)
            seq = await pub.send(op="store", tokens=a, salt="acme")
            await until(lambda: harness.sub.last_seq == seq, f"seq {seq}")
            assert harness.holds(a, "acme")
            assert not harness.holds(a, "globex") and not harness.holds(a, None)

            # Chained extension: only the new blocks are reported, with a parent.
            longer = a[: 4 * BS] + prompt(3, 2)
            seq = await pub.send(op="store", tokens=longer, salt="acme")
            await until(lambda: harness.sub.last_seq == seq, f"seq {seq}")
            assert harness.holds(longer, "acme")
            assert harness.results[-1][1].rejected == []

            # A corrupt event is reported; the good events around it apply.
            c = prompt(4, 2)
            seq = await pub.send(op="corrupt", tokens=b, tokens2=c)
            await until(lambda: harness.sub.last_seq == seq, f"seq {seq}")
            assert harness.holds(b, None) and harness.holds(c, None)
            result = harness.results[-1][1]
            assert result.applied == 2
            assert [(e.index, e.reason) for e in result.rejected] == [(1, "token_count_mismatch")]
            assert (ENGINE, seq, "token_count_mismatch") in [e[:3] for e in harness.errors]
            assert harness.sub.counters.event_errors == 1

            # A batch never sent live is recovered through the replay socket.
            d, e = prompt(5, 2), prompt(6, 2)
            skipped = await pub.send(op="skip_next")
            assert await pub.send(op="store", tokens=d, salt="acme") == skipped
            seq = await pub.send(op="store", tokens=e, salt="acme")
            await until(lambda: harness.sub.last_seq == seq, f"seq {seq}")
            assert harness.sub.counters.gaps == 1
            assert harness.sub.counters.replayed >= 1
            assert harness.holds(d, "acme") and harness.holds(e, "acme")
            seqs = harness.applied_seqs
            assert seqs == sorted(seqs) and len(seqs) == len(set(seqs)), "in order, once each"
            assert skipped in seqs and harness.sub.counters.lost == 0

            # Removal of the tail blocks of `a`'s extension.
            seq = await pub.send(op="remove", tokens=longer, salt="acme", last=2)
            await until(lambda: harness.sub.last_seq == seq, f"seq {seq}")
            assert harness.holds(a, "acme") and not harness.holds(longer, "acme")

            # AllBlocksCleared empties the engine.
            assert harness.index.worker_block_count(ENGINE) > 0
            seq = await pub.send(op="clear")
            await until(lambda: harness.sub.last_seq == seq, f"seq {seq}")
            assert harness.index.worker_block_count(ENGINE) == 0
            assert len(harness.translator) == 0
            assert harness.sub.counters.wire_errors == 0
        finally:
            await harness.sub.stop()
            await pub.close()

    run(scenario())


async def warm_up_and_track(pub: Publisher, harness: Harness) -> None:
    deadline = time.monotonic() + 15.0
    last = -1
    while harness.sub.counters.batches == 0:
        if time.monotonic() > deadline:
            raise AssertionError("subscriber never received a batch")
        last = await pub.send(op="clear")
        with contextlib.suppress(AssertionError):
            await until(lambda: harness.sub.counters.batches > 0, "first batch", timeout_s=0.3)
    # Clears sent before the subscription was live come back through the catch-up replay.
    await until(lambda: harness.sub.last_seq == last, "warm-up batches")
    assert harness.applied_seqs == list(range(last + 1))


def test_a_late_subscriber_catches_up_from_the_replay_buffer():
    async def scenario() -> None:
        pub = await Publisher.start("--block-size", str(BS))
        harness = Harness(pub)
        try:
            early = prompt(7, 3)
            await pub.send(op="store", tokens=early, salt="acme")  # seq 0: nobody listening
            harness.sub.start()
            deadline = time.monotonic() + 15.0
            last = 0
            while harness.sub.last_seq < last:
                if time.monotonic() > deadline:
                    raise AssertionError("no batch received")
                last = await pub.send(op="store", tokens=prompt(100 + last, 1))
                with contextlib.suppress(AssertionError):
                    await until(lambda: harness.sub.last_seq >= 0, "a batch", timeout_s=0.3)
            await until(lambda: harness.sub.last_seq == last, "catch-up")
            assert harness.holds(early, "acme")
            assert harness.applied_seqs == list(range(last + 1))
            assert harness.sub.counters.gaps == 0 and harness.sub.counters.lost == 0
        finally:
            await harness.sub.stop()
            await pub.close()

    run(scenario())


def test_garbage_frames_are_reported_not_fatal():
    """Raw frames that are not vLLM batches, from a PUB socket in this process."""
    import zmq
    import zmq.asyncio

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind("tcp://127.0.0.1:*")
        endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        seen: list[tuple[int, DecodedBatch]] = []
        errors: list[tuple[int | None, str]] = []
        sub = EngineSubscriber(
            ENGINE,
            endpoint,
            None,
            on_batch=lambda _e, seq, batch: seen.append((seq, batch)),
            on_error=lambda _e, seq, reason, _d: errors.append((seq, reason)),
            catch_up=False,
        )
        sub.start()
        try:
            import msgpack

            good = msgpack.packb([1.0, [["AllBlocksCleared"]], 0])
            deadline = time.monotonic() + 15.0
            seq = 0
            while not seen:  # until the subscription is live
                if time.monotonic() > deadline:
                    raise AssertionError("subscriber never received a batch")
                await pub.send_multipart([b"", seq.to_bytes(8, "big"), good])
                seq += 1
                with contextlib.suppress(AssertionError):
                    await until(lambda: bool(seen), "first batch", timeout_s=0.3)
            base = seen[-1][0] + 1
            await pub.send_multipart([b"", b"\x00\x01"])  # 2 frames
            await pub.send_multipart([b"", b"\x01\x02", b"x"])  # short sequence
            await pub.send_multipart([b"", base.to_bytes(8, "big"), b"\xc1"])  # not msgpack
            await pub.send_multipart([b"", (base + 1).to_bytes(8, "big"), msgpack.packb(7)])
            await pub.send_multipart([b"", (base + 2).to_bytes(8, "big"), good])
            await until(lambda: sub.last_seq == base + 2, "the good batch after the garbage")
            assert [r for _, r in errors] == [
                "bad_frames",
                "bad_sequence",
                "not_msgpack",
                "not_a_batch",
            ]
            assert [s for s, _ in errors[2:]] == [base, base + 1]
            assert sub.counters.wire_errors == 4 and sub.running
        finally:
            await sub.stop()
            pub.close(linger=0)
            ctx.term()

    run(scenario())


def _in_process_harness(publisher) -> Harness:
    class _Endpoints:
        endpoint = publisher.endpoint
        replay_endpoint = publisher.replay_endpoint

    return Harness(_Endpoints())  # type: ignore[arg-type]


async def _go_live(publisher, harness: Harness) -> int:
    """Publish clears until one arrives live; returns the last seq published."""
    deadline = time.monotonic() + 15.0
    last = -1
    while harness.sub.counters.batches == 0:
        if time.monotonic() > deadline:
            raise AssertionError("subscriber never received a batch")
        last = publisher.publish([publisher.encoder.cleared_event()])
        with contextlib.suppress(AssertionError):
            await until(lambda: harness.sub.counters.batches > 0, "first batch", timeout_s=0.3)
    await until(lambda: harness.sub.last_seq == last, "warm-up batches")
    return last


def test_what_the_replay_buffer_no_longer_holds_is_reported_lost():
    from tests.support.vllm_publisher import VllmEventEncoder, VllmStylePublisher

    async def scenario() -> None:
        enc = VllmEventEncoder(block_size=BS)
        with VllmStylePublisher(enc, buffer_steps=2) as publisher:
            harness = _in_process_harness(publisher)
            harness.sub.start()
            try:
                await _go_live(publisher, harness)
                before = prompt(10, 1)
                last = publisher.publish([enc.stored_event(before)])
                await until(lambda: harness.sub.last_seq == last, "a stored batch")
                assert harness.holds(before, None)
                dropped = [prompt(20 + i, 1) for i in range(3)]
                publisher.drop.update({last + 1, last + 2, last + 3})
                for tokens in dropped:
                    publisher.publish([enc.stored_event(tokens)])
                final = publisher.publish([enc.stored_event(prompt(30, 1))])
                await until(lambda: harness.sub.last_seq == final, "the batch after the gap")
                # The buffer kept only the last 2 batches: the 3rd dropped one and the final.
                assert harness.sub.counters.gaps == 1 and harness.sub.counters.lost == 2
                assert "events_lost" in [e[2] for e in harness.errors]
                assert not harness.holds(dropped[0], None) and harness.holds(dropped[2], None)
                assert harness.holds(prompt(30, 1), None)
                # What was known before the loss is no longer trusted: it went, once.
                assert len(harness.lost_resets) == 1 and harness.lost_resets[0] > 0
                assert not harness.holds(before, None)
            finally:
                await harness.sub.stop()

    run(scenario())


def test_a_subscriber_started_beside_idle_engines_knows_them_at_once():
    """A conductor (re)started while its engines are idle: what an engine's replay
    buffer holds is applied as the subscriber starts, before the engine publishes
    again, and an engine that has published nothing is current at once, not behind
    until its first batch."""
    from tests.support.vllm_publisher import VllmEventEncoder, VllmStylePublisher

    async def scenario() -> None:
        enc = VllmEventEncoder(block_size=BS)
        with VllmStylePublisher(enc) as warm, VllmStylePublisher(enc) as fresh:
            early = prompt(50, 3)
            warm.publish([enc.stored_event(early)])  # nobody listening yet
            warm.publish([enc.stored_event(prompt(51, 1))])
            on_warm, on_fresh = _in_process_harness(warm), _in_process_harness(fresh)
            on_warm.sub.start()
            on_fresh.sub.start()
            try:
                await until(lambda: on_warm.holds(early, None), "the warm engine's blocks")
                assert on_warm.applied_seqs == [0, 1] and on_warm.sub.counters.gaps == 0
                await until(lambda: on_fresh.sub.counters.probes == 1, "the fresh one's answer")
                now = time.monotonic()
                assert on_warm.sub.freshness.behind_ms(now) == 0
                assert on_fresh.sub.freshness.behind_ms(now) == 0
                assert on_fresh.applied_seqs == [] and on_fresh.errors == []
                # And the stream goes on from there, each batch applied once, in order.
                deadline = time.monotonic() + 15.0
                last = 1
                while on_warm.sub.last_seq < last:
                    if time.monotonic() > deadline:
                        raise AssertionError("no live batch received")
                    last = warm.publish([enc.stored_event(prompt(60 + last, 1))])
                    with contextlib.suppress(AssertionError):
                        await until(lambda: on_warm.sub.last_seq >= 2, "a batch", timeout_s=0.3)
                await until(lambda: on_warm.sub.last_seq == last, "the live batches")
                assert on_warm.applied_seqs == list(range(last + 1))
            finally:
                await on_warm.sub.stop()
                await on_fresh.sub.stop()

    run(scenario())


def test_a_restarted_publisher_resets_the_engine():
    from tests.support.vllm_publisher import VllmEventEncoder, VllmStylePublisher

    async def scenario() -> None:
        enc = VllmEventEncoder(block_size=BS)
        with VllmStylePublisher(enc) as publisher:
            harness = _in_process_harness(publisher)
            harness.sub.start()
            try:
                await _go_live(publisher, harness)
                before = prompt(40, 2)
                seq = publisher.publish([enc.stored_event(before)])
                await until(lambda: harness.sub.last_seq == seq, "store")
                assert harness.holds(before, None)
                # The engine restarts: empty cache, sequence numbers from 0 again.
                publisher._next_seq = 0
                enc.cached.clear()
                after = prompt(41, 2)
                publisher.publish([enc.stored_event(after)])
                await until(lambda: harness.sub.counters.resets == 1, "reset detected")
                await until(lambda: harness.holds(after, None), "store after restart")
                assert not harness.holds(before, None)
                assert "sequence_reset" in [e[2] for e in harness.errors]
                assert harness.sub.last_seq == 0
            finally:
                await harness.sub.stop()

    run(scenario())


def test_a_silent_replay_socket_times_out_and_the_stream_goes_on():
    import msgpack
    import zmq
    import zmq.asyncio

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind("tcp://127.0.0.1:*")
        silent = ctx.socket(zmq.ROUTER)  # accepts replay requests, never answers
        silent.setsockopt(zmq.LINGER, 0)
        silent.bind("tcp://127.0.0.1:*")
        errors: list[tuple[int | None, str]] = []
        seen: list[int] = []
        sub = EngineSubscriber(
            ENGINE,
            pub.getsockopt_string(zmq.LAST_ENDPOINT),
            silent.getsockopt_string(zmq.LAST_ENDPOINT),
            on_batch=lambda _e, seq, _b: seen.append(seq),
            on_error=lambda _e, seq, reason, _d: errors.append((seq, reason)),
            catch_up=False,
            replay_timeout_s=0.2,
        )
        sub.start()
        try:
            good = msgpack.packb([1.0, [], 0])
            seq = 0
            deadline = time.monotonic() + 15.0
            while not seen:
                if time.monotonic() > deadline:
                    raise AssertionError("subscriber never received a batch")
                await pub.send_multipart([b"", seq.to_bytes(8, "big"), good])
                seq += 1
                with contextlib.suppress(AssertionError):
                    await until(lambda: bool(seen), "first batch", timeout_s=0.3)
            jump = seen[-1] + 5
            await pub.send_multipart([b"", jump.to_bytes(8, "big"), good])
            await until(lambda: sub.last_seq == jump, "the batch after the failed replay")
            assert [r for _, r in errors] == ["replay_failed", "events_lost"]
            assert sub.counters.replay_failures == 1 and sub.counters.lost == 4
            # The next gap opens a fresh replay socket and fails the same way, no crash.
            await pub.send_multipart([b"", (jump + 2).to_bytes(8, "big"), good])
            await until(lambda: sub.last_seq == jump + 2, "second gap")
            assert sub.counters.replay_failures == 2 and sub.running
        finally:
            await sub.stop()
            pub.close(linger=0)
            silent.close(linger=0)
            ctx.term()

    run(scenario())


class _BarePublisher:
    """A PUB socket in this process that numbers what it sends: each batch one
    AllBlocksCleared, as a live engine's would be framed."""

    def __init__(self) -> None:
        import msgpack
        import zmq
        import zmq.asyncio

        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.payload = msgpack.packb([1.0, [["AllBlocksCleared"]], 0])
        self.seq = 0  # the next batch's sequence number

    async def send(self, count: int = 1) -> None:
        for _ in range(count):
            await self.pub.send_multipart([b"", self.seq.to_bytes(8, "big"), self.payload])
            self.seq += 1

    async def until_live(self, sub: EngineSubscriber, applied: list[int]) -> None:
        """Send until `sub` applies a batch (the subscription is live), then until it
        has applied everything sent."""
        while not applied:
            await self.send()
            with contextlib.suppress(AssertionError):
                await until(lambda: bool(applied), "first batch", timeout_s=0.3)
        await self.caught_up(sub, "the warm-up batches")

    async def caught_up(self, sub: EngineSubscriber, what: str) -> None:
        last = self.seq - 1
        await until(lambda: sub.last_seq == last, what)

    def close(self) -> None:
        self.pub.close(0)
        self.ctx.term()


def test_a_backlog_of_batches_yields_to_other_tasks_after_each_batch():
    """A Plan arriving during an event backlog waits for one batch's work, not a chunk's:
    with batches that take 20 ms to apply queued in the socket, another task of the
    loop is never kept waiting for two of them."""
    batch_s = 0.02

    async def scenario() -> None:
        pub = _BarePublisher()
        applied: list[int] = []
        slow = False

        def on_batch(_engine: str, seq: int, _batch: DecodedBatch) -> None:
            if slow:
                time.sleep(batch_s)  # the batch's decode and index work, holding the loop
            applied.append(seq)

        sub = EngineSubscriber(ENGINE, pub.endpoint, None, on_batch=on_batch, catch_up=False)
        sub.start()
        try:
            await pub.until_live(sub, applied)
            slow = True
            backlog = 24
            await pub.send(backlog)
            waits: list[float] = []
            while sub.last_seq < pub.seq - 1:
                t = time.perf_counter()
                await asyncio.sleep(0)
                waits.append(time.perf_counter() - t)
            assert len(applied) >= backlog
            assert max(waits) < 1.8 * batch_s, f"longest wait {max(waits) * 1e3:.0f} ms"
        finally:
            await sub.stop()
            pub.close()

    run(scenario())


def test_a_subscriber_between_batches_costs_no_cpu_and_misses_none():
    """The subscriber waits on the socket's descriptor: between batches it spends
    nothing (no polling, no spinning on a signalled descriptor), and batches sent one
    at a time after a quiet spell, or in a burst, each arrive once and in order."""

    async def scenario() -> None:
        pub = _BarePublisher()
        applied: list[int] = []
        sub = EngineSubscriber(
            ENGINE,
            pub.endpoint,
            None,
            on_batch=lambda _e, seq, _b: applied.append(seq),
            catch_up=False,
        )
        sub.start()
        try:
            await pub.until_live(sub, applied)
            first = len(applied)
            cpu = time.thread_time()
            await asyncio.sleep(1.0)  # quiet: nothing published
            idle_cpu_s = time.thread_time() - cpu
            assert idle_cpu_s < 0.05, f"{idle_cpu_s * 1e3:.0f} ms of CPU in a quiet second"
            for _ in range(5):  # one at a time, each after a quiet spell
                await pub.send()
                await pub.caught_up(sub, "a batch after a pause")
                await asyncio.sleep(0.05)
            await pub.send(200)  # a burst
            await pub.caught_up(sub, "the burst")
            assert applied[first - 1 :] == list(range(applied[first - 1], pub.seq))
        finally:
            await sub.stop()
            pub.close()

    run(scenario())
