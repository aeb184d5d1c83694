"""The gateway over two conductor replicas (in-process fakes): plans go to the primary
(or spread over both with `--conductor-spread round-robin`); one stopped or hung, every
request is still planned, at once, by the other; each Finish reaches the replica that
made its reservation."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.integration.test_gateway_fallback import PLAN, prompt, send
from tests.support.gateway_fakes import completion, gateway_setup, until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _finished_where_reserved(s) -> None:
    for replica in s.replicas:
        assert {f.reservation_id for f in replica.finishes} <= set(replica.reservations)
        assert not replica.open_reservations()


async def _burst(s, n: int, offset: int = 0) -> list:
    bodies = [completion(prompt=prompt(offset + i), stream=bool(i % 2)) for i in range(n)]
    results = []
    for i in range(0, n, 5):
        results += await asyncio.gather(*(send(s, b) for b in bodies[i : i + 5]))
    return results


def test_every_plan_goes_to_the_primary_and_the_standby_takes_over_when_it_stops():
    async def main():
        async with gateway_setup(2, conductors=2) as s:
            a, b = s.replicas  # a is first in --conductor: the primary
            results = await _burst(s, 20)
            assert all(r[0] == 200 and PLAN not in r[1] for r in results), results
            assert (len(a.plans), len(b.plans)) == (20, 0)
            await until(lambda: not a.open_reservations())
            _finished_where_reserved(s)
            await s.stop_conductor()
            results = await _burst(s, 10, offset=100)
            assert all(r[0] == 200 and PLAN not in r[1] for r in results), results
            assert (len(a.plans), len(b.plans)) == (20, 10)
            await until(lambda: not b.open_reservations())
            _finished_where_reserved(s)
            # Back (a restarted replica's index may still be catching up), the old
            # primary is a standby: the one that took over keeps planning.
            await s.start_conductor()
            await asyncio.sleep(1.1)  # its down mark has passed
            results = await _burst(s, 10, offset=200)
            assert all(r[0] == 200 and PLAN not in r[1] for r in results), results
            assert (len(a.plans), len(b.plans)) == (20, 20)
            # It takes over again when the new primary fails.
            await s.stop_replica(1)
            results = await _burst(s, 5, offset=300)
            assert all(r[0] == 200 and PLAN not in r[1] for r in results), results
            assert (len(a.plans), len(b.plans)) == (25, 20)

    asyncio.run(main())


def test_plans_spread_over_the_replicas_and_a_stopped_one_costs_nothing():
    async def main():
        async with gateway_setup(2, conductors=2, conductor_spread="round-robin") as s:
            a, b = s.replicas
            assert len(s.gateway.conductor.addresses) == 2
            results = await _burst(s, 20)
            assert all(r[0] == 200 and PLAN not in r[1] for r in results), results
            assert len(a.plans) >= 5 and len(b.plans) >= 5, (len(a.plans), len(b.plans))
            await until(lambda: not a.open_reservations() and not b.open_reservations())
            _finished_where_reserved(s)

            # Reservation ids differ by replica: each Finish went to the one that made it.
            await s.stop_conductor()
            a_plans, b_plans = len(a.plans), len(b.plans)
            started = time.monotonic()
            results = await _burst(s, 30, offset=100)
            took = time.monotonic() - started
            failed = [r for r in results if r[0] != 200]
            assert not failed, failed
            assert all(PLAN not in r[1] for r in results), "no request fell back"
            assert len(a.plans) == a_plans
            assert len(b.plans) == b_plans + 30
            assert s.gateway.conductor.retries >= 1
            await until(lambda: not b.open_reservations())
            _finished_where_reserved(s)
            print(f"30 requests with a replica down in {took:.2f} s, 0 failed")

    asyncio.run(main())


def test_a_hung_replica_is_passed_over_for_the_other_before_the_fallback():
    async def main():
        # A hung replica gets half the fallback's wait (1 s here, not the default 0.25 s,
        # so the other replica's answers fit in the rest on a loaded machine).
        async with gateway_setup(
            2, conductors=2, plan_stream=False, plan_fallback_timeout_s=2.0
        ) as s:
            a, b = s.replicas
            a.delay = lambda: 5.0  # reserves, then answers after 5 s
            started = time.monotonic()
            results = await _burst(s, 10)
            took = time.monotonic() - started
            assert all(r[0] == 200 and PLAN not in r[1] for r in results), results
            assert len(b.plans) == 10
            assert len(a.plans) >= 1  # the request that found it hung
            assert took < 5.0, took
            await until(lambda: not b.open_reservations())
            # A reservation left on the hung replica is never finished from here: it
            # expires there.
            assert {f.reservation_id for f in b.finishes} == set(b.reservations)

    asyncio.run(main())
