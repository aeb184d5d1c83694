"""A discrete-event simulation of a fleet of engines and store nodes under one router.

Virtual clock in microseconds; deterministic for a workload, arrival times and seed.
Pure: no sockets, no disk; the only clock read is `plan_clock`, which times the
routing decision itself (a reported figure, never fed back into the simulation).

The router is exactly the conductor's: `routing.plan_request` over a `MemoryIndex`
with live `WorkerState` load, reserved at plan time (in-flight request and running
decode +1, prefill tokens the plan leaves to compute, the request's blocks), prefill
tokens released at the first token, the rest at completion. A policy with lifecycle
hooks (the reference routers, the oracle) hears what it would in reality: the clock at
each decision, each prefill start, first token and end, and engine-metric scrapes at
its interval; our planner gets the virtual clock (`bind_clock`).

Each engine:

- **HBM**: a block budget. Blocks of running requests are pinned (reference counted);
  unpinned cached blocks wait in LRU order and are evicted from the front, a finished
  request's blocks freed tail first (vLLM's free-block queue). An evicted block is
  offloaded to the engine's store node.
- **Write-through** (`StoreWrites.WRITE_THROUGH`, QuillCache's KV connector: its
  `_add_saves`/`wait_for_save` hand every newly computed full block to a bounded
  background writer to the engine's store node, which drops and counts rather than
  block): each block the prefill computes is queued as it is computed (the prefill
  computes its blocks in order at prefill_us_per_token after its hits and fetches),
  one writer per engine writes them in order at the store's DRAM price per block
  (the same bandwidth a DRAM fetch is priced at), and a block reaches the store node's
  DRAM, and the index, when its write ends. A block computed while
  `write_queue_bytes` are queued is dropped (counted in `write_drops`); it still
  reaches the store if it is evicted later. The prefill never waits for the writer.
  With `StoreWrites.ON_EVICTION` (the default) blocks reach the store only when evicted.
- **Prefill**: one at a time in arrival order. At its start the engine executes the
  plan: blocks in HBM now are hits (also where the plan said otherwise, as vLLM's own
  prefix cache would find them); a FETCH block is loaded if its source node holds it
  now (on any tier; priced by the CostModel for that tier, plus the cross-domain
  penalty); any other block (a stale LOCAL_HIT or FETCH, or a RECOMPUTE) is loaded
  from the engine's own store node if that holds it now (vLLM's KV connectors, ours
  and LMCache alike, look there when they schedule a request; every engine, whatever
  the policy; counted in `unplanned_fetches`); the first block that is none of these
  ends the reused prefix, and it and every later token are recomputed.
  Prefill time = fetch time + hits x hbm_hit_us + recomputed tokens x
  prefill_us_per_token. At its end (the first token) the request's blocks become
  resident and pinned, and the index learns of every residency change at once, as
  from KV events.
- **Decode**: concurrent. Every running decode emits a token every
  decode_us_per_token + s x (other running decodes) µs, with s =
  running_decode_penalty_us / decode_slowdown_divisor (the cost model charges the
  penalty once per request; the divisor spreads it over a nominal answer length).

Each store node has a DRAM tier and an SSD tier, each a byte budget with LRU: DRAM
evictions are written to SSD, SSD evictions are dropped. A fetch refreshes the block's
place in its tier's LRU.
"""

from __future__ import annotations

import enum
import heapq
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from quillcache_bench.fleetsim.caches import HbmCache, StoreNode
from quillcache_bench.fleetsim.workloads import SimRequest
from quillcache_core.errors import InvalidArgument
from quillcache_core.index import MemoryIndex
from quillcache_core.model import MIB, CacheResidency, CacheTier, CostModel, WorkerState
from quillcache_core.routing.actions import ActionKind, BlockAction
from quillcache_core.routing.decide import plan_request, record_optimistic
from quillcache_core.routing.policy import Fleet, Policy
from quillcache_core.routing.references import EngineMetrics

GIB = 1024 * MIB
MAX_ENGINES = 256
MAX_STORES = 32

_HBM = CacheTier.HBM
_DRAM = CacheTier.CPU_DRAM
_SSD = CacheTier.LOCAL_SSD
_LOCAL_HIT = ActionKind.LOCAL_HIT
_FETCH = ActionKind.FETCH
_EPS_TOKENS = 1e-6
# Written-through blocks land in the store (and the index) in runs of at most this many.
WRITE_LANDING_BLOCKS = 16

# Event kinds, in the event heap.
_PREFILL_DONE = 0
_DECODE_TICK = 1
_WRITES_LANDED = 2


class StoreWrites(enum.Enum):
    """When an engine's computed blocks reach its store node."""

    ON_EVICTION = "on-eviction"  # only when evicted from HBM (offload)
    WRITE_THROUGH = "write-through"  # also as computed (QuillCache's KV connector)


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """The simulated fleet. Engine i uses store node i % stores; store j is in domain j % domains."""

    engines: int = 16
    stores: int = 4
    domains: int = 2
    hbm_blocks: int = 4096
    dram_bytes: int = 32 * GIB
    ssd_bytes: int = 128 * GIB
    decode_slowdown_divisor: float = 100.0
    cost_model: CostModel = field(default_factory=CostModel)
    store_writes: StoreWrites = StoreWrites.ON_EVICTION
    # The write-through queue's bound per engine: the connector's max_pending_bytes default.
    write_queue_bytes: int = 256 * MIB

    def validate(self) -> None:
        """Raise InvalidArgument naming the offending setting."""
        if not 1 <= self.engines <= MAX_ENGINES:
            raise InvalidArgument(f"--engines must be in [1, {MAX_ENGINES}], got {self.engines}")
        if not 1 <= self.stores <= MAX_STORES:
            raise InvalidArgument(f"--stores must be in [1, {MAX_STORES}], got {self.stores}")
        if self.stores > self.engines:
            raise InvalidArgument(
                f"--stores ({self.stores}) must not exceed --engines ({self.engines}): "
                "engines share store nodes"
            )
        if not 1 <= self.domains <= self.stores:
            raise InvalidArgument(f"--domains must be in [1, --stores], got {self.domains}")
        if self.hbm_blocks <= 0:
            raise InvalidArgument(f"--hbm-blocks must be positive, got {self.hbm_blocks}")
        if self.dram_bytes < 0 or self.ssd_bytes < 0:
            raise InvalidArgument("store tier budgets must be >= 0")
        if self.decode_slowdown_divisor <= 0:
            raise InvalidArgument("--decode-slowdown-divisor must be positive")
        if self.write_queue_bytes < 0:
            raise InvalidArgument("the write-through queue bound must be >= 0 bytes")


class _Engine:
    __slots__ = (
        "n",
        "state",
        "store",
        "hbm",
        "queue",
        "busy",
        "decode_heap",
        "v",
        "v_t",
        "version",
        "load_area",
        "load_t",
        "served",
        "busy_until",
        "writes",
        "write_free",
    )

    def __init__(self, n: int, state: WorkerState, store: StoreNode, hbm: HbmCache) -> None:
        self.n = n
        self.state = state
        self.store = store
        self.hbm = hbm
        self.queue: list[int] = []  # waiting for prefill, FIFO (head at queue_head)
        self.busy = False
        self.decode_heap: list[tuple[float, int]] = []  # (target virtual tokens, request)
        self.v = 0.0  # tokens each running decode has emitted since the start (virtual)
        self.v_t = 0.0
        self.version = 0
        self.load_area = 0.0  # integral of in-flight requests over time (request-µs)
        self.load_t = 0.0
        self.served = 0
        self.busy_until = 0.0  # when the prefill in progress ends
        self.writes: deque[float] = deque()  # write-through: queued blocks' write ends
        self.write_free = 0.0  # when the writer finishes what is queued


@dataclass
class RunResult:
    """Everything one run measured; per-request arrays are in workload order."""

    policy: str
    engines: int
    arrival_us: np.ndarray
    first_token_us: np.ndarray
    done_us: np.ndarray
    engine_of: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    hit_tokens: np.ndarray
    fetch_tokens: np.ndarray
    recompute_tokens: np.ndarray
    planned_hit_blocks: np.ndarray
    planned_fetch_blocks: np.ndarray
    est_ttft_us: np.ndarray  # our cost function's TTFT estimate for the chosen engine
    plan_s: np.ndarray
    load_avg: np.ndarray  # per engine: time-averaged in-flight requests
    served: np.ndarray  # per engine: requests completed
    completed: int
    stale_hits: int
    stale_fetches: int
    unplanned_hits: int
    fetch_us_total: float
    overcommits: int
    leftover_load: dict[str, int]
    unplanned_fetches: int = 0  # blocks loaded from the engine's own store node unplanned
    written_through: int = 0  # blocks the write-through put in a store node
    write_drops: int = 0  # computed blocks the full write-through queue dropped


class FleetSim:
    """One run: a workload's requests through a fleet under one policy."""

    def __init__(
        self,
        config: FleetConfig,
        policy: Policy,
        requests: Sequence[SimRequest],
        arrivals_us: Sequence[float],
        *,
        seed: int = 0,
        plan_clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        config.validate()
        if len(requests) != len(arrivals_us):
            raise InvalidArgument("one arrival time per request is needed")
        if not requests:
            raise InvalidArgument("a run needs at least one request")
        longest = max(len(r.shape.blocks) for r in requests)
        if longest > config.hbm_blocks:
            raise InvalidArgument(
                f"a prompt of {longest} blocks does not fit --hbm-blocks {config.hbm_blocks}"
            )
        self.config = config
        self.policy = policy
        self.requests = requests
        self.arrivals = list(arrivals_us)
        self.rng = random.Random(seed)
        self.plan_clock = plan_clock
        self.cm = config.cost_model
        self.nbytes = requests[0].shape.block_bytes
        self.index = MemoryIndex()
        mb = max(1, -(-self.nbytes // MIB))
        self._fetch_base_us = {t: self.cm.tier_us_per_mb(t) * mb for t in (_DRAM, _SSD)}
        self._write_through = config.store_writes is StoreWrites.WRITE_THROUGH
        self._write_us = float(self._fetch_base_us[_DRAM])
        self._write_slots = config.write_queue_bytes // self.nbytes
        self._landing: dict[int, tuple[_Engine, list]] = {}  # writes in flight, by event
        self._landing_next = 0
        self.stores: dict[str, StoreNode] = {}
        for j in range(config.stores):
            node_id = f"s{j:02d}"
            self.stores[node_id] = StoreNode(
                node_id,
                f"domain-{j % config.domains}",
                config.dram_bytes // self.nbytes,
                config.ssd_bytes // self.nbytes,
                self.index,
                self.nbytes,
            )
        store_list = list(self.stores.values())
        self.engines: list[_Engine] = []
        for i in range(config.engines):
            store = store_list[i % config.stores]
            state = WorkerState(
                id=f"e{i:03d}",
                locality_domain=store.domain,
                hbm_capacity_bytes=config.hbm_blocks * self.nbytes,
                store_node_id=store.id,
            )
            self.engines.append(_Engine(i, state, store, HbmCache(config.hbm_blocks)))
        self.engine_by_id = {e.state.id: e for e in self.engines}
        self.fleet = Fleet([e.state for e in self.engines], {s.id: s.domain for s in store_list})
        self.decode_slowdown_us = self.cm.running_decode_penalty_us / config.decode_slowdown_divisor
        # A router that tracks requests itself hears their lifecycle, as in reality: the
        # clock at each decision, each first token and each end, and (if it scrapes
        # engine metrics) a scrape at the first decision after each interval.
        self.hooks = policy if hasattr(policy, "bind_lifecycle") else None
        if self.hooks is not None:
            policy.bind_lifecycle()
        if hasattr(policy, "bind_sim"):  # the oracle reads the fleet's true state
            policy.bind_sim(self)
        self.now_us = 0.0
        if hasattr(policy, "bind_clock"):  # our planner's queue drains with (virtual) time
            policy.bind_clock(lambda: self.now_us)
        self._scrape_every = float(getattr(policy, "scrape_interval_us", 0.0) or 0.0)
        self._next_scrape = 0.0

        n = len(requests)
        self._events: list[tuple] = []
        self._order = 0
        self._actions: list[list[BlockAction] | None] = [None] * n
        self._reserved = [0] * n
        self._queue_head = [0] * config.engines
        self.arrival_us = np.asarray(self.arrivals, dtype=np.float64)
        self.first_token_us = np.full(n, np.nan)
        self.done_us = np.full(n, np.nan)
        self.engine_of = np.full(n, -1, dtype=np.int64)
        self.hit_tokens = np.zeros(n, dtype=np.int64)
        self.fetch_tokens = np.zeros(n, dtype=np.int64)
        self.recompute_tokens = np.zeros(n, dtype=np.int64)
        self.planned_hit = np.zeros(n, dtype=np.int64)
        self.planned_fetch = np.zeros(n, dtype=np.int64)
        self.est_ttft_us = np.zeros(n)
        self.plan_s = np.zeros(n)
        self.completed = 0
        self.stale_hits = 0
        self.stale_fetches = 0
        self.unplanned_hits = 0
        self.unplanned_fetches = 0
        self.fetch_us_total = 0.0
        self.written_through = 0
        self.write_drops = 0

    # --- the event loop ---------------------------------------------------------------

    def run(self) -> RunResult:
        arrivals = self.arrivals
        events = self._events
        n = len(arrivals)
        nxt = 0
        while nxt < n or events:
            if nxt < n and (not events or arrivals[nxt] <= events[0][0]):
                self._arrive(nxt, arrivals[nxt])
                nxt += 1
                continue
            now, _, kind, a, b = heapq.heappop(events)
            if kind == _PREFILL_DONE:
                self._prefill_done(self.engines[a], b, now)
            elif kind == _WRITES_LANDED:
                self._writes_landed(b)
            elif self.engines[a].version == b:
                self._decode_tick(self.engines[a], now)
        return self._result()

    def _push(self, t: float, kind: int, a: int, b: int) -> None:
        self._order += 1
        heapq.heappush(self._events, (t, self._order, kind, a, b))

    # --- routing ------------------------------------------------------------------------

    def _arrive(self, i: int, now: float) -> None:
        shape = self.requests[i].shape
        self.now_us = now
        hooks = self.hooks
        if hooks is not None:
            hooks.observe_time(now)
            if self._scrape_every and now >= self._next_scrape:
                hooks.observe_metrics(self.engine_metrics())
                self._next_scrape = (now // self._scrape_every + 1) * self._scrape_every
        start = self.plan_clock()
        decision = plan_request(self.index, self.policy, shape, self.fleet, self.rng)
        self.plan_s[i] = self.plan_clock() - start
        if self.policy.optimistic_residency:
            # As the conductor does; the engine's eviction events correct it later.
            record_optimistic(self.index, decision, shape, self.nbytes)
        eng = self.engine_by_id[decision.engine.id]
        state = eng.state
        prefill = decision.recompute_tokens(shape)
        self._load_mark(eng, now)
        state.inflight_requests += 1
        state.running_decodes += 1
        state.queued_prefill_tokens += prefill
        state.inflight_blocks += len(shape.blocks)
        self._reserved[i] = prefill
        self._actions[i] = decision.actions
        self.engine_of[i] = eng.n
        self.planned_hit[i] = decision.count(_LOCAL_HIT)
        self.planned_fetch[i] = decision.count(_FETCH)
        self.est_ttft_us[i] = decision.chosen.est_ttft_us
        eng.queue.append(i)
        if not eng.busy:
            self._start_prefill(eng, now)

    # --- prefill ------------------------------------------------------------------------

    def _start_prefill(self, eng: _Engine, now: float) -> None:
        head = self._queue_head[eng.n]
        i = eng.queue[head]
        self._queue_head[eng.n] = head + 1
        if head + 1 > 1024:
            del eng.queue[: head + 1]
            self._queue_head[eng.n] = 0
        eng.busy = True
        prefill_us, reused, compute_from_us = self._execute(eng, i)
        eng.busy_until = now + prefill_us
        if self._write_through:
            self._write_computed(eng, self.requests[i].shape.blocks[reused:], now + compute_from_us)
        if self.hooks is not None:
            self.hooks.observe_prefill_start(self.requests[i].shape.id, eng.state.id)
        self._push(eng.busy_until, _PREFILL_DONE, eng.n, i)

    def _execute(self, eng: _Engine, i: int) -> tuple[float, int, float]:
        """Run request i's plan against the fleet as it is now.

        Returns the prefill µs, how many leading blocks were reused (hit or fetched),
        and when (µs from the prefill's start) the engine starts computing the rest.
        """
        request = self.requests[i]
        actions = self._actions[i]
        self._actions[i] = None
        hbm = eng.hbm.refs
        cm = self.cm
        hit_tokens = fetch_tokens = hits = fetches = 0
        fetch_us = 0.0
        for action, key in zip(actions, request.shape.blocks, strict=True):
            h = key.block_hash
            if h in hbm:
                hits += 1
                hit_tokens += key.token_count
                if action.kind is not _LOCAL_HIT:
                    self.unplanned_hits += 1
                continue
            kind = action.kind
            node = tier = None
            if kind is _FETCH:
                node = self.stores.get(action.source_node)
                tier = node.tier_of(h) if node is not None else None
                if tier is None:
                    self.stale_fetches += 1
            elif kind is _LOCAL_HIT:
                self.stale_hits += 1
            if tier is None:
                # Not where the plan said (or the plan said recompute): the engine's
                # connector still finds what its own store node holds, as vLLM's KV
                # connectors look there when they schedule the request.
                node = eng.store
                tier = node.tier_of(h)
                if tier is None:
                    break
                self.unplanned_fetches += 1
            cost = self._fetch_base_us[tier]
            if node is not eng.store and node.domain != eng.store.domain:
                cost += cm.cross_domain_penalty_us
            fetch_us += cost
            node.touch(h)
            fetch_tokens += key.token_count
            fetches += 1
        recompute = request.prompt_tokens - hit_tokens - fetch_tokens
        self.hit_tokens[i] = hit_tokens
        self.fetch_tokens[i] = fetch_tokens
        self.recompute_tokens[i] = recompute
        self.fetch_us_total += fetch_us
        reuse_us = fetch_us + hits * cm.hbm_hit_us
        return recompute * cm.prefill_us_per_token + reuse_us, hits + fetches, reuse_us

    # --- write-through ------------------------------------------------------------------

    def _write_computed(self, eng: _Engine, keys: Sequence, compute_start: float) -> None:
        """Queue the blocks a prefill computes, each when computed; schedule their landing.

        The writer is FIFO at `_write_us` per block; the queue holds at most
        `_write_slots` blocks (a block computed while it is full is dropped).
        """
        per_token = self.cm.prefill_us_per_token
        writes, slots, write_us = eng.writes, self._write_slots, self._write_us
        t = compute_start
        run: list = []
        end = 0.0
        for key in keys:
            t += key.token_count * per_token  # the block is computed now
            while writes and writes[0] <= t:
                writes.popleft()
            if len(writes) >= slots:
                self.write_drops += 1
                continue
            end = (t if t > eng.write_free else eng.write_free) + write_us
            eng.write_free = end
            writes.append(end)
            run.append(key)
            if len(run) == WRITE_LANDING_BLOCKS:
                self._land_at(eng, run, end)
                run = []
        if run:
            self._land_at(eng, run, end)

    def _land_at(self, eng: _Engine, keys: list, at_us: float) -> None:
        n = self._landing_next
        self._landing_next = n + 1
        self._landing[n] = (eng, keys)
        self._push(at_us, _WRITES_LANDED, eng.n, n)

    def _writes_landed(self, n: int) -> None:
        """Written-through blocks reach the engine's store node (DRAM) and the index."""
        eng, keys = self._landing.pop(n)
        store = eng.store
        for key in keys:
            store.offload(key)
        self.written_through += len(keys)

    def _prefill_done(self, eng: _Engine, i: int, now: float) -> None:
        self.first_token_us[i] = now
        state = eng.state
        if self.hooks is not None:
            self.hooks.observe_first_token(self.requests[i].shape.id, state.id)
        state.queued_prefill_tokens -= self._reserved[i]
        blocks = self.requests[i].shape.blocks
        inserted, evicted = eng.hbm.admit(blocks)
        index, nbytes, me = self.index, self.nbytes, state.id
        for key in inserted:
            index.put(CacheResidency(key, me, _HBM, nbytes))
        self._evicted(eng, evicted)
        state.resident_blocks = len(eng.hbm)
        state.hbm_used_bytes = eng.hbm.pinned * nbytes
        remaining = self.requests[i].output_tokens - 1
        if remaining <= 0:
            self._complete(eng, i, now)
        else:
            self._decode_advance(eng, now)
            heapq.heappush(eng.decode_heap, (eng.v + remaining, i))
            self._decode_reschedule(eng, now)
        if self._queue_head[eng.n] < len(eng.queue):
            self._start_prefill(eng, now)
        else:
            eng.busy = False

    # --- decode (all running decodes advance together) -----------------------------------

    def _token_us(self, running: int) -> float:
        return self.cm.decode_us_per_token + self.decode_slowdown_us * (running - 1)

    def _decode_advance(self, eng: _Engine, now: float) -> None:
        running = len(eng.decode_heap)
        if running:
            eng.v += (now - eng.v_t) / self._token_us(running)
        eng.v_t = now

    def _decode_reschedule(self, eng: _Engine, now: float) -> None:
        eng.version += 1
        heap = eng.decode_heap
        if heap:
            wait = max(0.0, heap[0][0] - eng.v) * self._token_us(len(heap))
            self._push(now + wait, 1, eng.n, eng.version)

    def _decode_tick(self, eng: _Engine, now: float) -> None:
        self._decode_advance(eng, now)
        heap = eng.decode_heap
        while heap and heap[0][0] <= eng.v + _EPS_TOKENS:
            _, i = heapq.heappop(heap)
            self._complete(eng, i, now)
        self._decode_reschedule(eng, now)

    def _complete(self, eng: _Engine, i: int, now: float) -> None:
        if not np.isnan(self.done_us[i]):
            raise RuntimeError(f"request {i} completed twice")
        self.done_us[i] = now
        self.completed += 1
        if self.hooks is not None:
            self.hooks.observe_finished(self.requests[i].shape.id, eng.state.id)
        eng.served += 1
        blocks = self.requests[i].shape.blocks
        self._evicted(eng, eng.hbm.release(blocks))
        state = eng.state
        self._load_mark(eng, now)
        state.inflight_requests -= 1
        state.running_decodes -= 1
        state.inflight_blocks -= len(blocks)
        state.hbm_used_bytes = eng.hbm.pinned * self.nbytes
        state.resident_blocks = len(eng.hbm)

    def _evicted(self, eng: _Engine, keys: list) -> None:
        """Tell the index the engine dropped `keys` and offload them to its store node."""
        me = eng.state.id
        for key in keys:
            self.index.remove_tier(me, key.block_hash, _HBM)
            eng.store.offload(key)

    def engine_metrics(self) -> dict[str, EngineMetrics]:
        """Each engine's scrape: requests waiting for prefill, share of HBM pinned."""
        heads = self._queue_head
        return {
            e.state.id: EngineMetrics(
                len(e.queue) - heads[e.n], min(1.0, e.hbm.pinned / e.hbm.capacity)
            )
            for e in self.engines
        }

    def _load_mark(self, eng: _Engine, now: float) -> None:
        eng.load_area += eng.state.inflight_requests * (now - eng.load_t)
        eng.load_t = now

    # --- results ------------------------------------------------------------------------

    def _result(self) -> RunResult:
        start = float(self.arrival_us.min())
        end = float(np.nanmax(self.done_us)) if self.completed else start
        span = max(end - start, 1e-9)
        for eng in self.engines:
            self._load_mark(eng, end)
        # Areas count from t=0; nothing is in flight before the first arrival.
        load_avg = np.array([e.load_area / span for e in self.engines])
        states = [e.state for e in self.engines]
        leftover = {
            "inflight_requests": sum(s.inflight_requests for s in states),
            "running_decodes": sum(s.running_decodes for s in states),
            "queued_prefill_tokens": sum(s.queued_prefill_tokens for s in states),
            "inflight_blocks": sum(s.inflight_blocks for s in states),
            "hbm_used_bytes": sum(s.hbm_used_bytes for s in states),
            "pinned_blocks": sum(e.hbm.pinned for e in self.engines),
        }
        return RunResult(
            policy=self.policy.name,
            engines=len(self.engines),
            arrival_us=self.arrival_us,
            first_token_us=self.first_token_us,
            done_us=self.done_us,
            engine_of=self.engine_of,
            prompt_tokens=np.array([r.prompt_tokens for r in self.requests], dtype=np.int64),
            output_tokens=np.array([r.output_tokens for r in self.requests], dtype=np.int64),
            hit_tokens=self.hit_tokens,
            fetch_tokens=self.fetch_tokens,
            recompute_tokens=self.recompute_tokens,
            planned_hit_blocks=self.planned_hit,
            planned_fetch_blocks=self.planned_fetch,
            est_ttft_us=self.est_ttft_us,
            plan_s=self.plan_s,
            load_avg=load_avg,
            served=np.array([e.served for e in self.engines], dtype=np.int64),
            completed=self.completed,
            stale_hits=self.stale_hits,
            stale_fetches=self.stale_fetches,
            unplanned_hits=self.unplanned_hits,
            fetch_us_total=self.fetch_us_total,
            overcommits=sum(e.hbm.overcommits for e in self.engines),
            leftover_load=leftover,
            unplanned_fetches=self.unplanned_fetches,
            written_through=self.written_through,
            write_drops=self.write_drops,
        )
