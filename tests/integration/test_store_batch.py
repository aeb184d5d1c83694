"""A request's blocks in one exchange with a real store's block-data port
(`datapath.batch`): puts sent back to back then acknowledged, a get of many blocks in
one request, absent blocks as None, a refused put as its error, and a dead port as
every block failed (never raised)."""

from __future__ import annotations

import pytest

from quillcache_core.errors import InvalidArgument, NodeUnavailable
from quillcache_core.launch.vllm_engine import free_port
from quillcache_core.model import CacheTier
from quillcache_core.storeclient.client import StoreClient
from quillcache_core.storeclient.datapath.batch import BlockBatches
from tests.support import stores
from tests.support.stores import MIB, SHAPES, block_key, kv_payload, run
from tests.support.tls import tls

pytestmark = pytest.mark.integration


@pytest.fixture
def lone_store(tmp_path):
    with stores.lone_store(tmp_path, "--max-block-bytes", str(1 * MIB)) as store:
        yield store


def test_a_batch_of_puts_and_a_batch_get_move_every_block_byte_identical(lone_store):
    data = lone_store.fields["data"]
    keys = [block_key(i, chain="batch") for i in range(40)]
    payloads = [kv_payload(700 + i, SHAPES["0.5MiB"]) for i in range(40)]
    batches = BlockBatches(tls=tls("engine"))
    try:
        landed = batches.put_many(data, list(zip(keys, payloads, strict=True)))
        assert landed == [CacheTier.CPU_DRAM] * 40
        absent = block_key(99, chain="batch")
        back = batches.get_many(data, [*keys[:20], absent, *keys[20:]])
        assert back[:20] == payloads[:20] and back[21:] == payloads[20:]
        assert back[20] is None
        # too big for --max-block-bytes: that put refused, the others stored
        mixed = batches.put_many(
            data, [(block_key(0, chain="big"), bytes(2 * MIB)), (keys[0], payloads[0])]
        )
        assert isinstance(mixed[0], InvalidArgument | NodeUnavailable)
        assert batches.get_many(data, keys[:1]) == payloads[:1]  # a fresh connection
        dead = f"127.0.0.1:{free_port()}"
        assert batches.get_many(dead, keys[:3]) == [None] * 3
        assert all(
            isinstance(o, NodeUnavailable) for o in batches.put_many(dead, [(keys[0], payloads[0])])
        )
    finally:
        batches.close()

    async def read():  # the gRPC path sees what the batch stored
        async with StoreClient(lone_store.grpc_address, tls=tls("engine")) as client:
            return [(await client.get(k))[0] for k in keys[:3]]

    assert run(read()) == payloads[:3]
