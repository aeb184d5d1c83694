"""The gateway's conductor replicas: plans go to the primary (or spread over the healthy
ones), retried at once on another when one fails, and each Finish sent to the replica
holding its reservation.

The replicas are `--conductor a,b` (a comma list), else every conductor registered in
the registry, followed as they join and leave. Each has its own channel and
`ConductorCalls` (plan port, else PlanStream). With `spread="primary"` (the default)
every plan goes to one replica, the primary: one replica sees every reservation as it
is made, where replicas planning in turn see each other's only through their sync, a
moment later, and under load both booked the same idle-looking engine (bench-live docqa
heavy on sim engines: mean TTFT 107-109 ms against 130-133 with plans in turn,
interleaved runs). The primary is first the first replica in an order every gateway
shares (`--conductor`'s order, else the registry ids sorted); when it fails, the next
that answers is the primary from then on (sticky: a replica restarted after a crash
comes back as a standby, not as the primary with an index still catching up). The
others are hot standbys: they ingest every event and the primary's load deltas, and
plan at once when it fails. With
`spread="round-robin"` plans go round robin over the replicas present and not recently
failed (planning CPU shared). A Plan the replica did not answer (UNAVAILABLE other
than its "no engine", DEADLINE_EXCEEDED, a broken connection: `unreachable_reason`)
marks its replica down for `DOWN_S` and is sent at once to the next (a plan is
idempotent by request id: a reservation left behind on the failed replica is cancelled
when its answer comes late, else expires there). When others remain, an attempt gets `attempt_timeout_s` at most, so a hung
replica leaves time for the next before the gateway's own fallback (fallback.py) takes
over. Every error of the last attempt is raised as ConductorCalls raises it.

Finish goes to the replica that made the reservation (remembered per reservation id,
forgotten at its Finish; at most `MAX_OWNERS` remembered, the oldest dropped, its
reservation then expiring at its conductor). Stats (the engines catalog) is asked of
the replicas in the same order.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time

import grpc

from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
from quillcache_core.errors import InvalidArgument, NodeUnavailable
from quillcache_core.registry import open_registry
from quillcache_core.rpc.plan_client import rpc_error
from quillcache_core.security.tls import Tls, grpc_channel
from quillcache_gateway.conductor_calls import ConductorCalls
from quillcache_gateway.fallback import unreachable_reason

logger = logging.getLogger(__name__)

DOWN_S = 1.0
MAX_OWNERS = 200_000


SPREADS = ("primary", "round-robin")


class _Replica:
    def __init__(self, address: str, channel: grpc.aio.Channel, calls: ConductorCalls) -> None:
        self.address = address
        self.rank: tuple = ()  # the primary is the present replica ranked first
        self.channel = channel
        self.calls = calls
        self.stub = conductor_pb2_grpc.ConductorStub(channel)
        self.present = True  # in the registry (or fixed): gets new plans
        self.down_until = 0.0  # failed a call: skipped until then unless all are


def _rank(replica: _Replica) -> tuple:
    return replica.rank


def parse_addresses(value: str) -> list[str]:
    return [a.strip() for a in value.split(",") if a.strip()]


class ConductorReplicas:
    """Plan, Finish and Stats over the conductor replicas (see the module doc)."""

    def __init__(
        self,
        addresses: str,
        registry_url: str,
        tls: Tls | None,
        *,
        use_plan_port: bool = True,
        channel_options=None,
        attempt_timeout_s: float | None = None,
        spread: str = "primary",
    ) -> None:
        if spread not in SPREADS:
            raise InvalidArgument(f"spread must be one of {SPREADS}, got {spread!r}")
        self.spread = spread
        self.fixed = parse_addresses(addresses)
        self.registry_url = registry_url
        self.tls = tls
        self.use_plan_port = use_plan_port
        self.channel_options = channel_options
        self.attempt_timeout_s = attempt_timeout_s
        self._replicas: dict[str, _Replica] = {}
        self._ids: dict[str, str] = {}  # registry id -> address
        self._owners: dict[str, str] = {}  # reservation id -> address of its replica
        self._turn = itertools.count()
        self._primary = ""  # the address of the replica that planned last (spread primary)
        self._found = asyncio.Event()
        self._watch: asyncio.Task | None = None
        self._registry = None
        self.retries = 0  # plans sent again to another replica after a failure

    # --- membership ----------------------------------------------------------------------

    async def start(self, find_timeout_s: float = 15.0) -> None:
        """Connect to the fixed replicas, else wait for the registry to name one."""
        for i, address in enumerate(self.fixed):
            self._add(address, (0, i))
        if self.fixed:
            return
        self._registry = open_registry(self.registry_url, self.tls)
        self._watch = asyncio.create_task(self._follow(), name="conductor-replicas")
        try:
            await asyncio.wait_for(self._found.wait(), find_timeout_s)
        except TimeoutError:
            await self.close()
            raise NodeUnavailable(f"no conductor registered in {self.registry_url}") from None

    def _add(self, address: str, rank: tuple) -> None:
        replica = self._replicas.get(address)
        if replica is not None:
            replica.present = True
            replica.rank = rank
            return
        channel = grpc_channel(address, self.tls, self.channel_options)
        calls = ConductorCalls(channel, use_plan_port=self.use_plan_port, tls=self.tls)
        replica = self._replicas[address] = _Replica(address, channel, calls)
        replica.rank = rank
        self._found.set()
        logger.info("conductor replica %s (%d in all)", address, len(self._replicas))

    async def _follow(self) -> None:
        while True:
            try:
                async for event in self._registry.watch("conductor"):
                    record = event.record
                    old = self._ids.get(record.id)
                    if event.type == "leave" or (old and old != record.address):
                        self._ids.pop(record.id, None)
                        if old and old not in self._ids.values() and old in self._replicas:
                            self._replicas[old].present = False  # kept for its Finishes
                            logger.info("conductor %s at %s left", record.id, old)
                    if event.type != "leave" and record.address:
                        self._ids[record.id] = record.address
                        self._add(record.address, (1, record.id))
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("watching the conductors failed; watching again")
                await asyncio.sleep(0.5)

    @property
    def addresses(self) -> list[str]:
        """The replicas that get new plans."""
        return [a for a, r in self._replicas.items() if r.present]

    @property
    def primary(self) -> str:
        """The replica new plans go to first ("" with round-robin: each in turn)."""
        if self.spread != "primary":
            return ""
        order = self._order()
        return order[0].address if order else ""

    def _order(self) -> list[_Replica]:
        """Present replicas, the primary first (or from the next in turn), the recently
        failed ones last."""
        present = [r for r in self._replicas.values() if r.present] or list(self._replicas.values())
        if not present:
            return []
        if self.spread == "primary":
            turned = sorted(present, key=_rank)
            primary = self._replicas.get(self._primary)
            if primary is not None and primary.present:
                turned.remove(primary)
                turned.insert(0, primary)
        else:
            start = next(self._turn) % len(present)
            turned = present[start:] + present[:start]
        now = time.monotonic()
        return [r for r in turned if r.down_until <= now] + [
            r for r in turned if r.down_until > now
        ]

    # --- calls ---------------------------------------------------------------------------

    async def plan(
        self, request: conductor_pb2.PlanRequest, timeout_s: float
    ) -> conductor_pb2.PlanResponse:
        replicas = self._order()
        if not replicas:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "no conductor replica")
        for i, replica in enumerate(replicas):
            last = i == len(replicas) - 1
            budget = timeout_s
            if not last and self.attempt_timeout_s:
                budget = min(timeout_s, self.attempt_timeout_s)
            try:
                plan = await replica.calls.plan(request, budget)
            except Exception as exc:  # noqa: BLE001 (only "did not answer" is retried)
                if last or unreachable_reason(exc) is None:
                    raise
                replica.down_until = time.monotonic() + DOWN_S
                self.retries += 1
                logger.info(
                    "plan %s failed on %s (%s): asking %s",
                    request.request_id,
                    replica.address,
                    unreachable_reason(exc),
                    replicas[i + 1].address,
                )
                continue
            replica.down_until = 0.0
            self._primary = replica.address
            if plan.reservation_id:
                if len(self._owners) >= MAX_OWNERS:
                    self._owners.pop(next(iter(self._owners)))
                self._owners[plan.reservation_id] = replica.address
            return plan
        raise AssertionError("unreachable")

    def owner(self, reservation_id: str) -> str | None:
        return self._owners.get(reservation_id)

    async def finish(
        self, request: conductor_pb2.FinishRequest, timeout_s: float
    ) -> conductor_pb2.FinishResponse:
        owners = self._owners
        # A first token's report is not the end: the final Finish goes to the owner too.
        if request.outcome == conductor_pb2.FinishRequest.PREFILLED:
            owner = owners.get(request.reservation_id, "")
        else:
            owner = owners.pop(request.reservation_id, "")
        replica = self._replicas.get(owner)
        if replica is None:  # not planned here (or forgotten): any replica may know it
            replicas = self._order()
            if not replicas:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, "no conductor replica")
            replica = replicas[0]
        return await replica.calls.finish(request, timeout_s)

    async def Stats(self, request, timeout=None):  # noqa: N802 (a stub's method)
        """Stats of the first replica that answers (the gateway's engines catalog)."""
        replicas = self._order()
        if not replicas:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "no conductor replica")
        for i, replica in enumerate(replicas):
            try:
                return await replica.stub.Stats(request, timeout=timeout)
            except Exception as exc:  # noqa: BLE001
                if i == len(replicas) - 1 or unreachable_reason(exc) is None:
                    raise
        raise AssertionError("unreachable")

    @property
    def transport(self) -> str:
        return ", ".join(sorted({r.calls.transport for r in self._replicas.values()}))

    @property
    def fallbacks(self) -> int:
        return sum(r.calls.fallbacks for r in self._replicas.values())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch
        if self._registry is not None:
            with contextlib.suppress(Exception):
                await self._registry.close()
        replicas, self._replicas = list(self._replicas.values()), {}
        for replica in replicas:
            with contextlib.suppress(Exception):
                await replica.calls.close()
            with contextlib.suppress(Exception):
                await replica.channel.close()


__all__ = ["ConductorReplicas", "parse_addresses"]
