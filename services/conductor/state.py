"""The conductor's domain state: fleet, residency, reservations. No gRPC, no sockets.

Single-threaded by contract: the server calls it from its event loop only. The clock
and the random generator are injected, so tests drive time and ties.
"""

from __future__ import annotations

import logging
import random
import secrets
from collections.abc import Callable, Iterable, Sequence

from quillcache_conductor import overlay
from quillcache_conductor.drain import Drains
from quillcache_conductor.ledger import ReservationLedger
from quillcache_conductor.listener import ReservationListener
from quillcache_conductor.records import (
    OPTIMISTIC_LINGER_S,
    OUTCOMES,
    Counters,
    Departure,
    EngineInfo,
    PlanOutcome,
    Reservation,
)
from quillcache_core.errors import InvalidArgument, NodeUnavailable, NotFound
from quillcache_core.index.base import Chain, IndexBackend
from quillcache_core.model import (
    MIB,
    CacheResidency,
    CacheTier,
    IdentityScope,
    RequestShape,
    WorkerState,
)
from quillcache_core.registry import NodeRecord
from quillcache_core.routing import disagg
from quillcache_core.routing.calibrate import ModelSpeeds
from quillcache_core.routing.decide import plan_request
from quillcache_core.routing.policy import Fleet, PlanDecision, Policy

logger = logging.getLogger(__name__)

# A reported first token releases a plan's prefill; none: 4x its estimated TTFT + 2 s.
REPORTED_RELEASE = (4.0, 2.0)


class ConductorState:
    """Engines and store nodes (from the registry), the residency index, live load.

    Load is reserved at plan time: one in-flight request and running decode, the
    prefill tokens the plan leaves to compute, and the request's blocks. The prefill
    tokens are released when the estimated TTFT has passed (the engine has moved on to
    decoding), the rest at Finish or when the reservation expires.
    """

    def __init__(
        self,
        index: IndexBackend,
        policy: Policy,
        *,
        clock: Callable[[], float],
        rng: random.Random,
        reservation_ttl_s: float = 300.0,
        default_block_bytes: int = 2 * MIB,
        max_blocks_per_request: int = 16384,
        block_tokens: int = 16,
        optimistic_linger_s: float = OPTIMISTIC_LINGER_S,
        calibrate: bool = True,
    ) -> None:
        if reservation_ttl_s <= 0:
            raise InvalidArgument("reservation_ttl_s must be positive")
        self.index = index
        self.policy = policy
        self.clock = clock
        self.rng = rng
        self.reservation_ttl_s = reservation_ttl_s
        self.default_block_bytes = default_block_bytes
        self.max_blocks_per_request = max_blocks_per_request
        # The index's block size in tokens; engines with larger blocks are split into it.
        self.block_tokens = block_tokens
        # Engines whose blocks are several of ours -> how many (only those > 1).
        self.block_parts: dict[str, int] = {}
        self.engines: dict[str, EngineInfo] = {}
        self.stores: dict[str, NodeRecord] = {}
        # Block hash -> optimistic records of open reservations: what a planned request
        # is about to put in its engine's HBM, visible to the next plans at once.
        # Kept beside the index because most are taken back or replaced by the
        # engine's own events within seconds, and an overlay entry costs a tenth
        # of an index record.
        self.optimistic: dict[str, list[CacheResidency]] = {}
        # Finished reservations whose overlay records wait for the engine's events:
        # (forget at, reservation), in Finish order.
        self.optimistic_linger_s = optimistic_linger_s
        # This replica's open reservations, the load they hold, their overlay records.
        self.ledger = ReservationLedger(
            self.optimistic, resolve=self._engine_worker, on_release=self._released
        )
        # Eligible engines per (model, excluded engines); dropped on any join or leave.
        self._fleets: dict[tuple[str, tuple[str, ...]], Fleet] = {}
        self.counters = Counters()
        # Engine id -> the registry start time its records were written under.
        self._epochs: dict[str, float] = index.worker_epochs()
        # (kind, id) -> a node in its leave grace (`node_left`).
        self.departures: dict[tuple[str, str], Departure] = {}
        # Prefill/decode disaggregation (split.py): knobs and measured store bandwidth.
        self.disagg_settings = disagg.DisaggSettings()
        self.bandwidth = disagg.Bandwidth(self.disagg_settings.default_bytes_per_s)
        # Told of each reservation opened and closed (the replicas' sync), if set.
        self.listener: ReservationListener | None = None
        # Brings the other replicas' reservations up to now (`PeerLoad.release_due`),
        # if set: a plan weighs every ledger as it is at its own time, not the last tick.
        self.release_peers: Callable[[], object] | None = None
        # The engines' prefill speed per model, learned from Finish's TTFT
        # (routing/calibrate.py); the policy prices each plan with its model's.
        self.speeds = ModelSpeeds(policy.cost_model) if calibrate else None
        # Engines the planner leaves out while they drain (drain.py).
        self.drains = Drains()

    # --- fleet -------------------------------------------------------------------

    def engine_joined(self, record: NodeRecord) -> bool:
        """Add or update an engine. Returns True if its record names a new run of it
        (another `start_time_s` than the one its records were written under, even
        before this conductor's restart): the engine restarted with an empty cache, so
        its residency and its reservations' optimistic copies are dropped."""
        self._fleets.clear()
        departure = self.departures.pop(("engine", record.id), None)
        restarted = self._new_run(record)
        if departure is not None:
            self._came_back(departure, record, restarted)
        info = self.engines.get(record.id)
        if info is None:
            state = WorkerState(id=record.id, locality_domain=record.locality_domain)
            info = self.engines[record.id] = EngineInfo(record, state)
            state.resident_blocks = self.index.worker_block_count(record.id)
            logger.info(
                "engine %s joined (%s, %s)", record.id, record.base_url, record.locality_domain
            )
        info.record = record
        info.state.locality_domain = record.locality_domain
        info.state.store_node_id = record.store_node
        info.state.base_url = record.base_url or ""
        if record.capacity_bytes:
            info.state.hbm_capacity_bytes = record.capacity_bytes
        if restarted:
            info.state.resident_blocks = 0
            self.drains.forget(record.id)  # a new run of it serves again
        self._update_block_parts()
        return restarted

    def _update_block_parts(self) -> None:
        self.block_parts = {
            engine: parts
            for engine in self.engines
            if (parts := self.engine_block_parts(engine)) > 1
        }

    def _new_run(self, record: NodeRecord) -> bool:
        epoch = record.start_time_s
        if not epoch:  # a record written by hand (a real vLLM's) may carry none
            return False
        known = self._epochs.get(record.id)
        if known == epoch:
            return False
        self._epochs[record.id] = epoch
        self.index.set_worker_epoch(record.id, epoch)
        if known is None:
            return False
        dropped = self.index.clear_worker(record.id)
        self.ledger.forget_engine(record.id)
        self.counters.restart_records_dropped += dropped
        logger.info(
            "engine %s restarted (start time %.3f, was %.3f): dropped its %d residency records",
            record.id,
            epoch,
            known,
            dropped,
        )
        return True

    def node_left(
        self, kind: str, node_id: str, *, grace_s: float = 0.0, hold_s: float = 0.0
    ) -> bool:
        """An engine's or store's registry record went away. With `grace_s` <= 0 it is
        dropped at once (`engine_left`/`store_left`) and this returns True.

        Otherwise its residency stays for `grace_s` s: should it register again with
        the same start time (the same process, its lease lost in an etcd stall),
        nothing is lost; else `expire_departures` drops it then. During the grace it
        is not planned on nor located (it may be dead), but for the first `hold_s` s
        (< `grace_s`), which the caller gives right after a registry outage: the leave
        is then most likely the outage's, and the node about to register again."""
        live = self.engines if kind == "engine" else self.stores if kind == "store" else None
        if live is None or node_id not in live or (kind, node_id) in self.departures:
            return False  # not a node we route to, unknown, or already departing
        if grace_s <= 0:
            (self.engine_left if kind == "engine" else self.store_left)(node_id)
            return True
        now = self.clock()
        held = 0 < hold_s < grace_s
        record = live[node_id].record if kind == "engine" else live[node_id]
        departure = Departure(kind, record, now, now + grace_s, now + hold_s, held)
        self.departures[(kind, node_id)] = departure
        if not held:
            self._exclude(departure)
        logger.info(
            "%s %s left the registry: %s; its %d residency records kept for %.1fs unless "
            "it registers again",
            kind,
            node_id,
            f"held routable for {hold_s:.1f}s (a registry outage just ended)"
            if held
            else "no longer routed to",
            self.index.worker_block_count(node_id),
            grace_s,
        )
        return False

    def _exclude(self, departure: Departure) -> None:
        """Take a departed node out of plans and locations (its records stay)."""
        self._fleets.clear()
        departure.held = False
        if departure.kind == "engine":
            departure.info = self.engines.pop(departure.record.id, None)
            self._update_block_parts()
        else:
            self.stores.pop(departure.record.id, None)

    def expire_departures(self) -> list[tuple[str, str]]:
        """Exclude held nodes whose hold is over; drop those whose grace is over (their
        residency and reservations, as a leave did at once before). Returns the
        (kind, id) dropped."""
        if not self.departures:
            return []
        now = self.clock()
        dropped = []
        for key, departure in list(self.departures.items()):
            if departure.held and now >= departure.routable_until_s:
                self._exclude(departure)
                logger.info("%s %s is not back: no longer routed to", *key)
            if now < departure.drop_s:
                continue
            logger.info("%s %s did not come back within its leave grace", *key)
            (self.engine_left if key[0] == "engine" else self.store_left)(key[1])
            self.counters.nodes_dropped_after_grace += 1
            dropped.append(key)
        return dropped

    def _came_back(self, departure: Departure, record: NodeRecord, restarted: bool) -> None:
        """A departed node registered again within its grace. The same run keeps its
        residency and load (its requests go on). A new run's records went in
        `_new_run` (an engine's; a store resends its own), its requests with the old
        process."""
        if departure.kind == "engine":
            if restarted:
                for res in self.ledger.on_engine(record.id):
                    self.ledger.close(res.id)
                    self._tell_closed(res, 0.0, resident=False)
                    self.ledger.forget(res)
            elif departure.info is not None and record.id not in self.engines:
                self.engines[record.id] = departure.info
        else:
            self.stores[record.id] = record
        self.counters.nodes_returned += 1
        logger.info(
            "%s %s registered again after %.2fs: %s",
            departure.kind,
            record.id,
            self.clock() - departure.left_s,
            "a new run" if restarted else "the same run, its residency kept",
        )

    def engine_left(self, engine_id: str) -> int:
        """Forget an engine: its residency is dropped and no plan names it again."""
        self._fleets.clear()
        self.departures.pop(("engine", engine_id), None)
        self.engines.pop(engine_id, None)
        self.drains.forget(engine_id)
        self._update_block_parts()
        dropped = self.index.clear_worker(engine_id)
        for res in self.ledger.on_engine(engine_id):
            self.ledger.drop(res.id)
            self._tell_closed(res, 0.0, resident=False)
            self.ledger.forget(res)
        self.ledger.forget_engine(engine_id)
        logger.info("engine %s left; dropped %d residency records", engine_id, dropped)
        return dropped

    def drop_departed(self, candidates: Iterable[str], registered: Iterable[str]) -> dict[str, int]:
        """Drop the residency of every candidate worker that is not registered (nor
        known here as an engine or store): nodes that left while a reopened index was
        not watching. Returns records dropped per worker. Nodes in their leave grace
        are left to it."""
        live = {*registered, *self.engines, *self.stores, *(key[1] for key in self.departures)}
        dropped: dict[str, int] = {}
        for worker in candidates:
            if worker not in live:
                dropped[worker] = self.index.clear_worker(worker)
                self.counters.departed_records_dropped += dropped[worker]
                logger.info(
                    "%s is no longer registered; dropped its %d residency records",
                    worker,
                    dropped[worker],
                )
        return dropped

    def store_joined(self, record: NodeRecord) -> None:
        self._fleets.clear()
        departure = self.departures.pop(("store", record.id), None)
        if departure is not None:  # records kept: a restarted store resends its own
            self._came_back(departure, record, record.start_time_s != departure.record.start_time_s)
        elif record.id not in self.stores:
            logger.info(
                "store %s joined (%s, %s)", record.id, record.address, record.locality_domain
            )
        self.stores[record.id] = record

    def store_left(self, store_id: str) -> int:
        self._fleets.clear()
        self.departures.pop(("store", store_id), None)
        self.stores.pop(store_id, None)
        dropped = self.index.clear_worker(store_id)
        logger.info("store %s left; dropped %d residency records", store_id, dropped)
        return dropped

    # --- plan / finish / observe ---------------------------------------------------

    def plan(
        self,
        request: RequestShape,
        exclude: Sequence[str] = (),
        *,
        first_token_reported: bool = False,
    ) -> PlanOutcome:
        """Choose an engine, reserve load on it, and return the reservation id.

        With `first_token_reported` (the gateway says `prefilled` at the first token)
        the plan's queued prefill stays on its engine until then; the estimated TTFT
        only bounds it loosely (`REPORTED_RELEASE`), for a report that never comes."""
        self._check_request(request)
        now = self.clock()
        self._release_due(now)
        if self.release_peers is not None:
            self.release_peers()
        fleet = self._fleet(request.model_id, exclude)
        if self.speeds is not None:
            self.policy.cost_model = self.speeds.cost_model(request.model_id)
        decision = plan_request(
            self.index,
            self.policy,
            request,
            fleet,
            self.rng,
            self.optimistic,
            self.block_parts,
        )
        self.counters.plans += 1
        self.counters.guard_refusals += len(decision.refusals)
        worker = decision.engine
        prefill_tokens = decision.recompute_tokens(request)
        res = Reservation(
            id=secrets.token_hex(16),
            engine_id=worker.id,
            prefill_tokens=prefill_tokens,
            blocks=len(request.blocks),
            created_s=now,
            expires_s=now + self.reservation_ttl_s,
            model_id=request.model_id,
        )
        self._expect_cached(res, decision, request)
        if self.speeds is not None:
            if not decision.chosen.fetch_blocks:
                # Its TTFT is the prefill of its own tokens and of those queued ahead.
                res.sample_tokens = prefill_tokens
                res.sample_ahead = worker.queued_prefill_tokens
            elif worker.inflight_requests == 0:  # transfers alone beyond the line
                res.sample_tokens = prefill_tokens
                factor = self.speeds.fetch_factor(request.model_id)
                res.sample_fetch_us = decision.chosen.fetch_us / factor
        if self.policy.optimistic_residency:
            res.optimistic = self._record_optimistic(decision, request)
        est_ttft_s = decision.chosen.est_ttft_us / 1e6
        if self.speeds is not None:  # the fixed part of a TTFT the engines showed
            est_ttft_s += self.speeds.intercept_us(request.model_id) / 1e6
        if first_token_reported:
            factor, margin_s = REPORTED_RELEASE
            est_ttft_s = factor * est_ttft_s + margin_s
        self.ledger.add(res, worker, now + est_ttft_s)
        if self.listener is not None:
            self.listener.opened(res, est_ttft_s)
        return PlanOutcome(res.id, decision)

    def _expect_cached(self, res: Reservation, decision: PlanDecision, request: RequestShape):
        """The plan's hit and fetch blocks as its engine can deliver them: whole blocks
        of its own, never the prompt's last token (always computed)."""
        parts = self.engine_block_parts(res.engine_id)
        cacheable = max(0, request.input_tokens() - 1) // (self.block_tokens * parts) * parts
        res.hit_blocks = min(decision.chosen.hit_blocks, cacheable)
        res.fetch_blocks = min(decision.chosen.fetch_blocks, cacheable - res.hit_blocks)

    def prefilled(self, reservation_id: str, ttft_s: float) -> bool:
        """The request's first token came after `ttft_s`: its prefill no longer counts on
        its engine, and its TTFT is learned now (not again at its Finish). False when
        the reservation is unknown (finished or expired)."""
        res = self.ledger.get(reservation_id)
        if res is None:
            return False
        self.ledger.release_prefill(res)
        self._learn(res, ttft_s)
        if self.listener is not None:
            self.listener.prefilled(res)
        return True

    def _learn(self, res: Reservation, ttft_s: float) -> None:
        """A sample of the engines' speed from a reservation's measured TTFT (once)."""
        if ttft_s <= 0 or res.sample_tokens < 0 or res.sample_ttft_us > 0 or self.speeds is None:
            return
        res.sample_ttft_us = ttft_s * 1e6  # the other replicas learn it too, at its close
        self.speeds.observe(
            res.model_id,
            res.sample_ahead + res.sample_tokens,
            res.sample_ttft_us,
            res.sample_fetch_us,
        )

    def _fleet(self, model_id: str, exclude: Sequence[str]) -> Fleet:
        """The engines eligible for a model; the same object until membership changes.

        The planner derives its layout once per Fleet object, so keeping it saves a
        pass over every engine per plan. Load lives in the WorkerStates it shares.
        """
        cache_key = (model_id, tuple(sorted(exclude)) if exclude else ())
        fleet = self._fleets.get(cache_key)
        if fleet is not None:
            return fleet
        excluded = set(exclude)
        engines = [
            info.state
            for info in self.engines.values()
            if info.state.id not in excluded and serves(info.record, model_id)
        ]
        serving = [e for e in engines if not self.drains.excludes(self.engines[e.id].record)]
        engines = serving or engines  # draining engines only when none other is left
        # A prefill-only engine never decodes while another engine can (disagg.py).
        if any(self.engines[e.id].record.role != "prefill" for e in engines):
            engines = [e for e in engines if self.engines[e.id].record.role != "prefill"]
        if not engines:
            raise NodeUnavailable(
                f"no engine available for model {model_id!r}"
                + (f" (excluded: {', '.join(sorted(excluded))})" if excluded else "")
            )
        store_domains = {sid: rec.locality_domain for sid, rec in self.stores.items()}
        fleet = Fleet(engines, store_domains)
        if len(self._fleets) >= 256:  # exclusions are per failed request: bounded cache
            self._fleets.clear()
        self._fleets[cache_key] = fleet
        return fleet

    def drain(self, engine_id: str) -> EngineInfo:
        """Plan no new request to `engine_id` from now on; NotFound if unknown here."""
        info = self.engines.get(engine_id)
        if info is None:
            raise NotFound(f"no engine {engine_id!r} is registered")
        if self.drains.begin(engine_id):
            self._fleets.clear()
        return info

    def delivered_blocks(self, reservation_id: str, delivered: int) -> tuple[range, range]:
        """What an open reservation's engine reporting `delivered` cached blocks says of
        its residency (prompt indexes): the blocks its plan claimed in the engine's HBM
        past those (the engine had lost them), and the blocks it held beyond what the
        plan claimed and loaded (the conductor had not known them). Both empty when it
        delivered as planned, or the reservation is unknown."""
        res = self.ledger.get(reservation_id)
        if res is None:
            return range(0), range(0)
        extra_from = res.hit_blocks + res.fetch_blocks
        extra = range(res.hit_blocks, delivered) if delivered > extra_from else range(0)
        return range(max(0, delivered), res.hit_blocks), extra

    def finish(
        self,
        reservation_id: str,
        outcome: str,
        promote: bool = True,
        ttft_s: float = 0.0,
        lost_hashes: Sequence[str] = (),
        held_keys: Sequence = (),
    ) -> str:
        """Release a reservation; returns its engine. NotFound if unknown (finished or expired).

        On success its optimistic records become index records, unless `promote` is
        False (the caller is about to record the request's blocks itself), and its
        measured `ttft_s` (if any) teaches the model's prefill speed. `lost_hashes` are
        the blocks its plan claimed on the engine that the engine did not deliver, and
        `held_keys` those it delivered beyond the plan (`delivered_blocks`): the
        engine's records of the first are dropped, of the second written, before
        anything is promoted; the speed sample counts the lost ones as computed.
        """
        if outcome not in OUTCOMES:
            raise InvalidArgument(f"outcome must be one of {', '.join(OUTCOMES)}, got {outcome!r}")
        res = self.ledger.close(reservation_id)
        if res is None:
            raise NotFound(f"no open reservation {reservation_id!r} (finished, expired or unknown)")
        info = self.engines.get(res.engine_id)
        success = outcome == "success"
        if success and (lost_hashes or held_keys):
            self._correct(res, lost_hashes, held_keys)
        if success:
            self._learn(res, ttft_s)
        if success and res.optimistic and info is not None and not publishes_events(info.record):
            self._tell_closed(res, 0.0, resident=True)
            if promote:
                # The engine has computed them now: resident until it says otherwise.
                self.index.put_many(res.optimistic)
        elif success and res.optimistic and self.optimistic_linger_s > 0:
            # Its events are the truth, but may still be on their way.
            self.ledger.linger(res, self.clock() + self.optimistic_linger_s)
            self._tell_closed(res, self.optimistic_linger_s, resident=False)
            self.counters.finishes[outcome] += 1
            return res.engine_id
        else:
            self._tell_closed(res, 0.0, resident=False)
        self.ledger.forget(res)
        self.counters.finishes[outcome] += 1
        return res.engine_id

    def _correct(self, res: Reservation, lost_hashes: Sequence[str], held_keys: Sequence) -> None:
        """The engine no longer held the lost blocks its plan claimed: no record (index
        or overlay) claims them there now, and its TTFT was the prefill of them too. It
        did hold the `held_keys` (events of them that did not arrive): recorded, and not
        computed. So a wrong drop (the engine recomputed the lost blocks and its events
        of that came before this Finish) lasts until the next answer that hits them."""
        engine_id = res.engine_id
        hbm = CacheTier.HBM
        for block_hash in lost_hashes:
            self.index.remove_tier(engine_id, block_hash, hbm)
            overlay.release(self.optimistic, engine_id, block_hash)
        if held_keys:
            self.index.put_many(
                CacheResidency(key, engine_id, hbm, self.default_block_bytes) for key in held_keys
            )
        info = self.engines.get(engine_id)
        if info is not None:
            info.state.resident_blocks = self.index.worker_block_count(engine_id)
        if res.sample_tokens >= 0 and res.sample_ttft_us == 0:  # not learned at PREFILLED
            computed_fewer = max(0, len(held_keys) - res.fetch_blocks)
            delta = (len(lost_hashes) - computed_fewer) * self.block_tokens
            res.sample_tokens = max(0, res.sample_tokens + delta)
        corrections = self.counters.residency_corrections
        corrections[engine_id] = corrections.get(engine_id, 0) + 1
        logger.debug(
            "engine %s had lost %d planned blocks, held %d unknown ones",
            engine_id,
            len(lost_hashes),
            len(held_keys),
        )

    def observe(self, engine_id: str, keys: Sequence) -> int:
        """Record a served request's prefix blocks as resident in the engine's HBM.

        Not for an engine that publishes KV events: its events are the truth (a block
        observed after the engine evicted it would be claimed for ever). Returns the
        blocks recorded."""
        info = self.engines.get(engine_id)
        if info is None:
            raise NotFound(f"unknown engine {engine_id!r}")
        if publishes_events(info.record):
            return 0
        # Most of a served prefix is usually recorded already (by an earlier request or
        # the engine's own events): a lookup is a tenth of a put, so only new blocks
        # are written.
        hbm = CacheTier.HBM
        nbytes = self.default_block_bytes
        new = []
        for key, found in zip(
            keys, self.index.locate_hashes([k.block_hash for k in keys]), strict=True
        ):
            for record in found:
                if record.worker_id == engine_id and record.tier is hbm and record.key == key:
                    break
            else:
                new.append(CacheResidency(key, engine_id, hbm, nbytes))
        if new:
            self.index.put_many(new)
        info.state.resident_blocks = self.index.worker_block_count(engine_id)
        self.counters.observed_blocks += len(keys)
        return len(keys)

    def locate(
        self, scope: IdentityScope, block_hashes: Sequence[str]
    ) -> list[list[tuple[str, str, CacheTier, str]]]:
        """Per hash, the live nodes holding it under `scope`: (node id, address, tier, kind)."""
        out = []
        for found in self.index.locate_hashes(block_hashes):
            places = []
            for residency in found:
                if not scope.matches(residency.key):
                    continue
                store = self.stores.get(residency.worker_id)
                if store is not None:
                    places.append((store.id, store.address, residency.tier, "store"))
                    continue
                engine = self.engines.get(residency.worker_id)
                if engine is not None:
                    places.append(
                        (engine.record.id, engine.record.address, residency.tier, "engine")
                    )
            out.append(places)
        return out

    # --- store residency ------------------------------------------------------------

    def store_blocks_stored(
        self,
        node_id: str,
        scope: IdentityScope,
        hashes: Sequence[str],
        parent: str,
        first_index: int,
        token_count: int,
        tier: CacheTier,
        nbytes: int,
    ) -> int:
        # One Chain (the index builds its records in C-level passes, or none until read)
        # instead of a KvBlockKey and a CacheResidency per block: the same records.
        count = len(hashes)
        if count:
            self.index.put_chain(
                Chain(
                    (scope.model_id, scope.tokenizer_id, scope.adapter_id, scope.tenant_id),
                    parent or "root",
                    list(hashes),
                    first_index,
                    token_count,
                    node_id,
                    tier,
                    nbytes or self.default_block_bytes,
                )
            )
        self.counters.store_events += count
        return count

    def store_blocks_removed(self, node_id: str, hashes: Sequence[str], tier: CacheTier) -> int:
        self.counters.store_events += len(hashes)
        return sum(self.index.remove_tier(node_id, h, tier) for h in hashes)

    # --- time -----------------------------------------------------------------------

    def tick(self) -> None:
        """Release prefill load that is due and expire abandoned reservations."""
        self._release_due(self.clock())

    def _release_due(self, now: float) -> None:
        for res in self.ledger.advance(now):
            self._tell_closed(res, 0.0, resident=False)
            self.ledger.forget(res)
            self.counters.reservations_expired += 1
            logger.info("reservation %s on %s expired without Finish", res.id, res.engine_id)

    @property
    def reservations(self) -> dict[str, Reservation]:
        """The open reservations by id (read only: the ledger opens and closes them)."""
        return self.ledger.open

    def engine_block_parts(self, engine_id: str) -> int:
        """Index blocks per block of the engine (its record's block size over ours; >= 1)."""
        info = self.engines.get(engine_id)
        size = info.record.block_size if info is not None else 0
        return max(1, size // self.block_tokens) if size else 1

    def _record_optimistic(self, decision: PlanDecision, request: RequestShape) -> list:
        """Overlay records for the request's blocks not already in its engine's HBM."""
        parts = self.engine_block_parts(decision.engine.id)
        return overlay.record(self.optimistic, decision, request.blocks, request.block_bytes, parts)

    def overlay_released(self, engine_id: str, block_hash: str | None) -> None:
        """The engine's events say its HBM no longer holds the block (None: nothing):
        no optimistic record may claim it there any longer, a finished request's
        lingering one or an open request's."""
        if block_hash is None:
            self.ledger.forget_engine(engine_id)
            return
        overlay.release(self.optimistic, engine_id, block_hash)

    def _tell_closed(self, res: Reservation, linger_s: float, *, resident: bool) -> None:
        if self.listener is not None:
            self.listener.closed(res, linger_s, resident)

    def engine_info(self, engine_id: str) -> EngineInfo | None:
        """A live engine's entry, or that of an engine excluded during its leave grace
        (its reservations still release their load)."""
        info = self.engines.get(engine_id)
        if info is None and self.departures:
            departure = self.departures.get(("engine", engine_id))
            info = departure.info if departure is not None else None
        return info

    def _engine_worker(self, res: Reservation) -> WorkerState | None:
        info = self.engine_info(res.engine_id)
        return info.state if info is not None else None

    def _released(self, res: Reservation, worker: WorkerState) -> None:
        worker.resident_blocks = self.index.worker_block_count(res.engine_id)

    def _check_request(self, request: RequestShape) -> None:
        for name in ("model_id", "tokenizer_id", "tenant_id"):
            if not getattr(request, name):
                raise InvalidArgument(f"identity.{name} is required")
        if not request.blocks and request.prompt_tokens <= 0:
            raise InvalidArgument("a plan needs blocks or prompt_tokens > 0")
        if len(request.blocks) > self.max_blocks_per_request:
            raise InvalidArgument(
                f"{len(request.blocks)} blocks exceed the limit of {self.max_blocks_per_request}"
            )


def publishes_events(record: NodeRecord) -> bool:
    """Whether the engine reports its cache itself (KV events over ZMQ)."""
    return bool(record.kv_events_endpoint)


def serves(record: NodeRecord, model_id: str) -> bool:
    return not record.model or record.model == model_id
