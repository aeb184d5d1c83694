"""Store gRPC servicer: chunk framing and proto <-> domain translation.

Put and Get carry block bytes in hand-framed chunks (`wire`), so their handlers are
registered with custom (de)serialisers (`method_handlers`); Exists, Delete and Stats
are ordinary protobuf methods. The data plane is `TieredStore` (through `PooledStore`
for reads); disk and checksum work runs on the executor, never on the event loop.

Put's contract: the first chunk carries the key and total_bytes; no chunk's data may
exceed `max_chunk_bytes`; the data must add up to exactly total_bytes; a non-zero
checksum must match the whole block. The block is stored only after its last chunk
arrived and every check passed: a failed or cancelled Put stores nothing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor

import grpc

from quillcache.v1 import store_pb2
from quillcache_core.errors import CapacityExceeded, InvalidArgument, NotFound, QuillCacheError
from quillcache_core.model import CacheTier
from quillcache_core.rpc.server import stream_errors, unary_errors
from quillcache_core.storeclient import wire
from quillcache_core.storeclient.blockcodec import check_field_size
from quillcache_core.storeclient.datapath import protocol as dataproto
from quillcache_core.wire.tiers import tier_from_proto, tier_to_proto
from quillcache_store.datapath.pull import BlockPuller, OutcomeBatches, PullOutcome
from quillcache_store.pooled import PooledStore
from quillcache_store.tiers.tiered import TieredStore
from quillcache_store.timings import StoreTimings

logger = logging.getLogger(__name__)

SERVICE_NAME = store_pb2.DESCRIPTOR.services_by_name["Store"].full_name
MIN_GET_CHUNK_BYTES = 16 * 1024
DRAIN_S = 5.0  # longest a failed Put keeps reading its client's stream
# Pull with max_batch_results: at most this many results per message (whatever the
# client asks), sent at most this long after the first of them is known. A message
# per block cost the destination and the transfer service more CPU than storing it.
PULL_MAX_BATCH_RESULTS = 64
PULL_BATCH_LINGER_S = 0.02


class ByteBudget:
    """Bytes of Put payloads held at once; `acquire` waits for room (event-loop only)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._cond = asyncio.Condition()

    async def acquire(self, nbytes: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.used + nbytes <= self.capacity)
            self.used += nbytes

    async def release(self, nbytes: int) -> None:
        async with self._cond:
            self.used -= nbytes
            self._cond.notify_all()


def _pull_result(outcome: PullOutcome) -> store_pb2.PullResult:
    return store_pb2.PullResult(
        index=outcome.index,
        ok=outcome.ok,
        bytes=outcome.bytes,
        checksum=outcome.checksum,
        tier=tier_to_proto(outcome.tier),
        code=outcome.code,
        error=outcome.error,
        source_failed=outcome.source_failed,
    )


def _lenient(decode):
    """A request deserialiser that returns the error instead of raising it, so a
    malformed chunk becomes INVALID_ARGUMENT rather than gRPC's own INTERNAL."""

    def deserialize(buf: bytes):
        try:
            return decode(buf)
        except InvalidArgument as exc:
            return exc

    return deserialize


class StoreServicer:
    """Put/Get/Exists/Delete/Stats of one node. Call `method_handlers()` to serve it."""

    def __init__(
        self,
        node_id: str,
        tiered: TieredStore,
        pooled: PooledStore,
        executor: Executor,
        *,
        max_chunk_bytes: int,
        max_block_bytes: int,
        default_chunk_bytes: int,
        put_budget: ByteBudget,
        extra_corrupt: Callable[[], int] = lambda: 0,
        puller: BlockPuller | None = None,
        data_address: str = "",
        data_socket: str = "",
        pull_streams: int = 2,
        timings: StoreTimings | None = None,
    ) -> None:
        self.node_id = node_id
        self.timings = timings
        self.tiered = tiered
        self.pooled = pooled
        self._executor = executor
        self.max_chunk_bytes = max_chunk_bytes
        self.max_block_bytes = max_block_bytes
        self.default_chunk_bytes = default_chunk_bytes
        self._budget = put_budget
        self._extra_corrupt = extra_corrupt
        self.puller = puller
        self.data_address = data_address
        self.data_socket = data_socket
        self.pull_streams = pull_streams
        self.puts = {CacheTier.CPU_DRAM: 0, CacheTier.LOCAL_SSD: 0}
        self.put_bytes = 0
        self.get_bytes = 0
        self.rejected_puts = 0

    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "Put": grpc.stream_unary_rpc_method_handler(
                self.Put,
                request_deserializer=_lenient(wire.decode_put_chunk),
                response_serializer=store_pb2.PutResponse.SerializeToString,
            ),
            "Get": grpc.unary_stream_rpc_method_handler(
                self.Get,
                request_deserializer=store_pb2.GetRequest.FromString,
                response_serializer=None,  # handlers yield pre-framed bytes
            ),
            "Exists": grpc.unary_unary_rpc_method_handler(
                self.Exists,
                request_deserializer=store_pb2.ExistsRequest.FromString,
                response_serializer=store_pb2.ExistsResponse.SerializeToString,
            ),
            "Delete": grpc.unary_unary_rpc_method_handler(
                self.Delete,
                request_deserializer=store_pb2.DeleteRequest.FromString,
                response_serializer=store_pb2.DeleteResponse.SerializeToString,
            ),
            "Stats": grpc.unary_unary_rpc_method_handler(
                self.Stats,
                request_deserializer=store_pb2.StoreStatsRequest.FromString,
                response_serializer=store_pb2.StoreStatsResponse.SerializeToString,
            ),
            "Pull": grpc.unary_stream_rpc_method_handler(
                self.Pull,
                request_deserializer=store_pb2.PullRequest.FromString,
                response_serializer=store_pb2.PullResult.SerializeToString,
            ),
        }

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # --- Put ----------------------------------------------------------------------------

    def _check_capacity(self, total: int, tier: CacheTier, durable: bool) -> None:
        ssd_cap = self.tiered.ssd.capacity_bytes
        dram_cap = self.tiered.dram.capacity_bytes
        if total > self.max_block_bytes:
            raise InvalidArgument(
                f"block of {total} bytes exceeds the largest accepted block "
                f"({self.max_block_bytes} bytes, --max-block-bytes)"
            )
        if (tier is CacheTier.LOCAL_SSD or durable) and total > ssd_cap:
            raise CapacityExceeded(
                f"block of {total} bytes exceeds the SSD tier capacity of {ssd_cap} bytes"
            )
        if total > max(ssd_cap, dram_cap):
            raise CapacityExceeded(
                f"block of {total} bytes exceeds both tiers ({dram_cap} bytes DRAM, "
                f"{ssd_cap} bytes SSD)"
            )

    @unary_errors
    async def Put(self, request_iterator, context):
        try:
            return await self._put(request_iterator)
        except QuillCacheError:
            self.rejected_puts += 1
            # Read what the client still sends before failing the call: a client
            # writing into a call the server already closed sees gRPC's INTERNAL
            # instead of this error's status.
            await self._drain(request_iterator)
            raise

    async def _drain(self, request_iterator) -> None:
        deadline = asyncio.get_running_loop().time() + DRAIN_S
        drained = 0
        try:
            async with asyncio.timeout_at(deadline):
                async for frame in request_iterator:
                    if not isinstance(frame, InvalidArgument):
                        drained += frame.data.nbytes
                    if drained > self.max_block_bytes:
                        return
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.CancelledError):
            pass

    async def _put(self, request_iterator) -> store_pb2.PutResponse:
        started = time.perf_counter()
        header = None
        key = None
        total = received = 0
        single: memoryview | None = None
        buf: bytearray | None = None
        held = 0
        try:
            async for frame in request_iterator:
                if isinstance(frame, InvalidArgument):
                    raise frame
                data = frame.data
                n = data.nbytes
                if n > self.max_chunk_bytes:
                    raise InvalidArgument(
                        f"chunk of {n} bytes exceeds the maximum of {self.max_chunk_bytes}"
                    )
                if header is None:
                    header = frame.header
                    if not header.HasField("key"):
                        raise InvalidArgument("the first Put chunk must carry the key")
                    key = wire.key_from_proto(header.key)
                    total = header.total_bytes
                    if total == 0:
                        raise InvalidArgument("the first Put chunk must carry total_bytes > 0")
                    tier = _put_tier(header.tier)
                    self._check_capacity(total, tier, header.durable)
                    await self._budget.acquire(total)
                    held = total
                    if n == total:
                        single = data  # the whole block in one chunk: no copy
                        received = n
                        continue
                    buf = bytearray(total)
                if received + n > total:
                    raise InvalidArgument(
                        f"Put chunks carry more than total_bytes={total} "
                        f"({received + n} bytes so far)"
                    )
                if buf is None:  # a chunk after a single complete one
                    buf = bytearray(total)
                    buf[:received] = single
                    single = None
                buf[received : received + n] = data
                received += n
            if header is None:
                raise InvalidArgument("empty Put stream: no chunk received")
            if received != total:
                raise InvalidArgument(
                    f"Put of block {key.block_hash} ended after {received} of "
                    f"total_bytes={total} bytes; nothing stored"
                )
            payload = single if single is not None else memoryview(buf)
            tier = _put_tier(header.tier)
            landed = await self._run(
                functools.partial(
                    self.tiered.put,
                    key,
                    payload,
                    durable=header.durable,
                    tier=tier,
                    checksum=header.checksum or None,
                )
            )
        finally:
            if held:
                await self._budget.release(held)
        info = (
            self.tiered.dram.info(key) if landed is CacheTier.CPU_DRAM else None
        ) or self.tiered.ssd.info(key)
        self.puts[landed] = self.puts.get(landed, 0) + 1
        self.put_bytes += total
        if self.timings is not None:
            self.timings.put(started, landed)
        logger.debug("put %s: %d bytes -> %s", key.block_hash, total, landed)
        return store_pb2.PutResponse(
            key=header.key,
            tier=tier_to_proto(landed),
            bytes=total,
            durable=header.durable or landed is CacheTier.LOCAL_SSD,
            checksum=header.checksum or (info[1] if info else 0),
        )

    # --- Get ----------------------------------------------------------------------------

    @stream_errors
    async def Get(self, request, context):
        if not request.HasField("key"):
            raise InvalidArgument("key is required")
        key = wire.key_from_proto(request.key)
        chunk = request.chunk_bytes or self.default_chunk_bytes
        chunk = max(MIN_GET_CHUNK_BYTES, min(chunk, self.max_chunk_bytes))
        started = time.perf_counter()
        try:
            block = await self.pooled.read(key, allow_remote=request.allow_remote)
        except NotFound:
            if self.timings is not None:
                self.timings.got(started, None)
            raise
        try:
            view = block.payload
            total = view.nbytes
            header = store_pb2.GetChunk(
                total_bytes=total,
                checksum=block.checksum,
                tier=tier_to_proto(block.tier),
                served_from=block.served_from,
            )
            yield wire.encode_get_chunk(header, view[:chunk])
            for offset in range(chunk, total, chunk):
                yield wire.encode_get_chunk(None, view[offset : offset + chunk])
            self.get_bytes += total
            if self.timings is not None:
                self.timings.got(started, block.tier, remote=block.served_from != self.node_id)
        finally:
            block.release()

    # --- Pull (the block data path) -------------------------------------------------------

    @stream_errors
    async def Pull(self, request, context):
        if self.puller is None:
            raise InvalidArgument("this node's block data path is off (--data-port -1)")
        if not request.source_data_address:
            raise InvalidArgument("source_data_address is required")
        check_field_size("source_data_address", request.source_data_address)
        check_field_size("source_node", request.source_node)
        if not request.keys:
            raise InvalidArgument("keys is empty: nothing to pull")
        if len(request.keys) > dataproto.MAX_REQUEST_KEYS:
            raise InvalidArgument(
                f"{len(request.keys)} keys exceed the maximum of {dataproto.MAX_REQUEST_KEYS}"
            )
        if request.source_data_address == self.data_address:
            raise InvalidArgument("the source is this node")
        keys = [wire.key_from_proto(k, f"keys[{i}]") for i, k in enumerate(request.keys)]
        tier = _put_tier(request.tier)
        loop = asyncio.get_running_loop()
        # An old client (no max_batch_results): one result per message, each as soon
        # as it is known.
        batched = request.max_batch_results > 0
        per_message = min(request.max_batch_results, PULL_MAX_BATCH_RESULTS) if batched else 1
        batches = OutcomeBatches(
            loop,
            len(keys),
            max_batch=per_message,
            linger_s=PULL_BATCH_LINGER_S if batched else 0.0,
        )
        cancelled = threading.Event()
        # Several connections at once: one stream leaves both ends idle in turns (a
        # block's header, checksum and commit); two kept this machine's cores busier.
        streams = max(1, min(self.pull_streams, len(keys)))
        pulls = []
        for s in range(streams):
            indices = list(range(s, len(keys), streams))

            def deliver(outcome: PullOutcome, indices=indices) -> None:
                outcome.index = indices[outcome.index]
                batches.add(outcome)

            pulls.append(
                loop.run_in_executor(
                    self._executor,
                    functools.partial(
                        self.puller.pull,
                        request.source_data_address,
                        [keys[i] for i in indices],
                        on_result=deliver,
                        tier=tier,
                        durable=request.durable,
                        cancelled=cancelled,
                    ),
                )
            )
        pulling = asyncio.gather(*pulls)

        def check(done: asyncio.Future) -> None:
            # A pull that raised (a bug) delivered no outcome for the rest: fail the
            # call rather than wait for them.
            if not done.cancelled() and done.exception() is not None:
                batches.fail(done.exception())

        pulling.add_done_callback(check)
        try:
            sent = 0
            while sent < len(keys):
                batch = await batches.next_batch()
                sent += len(batch)
                # What queued while the loop was busy may exceed a message.
                for start in range(0, len(batch), per_message):
                    part = batch[start : start + per_message]
                    if batched:
                        yield store_pb2.PullResult(results=[_pull_result(o) for o in part])
                    else:
                        yield _pull_result(part[0])
            await pulling
        finally:
            cancelled.set()  # the caller went away: stop between blocks

    # --- small calls ------------------------------------------------------------------------

    @unary_errors
    async def Exists(self, request, context):
        keys = [wire.key_from_proto(k, f"keys[{i}]") for i, k in enumerate(request.keys)]
        tiers = [self.tiered.locate(k) for k in keys]
        return store_pb2.ExistsResponse(
            exists=[t is not None for t in tiers],
            tiers=[tier_to_proto(t) for t in tiers],
        )

    @unary_errors
    async def Delete(self, request, context):
        keys = [wire.key_from_proto(k, f"keys[{i}]") for i, k in enumerate(request.keys)]

        def delete_all() -> int:
            return sum(1 for k in keys if self.tiered.delete(k))

        return store_pb2.DeleteResponse(deleted=await self._run(delete_all))

    @unary_errors
    async def Stats(self, request, context):
        s = self.tiered.stats()
        return store_pb2.StoreStatsResponse(
            node_id=self.node_id,
            dram_bytes=s["cpu_dram_bytes"],
            dram_blocks=s["cpu_dram_blocks"],
            dram_capacity_bytes=s["cpu_dram_capacity"],
            ssd_bytes=s["local_ssd_bytes"],
            ssd_blocks=s["local_ssd_blocks"],
            ssd_capacity_bytes=s["local_ssd_capacity"],
            hits=self.pooled.hits,
            misses=self.pooled.misses,
            demotions=s["demotions"],
            evictions=s["evictions"],
            corrupt_blocks=s["corrupt"] + self._extra_corrupt(),
            peer_fetches=self.pooled.peer_fetches,
            data_address=self.data_address,
            data_socket=self.data_socket,
        )


def _put_tier(value: int) -> CacheTier:
    if value == 0:
        return CacheTier.CPU_DRAM
    tier = tier_from_proto(value)
    if tier not in (CacheTier.CPU_DRAM, CacheTier.LOCAL_SSD):
        raise InvalidArgument(
            f"Put tier must be TIER_CPU_DRAM or TIER_LOCAL_SSD, got {value} ({tier})"
        )
    return tier
