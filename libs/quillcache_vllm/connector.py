"""`QuillCacheConnector`: vLLM's KV-connector API (KVConnectorBase_V1) over the QuillCache pool.

Loaded by vLLM with

    --kv-transfer-config '{"kv_connector": "QuillCacheConnector",
      "kv_connector_module_path": "quillcache_vllm.connector", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"store": "HOST:PORT", "model": "tiny",
        "tokenizer": "/models/tiny", "index_block_tokens": 16, "metrics_port": 9400,
        "tls_dir": "/certs"}}'

(`store`: the engine's store node, gRPC; `tls_dir`: the cluster's certificates, used as
the `engine` role (`"insecure": true` instead for an --insecure pool); `model` and
`tokenizer` as the engine's registry record names them; `metrics_port`: the worker's
counters at /metrics (HTTPS with `tls_dir`), 0 = none; `scheduler_metrics_port`: the
scheduler side's likewise; `max_pending_bytes`: the save queue's bound;
`lookup_deadline_ms`: how long a request waits for a store lookup; `bypass_file`: while
a file of that path exists, requests that arrive are served as without the connector
(no lookup, no load, no save: what `bench-live` uses while a router's rows run).)

vLLM builds one instance in its scheduler and one in its worker.

Blocks are keyed as the conductor indexes them: `block_identity(model, tokenizer,
cache_salt=the request's, adapter_id=its LoRA)` over the prompt in blocks of
`index_block_tokens` (the conductor's index block), so an engine block of 32 tokens is two
store blocks. A store block holds, for every attention layer in order, that block's
slice of the layer's paged KV tensor ([kv_heads, tokens, ...] as the layer keeps it).

Scheduler side: `get_num_new_matched_tokens` counts the prompt's blocks after vLLM's own
cache that the pool holds, from vLLM's hit on, in whole engine blocks, never the prompt's
last token; the metadata of each step tells the worker which allocated blocks to load
and which newly computed full blocks to save. vLLM calls it inside its scheduling step,
so whatever it waits for stalls every request on the engine. It asks the store node
nothing when it need not:
- vLLM's own hit covers the prompt's full blocks: nothing to add;
- the request carries the conductor's plan (a reservation id): the plan says which blocks
  the pool holds (its fetch list, on this engine's store node or a peer), from the
  conductor's residency index. A block the plan names and the pool lacks fails to load
  and vLLM recomputes it; a block saved since the conductor planned is recomputed;
- otherwise (no plan, the gateway's own fallback plan, or vLLM holds less than the plan
  counted on) one Exists on this engine's store node for the blocks after vLLM's hit,
  extended by the plan's fetch list. It is asked in the background: until it answers,
  the request is "not ready" (vLLM's `None`) and the step schedules the others; past
  `lookup_deadline_ms` (250) the request computes what vLLM lacks instead.
(Measured on `bench-live --engine vllm` docqa: an Exists per request took 4.9 ms at the
median and 220 ms at the 99th percentile, on two cores shared with the stores, the
conductors and the other engine; 12 of 361 found a block beyond vLLM's own hit.)
`scheduler_metrics_port` serves the scheduler side's counters (its lookups).

Worker side: loads run in the background (vLLM's asynchronous loading: the request
waits in WAITING_FOR_REMOTE_KVS, the engine's other requests are scheduled meanwhile,
and `get_finished` tells vLLM when its blocks are in; `"async_loads": false` loads
before the forward pass instead, which every request in it then waits for). A request
vLLM asks about again after its background load (the load failed, or it was preempted
since) computes what vLLM lacks rather than load again. The blocks the plan names on a peer node come
straight from that node's block-data port, in one request per node; a block that cannot
be loaded, missing, corrupt or unreachable, is reported through
`get_block_ids_with_load_errors` and vLLM recomputes it: never a wrong token. Saves copy
the computed blocks out of the paged cache after the forward pass and hand them to a
bounded background writer (`pool.Pool`), which drops and counts rather than block.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from quillcache_core.errors import InvalidArgument
from quillcache_core.identity.keys import block_identity
from quillcache_core.model import KvBlockKey
from quillcache_core.security.tls import Tls
from quillcache_core.wire.engine_plan import EnginePlan
from quillcache_vllm import metrics
from quillcache_vllm.pool import Pool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL_S = 0.0002  # the worker's, while this connector is in it (see __init__)
MAX_LOOKUPS = 4096  # requests' store lookups kept (each until its request finishes)
STAGING_BYTES = 256 << 20  # a load's staging buffer, at most (larger loads go in pieces)
STAGING_FIRST_BYTES = 64 << 20  # ... as allocated when the KV caches are registered


@dataclass
class BlockTransfer:
    """One engine block: its id in the paged cache and its store keys (one per index block)."""

    block_id: int
    keys: list[KvBlockKey]


@dataclass
class QuillCacheMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    # Block hash -> the peer store node (gRPC address) the plan fetches it from.
    sources: dict[str, str] = field(default_factory=dict)
    # Some saves are a prefill's for another engine (disaggregation): the worker waits
    # until the store has them, so the request's answer means its KV is in the pool.
    flush: bool = False
    # Request id -> its blocks to load in the background: vLLM holds the request
    # (WAITING_FOR_REMOTE_KVS) until the worker reports it loaded (get_finished), and
    # schedules the engine's other requests meanwhile.
    async_loads: dict[str, list[BlockTransfer]] = field(default_factory=dict)


@dataclass
class _Tracked:
    """A request the scheduler side follows until it finishes."""

    keys: list[KvBlockKey]  # the prompt's full index blocks
    held: int  # leading index blocks the pool holds (at lookup)
    local: int = 0  # tokens vLLM had cached itself (at lookup)
    load_from: int = 0  # engine blocks [load_from, load_to) come from the pool
    load_to: int = 0
    block_ids: list[int] = field(default_factory=list)
    saved_to: int = 0  # engine blocks below this are in the pool or queued
    sources: dict[str, str] = field(default_factory=dict)  # the plan's peer of a block
    producer: bool = False  # a prefill for a decode engine: saves are waited for
    load_async: bool = False  # its loads go to the worker in the background
    loaded_async: bool = False  # they went: not loaded again when it is scheduled


def _plan_fetchable(plan: EnginePlan | None, held: int, total: int) -> int:
    """The leading blocks held here or, by the gateway's plan, on a peer store node."""
    if plan is None or not plan.fetch:
        return held
    fetchable = plan.fetch_indices()
    while held < total and held in fetchable:
        held += 1
    return held


class QuillCacheConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.block_size = vllm_config.cache_config.block_size
        self.index_block = int(extra.get("index_block_tokens", 16))
        if self.block_size % self.index_block:
            raise ValueError(
                f"vLLM's block size {self.block_size} is not a multiple of the index's "
                f"{self.index_block} tokens"
            )
        self.parts = self.block_size // self.index_block
        self.model = str(extra.get("model") or vllm_config.model_config.served_model_name)
        self.tokenizer = str(extra.get("tokenizer", ""))
        # kv_producer: every request is a prefill for a decode engine (saves are waited
        # for); otherwise only those whose plan says `"disagg": "prefill"`.
        self.producer = self._kv_transfer_config.kv_role == "kv_producer"
        # The pool is reached as an engine, over mutual TLS, unless `insecure` is set.
        if not extra.get("insecure") and not extra.get("tls_dir"):
            raise ValueError("kv_connector_extra_config needs tls_dir (or insecure: true)")
        tls = None if extra.get("insecure") else Tls.from_dir(str(extra["tls_dir"]), "engine")
        self.pool = Pool(
            str(extra["store"]),
            max_pending_bytes=int(extra.get("max_pending_bytes", 256 << 20)),
            tls=tls,
        )
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        # request id -> its store lookup in flight: (vLLM's hit in index blocks when it
        # was asked, the Future of the count after it, the deadline)
        self._lookups: dict[str, tuple[int, Future, float]] = {}
        # request id -> the gateway's plan it carries (None: none, or a malformed one),
        # read once: vLLM asks about a request again each step it cannot schedule it.
        self._plans: dict[str, EnginePlan | None] = {}
        self.lookup_deadline_s = float(extra.get("lookup_deadline_ms", 250)) / 1000
        self.bypass_file = str(extra.get("bypass_file") or "")
        # Loads in the background (vLLM's asynchronous loading) unless `async_loads` is
        # false: then the forward pass that needs them waits, and so does every request
        # in it.
        self.async_loads = bool(extra.get("async_loads", True))
        self._async_ready: list[str] = []  # allocated since the last step's metadata
        # worker side
        self._layers: list[tuple[str, torch.Tensor]] = []
        self._load_errors: set[int] = set()
        self._loaded: set[str] = set()  # requests whose background loads are done
        self._load_lock = threading.Lock()  # both sets: the loader thread adds to them
        self._loader: ThreadPoolExecutor | None = None
        self._layer_spans: list[tuple[int, int]] = []  # (offset, bytes) in a store block
        self._store_block_bytes = 0
        self._staging: torch.Tensor | None = None  # loads land here first (`_load`)
        self._staging_lock = threading.Lock()  # background and synchronous loads
        if role == KVConnectorRole.WORKER:
            # A load runs beside the worker's main thread, which holds the GIL between
            # its steps (and steps while a request waits for its KV); each return from
            # a socket or a tensor copy waits for the GIL, 5 ms at most by default.
            interval = float(extra.get("gil_switch_interval_s", GIL_SWITCH_INTERVAL_S))
            if 0 < interval < sys.getswitchinterval():
                sys.setswitchinterval(interval)
        # Load and save durations, handed to vLLM each step (metrics.py).
        self._timings = metrics.Timings()
        self.pool.on_saved = self._timings.save
        self._metrics = None
        port_field = "metrics_port" if role == KVConnectorRole.WORKER else "scheduler_metrics_port"
        if int(extra.get(port_field, 0)) > 0:
            self._metrics = metrics.serve(
                self.pool.counters, "127.0.0.1", int(extra[port_field]), tls
            )
        logger.info(
            "QuillCache connector (%s) on store %s: %s/%s, %d-token blocks as %d index blocks",
            role.name,
            extra["store"],
            self.model,
            self.tokenizer or "(model's tokenizer)",
            self.block_size,
            self.parts,
        )

    # --- scheduler side -----------------------------------------------------------------

    def _keys(self, request: Request) -> list[KvBlockKey]:
        adapter = request.lora_request.lora_name if request.lora_request else None
        identity = block_identity(
            self.model, self.tokenizer, cache_salt=request.cache_salt, adapter_id=adapter
        )
        tokens = list(request.prompt_token_ids or [])
        # Never the prompt's last token: vLLM always computes at least that one.
        usable = (len(tokens) - 1) // self.block_size * self.block_size
        return identity.keys(tokens[:usable], self.index_block)

    def _plan(self, request: Request) -> EnginePlan | None:
        """The gateway's plan `request` carries, read once (`EnginePlan`, its codec); a
        malformed one counts and the request is served as one without a plan."""
        try:
            return self._plans[request.request_id]
        except KeyError:
            pass
        try:
            plan = EnginePlan.from_params(request.kv_transfer_params)
        except InvalidArgument as exc:
            self.pool.counters.plans_malformed += 1
            logger.warning("request %s: %s; served without a plan", request.request_id, exc)
            plan = None
        if len(self._plans) >= MAX_LOOKUPS:  # requests vLLM dropped unannounced
            self._plans.clear()
        self._plans[request.request_id] = plan
        return plan

    def _held(
        self, request: Request, plan: EnginePlan | None, keys: list[KvBlockKey], local: int
    ) -> int | None:
        """The prompt's leading index blocks vLLM (its first `local`) and then the pool
        hold: from the conductor's plan when it has one that covers vLLM's hit, else by
        asking the store node about the blocks after vLLM's (None until it answers)."""
        if local >= len(keys):
            self.pool.counters.lookups_skipped += 1
            return len(keys)
        if plan is not None and plan.planned and plan.hit_blocks <= local:
            self.pool.counters.lookups_planned += 1
            return _plan_fetchable(plan, local, len(keys))
        # Kept until the request finishes: vLLM asks again each step it cannot schedule it.
        pending = self._lookups.get(request.request_id)
        if pending is None:
            if len(self._lookups) >= MAX_LOOKUPS:  # requests vLLM dropped unannounced
                self._lookups.clear()
            future = self.pool.leading_held_later(keys[local:])
            pending = (local, future, time.monotonic() + self.lookup_deadline_s)
            self._lookups[request.request_id] = pending
        asked_at, future, deadline = pending
        if not future.done():
            if time.monotonic() < deadline:
                return None
            self.pool.counters.lookups_late += 1
            future.cancel()  # done from now on: this request computes
        found = 0
        if future.done() and not future.cancelled() and future.exception() is None:
            found = future.result()
        return _plan_fetchable(plan, max(local, asked_at + found), len(keys))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        started = time.perf_counter()
        try:
            return self._matched(request, num_computed_tokens)
        finally:
            self.pool.counters.match_seconds += time.perf_counter() - started

    def _matched(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.bypass_file and os.path.exists(self.bypass_file):
            self.pool.counters.requests_bypassed += 1
            return 0, False  # not tracked: nothing loaded or saved for it
        keys = self._keys(request)
        plan = self._plan(request)
        local = num_computed_tokens // self.index_block
        before = self._tracked.get(request.request_id)
        if before is not None and before.loaded_async:
            # Asked again after its background load: that load failed (vLLM freed its
            # blocks) or it was preempted since. It computes what vLLM lacks.
            held: int | None = local
        else:
            held = self._held(request, plan, keys, local)
        if held is None:
            return None, False  # vLLM asks again at its next step
        matched = held // self.parts * self.block_size
        tracked = self._tracked[request.request_id] = _Tracked(
            keys,
            held,
            num_computed_tokens,
            producer=self.producer or (plan is not None and plan.prefill_for_another),
            sources=plan.sources() if plan is not None else {},
        )
        if matched <= num_computed_tokens:
            return 0, False
        tracked.load_async = self.async_loads
        return matched - num_computed_tokens, tracked.load_async

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int):
        tracked = self._tracked.get(request.request_id)
        if tracked is None or num_external_tokens <= 0:
            return
        # The request's own count is set only after this call: use the lookup's.
        tracked.load_from = tracked.local // self.block_size
        tracked.load_to = (tracked.local + num_external_tokens) // self.block_size
        if tracked.load_async:
            # Not scheduled in this step: its blocks are known from here only.
            tracked.block_ids = list(blocks.get_block_ids()[0])
            self._async_ready.append(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = QuillCacheMetadata()
        for req_id in self._async_ready:
            tracked = self._tracked.get(req_id)
            if tracked is None:  # finished (aborted) before its first step
                continue
            transfers = meta.async_loads[req_id] = []
            for index in range(tracked.load_from, tracked.load_to):
                transfers.append(self._transfer(tracked, index))
                self._add_sources(meta, tracked, transfers[-1])
            tracked.loaded_async = True
        self._async_ready = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            if not tracked.loaded_async:  # else loaded in the background already
                for index in range(tracked.load_from, tracked.load_to):
                    self._add_load(meta, tracked, index)
            # What the pool already holds is not saved again.
            tracked.saved_to = max(tracked.load_to, tracked.held // self.parts)
            self._add_saves(meta, tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            more = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Back from preemption: its blocks are all new (listed here in full), and
                # what the lookup promised when it was rescheduled must be loaded again.
                tracked.block_ids = list(more[0]) if more is not None else []
                for index in range(tracked.load_from, tracked.load_to):
                    self._add_load(meta, tracked, index)
                tracked.saved_to = max(tracked.load_to, tracked.held // self.parts)
            elif more is not None:
                tracked.block_ids.extend(more[0])
            self._add_saves(meta, tracked, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _add_load(self, meta: QuillCacheMetadata, tracked: _Tracked, index: int) -> None:
        transfer = self._transfer(tracked, index)
        meta.loads.append(transfer)
        self._add_sources(meta, tracked, transfer)

    @staticmethod
    def _add_sources(meta: QuillCacheMetadata, tracked: _Tracked, transfer: BlockTransfer):
        for key in transfer.keys:
            source = tracked.sources.get(key.block_hash)
            if source:
                meta.sources[key.block_hash] = source

    def _transfer(self, tracked: _Tracked, index: int) -> BlockTransfer:
        keys = tracked.keys[index * self.parts : (index + 1) * self.parts]
        return BlockTransfer(tracked.block_ids[index], keys)

    def _add_saves(self, meta: QuillCacheMetadata, tracked: _Tracked, computed: int) -> None:
        full = min(computed // self.block_size, len(tracked.keys) // self.parts)
        for index in range(tracked.saved_to, min(full, len(tracked.block_ids))):
            meta.saves.append(self._transfer(tracked, index))
            meta.flush = meta.flush or tracked.producer
        tracked.saved_to = max(tracked.saved_to, full)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        self._tracked.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        self._plans.pop(request.request_id, None)
        return False, None

    # --- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layers = list(kv_caches.items())
        # Where each layer's slice sits in a store block, and the block's size.
        spans, offset = [], 0
        for _, tensor in self._layers:
            size = self._slice(tensor, 0, 0).numel() * tensor.element_size()
            spans.append((offset, size))
            offset += size
        self._layer_spans, self._store_block_bytes = spans, offset
        # Touched once here, not by the first load (64 MB of first-touch page faults
        # took 20-30 ms of that load).
        self._staging = torch.zeros(STAGING_FIRST_BYTES, dtype=torch.uint8)
        shapes = {tuple(t.shape) for _, t in self._layers}
        logger.info("QuillCache connector: %d KV layers, shapes %s", len(self._layers), shapes)

    def _slice(self, tensor: torch.Tensor, block_id: int, part: int) -> torch.Tensor:
        """One index block of one engine block in a layer's [blocks, heads, tokens, ...]."""
        start = part * self.index_block
        return tensor[block_id, :, start : start + self.index_block]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, QuillCacheMetadata) or not self._layers:
            return
        for req_id, transfers in meta.async_loads.items():
            if self._loader is None:
                self._loader = ThreadPoolExecutor(1, thread_name_prefix="quillcache-load")
            self._loader.submit(self._load_in_background, req_id, transfers, meta.sources)
        if meta.loads:
            failed = self._load(meta.loads, meta.sources)
            with self._load_lock:
                self._load_errors |= failed

    def _load_in_background(
        self, req_id: str, transfers: list[BlockTransfer], sources: dict[str, str]
    ) -> None:
        failed = {t.block_id for t in transfers}
        try:
            failed = self._load(transfers, sources)
        except Exception:  # a failed load is recomputed, never a lost request
            logger.exception("background load for %s failed", req_id)
        finally:
            # Its failed blocks are reported no later than the request itself.
            with self._load_lock:
                self._load_errors |= failed
                self._loaded.add(req_id)
                self.pool.counters.requests_loaded_async += 1

    def _load(self, transfers: list[BlockTransfer], sources: dict[str, str]) -> set[int]:
        """Load `transfers` into the paged cache; the engine blocks that failed.

        The store blocks are received straight into a staging buffer (`Pool.load_into`
        with `into`: the data port's bytes land there, no copy in between), then each
        layer takes its slices of every engine block in one copy (`_place`). A copy per
        store block and layer (8 a store block here) made the load wait for the GIL at
        each: the worker's main thread holds it between its steps, and a load of 124
        blocks inside a running engine took 130-190 ms where the same bytes move in 50.
        Loads larger than the buffer go in pieces."""
        if not transfers:
            return set()
        started = time.perf_counter()
        per_engine_block = self.parts * self._store_block_bytes
        step = max(1, STAGING_BYTES // per_engine_block)
        failed: set[int] = set()
        with self._staging_lock:
            for start in range(0, len(transfers), step):
                failed |= self._load_piece(transfers[start : start + step], sources)
        self._timings.load(time.perf_counter() - started)
        return failed

    def _load_piece(self, transfers: list[BlockTransfer], sources: dict[str, str]) -> set[int]:
        size = self._store_block_bytes
        keys = [key for t in transfers for key in t.keys]
        if self._staging is None or self._staging.numel() < len(keys) * size:
            self._staging = torch.empty(len(keys) * size, dtype=torch.uint8)
        flat = self._staging.numpy()

        def into(i: int, nbytes: int) -> memoryview | None:
            return memoryview(flat[i * size : (i + 1) * size]) if nbytes == size else None

        def sink(i: int, view: memoryview) -> bool:
            if view.nbytes != size:
                return False  # not a block of this engine's layers: never trusted
            slot = flat[i * size : (i + 1) * size]
            got = np.frombuffer(view, dtype=np.uint8)
            if got.ctypes.data != slot.ctypes.data:  # came another way (gRPC): copy it in
                slot[:] = got
            return True

        taken = self.pool.load_into(keys, sink, sources, into)
        parts = self.parts
        whole = [all(taken[j * parts : (j + 1) * parts]) for j in range(len(transfers))]
        if any(whole):
            started = time.perf_counter()
            try:
                self._place(transfers, whole, len(keys) * size)
            except (RuntimeError, ValueError):  # a layout this copy does not know
                logger.exception("placing %d loaded blocks failed: recomputed", len(keys))
                whole = [False] * len(transfers)
            # A load's time is until its bytes are in the paged cache.
            placed = time.perf_counter() - started
            self.pool.counters.load_seconds += placed
            self.pool.counters.place_seconds += placed
        return {t.block_id for t, ok in zip(transfers, whole, strict=True) if not ok}

    def _place(self, transfers: list[BlockTransfer], whole: list[bool], nbytes: int) -> None:
        """Copy the staged store blocks of every engine block marked `whole` into each
        layer, one copy a layer. A store block holds, layer after layer, its tokens'
        slice of the layer ([kv_heads, index_block, ...])."""
        n, parts = len(transfers), self.parts
        staged = self._staging[:nbytes].view(n, parts, self._store_block_bytes)
        rows = [j for j, ok in enumerate(whole) if ok]
        ids = torch.tensor([transfers[j].block_id for j in rows], dtype=torch.long)
        pick = None if len(rows) == n else torch.tensor(rows, dtype=torch.long)
        for (_, tensor), (offset, size) in zip(self._layers, self._layer_spans, strict=True):
            heads, rest = tensor.shape[1], tuple(tensor.shape[3:])
            piece = staged[:, :, offset : offset + size].view(tensor.dtype)
            piece = piece.view(n, parts, heads, self.index_block, *rest)
            piece = piece.permute((0, 2, 1, 3, *range(4, 4 + len(rest))))
            if pick is not None:
                piece = piece[pick]
            # The layer seen as [blocks, heads, parts, index_block, ...]: the staged
            # pieces go in by one strided copy, with no reshaped copy between.
            target = tensor.view(tensor.shape[0], heads, parts, self.index_block, *rest)
            target.index_copy_(0, ids, piece)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every layer was loaded in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # the blocks are copied out once the forward pass is done (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, QuillCacheMetadata) or not meta.saves or not self._layers:
            return
        started = time.perf_counter()
        blocks = []
        for transfer in meta.saves:
            for part, key in enumerate(transfer.keys):
                # One copy out of the paged cache, into the buffer the writer sends.
                slices = [self._slice(t, transfer.block_id, part) for _, t in self._layers]
                out = torch.empty(
                    sum(x.numel() * x.element_size() for x in slices), dtype=torch.uint8
                )
                offset = 0
                for piece in slices:
                    size = piece.numel() * piece.element_size()
                    out[offset : offset + size].view(piece.dtype).view(piece.shape).copy_(piece)
                    offset += size
                blocks.append((key, memoryview(out.numpy())))
        self.pool.counters.copy_out_seconds += time.perf_counter() - started
        self.pool.save_later(blocks)
        if meta.flush and not self.pool.flush(self.pool.timeout_s):
            logger.warning(
                "a prefill's KV is not all in the store after %.0fs", self.pool.timeout_s
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._load_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(no sends of ours are asynchronous, the requests whose background loads are
        done, failed blocks and all: vLLM then schedules them)."""
        with self._load_lock:
            loaded, self._loaded = self._loaded, set()
        return None, loaded or None

    # --- statistics for vLLM's /metrics (metrics.py) ------------------------------------

    def get_kv_connector_stats(self) -> metrics.ConnectorStats | None:
        return self._timings.drain()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> metrics.ConnectorStats:
        return metrics.ConnectorStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return metrics.prom_metrics(metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if self._metrics is not None:
            self._metrics.shutdown()
        self.pool.close()
