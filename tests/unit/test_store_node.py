"""A store node's pieces without processes: PooledStore reads and the residency reporter."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from quillcache.v1 import conductor_pb2
from quillcache_core.errors import NodeUnavailable, NotFound
from quillcache_core.identity.chain import chain_keys
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_store.pooled import PeerLocation, PooledStore
from quillcache_store.reporter import ResidencyReporter, event_to_proto, events_to_protos
from quillcache_store.tiers.dram import DramTier
from quillcache_store.tiers.ssd import SsdTier
from quillcache_store.tiers.tiered import REMOVED, STORED, TieredStore, TierEvent

pytestmark = pytest.mark.unit

MIB = 1024 * 1024


def key(i: int, tenant: str = "acme") -> KvBlockKey:
    return KvBlockKey("m", "t", None, tenant, "root" if i == 0 else f"h{i - 1}", f"h{i}", i, 16)


@pytest.fixture
def tiered(tmp_path):
    events: list[TierEvent] = []
    store = TieredStore(DramTier(8 * MIB), SsdTier(tmp_path / "ssd", 32 * MIB), events.append)
    store.events = events
    yield store
    store.close()


@pytest.fixture
def executor():
    with ThreadPoolExecutor(2) as pool:
        yield pool


def test_local_reads_pin_dram_and_verify(tiered, executor):
    data = bytes(range(256)) * 4096  # 1 MiB
    tiered.put(key(0), data)
    pooled = PooledStore("n1", tiered, executor)

    async def scenario():
        block = await pooled.read(key(0))
        try:
            assert bytes(block.payload) == data and block.tier is CacheTier.CPU_DRAM
            assert block.served_from == "n1"
        finally:
            block.release()
        with pytest.raises(NotFound):
            await pooled.read(key(1))
        with pytest.raises(NotFound):
            await pooled.read(key(0, tenant="globex"))

    asyncio.run(scenario())
    assert (pooled.hits, pooled.misses) == (1, 2)


def test_a_corrupt_dram_copy_is_never_served(tiered, executor):
    data = b"k" * (2 * MIB)
    tiered.put(key(0), data, durable=True)  # DRAM and SSD
    entry = tiered.dram._lru[key(0)]  # flip a bit in the pooled buffer itself
    entry.buf[100] ^= 1
    pooled = PooledStore("n1", tiered, executor)

    async def scenario():
        block = await pooled.read(key(0))
        return bytes(block.payload), block.tier

    got, tier = asyncio.run(scenario())
    assert got == data and tier is CacheTier.LOCAL_SSD  # fell through to the SSD copy
    assert tiered.stats()["corrupt"] == 1
    assert TierEvent(REMOVED, key(0), CacheTier.CPU_DRAM, len(data)) in tiered.events


def test_peer_fetch_prefers_dram_falls_back_to_direct_and_runs_once_per_block(tiered, executor):
    data = b"p" * MIB
    calls: dict[str, list] = {"locate": [], "copy": [], "fetch": []}

    async def locate(k):
        calls["locate"].append(k)
        await asyncio.sleep(0.01)  # let concurrent readers pile up
        return [
            PeerLocation("n1", "self:1", CacheTier.CPU_DRAM),  # this node: skipped
            PeerLocation("n3", "h3:1", CacheTier.LOCAL_SSD),
            PeerLocation("n2", "h2:1", CacheTier.CPU_DRAM),
        ]

    async def copy_here(peer, k):
        calls["copy"].append(peer.node_id)
        raise NodeUnavailable("transfer service down")

    async def fetch(peer, k):
        calls["fetch"].append(peer.node_id)
        if peer.node_id == "n2" or k == key(6):
            raise NotFound("evicted meanwhile")
        return data

    pooled = PooledStore("n1", tiered, executor, locate=locate, copy_here=copy_here, fetch=fetch)

    async def scenario():
        blocks = await asyncio.gather(*(pooled.read(key(5), allow_remote=True) for _ in range(3)))
        return [(bytes(b.payload), b.served_from) for b in blocks]

    served = asyncio.run(scenario())
    assert served == [(data, "n3")] * 3
    assert len(calls["locate"]) == 1
    assert calls["copy"] == ["n2", "n3"] and calls["fetch"] == ["n2", "n3"]
    assert pooled.peer_fetches == 1 and tiered.locate(key(5)) is CacheTier.CPU_DRAM

    async def nowhere():
        with pytest.raises(NotFound, match="no peer served it"):
            await pooled.read(key(6), allow_remote=True)

    calls["fetch"].clear()
    asyncio.run(nowhere())


def _stored(i: int) -> TierEvent:
    return TierEvent(STORED, key(i), CacheTier.CPU_DRAM, 100)


def test_reporter_resyncs_first_then_sends_in_order_and_retries():
    sent: list[conductor_pb2.KvEventBatch] = []
    failures = [2]

    async def send(batch):
        if failures[0]:
            failures[0] -= 1
            raise NodeUnavailable("conductor down")
        sent.append(batch)

    reporter = ResidencyReporter("n1", send, lambda: [_stored(0)], max_batch=2)

    async def scenario():
        task = asyncio.create_task(reporter.run())
        for i in range(1, 6):
            reporter.offer(_stored(i))
        reporter.offer(TierEvent(REMOVED, key(1), CacheTier.CPU_DRAM, 100))
        while reporter.pending or reporter.events_sent < 6:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 10))
    kinds = [e.WhichOneof("event") for b in sent for e in b.events]
    assert kinds[0] == "cleared" and kinds[1] == "stored"  # the snapshot comes first
    hashes = [
        h for b in sent[2:] for e in b.events if e.HasField("stored") for h in e.stored.block_hashes
    ]
    assert hashes == [f"h{i}" for i in range(1, 6)]
    assert kinds[-1] == "removed"
    assert all(b.source_kind == "store" and b.engine_id == "n1" for b in sent)
    assert [b.sequence for b in sent] == sorted(b.sequence for b in sent)
    assert reporter.send_failures == 2
    assert all(blocks(b) <= 2 for b in sent)


def blocks(batch: conductor_pb2.KvEventBatch) -> int:
    """Blocks a batch speaks of (AllBlocksCleared counts one)."""
    which = [e.WhichOneof("event") for e in batch.events]
    return sum(
        1 if kind == "cleared" else len(getattr(e, kind).block_hashes)
        for kind, e in zip(which, batch.events, strict=True)
    )


async def trickled(reporter: ResidencyReporter, sent: list, count: int, gap_s: float) -> None:
    """Run `reporter` past its resync, then offer `count` blocks `gap_s` apart and wait
    until all are sent; `sent` (what its `send` appends to) then holds only those."""
    task = asyncio.create_task(reporter.run())
    while reporter.resyncs == 0 or reporter.pending or not sent:
        await asyncio.sleep(0.001)
    sent.clear()
    before = reporter.events_sent
    for i in range(1, count + 1):
        reporter.offer(_stored(i))
        await asyncio.sleep(gap_s)
    while reporter.pending or reporter.events_sent < before + count:
        await asyncio.sleep(0.001)
    task.cancel()


def test_reporter_lingers_so_trickling_events_share_a_batch():
    """Events offered one by one (a pull stores a block every ~ms) go out together
    when the reporter lingers; without lingering each would be a call of its own."""
    sent: list[conductor_pb2.KvEventBatch] = []

    async def send(batch):
        sent.append(batch)

    lingering = ResidencyReporter("n1", send, list, linger_s=1.0)
    asyncio.run(asyncio.wait_for(trickled(lingering, sent, 8, 0.002), 10))
    # One batch, and the chain's 8 blocks one coalesced event in it.
    assert [(blocks(b), len(b.events)) for b in sent] == [(8, 1)]
    sent.clear()
    eager = ResidencyReporter("n1", send, list, linger_s=0.0)
    asyncio.run(asyncio.wait_for(trickled(eager, sent, 8, 0.002), 10))
    assert len(sent) > 1 and sum(blocks(b) for b in sent) == 8


def test_reporter_overflow_drops_the_queue_and_resyncs():
    held = [_stored(0), _stored(1)]
    sent: list[conductor_pb2.KvEventBatch] = []

    async def send(batch):
        sent.append(batch)

    reporter = ResidencyReporter("n1", send, lambda: list(held), max_queue=3)
    for i in range(10):  # no loop yet: nothing is sent, the queue overflows
        reporter.offer(_stored(i))
    assert reporter.events_dropped > 0 and reporter.pending <= 3

    async def scenario():
        task = asyncio.create_task(reporter.run())
        while reporter.pending or reporter.resyncs == 0 or not sent:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert sent[0].events[0].WhichOneof("event") == "cleared"


def test_event_proto_carries_the_key():
    k = KvBlockKey("m", "t", "lora", "acme", "h1", "h2", 2, 16)
    stored = event_to_proto(TierEvent(STORED, k, CacheTier.LOCAL_SSD, 7)).stored
    assert list(stored.block_hashes) == ["h2"] and stored.parent_block_hash == "h1"
    assert stored.first_block_index == 2 and stored.block_size == 16
    assert stored.medium == "local_ssd" and stored.bytes_per_block == 7
    assert stored.identity.adapter_id == "lora" and stored.identity.tenant_id == "acme"
    removed = event_to_proto(TierEvent(REMOVED, k, CacheTier.CPU_DRAM, 7)).removed
    assert list(removed.block_hashes) == ["h2"] and removed.medium == "cpu_dram"


def facts(protos: list[conductor_pb2.KvEvent]) -> list[tuple]:
    """Per block, what the conductor records from these events, in order."""
    out = []
    for proto in protos:
        if proto.WhichOneof("event") == "stored":
            st = proto.stored
            ident = st.identity
            adapter = ident.adapter_id if ident.HasField("adapter_id") else None
            keys = chain_keys(
                (ident.model_id, ident.tokenizer_id, adapter, ident.tenant_id),
                list(st.block_hashes),
                parent=st.parent_block_hash or "root",
                first_index=st.first_block_index,
                token_count=st.block_size,
            )
            out += [("stored", k, st.medium, st.bytes_per_block) for k in keys]
        else:
            out += [("removed", h, proto.removed.medium) for h in proto.removed.block_hashes]
    return out


def test_runs_of_a_chain_are_one_event_and_say_exactly_what_one_per_block_says():
    dram, ssd = CacheTier.CPU_DRAM, CacheTier.LOCAL_SSD
    events = [TierEvent(STORED, key(i), dram, 7) for i in range(40)]  # a prompt offloaded
    events += [TierEvent(STORED, key(i, tenant="globex"), dram, 7) for i in range(3)]
    events += [TierEvent(STORED, key(i), ssd, 7) for i in (0, 1, 5, 6)]  # a gap: two runs
    events += [TierEvent(REMOVED, key(i), dram, 7) for i in range(10)]
    events += [TierEvent(REMOVED, key(i), ssd, 7) for i in range(2)]
    events += [TierEvent(STORED, key(2), dram, 9)]  # other bytes: not merged into a run
    coalesced = events_to_protos(events)
    one_each = [event_to_proto(e) for e in events]
    assert facts(coalesced) == facts(one_each)
    assert [p.WhichOneof("event") for p in coalesced] == [
        "stored", "stored", "stored", "stored", "removed", "removed", "stored"
    ]  # fmt: skip
    assert len(coalesced[0].stored.block_hashes) == 40
