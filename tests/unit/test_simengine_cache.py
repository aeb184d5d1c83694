"""Sim engine pure parts: prefix cache (LRU, pins), vLLM-style hashing with salts,
KV events as the conductor decodes them, deterministic output and KV bytes, FETCH
and offload against a fake store, request parsing, prefill/decode timing."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from quillcache_core.errors import NotFound
from quillcache_core.identity.keys import request_blocks
from quillcache_core.identity.tokenize import BuiltinTokenizer, render_chat
from quillcache_core.index.memory import MemoryIndex
from quillcache_core.kvevents.decode import decode_batch
from quillcache_core.kvevents.events import EngineAllCleared, EngineBlockRemoved, EngineBlockStored
from quillcache_core.kvevents.translate import EngineEventTranslator
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.wire.engine_plan import EnginePlan, FetchAction
from quillcache_simengine.engine import SimEngine
from quillcache_simengine.events import KvEventPublisher
from quillcache_simengine.kvbytes import kv_array, kv_payload, payload_bytes
from quillcache_simengine.kvcache import CachedBlock, PrefixCache, engine_digests, wire_hash
from quillcache_simengine.offload import MAX_CLIENTS, BlockMover
from quillcache_simengine.openai_api import ApiError, parse_request
from quillcache_simengine.output import generate
from quillcache_simengine.scheduler import PrefillQueue, Scheduler
from tests.support.vllm_publisher import VllmEventEncoder

pytestmark = pytest.mark.unit

BS = 4
MODEL, TOKENIZER = "sim-model", "builtin-v1"
SHAPE = (2, 2, BS, 2, 8)  # small KV blocks: 256 bytes
SEED = bytes(range(32))


def key(i: int) -> KvBlockKey:
    return KvBlockKey(MODEL, TOKENIZER, None, "default", "root", f"{i:032x}", i, BS)


def block(h: int, parent: int | None = None, index: int = 0) -> CachedBlock:
    return CachedBlock(h, parent, index, tuple(range(BS)), key(h), None)


def chain(*hashes: int) -> list[CachedBlock]:
    return [block(h, hashes[i - 1] if i else None, i) for i, h in enumerate(hashes)]


def prompt(seed: int, blocks: int, extra: int = 1) -> list[int]:
    return [(seed * 7919 + i * 31) % 32000 for i in range(blocks * BS + extra)]


# --- prefix cache ------------------------------------------------------------------------


def test_lookup_counts_leading_hits_only():
    cache = PrefixCache(8)
    cache.insert(chain(1, 2, 3))
    assert cache.lookup([1, 2, 3, 4]) == 3
    assert cache.lookup([1, 9, 3]) == 1
    assert cache.lookup([9, 1]) == 0


def test_lru_evicts_unpinned_blocks_tail_first():
    cache = PrefixCache(4)
    first = cache.insert(chain(1, 2, 3))
    cache.release(first.pinned, cache.generation)
    second = cache.insert(chain(10, 11, 12))
    # The first request's blocks go tail first: 3, then 2; 1 (its head) stays longest.
    assert [b.engine_hash for b in second.evicted] == [3, 2]
    assert 1 in cache and 2 not in cache and len(cache) == 4
    assert cache.evictions == 2


def test_recently_used_blocks_outlive_older_ones():
    cache = PrefixCache(3)
    for h in (1, 2, 3):
        cache.release(cache.insert([block(h)]).pinned, cache.generation)
    cache.release(cache.acquire([1]), cache.generation)  # 1 becomes the most recent
    result = cache.insert([block(4)])
    assert [b.engine_hash for b in result.evicted] == [2]


def test_pinned_blocks_are_never_evicted():
    cache = PrefixCache(2)
    held = cache.insert(chain(1, 2))
    result = cache.insert(chain(5, 6))
    assert result.stored == [] and result.evicted == [] and result.pinned == []
    assert 1 in cache and 2 in cache and cache.pinned_blocks == 2
    cache.release(held.pinned, cache.generation)
    assert cache.pinned_blocks == 0
    assert [b.engine_hash for b in cache.insert(chain(5, 6)).stored] == [5, 6]


def test_insert_pins_blocks_cached_meanwhile_and_stores_the_rest():
    cache = PrefixCache(8)
    other = cache.insert(chain(1, 2))
    mine = cache.insert(chain(1, 2, 3))
    assert [b.engine_hash for b in mine.stored] == [3]
    assert mine.pinned == [1, 2, 3]
    assert cache.get(1).refs == 2
    cache.release(other.pinned, cache.generation)
    cache.release(mine.pinned, cache.generation)
    assert cache.pinned_blocks == 0


def test_clear_voids_older_pins():
    cache = PrefixCache(4)
    held = cache.insert(chain(1, 2))
    generation = cache.generation
    assert cache.clear() == 2 and len(cache) == 0
    again = cache.insert(chain(1, 2))
    cache.release(held.pinned, generation)  # from before the clear: ignored
    assert cache.get(1).refs == 1
    cache.release(again.pinned, cache.generation)
    assert cache.pinned_blocks == 0


# --- engine hashes -----------------------------------------------------------------------


def test_engine_hashes_chain_and_match_the_reference_vllm_encoder():
    tokens = prompt(1, 3)
    reference = VllmEventEncoder(block_size=BS, seed=SEED)
    for salt in (None, "acme"):
        assert engine_digests(SEED, tokens, BS, salt) == reference.digests(tokens, salt)
    digests = engine_digests(SEED, tokens, BS, None)
    assert len(digests) == 3 and len(set(digests)) == 3
    assert wire_hash(digests[0]) == int.from_bytes(digests[0][-8:], "big") < 2**64


def test_salts_separate_every_block_and_seeds_separate_engines():
    tokens = prompt(2, 4)
    plain = engine_digests(SEED, tokens, BS, None)
    acme = engine_digests(SEED, tokens, BS, "acme")
    globex = engine_digests(SEED, tokens, BS, "globex")
    assert not set(plain) & set(acme) and not set(acme) & set(globex)
    assert engine_digests(SEED, tokens, BS, "acme") == acme
    assert not set(engine_digests(bytes(32), tokens, BS, "acme")) & set(acme)
    # A shared prefix gives shared leading blocks under one salt.
    longer = tokens[: 2 * BS] + prompt(3, 2)
    assert engine_digests(SEED, longer, BS, "acme")[:2] == acme[:2]
    assert engine_digests(SEED, tokens[: BS - 1], BS, "acme") == []


# --- output and KV bytes ------------------------------------------------------------------


def test_output_is_a_pure_function_of_prompt_and_max_tokens():
    a, b = prompt(1, 2), prompt(2, 2)
    assert generate(a, 20) == generate(list(a), 20)
    assert len(generate(a, 20)) == 20 and len(generate(a, 1)) == 1
    assert generate(a, 20) != generate(b, 20)
    assert all(piece.startswith(" ") for piece in generate(a, 50)[1:])


def test_kv_bytes_are_deterministic_finite_and_per_block():
    h1, h2 = "ab" * 16, "cd" * 16
    arr = kv_array(h1, SHAPE)
    assert arr.dtype == np.float16 and arr.shape == SHAPE
    assert np.isfinite(arr).all() and float(np.abs(arr).max()) < 1.0
    assert kv_payload(h1, SHAPE) == arr.tobytes() == kv_payload(h1, SHAPE)
    assert kv_payload(h1, SHAPE) != kv_payload(h2, SHAPE)
    assert len(kv_payload(h1, SHAPE)) == payload_bytes(SHAPE) == 2 * 2 * BS * 2 * 8 * 2
    # The default shape of a block is about 1 MiB, within 0.5-2 MiB.
    assert payload_bytes((16, 2, 16, 8, 128)) == 1 << 20


# --- engine: events, offload, fetch -----------------------------------------------------------


class FakeStore:
    """StoreClient's API over a dict; `fail` makes gets raise, `corrupt` alters bytes."""

    def __init__(self) -> None:
        self.blocks: dict[KvBlockKey, bytes] = {}
        self.gets: list[tuple[KvBlockKey, bool]] = []
        self.fail = False
        self.corrupt = False

    async def put(self, key, payload, *, durable=False, tier=CacheTier.CPU_DRAM):
        self.blocks[key] = bytes(payload)
        return tier

    async def get(self, key, *, allow_remote=False):
        self.gets.append((key, allow_remote))
        if self.fail or key not in self.blocks:
            raise NotFound(key.block_hash)
        data = self.blocks[key]
        if self.corrupt:
            data = bytes([data[0] ^ 1]) + data[1:]
        return data, CacheTier.CPU_DRAM

    async def close(self):
        pass


class Rig:
    """A SimEngine with a fake store, no sockets, zero compute time."""

    def __init__(
        self, hbm_blocks: int = 64, store_address: str = "own:1", encoding: str = "array"
    ) -> None:
        self.stores: dict[str, FakeStore] = {}
        self.publisher = KvEventPublisher("127.0.0.1", encoding=encoding)
        self.mover = BlockMover(
            own_address=store_address,
            own_node_id="store-a",
            kv_shape=SHAPE,
            timeout_s=5.0,
            queue_blocks=64,
            concurrency=2,
            store_factory=lambda address, _t: self.stores.setdefault(address, FakeStore()),
        )
        self.engine = SimEngine(
            engine_id="sim-0",
            model_id=MODEL,
            tokenizer_id=TOKENIZER,
            block_size=BS,
            cache=PrefixCache(hbm_blocks),
            scheduler=Scheduler(prefill_us_per_token=45, decode_us_per_token=80, time_scale=0),
            publisher=self.publisher,
            mover=self.mover,
            seed=SEED,
        )

    async def serve(self, tokens, salt=None, plan=None):
        prepared = await self.engine.prepare(tokens, salt, plan)
        try:
            await self.engine.prefill(prepared)
        finally:
            self.engine.release(prepared)
        return prepared

    def batches(self):
        return [decode_batch(payload) for _seq, payload in self.publisher.buffered()]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_events_decode_and_the_conductor_rehashes_them_to_our_keys(encoding):
    async def scenario():
        rig = Rig(hbm_blocks=4, encoding=encoding)
        index = MemoryIndex()
        translator = EngineEventTranslator(index, "sim-0", MODEL, TOKENIZER)
        a = prompt(1, 3)
        first = await rig.serve(a, "acme")
        assert (first.hit_blocks, first.recomputed_blocks) == (0, 3)
        again = await rig.serve(a, "acme")
        assert (again.hit_blocks, again.recomputed_blocks) == (3, 0)
        other = await rig.serve(a, "globex")  # same tokens, other salt: no hit
        assert other.hit_blocks == 0
        batches = rig.batches()
        assert [b.errors for b in batches] == [[], []]
        stored = batches[0].events[0]
        assert isinstance(stored, EngineBlockStored)
        assert stored.cache_salt == "acme" and stored.parent is None
        assert stored.token_ids == tuple(a[: 3 * BS]) and stored.block_size == BS
        assert stored.tier is CacheTier.HBM
        # globex's 3 blocks need 3 of the 4 slots: acme's tail blocks are evicted first.
        removed, stored2 = batches[1].events
        assert isinstance(removed, EngineBlockRemoved) and len(removed.block_hashes) == 2
        assert stored2.cache_salt == "globex"
        for batch in batches:
            assert translator.apply(batch).rejected == []
        ours = request_blocks(
            a, BS, model_id=MODEL, tokenizer_id=TOKENIZER, adapter_id=None,
            tenant_id="globex", cache_salt="globex",
        )  # fmt: skip
        assert rig.engine.block_keys(a, "globex") == ours
        for k in ours:
            assert [r.key for r in index.locate(k)] == [k]
        assert index.locate(rig.engine.block_keys(a, "acme")[0])
        assert not index.locate(rig.engine.block_keys(a, "acme")[2])
        rig.engine.reset_prefix_cache()
        assert isinstance(rig.batches()[-1].events[0], EngineAllCleared)
        assert len(rig.engine.cache) == 0

    run(scenario())


def test_a_chained_extension_reports_only_new_blocks_with_a_parent():
    async def scenario():
        rig = Rig()
        a = prompt(1, 2)
        await rig.serve(a, "acme")
        longer = a[: 2 * BS] + prompt(9, 2)
        prepared = await rig.serve(longer, "acme")
        assert prepared.hit_blocks == 2 and prepared.recomputed_blocks == 2
        stored = rig.batches()[-1].events[0]
        assert stored.parent == f"u:{prepared.hashes[1]:016x}"
        assert stored.cache_salt is None  # the salt sits in block 0's extra keys only
        assert len(stored.block_hashes) == 2

    run(scenario())


def test_an_aligned_prompt_always_computes_its_last_block():
    async def scenario():
        rig = Rig()
        tokens = prompt(4, 3, extra=0)
        await rig.serve(tokens)
        again = await rig.serve(tokens)
        assert (again.hit_blocks, again.recomputed_blocks) == (2, 1)
        assert again.compute_tokens(BS) == BS

    run(scenario())


def test_evicted_blocks_are_offloaded_and_fetched_back_instead_of_recomputed():
    async def scenario():
        rig = Rig(hbm_blocks=3)
        rig.mover.start()
        a, b = prompt(1, 3), prompt(2, 3)
        await rig.serve(a)
        await rig.serve(b)  # evicts all of a
        assert await rig.mover.drain(5.0)
        store = rig.stores["own:1"]
        keys = rig.engine.block_keys(a, None)
        assert set(store.blocks) == set(keys)
        assert all(store.blocks[k] == kv_payload(k.block_hash, SHAPE) for k in keys)
        plan = EnginePlan(
            reservation_id="r", engine_id="sim-0", model_id=MODEL, tokenizer_id=TOKENIZER,
            tenant_id="default", block_size=BS,
            fetch=tuple(FetchAction(i, k.block_hash, "store-a", "own:1", "cpu_dram")
                        for i, k in enumerate(keys)),
        )  # fmt: skip
        prepared = await rig.serve(a, None, plan)
        assert (prepared.hit_blocks, prepared.fetched_blocks, prepared.recomputed_blocks) == (
            0, 3, 0,
        )  # fmt: skip
        assert prepared.compute_tokens(BS) == 1
        assert all(allow_remote for _k, allow_remote in store.gets)
        assert rig.mover.stats.fetched == 3
        await rig.mover.close()

    run(scenario())


def test_failed_or_wrong_fetches_fall_back_to_recompute():
    async def scenario():
        rig = Rig()
        a = prompt(1, 3)
        keys = rig.engine.block_keys(a, "acme")
        peer = rig.mover.client("peer:2")
        for k in keys[:2]:
            await peer.put(k, kv_payload(k.block_hash, SHAPE))

        def plan(*actions):
            return EnginePlan(
                reservation_id="r", engine_id="sim-0", model_id=MODEL, tokenizer_id=TOKENIZER,
                tenant_id="acme", cache_salt="acme", block_size=BS, fetch=tuple(actions),
            )  # fmt: skip

        def action(i, node="store-b", address="peer:2", block_hash=None):
            return FetchAction(i, block_hash or keys[i].block_hash, node, address, "cpu_dram")

        # Block 2 is absent on the peer: 2 fetched (directly, not via our store), 1 recomputed.
        p = await rig.engine.prepare(a, "acme", plan(action(0), action(1), action(2)))
        rig.engine.release(p)
        assert (p.fetched_blocks, p.fetch_fallback_blocks, p.recomputed_blocks) == (2, 1, 1)
        assert not any(allow_remote for _k, allow_remote in peer.gets)
        # A gap in the plan (block 0 missing) means nothing can be loaded.
        p = await rig.engine.prepare(a, "acme", plan(action(1), action(2)))
        rig.engine.release(p)
        assert (p.fetched_blocks, p.recomputed_blocks) == (0, 3)
        # A plan naming another hash for the block is not followed.
        p = await rig.engine.prepare(a, "acme", plan(action(0, block_hash="f" * 32)))
        rig.engine.release(p)
        assert p.fetched_blocks == 0
        # Corrupt bytes are detected and recomputed.
        peer.corrupt = True
        p = await rig.engine.prepare(a, "acme", plan(action(0), action(1)))
        rig.engine.release(p)
        assert (p.fetched_blocks, p.fetch_fallback_blocks) == (0, 2)
        assert rig.mover.stats.fetch_mismatches >= 1
        # Local hits come first; the plan's fetch continues after them.
        peer.corrupt = False
        await rig.serve(a[: BS + 1], "acme")
        p = await rig.engine.prepare(a, "acme", plan(action(0), action(1), action(2)))
        rig.engine.release(p)
        assert (p.hit_blocks, p.fetched_blocks, p.recomputed_blocks) == (1, 1, 1)
        assert rig.engine.cache.pinned_blocks == 0

    run(scenario())


def test_store_keys_follow_the_plan_identity_when_there_is_one():
    rig = Rig()
    tokens = prompt(5, 2)
    plan = EnginePlan("r", "sim-0", MODEL, TOKENIZER, "acme-tenant", cache_salt="s1", block_size=BS)
    expected = request_blocks(
        tokens, BS, model_id=MODEL, tokenizer_id=TOKENIZER, adapter_id=None,
        tenant_id="acme-tenant", cache_salt="s1",
    )  # fmt: skip
    assert rig.engine.block_keys(tokens, "s1", plan) == expected
    assert rig.engine.block_keys(tokens, "s1")[0].tenant_id == "s1"
    assert rig.engine.block_keys(tokens, None)[0].tenant_id == "default"


def test_store_clients_are_bounded_and_keep_the_own_node():
    async def scenario():
        rig = Rig()
        own = rig.mover.client("own:1")
        for i in range(MAX_CLIENTS + 10):
            rig.mover.client(f"peer:{i}")
        assert len(rig.mover._clients) == MAX_CLIENTS
        assert rig.mover.client("own:1") is own
        await rig.mover.close()

    run(scenario())


def test_offload_drops_when_the_queue_is_full_and_is_off_without_a_store():
    async def scenario():
        rig = Rig(hbm_blocks=2)  # workers not started: the queue only fills
        rig.mover._queue = asyncio.Queue(maxsize=1)
        await rig.serve(prompt(1, 2))
        await rig.serve(prompt(2, 2))
        assert rig.mover.pending == 1 and rig.mover.stats.offload_dropped == 1
        off = Rig(hbm_blocks=2, store_address="")
        await off.serve(prompt(1, 2))
        await off.serve(prompt(2, 2))
        assert off.mover.pending == 0 and off.mover.stats.offload_dropped == 0

    run(scenario())


# --- requests ----------------------------------------------------------------------------------


def parse(body, chat=True):
    return parse_request(
        body,
        chat=chat,
        served_model=MODEL,
        tokenizer=BuiltinTokenizer(),
        default_max_tokens=16,
        max_model_len=4096,
    )


def test_chat_is_tokenized_exactly_as_the_gateway_does():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    parsed = parse({"model": MODEL, "messages": messages, "cache_salt": "acme", "stream": True})
    assert parsed.prompts == (tuple(BuiltinTokenizer().encode(render_chat(messages))),)
    assert parsed.cache_salt == "acme" and parsed.stream and parsed.max_tokens == 16
    batch = parse({"prompt": ["a b", "c"], "max_tokens": 3}, chat=False)
    assert len(batch.prompts) == 2 and batch.max_tokens == 3 and not batch.stream
    assert parse({"prompt": [1, 2, 3]}, chat=False).prompts == ((1, 2, 3),)


def test_plan_is_read_from_kv_transfer_params():
    plan = EnginePlan("r", "sim-0", MODEL, TOKENIZER, "acme", block_size=BS,
                      fetch=(FetchAction(0, "ab" * 16, "s", "h:1", "cpu_dram"),))  # fmt: skip
    body = {"prompt": "x", "kv_transfer_params": {"quillcache": plan.to_json()}}
    assert parse(body, chat=False).plan == plan
    assert parse({"prompt": "x", "kv_transfer_params": {}}, chat=False).plan is None


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ([1, 2], 400),
        ({"messages": []}, 400),
        ({"messages": "hi"}, 400),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400),
        ({}, 400),
        ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404),
        ({"model": 7, "messages": [{"role": "user", "content": "x"}]}, 400),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}, 400),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}, 400),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400),
        ({"messages": [{"role": "user", "content": "x"}], "cache_salt": ""}, 400),
        ({"messages": [{"role": "user", "content": "x"}], "cache_salt": 5}, 400),
        ({"messages": [{"role": "user", "content": "x"}], "kv_transfer_params": 3}, 400),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "kv_transfer_params": {"quillcache": {"fetch": "x"}},
            },
            400,
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "kv_transfer_params": {"quillcache": {"fetch": [{"block_index": 0}]}},
            },
            400,
        ),
    ],
)
def test_bad_requests_are_openai_errors(body, status):
    with pytest.raises(ApiError) as caught:
        parse(body)
    assert caught.value.status == status
    error = caught.value.body()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status


def test_bad_completion_prompts():
    for body in ({"prompt": 5}, {"prompt": []}, {"prompt": [-1]}, {"max_tokens": 3}):
        with pytest.raises(ApiError):
            parse(body, chat=False)


# --- timing ------------------------------------------------------------------------------------


def test_prefills_queue_in_arrival_order_on_one_server():
    q = PrefillQueue(us_per_token=100, time_scale=0.5)  # 50 µs per token
    assert q.book(0.0, 1000) == (0.0, pytest.approx(0.05))
    assert q.book(0.01, 2000) == (pytest.approx(0.05), pytest.approx(0.15))
    assert q.book(0.5, 0) == (0.5, 0.5)  # idle server: starts at once
    assert q.duration_s(10) == pytest.approx(0.0005)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        self.now += delay


def test_scheduler_waits_for_booked_prefill_then_paces_decode():
    async def scenario():
        clock = FakeClock()
        sched = Scheduler(
            prefill_us_per_token=45, decode_us_per_token=1000, time_scale=1.0,
            clock=clock, sleep=clock.sleep,
        )  # fmt: skip
        end = await sched.prefill(1000)
        assert end == pytest.approx(0.045) and clock.now == pytest.approx(0.045)
        assert sched.waiting == 0 and sched.queued_prefill_tokens == 0
        times = []
        async for _i in sched.decode(4, end):
            times.append(clock.now)
            assert sched.running == 1
        # The first token comes with the end of prefill, then one per millisecond.
        assert times == pytest.approx([0.045, 0.046, 0.047, 0.048])
        assert sched.running == 0

    run(scenario())


def test_concurrent_prefills_finish_one_after_another():
    async def scenario():
        sched = Scheduler(prefill_us_per_token=1000, decode_us_per_token=0, time_scale=1.0)
        loop = asyncio.get_running_loop()
        start = loop.time()
        order = itertools.count()

        async def one(tokens):
            end = await sched.prefill(tokens)
            return next(order), end - start

        results = await asyncio.gather(one(20), one(20), one(20))
        assert [r[0] for r in results] == [0, 1, 2]
        ends = [r[1] for r in results]
        assert ends == pytest.approx([0.02, 0.04, 0.06], abs=0.01)

    run(scenario())


def test_a_request_queued_behind_the_same_prompt_hits_what_that_prefill_computes():
    """vLLM looks its prefix cache up when it schedules a request: one that waits behind
    a prefill of the same prompt finds those blocks computed by its turn."""

    async def scenario():
        rig = Rig()
        rig.engine.scheduler = Scheduler(
            prefill_us_per_token=200, decode_us_per_token=0, time_scale=1.0
        )
        a = prompt(1, 4)
        first = await rig.engine.prepare(a, None, None)
        running = asyncio.ensure_future(rig.engine.prefill(first))
        await asyncio.sleep(0)  # the first prefill is booked, not done
        second = await rig.engine.prepare(a, None, None)
        other = await rig.engine.prepare(prompt(2, 4), None, None)
        assert (first.hit_blocks, second.hit_blocks, other.hit_blocks) == (0, 4, 0)
        assert second.compute_tokens(BS) == 1 and second.pinned == []
        await running
        await rig.engine.prefill(second)
        await rig.engine.prefill(other)
        for prepared in (first, second, other):
            rig.engine.release(prepared)
        assert rig.engine._pending == {}
        # A prefill that fails to finish (cancelled) leaves nothing pending either.
        third = await rig.engine.prepare(prompt(3, 4), None, None)
        task = asyncio.ensure_future(rig.engine.prefill(third))
        await asyncio.sleep(0)
        assert rig.engine._pending
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        rig.engine.release(third)
        assert rig.engine._pending == {}

    run(scenario())


class FakeBatches:
    """`datapath.batch.BlockBatches`' get_many over per-address dicts; records calls."""

    def __init__(self, nodes: dict[str, dict[KvBlockKey, bytes]]) -> None:
        self.nodes = nodes
        self.calls: list[tuple[str, int]] = []

    def get_many(self, address, keys):
        self.calls.append((address, len(keys)))
        held = self.nodes.get(address, {})
        return [held.get(key) for key in keys]

    def close(self):
        pass


def test_fetch_reads_each_source_nodes_run_in_one_batch_then_one_by_one_from_a_gap():
    keys = [KvBlockKey(MODEL, TOKENIZER, None, "acme", "p", f"{i:032x}", i, BS) for i in range(6)]
    payloads = {k: kv_payload(k.block_hash, SHAPE) for k in keys}
    own = {k: payloads[k] for k in keys[:3]}
    peer = {k: payloads[k] for k in keys[3:5]}  # the peer lacks the last block
    batches = FakeBatches({"own-data:1": own, "peer-data:2": peer})
    fallback = FakeStore()
    fallback.blocks[keys[5]] = payloads[keys[5]]
    resolved = {"store-a": "own-data:1", "store-b": "peer-data:2"}

    async def resolve(node_id):
        return resolved[node_id]

    async def scenario():
        mover = BlockMover(
            own_address="own:1", own_node_id="store-a", kv_shape=SHAPE, timeout_s=5.0,
            queue_blocks=8, concurrency=1, store_factory=lambda _a, _t: fallback,
            batches=lambda: batches, data_address=resolve,
        )  # fmt: skip
        wanted = [(k, "store-a", "own:1") for k in keys[:3]]
        wanted += [(k, "store-b", "peer:2") for k in keys[3:]]
        assert await mover.fetch_many(wanted) == [True] * 6
        assert batches.calls == [("own-data:1", 3), ("peer-data:2", 3)]
        assert fallback.gets == [(keys[5], False)]  # read from the peer's own address
        assert (mover.stats.batched_fetches, mover.stats.fetched) == (5, 6)
        assert mover.stats.fetch_requests == 1 and mover.stats.fetch_seconds > 0

    run(scenario())
