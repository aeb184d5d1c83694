"""Conductor gRPC servicer: proto <-> domain translation only."""

from __future__ import annotations

import heapq
import logging
import time

import grpc

from quillcache.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from quillcache_conductor.events import EventRouter, SourceRefused
from quillcache_conductor.split import plan_split, transfer_measured
from quillcache_conductor.standby import Standby
from quillcache_conductor.state import ConductorState, publishes_events
from quillcache_core.errors import InvalidArgument, QuillCacheError
from quillcache_core.identity.chain import BlockChain, chain_keys
from quillcache_core.model import IdentityScope, KvBlockKey, RequestShape, SloTarget
from quillcache_core.process.metrics import Histogram
from quillcache_core.routing.actions import ActionKind, action_runs
from quillcache_core.rpc.server import status_for, unary_errors
from quillcache_core.security.tls import peer_identity
from quillcache_core.wire.plan import HASH_BYTES, digest_count, unpack_hashes
from quillcache_core.wire.tiers import TIER_TO_PROTO

logger = logging.getLogger(__name__)

# Keyed by member name: an Enum's own __hash__ is a Python-level call, slow per block.
KIND_TO_PROTO = {
    ActionKind.LOCAL_HIT.name: conductor_pb2.BlockAction.LOCAL_HIT,
    ActionKind.FETCH.name: conductor_pb2.BlockAction.FETCH,
    ActionKind.RECOMPUTE.name: conductor_pb2.BlockAction.RECOMPUTE,
}
OUTCOME_NAMES = {
    conductor_pb2.FinishRequest.SUCCESS: "success",
    conductor_pb2.FinishRequest.ERROR: "error",
    conductor_pb2.FinishRequest.CANCELLED: "cancelled",
}


def scope_from_proto(identity: common_pb2.Identity) -> IdentityScope:
    """The reuse scope of a request; the cache salt, when set, is the tenant's partition."""
    if not identity.model_id:
        raise InvalidArgument("identity.model_id is required")
    if not identity.tokenizer_id:
        raise InvalidArgument("identity.tokenizer_id is required")
    if not identity.tenant_id:
        raise InvalidArgument("identity.tenant_id is required")
    adapter = identity.adapter_id if identity.HasField("adapter_id") else None
    return IdentityScope(
        identity.model_id, identity.tokenizer_id, adapter or None, identity.tenant_id
    )


def _cost_key(cost) -> float:
    return cost.cost_us


def _cost_to_proto(cost) -> conductor_pb2.EngineCost:
    return conductor_pb2.EngineCost(
        engine_id=cost.engine_id,
        cost_us=cost.cost_us,
        est_ttft_us=cost.est_ttft_us,
        queue_us=cost.queue_us,
        fetch_us=cost.fetch_us,
        prefill_us=cost.prefill_us,
        decode_us=cost.decode_us,
        prefix_blocks=cost.prefix_blocks,
        hit_blocks=cost.hit_blocks,
        fetch_blocks=cost.fetch_blocks,
        score=cost.score,
    )


class ConductorServicer(conductor_pb2_grpc.ConductorServicer):
    def __init__(
        self,
        state: ConductorState,
        events: EventRouter,
        max_blocks: int,
        alternatives: int = 8,
        *,
        plan_seconds: Histogram | None = None,
        standby: Standby | None = None,
    ) -> None:
        self.state = state
        # Told of each Plan and Locate; its wait is what IngestKvEvents replies advise.
        self.standby = standby or Standby(0.0, lambda: False)
        self.plan_seconds = plan_seconds  # each plan's time, observed here (or not)
        self.alternatives = alternatives
        # host:port of the plan port, reported by Stats ("" = none).
        self.plan_address = ""
        # PlanStream messages received and the calls they carried (calls per message
        # is how well clients batch).
        self.stream_messages = 0
        self.stream_calls = 0
        self.events = events
        self.max_blocks = max_blocks

    def _keys(self, scope: IdentityScope, refs, what: str) -> list[KvBlockKey]:
        """Keys of a request's blocks in order; each block's parent is the previous one.

        A block's token_count defaults to 16 (vLLM's block size) when the caller omits it.
        """
        self._check_count(len(refs), what)
        hashes = [ref.block_hash for ref in refs]
        if not all(hashes):
            raise InvalidArgument(f"{what}: blocks[{hashes.index('')}].block_hash is empty")
        return chain_keys(scope, hashes, token_counts=[ref.token_count or 16 for ref in refs])

    def _packed_keys(self, scope: IdentityScope, packed: bytes, tokens: int, what: str):
        """The keys of the chain a caller sent as packed digests (the gateway's)."""
        chain = BlockChain(scope, tokens or 16, packed)
        self._check_count(len(chain), what)
        return chain.keys()

    def _records_observed(self, reservation_id: str) -> bool:
        """Whether a Finish's observed blocks would be recorded: its reservation is open
        and its engine does not publish KV events (ConductorState.observe)."""
        res = self.state.reservations.get(reservation_id)
        info = None if res is None else self.state.engines.get(res.engine_id)
        return info is not None and not publishes_events(info.record)

    def _check_count(self, count: int, what: str) -> None:
        if count > self.max_blocks:
            raise InvalidArgument(f"{what}: {count} blocks exceed the limit of {self.max_blocks}")

    @unary_errors
    async def Plan(self, request, context):
        return self.plan(request)

    def plan(self, request) -> conductor_pb2.PlanResponse:
        """One Plan, for the unary RPC and the stream alike."""
        start = time.perf_counter()
        self.standby.served()
        scope = scope_from_proto(request.identity)
        if request.packed_hashes:
            if request.blocks:
                raise InvalidArgument("set blocks or packed_hashes, not both")
            keys = self._packed_keys(scope, request.packed_hashes, request.block_tokens, "Plan")
            block_bytes = request.block_bytes or self.state.default_block_bytes
            total = len(keys) * (request.block_tokens or 16)
        else:
            if not request.blocks and request.prompt_tokens == 0:
                raise InvalidArgument("blocks is empty and prompt_tokens is 0: nothing to plan")
            keys = self._keys(scope, request.blocks, "Plan")
            block_bytes = (
                request.blocks[0].bytes
                if request.blocks and request.blocks[0].bytes
                else self.state.default_block_bytes
            )
            total = sum(key.token_count for key in keys)
        slo = SloTarget(ttft_ms=request.slo.ttft_ms or 800, tpot_ms=request.slo.tpot_ms or 80)
        shape = RequestShape(
            id=request.request_id or "",
            model_id=scope.model_id,
            tokenizer_id=scope.tokenizer_id,
            adapter_id=scope.adapter_id,
            tenant_id=scope.tenant_id,
            blocks=tuple(keys),
            estimated_decode_tokens=request.expected_decode_tokens,
            slo=slo,
            prompt_tokens=request.prompt_tokens,
            block_bytes=block_bytes,
            block_tokens_total=total,
            max_others=request.max_others if request.HasField("max_others") else None,
        )
        outcome = plan_split(
            self.state,
            shape,
            request.exclude_engines,
            request.disagg or "auto",
            first_token_reported=request.reports_first_token,
        )
        decision = outcome.decision
        chosen = decision.chosen
        request_blocks = shape.blocks
        reply = conductor_pb2.PlanResponse(
            reservation_id=outcome.reservation_id,
            engine_id=decision.engine.id,
            engine_base_url=decision.engine.base_url,
            est_ttft_ms=decision.chosen.est_ttft_us / 1000.0,
            chosen=_cost_to_proto(decision.chosen),
            others=[
                _cost_to_proto(c)
                for c in heapq.nsmallest(
                    self.alternatives
                    if shape.max_others is None
                    else min(self.alternatives, shape.max_others),
                    decision.others,
                    key=_cost_key,
                )
            ],
            refusals=[
                conductor_pb2.Refusal(
                    block_index=r.block_index,
                    block_hash=r.block_hash,
                    worker_id=r.worker_id,
                    reason=r.reason,
                )
                for r in decision.refusals
            ],
            policy=decision.policy,
            # Every policy's `chosen` is our estimate of its actions: exact counts.
            hit_blocks=chosen.hit_blocks,
            fetch_blocks=chosen.fetch_blocks,
            recompute_blocks=len(request_blocks) - chosen.prefix_blocks,
            index_behind_ms=self.events.behind_ms(decision.engine.id),
        )
        if request.action_runs:
            self._add_runs(reply, decision.actions, request_blocks)
        else:
            self._add_actions(reply, decision.actions)
        if outcome.split is not None:
            self._add_split(reply, outcome)
        elapsed_s = time.perf_counter() - start
        reply.plan_us = int(elapsed_s * 1e6)
        if self.plan_seconds is not None:
            self.plan_seconds.observe(elapsed_s)
        return reply

    def _add_split(self, reply, outcome) -> None:
        """Prefill/decode disaggregation: the plan's prefill engine, and why (or why not)."""
        split = outcome.split
        reply.disagg = "split" if split.split else "colocated"
        reply.disagg_reason = split.reason
        if not split.split or split.prefill is None:
            return
        reply.prefill_engine_id = split.prefill.id
        reply.prefill_engine_base_url = split.prefill.base_url
        reply.prefill_reservation_id = outcome.prefill_reservation_id
        reply.prefill_store_node = split.prefill.store_node_id or ""
        reply.decode_store_node = outcome.decision.engine.store_node_id or ""

    def _source(self, action) -> dict:
        if not action.source_node:
            return {}
        node = self.state.stores.get(action.source_node)
        return {
            "source_node": action.source_node,
            "source_address": node.address if node is not None else "",
            "source_tier": TIER_TO_PROTO[action.source_tier],
        }

    def _add_actions(self, reply, actions) -> None:
        # repeated.add() is about twice as fast as building each message first.
        add = reply.actions.add
        for action in actions:
            add(
                kind=KIND_TO_PROTO[action.kind._name_],
                block_index=action.block_index,
                block_hash=action.block_hash,
                cost_us=int(action.cost_us),
                **self._source(action),
            )

    def _add_runs(self, reply, actions, blocks) -> None:
        """One action per run of blocks with the same kind, source node and tier."""
        add = reply.actions.add
        for run in action_runs(actions):
            add(
                kind=KIND_TO_PROTO[run.kind._name_],
                block_index=run.first,
                block_hash=blocks[run.first].block_hash,
                block_count=run.count,
                cost_us=int(run.cost_us),
                **self._source(run),
            )

    @unary_errors
    async def Finish(self, request, context):
        return self.finish(request)

    def finish(self, request) -> conductor_pb2.FinishResponse:
        """One Finish, for the unary RPC and the stream alike."""
        if not request.reservation_id:
            raise InvalidArgument("reservation_id is required")
        if request.outcome == conductor_pb2.FinishRequest.PREFILLED:
            if not request.ttft_ms > 0:
                raise InvalidArgument("PREFILLED needs the measured ttft_ms")
            released = self.state.prefilled(request.reservation_id, request.ttft_ms / 1000)
            return conductor_pb2.FinishResponse(released=released)
        outcome = OUTCOME_NAMES.get(request.outcome)
        if outcome is None:
            raise InvalidArgument("outcome must be SUCCESS, ERROR, CANCELLED or PREFILLED")
        observe = None
        if outcome == "success":
            if request.observe_packed_hashes:
                if request.observe_blocks:
                    raise InvalidArgument("set observe_blocks or observe_packed_hashes, not both")
                scope = scope_from_proto(request.identity)
                packed = request.observe_packed_hashes
                if self._records_observed(request.reservation_id):
                    observe = self._packed_keys(
                        scope, packed, request.observe_block_tokens, "Finish"
                    )
                else:  # its engine's events are the truth: checked, never built
                    self._check_count(digest_count(packed), "Finish")
            elif request.observe_blocks:
                observe = self._keys(
                    scope_from_proto(request.identity), request.observe_blocks, "Finish"
                )
        if request.transfer_bytes_per_s > 0:
            transfer_measured(
                self.state,
                request.transfer_bytes,
                request.transfer_bytes_per_s,
                request.transfer_blocks,
            )
        engine_id = self.state.finish(
            request.reservation_id,
            outcome,
            promote=not observe,
            ttft_s=request.ttft_ms / 1000,
            **(self._delivered(request) if outcome == "success" else {}),
        )
        if observe and engine_id in self.state.engines:
            self.state.observe(engine_id, observe)
        return conductor_pb2.FinishResponse(released=True)

    def _delivered(self, request) -> dict:
        """What the engine's delivered cached tokens correct (ConductorState.finish's
        `lost_hashes` and `held_keys`), read off the Finish's observed blocks."""
        if not request.HasField("delivered_cached_tokens") or not request.observe_packed_hashes:
            return {}
        block_tokens = request.observe_block_tokens or 16
        lost, held = self.state.delivered_blocks(
            request.reservation_id, request.delivered_cached_tokens // block_tokens
        )
        packed = request.observe_packed_hashes
        if held:
            scope = scope_from_proto(request.identity)
            chain = BlockChain(scope, block_tokens, packed[: held.stop * HASH_BYTES])
            return {"held_keys": chain.keys()[held.start :]}
        lost_packed = packed[lost.start * HASH_BYTES : lost.stop * HASH_BYTES]
        return {"lost_hashes": unpack_hashes(lost_packed)}

    async def PlanStream(self, request_iterator, context):
        """Plan and Finish calls over one stream; each call fails or succeeds alone.

        All calls of one message are answered in one message, in order. A call's
        failure is its result (a CallError with the unary RPC's status code); the
        stream itself ends only when the client closes it.
        """
        async for message in request_iterator:
            self.stream_messages += 1
            self.stream_calls += len(message.calls)
            yield self.handle_calls(message)

    def handle_calls(self, message) -> conductor_pb2.PlanStreamResponse:
        """Answer one PlanStreamRequest (from PlanStream or the plan port)."""
        reply = conductor_pb2.PlanStreamResponse()
        add = reply.results.add
        for call in message.calls:
            which = call.WhichOneof("call")
            try:
                if which == "plan":
                    add(call_id=call.call_id, plan=self.plan(call.plan))
                elif which == "finish":
                    add(call_id=call.call_id, finish=self.finish(call.finish))
                else:
                    raise InvalidArgument("a PlanCall needs plan or finish")
            except QuillCacheError as exc:
                add(
                    call_id=call.call_id,
                    error=conductor_pb2.CallError(code=status_for(exc).value[0], message=str(exc)),
                )
            except Exception:
                logger.exception("%s call failed", which)
                add(
                    call_id=call.call_id,
                    error=conductor_pb2.CallError(
                        code=grpc.StatusCode.INTERNAL.value[0],
                        message=f"{which}: internal error",
                    ),
                )
        return reply

    @unary_errors
    async def Observe(self, request, context):
        if not request.engine_id:
            raise InvalidArgument("engine_id is required")
        scope = scope_from_proto(request.identity)
        keys = self._keys(scope, request.blocks, "Observe")
        return conductor_pb2.ObserveResponse(recorded=self.state.observe(request.engine_id, keys))

    @unary_errors
    async def Locate(self, request, context):
        self.standby.served()
        scope = scope_from_proto(request.identity)
        if len(request.block_hashes) > self.max_blocks:
            raise InvalidArgument(
                f"Locate: {len(request.block_hashes)} hashes exceed the limit of {self.max_blocks}"
            )
        found = self.state.locate(scope, list(request.block_hashes))
        return conductor_pb2.LocateResponse(
            blocks=[
                conductor_pb2.BlockLocations(
                    block_hash=h,
                    locations=[
                        conductor_pb2.Location(node_id=n, address=a, tier=TIER_TO_PROTO[t], kind=k)
                        for n, a, t, k in places
                    ],
                )
                for h, places in zip(request.block_hashes, found, strict=True)
            ]
        )

    @unary_errors
    async def IngestKvEvents(self, request, context):
        if not request.engine_id:
            raise InvalidArgument("engine_id is required")
        caller = peer_identity(context)
        if caller is not None:  # None: a plaintext (--insecure) conductor
            try:
                self.events.check_source(request, caller)
            except SourceRefused as exc:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        applied, errors = self.events.ingest_proto(request)
        return conductor_pb2.IngestResponse(
            applied=applied,
            rejected=len(errors),
            errors=[f"event {e.index}: {e.reason}: {e.detail}" for e in errors][:100],
            linger_ms=self.standby.linger_ms(),
        )

    @unary_errors
    async def Stats(self, request, context):
        state = self.state
        state.tick()
        metrics = state.index.metrics()
        return conductor_pb2.StatsResponse(
            policy=state.policy.name,
            index_backend=state.index.name,
            resident_records=metrics.resident_blocks,
            resident_bytes=metrics.resident_bytes,
            plans=state.counters.plans,
            events_applied=self.events.applied_total(),
            events_rejected=self.events.rejected_total(),
            reservations_open=len(state.reservations),
            reservations_expired=state.counters.reservations_expired,
            guard_refusals=state.counters.guard_refusals,
            plan_address=self.plan_address,
            block_tokens=state.block_tokens,
            engines=[
                conductor_pb2.EngineStats(
                    engine_id=info.state.id,
                    base_url=info.state.base_url,
                    locality_domain=info.state.locality_domain,
                    inflight_requests=info.state.inflight_requests,
                    queued_prefill_tokens=info.state.queued_prefill_tokens,
                    resident_blocks=state.index.worker_block_count(info.state.id),
                    store_node=info.state.store_node_id or "",
                    model=info.record.model or "",
                    tokenizer=info.record.tokenizer or "",
                    role=info.record.role,
                    block_size=info.record.block_size or 0,
                )
                for info in sorted(state.engines.values(), key=lambda i: i.state.id)
            ],
        )

    @unary_errors
    async def Drain(self, request, context):
        if not request.engine_id:
            raise InvalidArgument("engine_id is required")
        info = self.state.drain(request.engine_id)
        return conductor_pb2.DrainResponse(
            engine_id=request.engine_id,
            inflight_requests=info.state.inflight_requests,
            state=self.state.drains.state_of(info.record),
        )
