"""The IndexBackend contract, run against every backend (persistent ones in a temp dir)."""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from quillcache_core.errors import InvalidArgument
from quillcache_core.index import (
    ArtIndex,
    Chain,
    FsIndex,
    IndexBackend,
    LmdbIndex,
    MemoryIndex,
    MirroredIndex,
    RocksIndex,
    open_index,
)
from quillcache_core.model import CacheResidency, CacheTier, IdentityScope, KvBlockKey

pytestmark = pytest.mark.unit

BACKENDS = ["memory", "lmdb", "rocksdb", "fs", "art"]
PERSISTENT = [backend for backend in BACKENDS if backend != "memory"]


def make_index(backend: str, directory: Path) -> IndexBackend:
    if backend == "memory":
        return open_index("memory")
    return open_index(backend, str(directory / "index"))


@pytest.fixture(params=BACKENDS)
def index(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[IndexBackend]:
    idx = make_index(request.param, tmp_path)
    yield idx
    idx.close()


def key(
    block_hash: str = "h1",
    tenant: str = "t0",
    parent: str = "root",
    adapter: str | None = None,
    model: str = "m0",
    block_index: int = 0,
) -> KvBlockKey:
    return KvBlockKey(
        model_id=model,
        tokenizer_id="tok",
        adapter_id=adapter,
        tenant_id=tenant,
        prefix_hash=parent,
        block_hash=block_hash,
        block_index=block_index,
        token_count=16,
    )


def rec(
    k: KvBlockKey,
    worker: str = "w0",
    tier: CacheTier = CacheTier.HBM,
    nbytes: int = 1000,
    **extra: object,
) -> CacheResidency:
    return CacheResidency(key=k, worker_id=worker, tier=tier, bytes=nbytes, **extra)


def bag(records: Iterable[CacheResidency]) -> Counter[CacheResidency]:
    """Order-insensitive, duplicate-sensitive comparison form."""
    return Counter(records)


# --- contract, example by example ------------------------------------------------------


def test_put_then_locate(index: IndexBackend) -> None:
    k = key()
    r = rec(k, last_access_ms=5, ref_count=2, pinned=True)
    index.put(r)
    assert index.locate(k) == [r]
    assert index.locate(key(tenant="t1")) == []
    assert index.locate(key(block_index=1)) == []
    assert index.locate(key(block_hash="other")) == []
    assert len(index) == 1


def test_put_replaces_same_key_worker_and_tier(index: IndexBackend) -> None:
    k = key()
    index.put(rec(k, nbytes=100))
    newer = rec(k, nbytes=300, ref_count=4, last_access_ms=9)
    index.put(newer)
    assert index.locate(k) == [newer]
    assert len(index) == 1
    assert index.worker_block_count("w0") == 1
    m = index.metrics()
    assert (m.resident_blocks, m.resident_bytes, m.puts) == (1, 300, 2)


def test_same_block_on_two_workers_and_two_tiers(index: IndexBackend) -> None:
    k = key()
    copies = [
        rec(k, worker, tier, nbytes)
        for nbytes, (worker, tier) in enumerate(
            [
                ("w0", CacheTier.HBM),
                ("w0", CacheTier.CPU_DRAM),
                ("w1", CacheTier.HBM),
                ("w1", CacheTier.LOCAL_SSD),
            ],
            start=1,
        )
    ]
    for r in copies:
        index.put(r)
    assert bag(index.locate(k)) == bag(copies)
    assert bag(index.locate_hash("h1")) == bag(copies)
    assert len(index) == 4
    assert index.worker_block_count("w0") == 2
    assert index.metrics().resident_bytes == 1 + 2 + 3 + 4


def test_locate_hash_returns_every_identity_with_that_hash(index: IndexBackend) -> None:
    own = rec(key(tenant="t0"))
    other_tenant = rec(key(tenant="t1"), worker="w1")
    other_adapter = rec(key(adapter="lora"), tier=CacheTier.CPU_DRAM)
    other_model = rec(key(model="m1"))
    unrelated = rec(key(block_hash="h2"))
    for r in (own, other_tenant, other_adapter, other_model, unrelated):
        index.put(r)
    assert bag(index.locate_hash("h1")) == bag([own, other_tenant, other_adapter, other_model])
    assert index.locate(key(tenant="t0")) == [own]
    assert index.locate_hash("missing") == []
    assert [bag(found) for found in index.locate_hashes(["h2", "missing", "h1"])] == [
        bag([unrelated]),
        bag([]),
        bag([own, other_tenant, other_adapter, other_model]),
    ]


def test_prefix_scan_returns_only_that_scope_and_parent(index: IndexBackend) -> None:
    child_a = rec(key("a", parent="p"))
    child_a_copy = rec(key("a", parent="p"), worker="w1", tier=CacheTier.CPU_DRAM)
    child_b = rec(key("b", parent="p"), worker="w2")
    index.put_many([child_a, child_a_copy, child_b])
    # Same parent, other scopes; same scope, other parent.
    index.put(rec(key("c", parent="p", tenant="t1")))
    index.put(rec(key("d", parent="p", adapter="lora")))
    index.put(rec(key("e", parent="p", model="m1")))
    index.put(rec(key("f", parent="q")))
    scope = IdentityScope("m0", "tok", None, "t0")
    assert bag(index.prefix_scan(scope, "p")) == bag([child_a, child_a_copy, child_b])
    assert [r.key.block_hash for r in index.prefix_scan(scope, "q")] == ["f"]
    assert index.prefix_scan(scope, "nothing") == []
    assert index.prefix_scan(IdentityScope("m0", "tok", "lora", "t1"), "p") == []
    assert index.metrics().prefix_scans == 4


def test_remove_block_touches_only_that_worker_and_scope(index: IndexBackend) -> None:
    mine = key(tenant="t0")
    theirs = key(tenant="t1")
    index.put_many(
        [
            rec(mine, "w0", CacheTier.HBM, 10),
            rec(mine, "w0", CacheTier.CPU_DRAM, 20),
            rec(mine, "w1", CacheTier.HBM, 40),
            rec(theirs, "w0", CacheTier.HBM, 80),
            rec(key("h2"), "w0", CacheTier.HBM, 160),
        ]
    )
    assert index.remove_block(mine.scope(), "w0", "h1") == 2
    assert index.locate(mine) == [rec(mine, "w1", CacheTier.HBM, 40)]
    assert index.locate(theirs) == [rec(theirs, "w0", CacheTier.HBM, 80)]
    assert len(index.locate_hash("h2")) == 1
    assert index.remove_block(mine.scope(), "w0", "h1") == 0
    assert index.remove_block(mine.scope(), "w9", "h1") == 0
    m = index.metrics()
    assert (m.resident_blocks, m.resident_bytes, m.removes) == (3, 40 + 80 + 160, 2)
    assert index.worker_block_count("w0") == 2


def test_remove_tier_takes_one_tier_of_every_identity(index: IndexBackend) -> None:
    mine, theirs = key(tenant="t0"), key(tenant="t1")
    index.put_many(
        [
            rec(mine, "w0", CacheTier.HBM, 1),
            rec(mine, "w0", CacheTier.CPU_DRAM, 2),
            rec(theirs, "w0", CacheTier.HBM, 4),
            rec(mine, "w1", CacheTier.HBM, 8),
        ]
    )
    assert index.remove_tier("w0", "h1", CacheTier.HBM) == 2
    assert bag(index.locate_hash("h1")) == bag(
        [rec(mine, "w0", CacheTier.CPU_DRAM, 2), rec(mine, "w1", CacheTier.HBM, 8)]
    )
    # Tier names and engine media parse like CacheTier.parse.
    assert index.remove_tier("w0", "h1", "cpu") == 1
    assert index.remove_tier("w0", "h1", "cpu_dram") == 0
    with pytest.raises(InvalidArgument):
        index.remove_tier("w1", "h1", "floppy")
    assert index.locate_hash("h1") == [rec(mine, "w1", CacheTier.HBM, 8)]
    assert index.metrics().resident_bytes == 8


def test_writes_in_a_batch_all_land(index: IndexBackend) -> None:
    mine, theirs = key(tenant="t0"), key(tenant="t1")
    with index.write_batch():
        index.put_many([rec(mine, "w0", CacheTier.HBM, 1), rec(theirs, "w0", CacheTier.HBM, 2)])
        assert index.remove_tier("w0", "h1", CacheTier.HBM) == 2  # sees the batch's puts
        index.put(rec(mine, "w1", CacheTier.CPU_DRAM, 4))
        index.set_worker_epoch("w1", 5.0)
    index.flush()
    assert index.locate_hash("h1") == [rec(mine, "w1", CacheTier.CPU_DRAM, 4)]
    m = index.metrics()
    assert (m.resident_blocks, m.resident_bytes) == (1, 4)
    assert index.worker_epochs() == {"w1": 5.0}


def test_clear_worker_returns_count_and_leaves_other_workers(index: IndexBackend) -> None:
    parent_scope = IdentityScope("m0", "tok", None, "t0")
    index.put_many(
        [
            rec(key("a", parent="p"), "w0", CacheTier.HBM, 1),
            rec(key("a", parent="p"), "w0", CacheTier.CPU_DRAM, 2),
            rec(key("b", parent="p"), "w0", CacheTier.HBM, 4),
            rec(key("a", parent="p"), "w1", CacheTier.HBM, 8),
            rec(key("c", parent="p"), "w1", CacheTier.HBM, 16),
        ]
    )
    assert index.workers() == ["w0", "w1"]
    assert index.clear_worker("w0") == 3
    assert index.clear_worker("w0") == 0
    assert index.worker_block_count("w0") == 0
    assert index.worker_block_count("w1") == 2
    assert index.workers() == ["w1"]
    assert {r.worker_id for r in index.snapshot()} == {"w1"}
    assert index.locate_hash("b") == []
    assert {r.key.block_hash for r in index.prefix_scan(parent_scope, "p")} == {"a", "c"}
    m = index.metrics()
    assert (len(index), m.resident_blocks, m.resident_bytes, m.removes) == (2, 2, 24, 3)


def test_clear_drops_everything_and_index_stays_usable(index: IndexBackend) -> None:
    index.put_many([rec(key(h), w) for h in ("a", "b") for w in ("w0", "w1")])
    index.clear()
    assert len(index) == 0
    assert index.snapshot() == []
    assert index.locate_hash("a") == []
    assert index.prefix_scan(IdentityScope("m0", "tok", None, "t0"), "root") == []
    assert index.worker_block_count("w0") == 0
    m = index.metrics()
    assert (m.resident_blocks, m.resident_bytes, m.removes) == (0, 0, 4)
    again = rec(key("a"))
    index.put(again)
    assert index.locate_hash("a") == [again]
    assert len(index) == 1


def test_len_snapshot_and_metrics_follow_puts_and_removes(index: IndexBackend) -> None:
    records = [rec(key(f"h{i}"), f"w{i % 2}", nbytes=100 * (i + 1)) for i in range(6)]
    index.put_many(records)
    index.put(rec(key("h0"), "w0", nbytes=5))  # replaces 100 with 5
    assert index.remove_block(key().scope(), "w1", "h1") == 1  # drops 200
    assert index.remove_tier("w0", "h2", CacheTier.HBM) == 1  # drops 300
    expected = [rec(key("h0"), "w0", nbytes=5)] + records[3:]
    assert len(index) == 4
    assert bag(index.snapshot()) == bag(expected)
    m = index.metrics()
    assert m.resident_blocks == 4
    assert m.resident_bytes == 5 + 400 + 500 + 600
    assert (m.puts, m.removes) == (7, 2)
    if index.persistent:
        assert m.bytes_written > 0
    else:
        assert m.bytes_written == 0


def test_worker_block_count_counts_every_tier_copy(index: IndexBackend) -> None:
    index.put_many(
        [
            rec(key("a"), "w0", CacheTier.HBM),
            rec(key("a"), "w0", CacheTier.CPU_DRAM),
            rec(key("a", tenant="t1"), "w0", CacheTier.HBM),
            rec(key("b"), "w0", CacheTier.HBM),
            rec(key("b"), "w1", CacheTier.HBM),
        ]
    )
    assert index.worker_block_count("w0") == 4
    assert index.worker_block_count("w1") == 1
    assert index.worker_block_count("nobody") == 0


def test_put_many_applies_in_order(index: IndexBackend) -> None:
    k = key()
    index.put_many([rec(k, nbytes=1), rec(k, nbytes=2), rec(k, "w1", nbytes=3)])
    assert bag(index.locate(k)) == bag([rec(k, nbytes=2), rec(k, "w1", nbytes=3)])
    m = index.metrics()
    assert (m.puts, m.resident_blocks, m.resident_bytes) == (3, 2, 5)


def test_put_chain_is_put_many_of_the_chain(index: IndexBackend) -> None:
    scope = ("m0", "tok", None, "t0")
    chain = [key("a"), key("b", parent="a", block_index=1), key("c", parent="b", block_index=2)]
    index.put(rec(chain[1], "w0", nbytes=7))  # one already there
    sibling = rec(key("x", parent="a", block_index=1), "w1")
    index.put(sibling)  # under the same parent
    index.put_chain(Chain(scope, "root", ["a", "b", "c"], 0, 16, "w0", CacheTier.HBM, 100, 9))
    records = [CacheResidency(k, "w0", CacheTier.HBM, 100, 9) for k in chain]
    for k, r in zip(chain, records, strict=True):
        assert index.locate(k) == [r]
    assert bag(index.prefix_scan(chain[0].scope(), "a")) == bag([records[1], sibling])
    assert len(index) == 4 and index.worker_block_count("w0") == 3
    m = index.metrics()
    assert (m.puts, m.resident_bytes) == (5, 300 + 1000)
    # A fresh chain (the bulk path) under another scope, chained from an existing block.
    other = ("m0", "tok", "lora", "t1")
    index.put_chain(Chain(other, "c", ["d", "e"], 3, 16, "w1", CacheTier.CPU_DRAM, 5))
    more = [index.locate_hash("d"), index.locate_hash("e")]
    assert [[r.key for r in found] for found in more] == [
        [KvBlockKey("m0", "tok", "lora", "t1", "c", "d", 3, 16)],
        [KvBlockKey("m0", "tok", "lora", "t1", "d", "e", 4, 16)],
    ]
    assert index.prefix_scan(IdentityScope(*other), "d") == more[1]
    assert index.prefix_scan(IdentityScope("m0", "tok", None, "t0"), "d") == []


_SCOPE = ("m0", "tok", None, "t0")
_CHAIN = ["a", "b", "c", "d"]
_T1 = IdentityScope("m0", "tok", None, "t1")
# What one can do to a freshly put chain's blocks before anything read them.
_AFTER_CHAIN = {
    "locate": lambda i: i.locate(key("c", parent="b", block_index=2)),
    "locate_hash": lambda i: i.locate_hash("b"),
    "locate_hashes": lambda i: i.locate_hashes(["a", "x", "d"]),
    "locate_prefix": lambda i: i.locate_prefix(["a", "b", "x", "d"]),
    "put_same_slot": lambda i: i.put(rec(key("b", parent="a", block_index=1), "w0", nbytes=7)),
    "put_other_worker": lambda i: i.put(rec(key("b", parent="a", block_index=1), "w1")),
    "put_other_identity": lambda i: i.put(rec(key("c", tenant="t1", parent="b"), "w0")),
    "remove_tier": lambda i: i.remove_tier("w0", "d", CacheTier.HBM),
    "remove_tier_other": lambda i: i.remove_tier("w0", "d", CacheTier.CPU_DRAM),
    "remove_block": lambda i: i.remove_block(key().scope(), "w0", "a"),
    "remove_block_other_scope": lambda i: i.remove_block(_T1, "w0", "a"),
    "clear_worker": lambda i: i.clear_worker("w0"),
    "clear_other_worker": lambda i: i.clear_worker("w1"),
    "clear": lambda i: i.clear(),
    "prefix_scan": lambda i: i.prefix_scan(key().scope(), "b"),
    "put_chain_overlapping": lambda i: i.put_chain(
        Chain(_SCOPE, "b", ["c", "y"], 2, 16, "w1", CacheTier.HBM, 100)
    ),
}


@pytest.mark.parametrize("first", sorted(_AFTER_CHAIN))
@pytest.mark.parametrize("then", ["locate_prefix", "clear_worker", "put_same_slot"])
def test_a_chain_answers_like_put_many_of_its_records(index: IndexBackend, first, then) -> None:
    """MemoryIndex defers a fresh chain's records until a read or write touches it:
    whatever touches it first, every later answer is put_many's."""
    reference = MemoryIndex()
    index.put(rec(key("z", parent="q"), "w0"))
    reference.put(rec(key("z", parent="q"), "w0"))
    index.put_chain(Chain(_SCOPE, "root", _CHAIN, 0, 16, "w0", CacheTier.HBM, 100, 9))
    reference.put_many(
        [
            CacheResidency(key(h, parent=p, block_index=n), "w0", CacheTier.HBM, 100, 9)
            for n, (h, p) in enumerate(zip(_CHAIN, ["root", *_CHAIN[:-1]], strict=True))
        ]
    )
    assert len(index) == 5 and index.worker_block_count("w0") == 5
    for step in (first, then):
        got, want = _AFTER_CHAIN[step](index), _AFTER_CHAIN[step](reference)
        if isinstance(got, list) and got and isinstance(got[0], list):
            assert [bag(g) for g in got] == [bag(w) for w in want], step
        elif isinstance(got, list):
            assert bag(got) == bag(want), step
        else:
            assert got == want, step
        assert len(index) == len(reference), step
        for worker in ("w0", "w1"):
            assert index.worker_block_count(worker) == reference.worker_block_count(worker)
        m, r = index.metrics(), reference.metrics()
        assert (m.resident_blocks, m.resident_bytes, m.puts, m.removes) == (
            r.resident_blocks,
            r.resident_bytes,
            r.puts,
            r.removes,
        ), step
    assert bag(index.snapshot()) == bag(reference.snapshot())


def test_clear_worker_drops_a_chain_nothing_read() -> None:
    idx = MemoryIndex()
    idx.put_chain(Chain(_SCOPE, "root", _CHAIN, 0, 16, "w0", CacheTier.HBM, 100))
    idx.put_chain(Chain(_SCOPE, "root", ["p", "q"], 0, 16, "w1", CacheTier.HBM, 100))
    assert idx.clear_worker("w0") == 4
    assert idx.locate_prefix(_CHAIN) == [] and len(idx) == 2
    assert [r.key.block_hash for found in idx.locate_prefix(["p", "q"]) for r in found] == [
        "p",
        "q",
    ]
    assert (idx.metrics().resident_bytes, idx.worker_block_count("w0")) == (200, 0)


def test_removing_a_chain_block_by_block_leaves_nothing_behind() -> None:
    idx = MemoryIndex()
    idx.put_chain(Chain(_SCOPE, "root", _CHAIN, 0, 16, "w0", CacheTier.HBM, 100))
    assert idx.remove_tier("w0", "b", CacheTier.CPU_DRAM) == 0
    assert idx.remove_block(_T1, "w0", "b") == 0
    assert idx.remove_tier("w1", "b", CacheTier.HBM) == 0
    assert idx.remove_tier("w0", "b", CacheTier.HBM) == 1
    assert idx.remove_tier("w0", "b", CacheTier.HBM) == 0
    assert idx.worker_block_count("w0") == 3 and len(idx) == 3
    for block_hash in ("a", "c"):
        assert idx.remove_block(key().scope(), "w0", block_hash) == 1
    assert idx.remove_tier("w0", "d", "gpu") == 1
    assert len(idx) == 0 and idx.worker_block_count("w0") == 0
    assert (idx._by_hash, idx._by_worker, idx.metrics().removes) == ({}, {}, 4)


def test_open_index_rejects_unknown_backend_and_lmdb_without_path(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="unknown index backend 'rocks'"):
        open_index("rocks")
    for backend in PERSISTENT:
        with pytest.raises(InvalidArgument, match="needs a path"):
            open_index(backend)
    assert isinstance(open_index(" Memory "), MemoryIndex)
    idx = open_index("LMDB", str(tmp_path / "x"))
    try:
        assert isinstance(idx, LmdbIndex)
        assert idx.persistent and not MemoryIndex().persistent
        assert (idx.name, MemoryIndex.name) == ("lmdb", "memory")
    finally:
        idx.close()


@pytest.mark.parametrize(
    ("backend", "kind"),
    [("rocksdb", RocksIndex), ("fs", FsIndex), ("art", ArtIndex)],
)
def test_open_index_opens_each_persistent_backend(tmp_path: Path, backend: str, kind: type) -> None:
    idx = open_index(backend.upper(), str(tmp_path / backend))
    try:
        assert type(idx) is kind and idx.persistent and idx.name == backend
    finally:
        idx.close()
    mirrored = open_index(backend, str(tmp_path / backend), sync_commits=False, mirror=True)
    try:
        assert type(mirrored) is MirroredIndex and mirrored.name == backend
        assert mirrored.persistent
    finally:
        mirrored.close()


@pytest.mark.parametrize("scanned", [False, True])
def test_memory_index_drops_emptied_containers(scanned: bool) -> None:
    idx = MemoryIndex()
    if scanned:  # the parent-hash index exists (and is kept) from the first scan on
        assert idx.prefix_scan(IdentityScope("m0", "tok", None, "t0"), "p") == []
    k = key(parent="p")
    idx.put_many([rec(k, w, t) for w in ("w0", "w1") for t in (CacheTier.HBM, CacheTier.CPU_DRAM)])
    idx.put(rec(key(tenant="t1", parent="p")))
    idx.remove_block(k.scope(), "w0", "h1")
    idx.remove_tier("w1", "h1", CacheTier.HBM)
    idx.clear_worker("w1")
    idx.remove_block(IdentityScope("m0", "tok", None, "t1"), "w0", "h1")
    assert len(idx) == 0
    assert (idx._by_hash, idx._by_prefix, idx._by_worker) == ({}, {} if scanned else None, {})


# --- property test: every backend against a trivially simple model ---------------------

WORKERS = ["w0", "w1", "w2"]
TIERS = [CacheTier.HBM, CacheTier.CPU_DRAM, CacheTier.LOCAL_SSD]
HASHES = ["h0", "h1", "h2"]
SCOPES = [
    IdentityScope("m0", "tok", None, "t0"),
    IdentityScope("m0", "tok", None, "t1"),
    IdentityScope("m0", "tok", "lora", "t0"),
]
PARENTS = ["root", "h0"]

scopes = st.sampled_from(SCOPES)
keys = st.builds(
    lambda scope, parent, block_hash, block_index: KvBlockKey(
        scope.model_id,
        scope.tokenizer_id,
        scope.adapter_id,
        scope.tenant_id,
        parent,
        block_hash,
        block_index,
        16,
    ),
    scopes,
    st.sampled_from(PARENTS),
    st.sampled_from(HASHES),
    st.integers(0, 1),
)
residencies = st.builds(
    CacheResidency,
    key=keys,
    worker_id=st.sampled_from(WORKERS),
    tier=st.sampled_from(TIERS),
    bytes=st.integers(0, 1 << 40),
    last_access_ms=st.integers(0, 10),
    ref_count=st.integers(0, 3),
    pinned=st.booleans(),
)


class IndexVsModel(RuleBasedStateMachine):
    """Drives one backend and a dict of records through the same operations."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self.dir = Path(tempfile.mkdtemp(prefix="qc-index-"))
        self.index = make_index(backend, self.dir)
        self.model: dict[tuple[KvBlockKey, str, CacheTier], CacheResidency] = {}
        self.puts = 0
        self.removes = 0

    def teardown(self) -> None:
        self.index.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _drop(self, doomed: list[tuple[KvBlockKey, str, CacheTier]]) -> int:
        for slot in doomed:
            del self.model[slot]
        self.removes += len(doomed)
        return len(doomed)

    @rule(r=residencies)
    def put(self, r: CacheResidency) -> None:
        self.index.put(r)
        self.model[(r.key, r.worker_id, r.tier)] = r
        self.puts += 1

    @rule(batch=st.lists(residencies, max_size=4))
    def put_many(self, batch: list[CacheResidency]) -> None:
        self.index.put_many(batch)
        for r in batch:
            self.model[(r.key, r.worker_id, r.tier)] = r
        self.puts += len(batch)

    @rule(
        scope=scopes,
        parent=st.sampled_from(PARENTS),
        chain=st.lists(st.sampled_from(HASHES), max_size=4),
        first_index=st.integers(0, 1),
        worker=st.sampled_from(WORKERS),
        tier=st.sampled_from(TIERS),
        nbytes=st.integers(0, 1 << 20),
        stamp=st.integers(0, 10),
    )
    def put_chain(
        self,
        scope: IdentityScope,
        parent: str,
        chain: list[str],
        first_index: int,
        worker: str,
        tier: CacheTier,
        nbytes: int,
        stamp: int,
    ) -> None:
        fields = (scope.model_id, scope.tokenizer_id, scope.adapter_id, scope.tenant_id)
        self.index.put_chain(
            Chain(fields, parent, chain, first_index, 16, worker, tier, nbytes, stamp)
        )
        expected = []
        for offset, block_hash in enumerate(chain):
            k = KvBlockKey(*fields, parent, block_hash, first_index + offset, 16)
            expected.append(CacheResidency(k, worker, tier, nbytes, stamp))
            parent = block_hash
        for r in expected:
            self.model[(r.key, r.worker_id, r.tier)] = r
        self.puts += len(expected)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), nbytes=st.integers(0, 1 << 20))
    def replace_existing(self, data: st.DataObject, nbytes: int) -> None:
        old = data.draw(st.sampled_from(list(self.model.values())))
        self.put(CacheResidency(old.key, old.worker_id, old.tier, nbytes, ref_count=1))

    @rule(scope=scopes, worker=st.sampled_from(WORKERS), block_hash=st.sampled_from(HASHES))
    def remove_block(self, scope: IdentityScope, worker: str, block_hash: str) -> None:
        doomed = [
            slot
            for slot in self.model
            if slot[1] == worker and slot[0].block_hash == block_hash and scope.matches(slot[0])
        ]
        assert self.index.remove_block(scope, worker, block_hash) == self._drop(doomed)

    @rule(
        worker=st.sampled_from(WORKERS),
        block_hash=st.sampled_from(HASHES),
        tier=st.sampled_from(TIERS),
    )
    def remove_tier(self, worker: str, block_hash: str, tier: CacheTier) -> None:
        doomed = [
            slot
            for slot in self.model
            if slot[1] == worker and slot[0].block_hash == block_hash and slot[2] is tier
        ]
        assert self.index.remove_tier(worker, block_hash, tier) == self._drop(doomed)

    @rule(worker=st.sampled_from(WORKERS))
    def clear_worker(self, worker: str) -> None:
        doomed = [slot for slot in self.model if slot[1] == worker]
        assert self.index.clear_worker(worker) == self._drop(doomed)

    @rule()
    def clear(self) -> None:
        self.index.clear()
        self._drop(list(self.model))

    @precondition(lambda self: self.backend != "memory")
    @rule()
    def reopen(self) -> None:
        self.index.close()
        self.index = make_index(self.backend, self.dir)
        self.puts = self.removes = 0  # per-process counters start again

    @rule(k=keys)
    def locate(self, k: KvBlockKey) -> None:
        expected = [r for r in self.model.values() if r.key == k]
        assert bag(self.index.locate(k)) == bag(expected)

    @rule(block_hash=st.sampled_from([*HASHES, "absent"]))
    def locate_hash(self, block_hash: str) -> None:
        expected = [r for r in self.model.values() if r.key.block_hash == block_hash]
        assert bag(self.index.locate_hash(block_hash)) == bag(expected)

    @rule(scope=scopes, parent=st.sampled_from([*PARENTS, "h1"]))
    def prefix_scan(self, scope: IdentityScope, parent: str) -> None:
        expected = [
            r for r in self.model.values() if scope.matches(r.key) and r.key.prefix_hash == parent
        ]
        assert bag(self.index.prefix_scan(scope, parent)) == bag(expected)

    @invariant()
    def totals_match(self) -> None:
        assert len(self.index) == len(self.model)
        assert bag(self.index.snapshot()) == bag(self.model.values())
        m = self.index.metrics()
        assert m.resident_blocks == len(self.model)
        assert m.resident_bytes == sum(r.bytes for r in self.model.values())
        assert (m.puts, m.removes) == (self.puts, self.removes)
        for worker in WORKERS:
            held = sum(1 for slot in self.model if slot[1] == worker)
            assert self.index.worker_block_count(worker) == held


# A pass takes seconds; the long timeout only lets a failure finish shrinking, so the
# report shows the minimal failing sequence instead of a timeout traceback. RocksDB
# creates a database per example (~18 ms) and fsyncs its WAL per write: fewer examples
# keep it near the others' time.
EXAMPLES = {"rocksdb": 25}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_simple_model(backend: str) -> None:
    run_state_machine_as_test(
        lambda: IndexVsModel(backend),
        settings=settings(
            max_examples=EXAMPLES.get(backend, 60),
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_workers_are_those_holding_a_record(index: IndexBackend) -> None:
    assert index.workers() == []
    index.put_many([rec(key("a"), "w1", CacheTier.HBM, 1), rec(key("b"), "w0", CacheTier.HBM, 1)])
    assert index.workers() == ["w0", "w1"]
    assert index.remove_tier("w1", "a", CacheTier.HBM) == 1
    assert index.workers() == ["w0"]


def test_worker_epochs_are_kept_apart_from_records(index: IndexBackend) -> None:
    assert index.worker_epochs() == {}
    index.set_worker_epoch("e0", 1700000000.25)
    index.set_worker_epoch("e1", 5.0)
    index.set_worker_epoch("e1", 6.5)  # a later run replaces the earlier
    index.put_many([rec(key("a"), "e0", CacheTier.HBM, 1)])
    index.clear_worker("e0")
    index.clear()
    assert index.worker_epochs() == {"e0": 1700000000.25, "e1": 6.5}
    assert index.workers() == []
