"""A store reports its residency to every conductor replica (real processes, real etcd):
both find its blocks; one killed, the other keeps learning; one started later gets the
store's full residency."""

from __future__ import annotations

import pytest

from quillcache_core.model import CacheTier
from quillcache_core.storeclient.client import StoreClient
from tests.support.services import wait_until
from tests.support.stores import block_key, kv_payload, locate, run
from tests.support.tls import tls

pytestmark = pytest.mark.integration

HERE = [("store-r", CacheTier.CPU_DRAM)]


def _put(store, keys) -> None:
    async def fill():
        async with StoreClient(store.grpc_address, tls=tls("engine")) as client:
            for i, key in enumerate(keys):
                await client.put(key, kv_payload(i))

    run(fill())


def test_every_conductor_replica_gets_the_residency_and_a_dead_one_blocks_none(fleet):
    a = fleet.conductor("--node-id", "cond-a", name="cond-a")
    b = fleet.conductor("--node-id", "cond-b", name="cond-b")
    store = fleet.store("store-r")
    first = [block_key(i, chain="r") for i in range(4)]
    _put(store, first)
    wait_until(
        lambda: all(locate(c, k) == HERE for c in (a, b) for k in first),
        timeout_s=10,
        what="both replicas indexing the first blocks",
    )
    a.kill()
    more = [block_key(i, chain="s") for i in range(4)]
    _put(store, more)
    wait_until(
        lambda: all(locate(b, k) == HERE for k in more),
        timeout_s=5,
        what="the live replica indexing blocks put after the other died",
    )
    # A replica that joins later gets everything the store holds.
    c = fleet.conductor("--node-id", "cond-c", name="cond-c")
    wait_until(
        lambda: all(locate(c, k) == HERE for k in first + more),
        timeout_s=10,
        what="a late replica getting the full residency",
    )
