"""A store's conductor replicas: who gets a reporter, and when a replica starts over."""

from __future__ import annotations

import asyncio

import pytest

from quillcache_core.registry import NodeRecord
from quillcache_store.replicas import ConductorReplicas

pytestmark = pytest.mark.unit


def _conductor(id_: str, port: int, start: float) -> NodeRecord:
    return NodeRecord(
        kind="conductor",
        id=id_,
        address=f"127.0.0.1:{port}",
        locality_domain="",
        start_time_s=start,
    )


def test_joins_leaves_and_restarts_of_conductor_replicas():
    async def main():
        replicas = ConductorReplicas("s1", "", 0.2, None, list, leave_grace_s=0.05)
        try:
            await replicas.joined(_conductor("a", 1, 1.0))
            await replicas.joined(_conductor("b", 2, 1.0))
            assert replicas.ids == ["a", "b"]
            first = replicas.reporter("a")
            # Back after a lease loss, the same process: the same reporter, no resync.
            await replicas.left(_conductor("a", 1, 1.0))
            await replicas.joined(_conductor("a", 1, 1.0))
            await asyncio.sleep(0.1)
            assert replicas.reporter("a") is first
            # Restarted (a new start time): a new reporter, which starts with a resync.
            await replicas.joined(_conductor("a", 1, 2.0))
            assert replicas.reporter("a") is not first
            # Gone for longer than the grace: no longer reported to.
            await replicas.left(_conductor("b", 2, 1.0))
            await asyncio.sleep(0.2)
            assert replicas.ids == ["a"]
        finally:
            await replicas.close()

    asyncio.run(main())


def test_fixed_addresses_are_the_replicas_and_the_registry_only_restarts_them():
    async def main():
        replicas = ConductorReplicas("s1", "127.0.0.1:1, 127.0.0.1:2", 0.2, None, list)
        try:
            replicas.start()
            assert replicas.ids == ["127.0.0.1:1", "127.0.0.1:2"]
            await replicas.joined(_conductor("other", 3, 1.0))
            assert replicas.ids == ["127.0.0.1:1", "127.0.0.1:2"]
            await replicas.joined(_conductor("a", 1, 1.0))
            resyncs = replicas.reporter("127.0.0.1:1").resyncs
            await replicas.joined(_conductor("a", 1, 2.0))  # restarted on its address
            await asyncio.sleep(0.05)
            assert replicas.reporter("127.0.0.1:1").resyncs > resyncs
        finally:
            await replicas.close()

    asyncio.run(main())
