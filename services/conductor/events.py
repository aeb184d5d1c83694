"""KV events into the residency index, from every source, counted per engine and reason.

Engines' events arrive over ZMQ (one subscriber per engine found in the registry) or
as a gRPC KvEventBatch; both go through the engine's translator, which maps the
engine's opaque hashes to ours. Store nodes' events carry our own hashes and keys
and are applied directly. A bad event is counted (engine, reason) on /metrics and
logged; the other events of its batch still apply.

Who may report what over gRPC (`check_source`). Stores report their own residency
(`store` certificates, source "store", their node id); engines publish over ZMQ, taken
from the sockets their own registry records name, and no engine calls IngestKvEvents,
so a gRPC batch of engine events is taken only from that engine's own certificate (one
naming it as its instance). A certificate naming an instance speaks for that node alone;
a store certificate of the whole role (`quillcache certs`) for any store node. Either
way only for a node the registry lists. A batch that fails is refused whole and
counted (`kv_event_batches_refused_total{source,reason}`).

A plan reports how far this replica's view of its engine trails the engine
(`behind_ms`, from the engine's ZMQ subscriber: see zmq_sub.StreamFreshness); an engine
whose events do not come over ZMQ counts as current.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from quillcache.v1 import conductor_pb2
from quillcache_conductor.state import ConductorState
from quillcache_conductor.zmq_sub import EngineSubscriber
from quillcache_core.errors import InvalidArgument, NotFound, QuillCacheError
from quillcache_core.identity.keys import identity_tokenizer
from quillcache_core.kvevents.bulk import BulkBatch
from quillcache_core.kvevents.events import (
    DecodedBatch,
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    EventError,
)
from quillcache_core.kvevents.translate import EngineEventTranslator
from quillcache_core.model import CacheTier, IdentityScope
from quillcache_core.process.metrics import LATENCY_BUCKETS_S, MetricsRegistry
from quillcache_core.registry import NodeRecord
from quillcache_core.security.tls import PeerIdentity

logger = logging.getLogger(__name__)

MAX_BLOCK_SIZE = 4096


class SourceRefused(QuillCacheError):
    """The caller may not report this batch's events (PERMISSION_DENIED)."""


class EventRouter:
    def __init__(
        self,
        state: ConductorState,
        metrics: MetricsRegistry,
        *,
        subscribe_zmq: bool,
        linger: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.state = state
        self.subscribe_zmq = subscribe_zmq
        self.linger = linger  # a standby's wait before each wake-up's batches (standby.py)
        self.translators: dict[str, EngineEventTranslator] = {}
        self.subscribers: dict[str, EngineSubscriber] = {}
        self._endpoints: dict[str, tuple[str, str | None]] = {}
        self.applied = metrics.counter("kv_events_applied_total", "KV events applied", ["source"])
        self.rejected = metrics.counter(
            "kv_events_rejected_total",
            "KV events rejected, by engine and reason",
            ["engine", "reason"],
        )
        self.batches = metrics.counter(
            "kv_event_batches_total", "KV event batches received", ["via"]
        )
        self.refused = metrics.counter(
            "kv_event_batches_refused_total",
            "gRPC KV event batches refused whole, by the kind of node they claim and reason",
            ["source", "reason"],
        )
        self.lag = metrics.histogram(
            "kv_event_lag_seconds",
            "a KV event batch's timestamp (set by the engine or store) to its events "
            "applied here, once per batch, by the kind of node that sent it",
            LATENCY_BUCKETS_S,
            ["source"],
        )
        metrics.gauge(
            "kv_subscribers",
            "engines whose ZMQ KV events are subscribed",
            read=lambda: [((), len(self.subscribers))],
        )

    # --- totals ----------------------------------------------------------------------

    def applied_total(self) -> int:
        return int(sum(v for _, v in self.applied.samples()))

    def rejected_total(self) -> int:
        return int(sum(v for _, v in self.rejected.samples()))

    # --- engines -----------------------------------------------------------------------

    def translator(
        self, engine_id: str, model_id: str = "", tokenizer_id: str = ""
    ) -> EngineEventTranslator:
        """The engine's translator; its identity comes from its registry record.

        A record (or batch identity) with no tokenizer means the model's own, as in
        `identity.keys.block_identity`."""
        current = self.translators.get(engine_id)
        info = self.state.engines.get(engine_id)
        model = (info.record.model if info else None) or model_id
        tokenizer = identity_tokenizer(
            model, (info.record.tokenizer if info else None) or tokenizer_id
        )
        if not model:
            raise InvalidArgument(
                f"engine {engine_id!r} has no model: register it with one, "
                "or send it in the batch identity"
            )
        if current is not None and (current.model_id, current.tokenizer_id) == (model, tokenizer):
            return current
        translator = EngineEventTranslator(
            self.state.index,
            engine_id,
            model,
            tokenizer,
            bytes_per_block=self.state.default_block_bytes,
            block_tokens=self.state.block_tokens,
            engine_block_tokens=info.record.block_size if info else 0,
            on_released=lambda block_hash: self.state.overlay_released(engine_id, block_hash),
        )
        self.translators[engine_id] = translator
        return translator

    def engine_joined(self, record: NodeRecord) -> None:
        if not self.subscribe_zmq or not record.kv_events_endpoint:
            return
        endpoints = (record.kv_events_endpoint, record.kv_replay_endpoint or None)
        if self._endpoints.get(record.id) == endpoints and record.id in self.subscribers:
            return
        old = self.subscribers.pop(record.id, None)
        if old is not None:
            asyncio.get_running_loop().create_task(old.stop())
        subscriber = EngineSubscriber(
            record.id,
            endpoints[0],
            endpoints[1],
            on_batch=self._on_zmq_batch,
            on_error=self._on_zmq_error,
            on_reset=self._on_reset,
            on_lost=self._on_lost,
            linger=self.linger,
        )
        subscriber.start()
        self.subscribers[record.id] = subscriber
        self._endpoints[record.id] = endpoints
        logger.info("subscribed to %s KV events at %s (replay %s)", record.id, *endpoints)

    def engine_restarted(self, engine_id: str) -> None:
        """The engine's hashes from before are gone with its cache: forget them."""
        translator = self.translators.get(engine_id)
        if translator is not None:
            translator.reset()

    def engine_left(self, engine_id: str) -> None:
        self.translators.pop(engine_id, None)
        self._endpoints.pop(engine_id, None)
        subscriber = self.subscribers.pop(engine_id, None)
        if subscriber is not None:
            asyncio.get_running_loop().create_task(subscriber.stop())

    async def close(self) -> None:
        for subscriber in list(self.subscribers.values()):
            with contextlib.suppress(Exception):
                await subscriber.stop()
        self.subscribers.clear()

    def behind_ms(self, engine_id: str) -> int:
        """How far this replica's residency for `engine_id` trails the engine, ms (0 =
        current, or its events do not come over ZMQ). A dict lookup: for the plan path."""
        subscriber = self.subscribers.get(engine_id)
        return 0 if subscriber is None else subscriber.freshness.behind_ms(time.monotonic())

    # --- ZMQ callbacks -------------------------------------------------------------------

    def _on_zmq_batch(self, engine_id: str, seq: int, batch: BulkBatch) -> None:
        self.batches.inc(via="zmq")
        if engine_id not in self.state.engines:
            return  # left meanwhile
        try:
            translator = self.translator(engine_id)
        except InvalidArgument as exc:
            self._reject(
                engine_id, EventError(-1, "no_identity", str(exc)), seq, count=batch.event_count
            )
            return
        result = translator.apply(batch)
        self.applied.inc(result.applied, source="engine")
        if batch.ts:
            lag_s = max(0.0, time.time() - batch.ts)
            self.lag.observe(lag_s, source="engine")
            subscriber = self.subscribers.get(engine_id)
            if subscriber is not None:
                subscriber.freshness.applied(lag_s)
        # The subscriber already reported the decoder's errors through _on_zmq_error.
        for error in result.rejected[len(batch.errors) :]:
            self._reject(engine_id, error, seq)

    def _on_zmq_error(self, engine_id: str, seq: int | None, reason: str, detail: str) -> None:
        self.rejected.inc(engine=engine_id, reason=reason)

    def _on_reset(self, engine_id: str) -> None:
        self._drop_records(engine_id, "restarted its publisher")

    def _on_lost(self, engine_id: str, missing: int) -> None:
        """Batches that neither came nor replayed: the engine's records are no longer
        trusted (one of them may be a BlockRemoved), so they go; its next events relearn."""
        self._drop_records(engine_id, f"lost {missing} event batches")

    def _drop_records(self, engine_id: str, why: str) -> None:
        translator = self.translators.get(engine_id)
        if translator is not None:
            dropped = translator.reset()
            logger.warning("engine %s %s: dropped its %d records", engine_id, why, dropped)

    def _reject(self, engine_id: str, error: EventError, seq: int | None, count: int = 1) -> None:
        self.rejected.inc(count, engine=engine_id, reason=error.reason)
        logger.warning(
            "rejected KV event %d of batch seq=%s from %s: %s (%s)",
            error.index,
            seq,
            engine_id,
            error.reason,
            error.detail,
        )

    # --- gRPC ingest ------------------------------------------------------------------

    def check_source(self, batch: conductor_pb2.KvEventBatch, caller: PeerIdentity) -> None:
        """Raise SourceRefused unless `caller` may report `batch` (see the module doc);
        counted. The node's registration is `ingest_proto`'s check."""
        source = _source(batch)
        node = batch.engine_id
        if caller.role != source:
            reason, detail = "role", f"a {caller.role} certificate may not report {source} events"
        elif caller.instance and caller.instance != node:
            reason, detail = "other_instance", f"{caller.instance} may not report for {node!r}"
        elif source == "engine" and not caller.instance:
            reason, detail = "no_instance", f"only engine {node!r}'s own certificate may"
        else:
            return
        self.batches.inc(via="grpc")
        self.refused.inc(source=source, reason=reason)
        logger.warning("refused a KV event batch for %r from %s: %s", node, caller, detail)
        raise SourceRefused(detail)

    def ingest_proto(self, batch: conductor_pb2.KvEventBatch) -> tuple[int, list[EventError]]:
        """Apply a gRPC KvEventBatch; returns (applied, rejected events). NotFound,
        nothing applied, for a node the registry does not list."""
        self.batches.inc(via="grpc")
        source = _source(batch)
        nodes = self.state.stores if source == "store" else self.state.engines
        if batch.engine_id not in nodes:
            self.refused.inc(source=source, reason="unregistered")
            raise NotFound(f"{source} {batch.engine_id!r} is not registered")
        if source == "store":
            applied, errors = self._store_batch(batch)
        else:
            applied, errors = self._engine_batch(batch)
        self.applied.inc(applied, source=source)
        if batch.ts_ms:
            self.lag.observe(max(0.0, time.time() - batch.ts_ms / 1000), source=source)
        for error in errors:
            self._reject(batch.engine_id, error, batch.sequence)
        return applied, errors

    def _engine_batch(self, batch) -> tuple[int, list[EventError]]:
        identity = batch.identity
        translator = self.translator(batch.engine_id, identity.model_id, identity.tokenizer_id)
        decoded = DecodedBatch(ts=batch.ts_ms / 1000.0 if batch.ts_ms else None, dp_rank=None)
        for index, event in enumerate(batch.events):
            try:
                decoded.events.append(_engine_event(event))
                decoded.positions.append(index)
            except InvalidArgument as exc:
                decoded.errors.append(
                    EventError(index, getattr(exc, "reason", "bad_event"), str(exc))
                )
        result = translator.apply(decoded)
        return result.applied, result.rejected

    def _store_batch(self, batch) -> tuple[int, list[EventError]]:
        node = batch.engine_id
        applied = 0
        errors: list[EventError] = []
        for index, event in enumerate(batch.events):
            try:
                which = event.WhichOneof("event")
                if which == "stored":
                    stored = event.stored
                    ident = stored.identity if stored.HasField("identity") else batch.identity
                    scope = _scope(ident)
                    tier = _tier(stored.medium, CacheTier.CPU_DRAM)
                    _check_hashes(stored.block_hashes)
                    self.state.store_blocks_stored(
                        node,
                        scope,
                        list(stored.block_hashes),
                        stored.parent_block_hash,
                        stored.first_block_index,
                        stored.block_size or 16,
                        tier,
                        stored.bytes_per_block or batch.bytes_per_block,
                    )
                elif which == "removed":
                    removed = event.removed
                    _check_hashes(removed.block_hashes)
                    tier = _tier(removed.medium, CacheTier.CPU_DRAM)
                    self.state.store_blocks_removed(node, list(removed.block_hashes), tier)
                elif which == "cleared":
                    self.state.index.clear_worker(node)
                else:
                    raise InvalidArgument("event has no stored/removed/cleared")
                applied += 1
            except InvalidArgument as exc:
                errors.append(EventError(index, "bad_event", str(exc)))
        return applied, errors


def _source(batch) -> str:
    """The kind of node a batch reports for: "engine" (the default) or "store"."""
    if batch.source_kind not in ("", "engine", "store"):
        raise InvalidArgument(f"source_kind must be 'engine' or 'store', got {batch.source_kind!r}")
    return batch.source_kind or "engine"


def _scope(identity) -> IdentityScope:
    if not (identity.model_id and identity.tokenizer_id and identity.tenant_id):
        raise InvalidArgument("store event identity needs model_id, tokenizer_id and tenant_id")
    adapter = identity.adapter_id if identity.HasField("adapter_id") else None
    return IdentityScope(
        identity.model_id, identity.tokenizer_id, adapter or None, identity.tenant_id
    )


def _tier(medium: str, default: CacheTier) -> CacheTier:
    return CacheTier.parse(medium) if medium else default


def _check_hashes(hashes) -> None:
    if not hashes:
        raise InvalidArgument("block_hashes is empty")
    if any(not h for h in hashes):
        raise InvalidArgument("a block hash is empty")


def _engine_event(event):
    """A gRPC engine event as the decoder's dataclass; hashes are opaque strings."""
    which = event.WhichOneof("event")
    if which == "stored":
        stored = event.stored
        _check_hashes(stored.block_hashes)
        size = stored.block_size
        if not 0 < size <= MAX_BLOCK_SIZE:
            raise InvalidArgument(f"block_size must be in 1..{MAX_BLOCK_SIZE}, got {size}")
        if len(stored.token_ids) != size * len(stored.block_hashes):
            raise InvalidArgument(
                f"{len(stored.token_ids)} token_ids for {len(stored.block_hashes)} blocks of {size}"
            )
        return EngineBlockStored(
            block_hashes=tuple("s:" + h for h in stored.block_hashes),
            parent=("s:" + stored.parent_block_hash) if stored.parent_block_hash else None,
            token_ids=tuple(stored.token_ids),
            block_size=size,
            tier=_tier(stored.medium, CacheTier.HBM),
            lora_name=stored.lora_name or None,
            cache_salt=stored.cache_salt or None,
            group_idx=stored.group_idx if stored.HasField("group_idx") else None,
        )
    if which == "removed":
        removed = event.removed
        _check_hashes(removed.block_hashes)
        return EngineBlockRemoved(
            block_hashes=tuple("s:" + h for h in removed.block_hashes),
            tier=_tier(removed.medium, CacheTier.HBM),
            group_idx=removed.group_idx if removed.HasField("group_idx") else None,
        )
    if which == "cleared":
        return EngineAllCleared()
    raise InvalidArgument("event has no stored/removed/cleared")
