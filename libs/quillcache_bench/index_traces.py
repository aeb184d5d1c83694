"""The traces `quillcache bench-index` replays against every index backend.

A trace is a list of ops, in order, each a tuple:

- ``("put", [CacheResidency, ...])``: one KV "stored" event (one worker, one tier);
- ``("remove", worker_id, block_hash, tier)``: one "removed" event (`remove_tier`);
- ``("clear", worker_id)``: an "all blocks cleared" event (`clear_worker`);
- ``("lookup", scope, block_hashes, prompt_tokens, output_tokens)``: one routing
  decision's lookup of the prompt's hash chain, as the conductor's Plan makes it
  (`locate_prefix`).

Two kinds:

- **recorded** (`record_fleet`): the fleet simulator (`quillcache bench`'s) running a
  workload (chat, docqa) under our policy, with its residency index wrapped in a
  `RecordingIndex`: every residency change the simulated engines and store nodes
  report (HBM admits, LRU evictions, offloads to DRAM, demotions to SSD) and every
  plan's prefix lookup, in the order the simulator made them. The planner's own
  optimistic records (`record_optimistic`: the conductor keeps those in an overlay,
  outside the index) are applied to the simulator's index but not recorded.
- **synthetic churn** (`churn_trace`): chains of blocks put on 20 workers until a
  steady resident size, then every new chain evicts the oldest records (tail block
  first), so puts and removes run at the same rate; chains extend earlier ones (shared
  prefixes), a lookup follows every few writes (hits, partial hits, misses), and one
  worker in a while restarts (`clear`).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgpack

from quillcache_bench.fleetsim.sim import GIB, FleetConfig, FleetSim
from quillcache_bench.fleetsim.workloads import make_workload
from quillcache_core.identity.chain import chain_keys
from quillcache_core.index import MemoryIndex
from quillcache_core.index.base import Chain, IndexBackend
from quillcache_core.index.fs_index import record_row
from quillcache_core.model import (
    MIB,
    CacheResidency,
    CacheTier,
    CostModel,
    IdentityScope,
    IndexMetrics,
    KvBlockKey,
)
from quillcache_core.routing.references import make_policy

PUT, REMOVE, CLEAR, LOOKUP = "put", "remove", "clear", "lookup"


@dataclass
class Trace:
    name: str
    description: str
    ops: list[tuple] = field(default_factory=list)
    _summary: dict | None = field(default=None, repr=False, compare=False)

    def counts(self) -> dict[str, int]:
        out = {"ops": len(self.ops), "records_put": 0, "removes": 0, "clears": 0, "lookups": 0}
        for op in self.ops:
            kind = op[0]
            if kind == PUT:
                out["records_put"] += len(op[1])
            elif kind == REMOVE:
                out["removes"] += 1
            elif kind == CLEAR:
                out["clears"] += 1
            else:
                out["lookups"] += 1
        return out

    def summary(self) -> dict[str, object]:
        """Counts, the logical bytes put (`logical_bytes`), and the state at the end
        (replayed into a MemoryIndex: records, peak, `fingerprint`). Computed once."""
        if self._summary is not None:
            return self._summary
        index = MemoryIndex()
        peak = 0
        logical = 0
        pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack
        for op in self.ops:
            kind = op[0]
            if kind == PUT:
                index.put_many(op[1])
                peak = max(peak, len(index))
                logical += sum(len(pack(record_row(r))) for r in op[1])
            elif kind == REMOVE:
                index.remove_tier(op[1], op[2], op[3])
            elif kind == CLEAR:
                index.clear_worker(op[1])
        self._summary = {
            "description": self.description,
            **self.counts(),
            "logical_bytes": logical,
            "resident_records_end": len(index),
            "resident_records_peak": peak,
            "workers": len({op[1][0].worker_id for op in self.ops if op[0] == PUT}),
            # as index_replay.fingerprint computes it for a backend
            "fingerprint": (
                len(index),
                index.metrics().resident_bytes,
                tuple(
                    (w, index.worker_block_count(w))
                    for w in index.workers()
                    if index.worker_block_count(w)
                ),
            ),
        }
        return self._summary


class RecordingIndex(IndexBackend):
    """A MemoryIndex that appends what is done to it to a trace (see the module docstring).

    Consecutive single puts of one worker and tier (an engine admitting a prompt's new
    blocks, one `put` each) are one "put" op, as an engine reports them in one event.
    `put_many` is the simulator's `record_optimistic` (the only caller): applied, not
    recorded. Each `locate_prefix` is request number `len(lookups so far)` of
    `requests` (the simulator plans them in arrival order); its scope and lengths come
    from that request.
    """

    name = "recording"

    def __init__(self, requests) -> None:
        self.inner = MemoryIndex()
        self.ops: list[tuple] = []
        self._requests = requests
        self._lookups = 0
        self._open_put: list | None = None  # the last op's records while it can grow

    # --- recorded writes --------------------------------------------------------------

    def put(self, residency: CacheResidency) -> None:
        self.inner.put(residency)
        batch = self._open_put
        if (
            batch is not None
            and batch[-1].worker_id == residency.worker_id
            and batch[-1].tier is residency.tier
        ):
            batch.append(residency)
            return
        batch = self._open_put = [residency]
        self.ops.append((PUT, batch))

    def remove_tier(self, worker_id: str, block_hash: str, tier: object) -> int:
        removed = self.inner.remove_tier(worker_id, block_hash, tier)
        self._open_put = None
        tier = tier if isinstance(tier, CacheTier) else CacheTier.parse(str(tier))
        self.ops.append((REMOVE, worker_id, block_hash, tier))
        return removed

    def clear_worker(self, worker_id: str) -> int:
        self._open_put = None
        self.ops.append((CLEAR, worker_id))
        return self.inner.clear_worker(worker_id)

    def locate_prefix(self, block_hashes, extra=None) -> list[list[CacheResidency]]:
        hashes = list(block_hashes)
        request = self._requests[self._lookups]
        if [k.block_hash for k in request.shape.blocks] != hashes:
            raise RuntimeError("the simulator planned requests out of order")
        self._lookups += 1
        self._open_put = None
        scope = request.shape.scope()
        self.ops.append(
            (
                LOOKUP,
                (scope.model_id, scope.tokenizer_id, scope.adapter_id, scope.tenant_id),
                hashes,
                request.prompt_tokens,
                request.output_tokens,
            )
        )
        return self.inner.locate_prefix(hashes, extra)

    # --- not recorded ---------------------------------------------------------------------

    def put_many(self, residencies: Iterable[CacheResidency]) -> None:
        self.inner.put_many(residencies)

    def put_chain(self, chain: Chain) -> None:
        self.inner.put_chain(chain)

    def locate(self, key: KvBlockKey) -> list[CacheResidency]:
        return self.inner.locate(key)

    def locate_hash(self, block_hash: str) -> list[CacheResidency]:
        return self.inner.locate_hash(block_hash)

    def locate_hashes(self, block_hashes) -> list[list[CacheResidency]]:
        return self.inner.locate_hashes(block_hashes)

    def prefix_scan(self, scope: IdentityScope, prefix_hash: str) -> list[CacheResidency]:
        return self.inner.prefix_scan(scope, prefix_hash)

    def remove_block(self, scope: IdentityScope, worker_id: str, block_hash: str) -> int:
        raise NotImplementedError("the fleet simulator removes by tier")

    def clear(self) -> None:
        raise NotImplementedError("the fleet simulator never clears the whole index")

    def snapshot(self) -> list[CacheResidency]:
        return self.inner.snapshot()

    def __len__(self) -> int:
        return len(self.inner)

    def worker_block_count(self, worker_id: str) -> int:
        return self.inner.worker_block_count(worker_id)

    def workers(self) -> list[str]:
        return self.inner.workers()

    def worker_epochs(self) -> dict[str, float]:
        return self.inner.worker_epochs()

    def set_worker_epoch(self, worker_id: str, epoch: float) -> None:
        self.inner.set_worker_epoch(worker_id, epoch)

    def metrics(self) -> IndexMetrics:
        return self.inner.metrics()


@dataclass(frozen=True)
class FleetTraceConfig:
    """The simulated fleet a trace is recorded on (`quillcache bench`'s defaults but for
    the tiers, smaller so that a short run fills them and evicts)."""

    requests: int = 600
    rate_multiple: float = 0.75  # of the workload's saturation rate
    engines: int = 16
    stores: int = 4
    domains: int = 2
    hbm_blocks: int = 1024
    dram_gib: float = 4.0
    ssd_gib: float = 16.0
    seed: int = 1


def record_fleet(workload: str, config: FleetTraceConfig) -> Trace:
    """Run the fleet simulator on `workload` under our policy and return what it did to
    its residency index."""
    wl = make_workload(workload, config.requests, config.seed)
    fleet = FleetConfig(
        engines=config.engines,
        stores=config.stores,
        domains=config.domains,
        hbm_blocks=config.hbm_blocks,
        dram_bytes=int(config.dram_gib * GIB),
        ssd_bytes=int(config.ssd_gib * GIB),
        cost_model=CostModel(),
    )
    rate = config.rate_multiple * wl.saturation_rate(fleet.engines, fleet.cost_model)
    policy = make_policy("quillcache", fleet.cost_model.queue_at_prefill_speed())
    sim = FleetSim(fleet, policy, wl.requests, wl.arrivals_us(rate, config.seed), seed=config.seed)
    recorder = RecordingIndex(wl.requests)
    # The simulator's index is its own attribute and each store node's; swap both.
    sim.index = recorder
    for store in sim.stores.values():
        store.index = recorder
    sim.run()
    return Trace(
        f"fleet-{workload}",
        f"fleet simulator, {workload} workload: {config.requests} requests at "
        f"{config.rate_multiple:g}x saturation on {config.engines} engines "
        f"(HBM {config.hbm_blocks} blocks) and {config.stores} store nodes "
        f"(DRAM {config.dram_gib:g} GiB + SSD {config.ssd_gib:g} GiB each), our policy",
        recorder.ops,
    )


@dataclass(frozen=True)
class ChurnConfig:
    resident: int = 40_000  # records held at steady state
    records_put: int = 120_000  # records put in all (the first `resident` fill the index)
    engines: int = 16
    stores: int = 4
    tenants: int = 8
    lookup_every: int = 4  # writes (put or remove ops) per lookup
    clear_every: int = 40_000  # records put between two worker restarts
    seed: int = 11
    block_bytes: int = 2 * MIB


def churn_trace(config: ChurnConfig) -> Trace:
    """Chains put at a steady resident size, LRU-evicted block by block (module docstring)."""
    rng = random.Random(config.seed)
    engines = [f"e{i:03d}" for i in range(config.engines)]
    stores = [f"s{j:02d}" for j in range(config.stores)]
    scopes = [("llama-3-8b", "llama-3", None, f"tenant-{t}") for t in range(config.tenants)]
    ops: list[tuple] = []
    # Resident chains, oldest first: [worker, tier, records left (oldest block first)].
    resident: deque[list] = deque()
    chains: list[tuple[tuple, list[str]]] = []  # every chain ever put: (scope, hashes)
    held = 0
    put = 0
    writes = 0
    serial = 0
    next_clear = config.clear_every
    while put < config.records_put:
        # A new chain: a fresh prompt (a third), or one extending an earlier chain's prefix.
        scope = scopes[min(int(rng.expovariate(0.5)), len(scopes) - 1)]
        length = rng.randint(8, 64)
        parent, first, prefix_hashes = "root", 0, []
        if chains and rng.random() < 2 / 3:
            base_scope, base = chains[rng.randrange(max(0, len(chains) - 500), len(chains))]
            scope = base_scope
            cut = rng.randint(1, len(base))
            prefix_hashes = base[:cut]
            parent, first = base[cut - 1], cut
        hashes = []
        for _ in range(length):
            serial += 1
            hashes.append(f"{rng.getrandbits(64):016x}{serial:016x}")
        if rng.random() < 0.7:
            worker, tier = rng.choice(engines), CacheTier.HBM
        else:
            worker = rng.choice(stores)
            tier = CacheTier.CPU_DRAM if rng.random() < 0.6 else CacheTier.LOCAL_SSD
        keys = chain_keys(scope, hashes, parent=parent, first_index=first)
        ops.append((PUT, [CacheResidency(k, worker, tier, config.block_bytes) for k in keys]))
        resident.append([worker, tier, list(hashes)])
        chains.append((scope, prefix_hashes + hashes))
        held += length
        put += length
        writes += 1
        # Evict down to the steady size: the oldest chain's tail blocks first.
        while held > config.resident:
            worker_o, tier_o, left = resident[0]
            ops.append((REMOVE, worker_o, left.pop(), tier_o))
            held -= 1
            writes += 1
            if not left:
                resident.popleft()
            if writes % config.lookup_every == 0:
                ops.append(_churn_lookup(rng, chains))
        if put >= next_clear:
            # An engine restarts: everything it held goes.
            victim = rng.choice(engines)
            ops.append((CLEAR, victim))
            for entry in resident:
                if entry[0] == victim:
                    held -= len(entry[2])
                    entry[2] = []
            resident = deque(e for e in resident if e[2])
            next_clear += config.clear_every
        if writes % config.lookup_every == 0:
            ops.append(_churn_lookup(rng, chains))
    return Trace(
        "churn",
        f"synthetic churn: {config.records_put:,} records put in chains of 8-64 blocks "
        f"(2/3 extend an earlier chain) on {config.engines} engines + {config.stores} "
        f"store nodes, LRU-evicted tail first at a steady {config.resident:,} resident, "
        f"a lookup every {config.lookup_every} writes, a worker restart every "
        f"{config.clear_every:,} records",
        ops,
    )


def _churn_lookup(rng: random.Random, chains: list) -> tuple:
    """A prompt over a recent chain (mostly resident), an old one (mostly evicted), or a
    recent one followed by new blocks."""
    if rng.random() < 0.7:
        scope, hashes = chains[rng.randrange(max(0, len(chains) - 300), len(chains))]
    else:
        scope, hashes = chains[rng.randrange(len(chains))]
    hashes = list(hashes)
    if rng.random() < 0.5:
        hashes += [f"new{rng.getrandbits(64):016x}" for _ in range(rng.randint(1, 16))]
    return (LOOKUP, scope, hashes, 16 * len(hashes) + rng.randint(0, 15), 128)
