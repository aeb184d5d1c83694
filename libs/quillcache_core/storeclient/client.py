"""Async client of a store node (grpc.aio), for engines, the transfer service and tests.

    client = StoreClient("127.0.0.1:50051")
    tier = await client.put(key, payload)            # -> CacheTier it landed in
    data, tier = await client.get(key)               # NotFound if absent
    await client.close()

Every call has a deadline (`timeout_s`). Only idempotent calls (get, exists, stats) are
retried, on UNAVAILABLE, with exponential backoff; put and delete are not. A failed call
raises the domain error of its status (`quillcache_core.rpc.server.error_from_status`):
NotFound, InvalidArgument, CapacityExceeded, Corrupt, NodeUnavailable.

Put and Get move block bytes as hand-framed chunks (see `wire`): the payload is never
copied into a protobuf message. `put` sends the payload's xxh3-64 in the first chunk, so
the store refuses (DATA_LOSS) bytes that changed on the way; `get` checks the checksum
the store sends before returning the bytes.

With `data_address` (the node's block-data port, `stats()["data_address"]` or its
registry record) `put` goes over raw TCP instead (`datapath.put`): the same checks and
acknowledgement, without gRPC's per-chunk cost.

Not thread-safe: use one client per event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
import grpc.aio

from quillcache.v1 import store_pb2
from quillcache_core.errors import Corrupt, InvalidArgument, NodeUnavailable, QuillCacheError
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.rpc.server import error_from_status
from quillcache_core.security.tls import Tls, grpc_channel
from quillcache_core.storeclient import wire
from quillcache_core.storeclient.blockcodec import payload_checksum
from quillcache_core.storeclient.datapath.put import BlockPusher
from quillcache_core.wire.tiers import tier_from_proto, tier_to_proto

log = logging.getLogger(__name__)

T = TypeVar("T")

SERVICE = "quillcache.v1.Store"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MIN_CHUNK_BYTES = 4 * 1024
MAX_CHUNK_BYTES = 8 * 1024 * 1024
_PUSH_THREADS = 16

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def domain_error(exc: grpc.aio.AioRpcError) -> QuillCacheError:
    """The domain error of a failed call (DEADLINE_EXCEEDED, UNAVAILABLE... -> NodeUnavailable)."""
    return error_from_status(exc.code(), exc.details() or exc.code().name)


class StoreClient:
    """One store node's gRPC API. See the module docstring for deadlines and retries."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 10.0,
        chunk_bytes: int = 1 << 20,
        retries: int = 3,
        backoff_s: float = 0.05,
        data_address: str = "",
        tls: Tls | None = None,
    ) -> None:
        """`tls`: the caller's certificates (mutual TLS on both the gRPC and the
        block-data port); None only against an --insecure node."""
        if not address:
            raise InvalidArgument("store address is empty")
        if timeout_s <= 0:
            raise InvalidArgument(f"timeout_s must be positive, got {timeout_s}")
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidArgument(
                f"chunk_bytes must be in {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}, got {chunk_bytes}"
            )
        self.address = address
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self.retries = max(0, retries)
        self.backoff_s = backoff_s
        self.tls = tls
        self._channel: grpc.aio.Channel | None = None
        self._closed = False
        # Puts through the node's block-data port (raw TCP) instead of gRPC, if given.
        self.data_address = data_address
        self._pusher: BlockPusher | None = None
        self._push_threads: ThreadPoolExecutor | None = None

    # --- channel ------------------------------------------------------------------------

    def _chan(self) -> grpc.aio.Channel:
        # Created on first use, so the channel belongs to the loop that uses it.
        if self._closed:
            raise NodeUnavailable(f"store client for {self.address} is closed")
        if self._channel is None:
            self._channel = grpc_channel(self.address, self.tls, CHANNEL_OPTIONS)
            ch = self._channel
            self._put_rpc = ch.stream_unary(
                f"/{SERVICE}/Put",
                request_serializer=None,  # requests are pre-framed bytes
                response_deserializer=store_pb2.PutResponse.FromString,
            )
            self._get_rpc = ch.unary_stream(
                f"/{SERVICE}/Get",
                request_serializer=store_pb2.GetRequest.SerializeToString,
                response_deserializer=wire.decode_get_chunk,
            )
            self._exists_rpc = ch.unary_unary(
                f"/{SERVICE}/Exists",
                request_serializer=store_pb2.ExistsRequest.SerializeToString,
                response_deserializer=store_pb2.ExistsResponse.FromString,
            )
            self._delete_rpc = ch.unary_unary(
                f"/{SERVICE}/Delete",
                request_serializer=store_pb2.DeleteRequest.SerializeToString,
                response_deserializer=store_pb2.DeleteResponse.FromString,
            )
            self._stats_rpc = ch.unary_unary(
                f"/{SERVICE}/Stats",
                request_serializer=store_pb2.StoreStatsRequest.SerializeToString,
                response_deserializer=store_pb2.StoreStatsResponse.FromString,
            )
            self._pull_rpc = ch.unary_stream(
                f"/{SERVICE}/Pull",
                request_serializer=store_pb2.PullRequest.SerializeToString,
                response_deserializer=store_pb2.PullResult.FromString,
            )
        return self._channel

    async def close(self) -> None:
        self._closed = True
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()
        pusher, threads = self._pusher, self._push_threads
        self._pusher = self._push_threads = None
        if threads is not None:
            threads.shutdown(wait=False)
        if pusher is not None:
            pusher.close()

    async def __aenter__(self) -> StoreClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # --- retries ----------------------------------------------------------------------------

    async def _retrying(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run an idempotent call, again on UNAVAILABLE (backoff doubling up to 1 s)."""
        delay = self.backoff_s
        for n in range(self.retries + 1):
            try:
                return await attempt()
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or n == self.retries:
                    raise domain_error(exc) from None
                log.debug(
                    "%s on %s unavailable (%s); retry in %.2fs",
                    what,
                    self.address,
                    exc.details(),
                    delay,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        raise AssertionError("unreachable")

    # --- block API ------------------------------------------------------------------------------

    async def put(
        self,
        key: KvBlockKey,
        payload: bytes | memoryview,
        *,
        durable: bool = False,
        tier: CacheTier = CacheTier.CPU_DRAM,
    ) -> CacheTier:
        """Store a block; returns the tier it landed in. Not retried.

        With `durable` the store acknowledges only after its SSD transaction commits.
        `tier` is CPU_DRAM (demoted to SSD under pressure) or LOCAL_SSD. With a
        `data_address` the block goes through the node's block-data port.
        """
        view = memoryview(payload)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        total = view.nbytes
        if total == 0:
            raise InvalidArgument("cannot store an empty block")
        if self.data_address:
            return await self._push(key, view, durable, tier)
        header = store_pb2.PutChunk(
            key=wire.key_to_proto(key),
            total_bytes=total,
            checksum=payload_checksum(view),
            durable=durable,
            tier=tier_to_proto(tier),
        )
        step = self.chunk_bytes
        call = self.open_put()
        try:
            await call.write(wire.encode_put_chunk(header, view[:step]))
            for offset in range(step, total, step):
                await call.write(wire.encode_put_chunk(None, view[offset : offset + step]))
            await call.done_writing()
            reply = await call
        except grpc.aio.AioRpcError as exc:
            raise domain_error(exc) from None
        except asyncio.InvalidStateError:
            # The server ended the call while we were writing: its status says why.
            code = await call.code()
            raise error_from_status(code, await call.details()) from None
        landed = tier_from_proto(reply.tier)
        return landed if landed is not None else tier

    async def _push(
        self, key: KvBlockKey, view: memoryview, durable: bool, tier: CacheTier
    ) -> CacheTier:
        if self._closed:
            raise NodeUnavailable(f"store client for {self.address} is closed")
        if self._pusher is None:
            self._pusher = BlockPusher(io_timeout_s=self.timeout_s, tls=self.tls)
            # Its own threads: the loop's default executor is small (a few per core),
            # and a durable put holds its thread until the store's SSD commit.
            self._push_threads = ThreadPoolExecutor(
                _PUSH_THREADS, thread_name_prefix="store-client-push"
            )
        call = functools.partial(
            self._pusher.put, self.data_address, key, view, durable=durable, tier=tier
        )
        return await asyncio.get_running_loop().run_in_executor(self._push_threads, call)

    async def get(self, key: KvBlockKey, *, allow_remote: bool = False) -> tuple[bytes, CacheTier]:
        """The block's bytes (checked against the store's checksum) and the tier it was
        served from. NotFound if absent (and, with `allow_remote`, on no peer either)."""
        return await self._retrying("get", lambda: self._get_once(key, allow_remote))

    async def _get_once(self, key: KvBlockKey, allow_remote: bool) -> tuple[bytes, CacheTier]:
        parts: list[memoryview] = []
        first: store_pb2.GetChunk | None = None
        async for frame in self.open_get(key, allow_remote=allow_remote):
            if first is None:
                first = frame.header
            if frame.data.nbytes:
                parts.append(frame.data)
        if first is None:
            raise NodeUnavailable(f"store {self.address} ended Get without a chunk")
        data = parts[0].tobytes() if len(parts) == 1 else b"".join(parts)
        if len(data) != first.total_bytes:
            raise Corrupt(
                f"block {key.block_hash} from {self.address}: {len(data)} bytes received, "
                f"{first.total_bytes} announced"
            )
        if first.checksum and payload_checksum(data) != first.checksum:
            raise Corrupt(f"block {key.block_hash} from {self.address} failed its checksum")
        tier = tier_from_proto(first.tier) or CacheTier.CPU_DRAM
        return data, tier

    async def exists(self, keys: Sequence[KvBlockKey]) -> list[CacheTier | None]:
        """Per key, the fastest tier holding it on this node, or None."""
        if not keys:
            return []
        request = store_pb2.ExistsRequest(keys=[wire.key_to_proto(k) for k in keys])

        async def attempt():
            self._chan()
            return await self._exists_rpc(request, timeout=self.timeout_s)

        reply = await self._retrying("exists", attempt)
        tiers = list(reply.tiers)
        out: list[CacheTier | None] = []
        for i, present in enumerate(reply.exists):
            if not present:
                out.append(None)
                continue
            tier = tier_from_proto(tiers[i]) if i < len(tiers) else None
            out.append(tier or CacheTier.CPU_DRAM)
        return out

    async def delete(self, keys: Sequence[KvBlockKey]) -> int:
        """Remove blocks from both tiers; returns how many were held. Not retried."""
        if not keys:
            return 0
        request = store_pb2.DeleteRequest(keys=[wire.key_to_proto(k) for k in keys])
        self._chan()
        try:
            reply = await self._delete_rpc(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise domain_error(exc) from None
        return reply.deleted

    async def stats(self) -> dict:
        """The node's StoreStatsResponse as a dict (every field, defaults included)."""

        async def attempt():
            self._chan()
            return await self._stats_rpc(store_pb2.StoreStatsRequest(), timeout=self.timeout_s)

        reply = await self._retrying("stats", attempt)
        return {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}

    # --- streaming building blocks (transfer service) -------------------------------------------

    def open_get(
        self,
        key: KvBlockKey,
        *,
        allow_remote: bool = False,
        chunk_bytes: int | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[wire.GetFrame]:
        """The raw Get stream: `GetFrame`s, the first carrying total_bytes and checksum.

        Not retried; raises grpc.aio.AioRpcError (see `domain_error`). Frames' data views
        point into the received messages and stay valid while referenced.
        """
        self._chan()
        request = store_pb2.GetRequest(
            key=wire.key_to_proto(key),
            allow_remote=allow_remote,
            chunk_bytes=chunk_bytes or self.chunk_bytes,
        )
        return self._get_rpc(request, timeout=timeout_s or self.timeout_s)

    def open_put(self, *, timeout_s: float | None = None) -> grpc.aio.StreamUnaryCall:
        """A raw Put call: write `wire.encode_put_chunk(...)` bytes, `done_writing()`,
        then await it for the PutResponse. Cancel it to abandon the block (nothing is
        stored). Not retried."""
        self._chan()
        return self._put_rpc(timeout=timeout_s or self.timeout_s)

    async def open_pull(
        self,
        source_node: str,
        source_data_address: str,
        keys: Sequence[KvBlockKey],
        *,
        tier: CacheTier = CacheTier.CPU_DRAM,
        durable: bool = False,
        timeout_s: float | None = None,
        max_batch_results: int = 16,
    ) -> AsyncIterator[list[store_pb2.PullResult]]:
        """Have this node pull `keys` from a source node's block-data port (the block
        data path): lists of PullResults, one result per key in all (`index`; not
        necessarily in order), as blocks are stored or fail. The node sends up to
        `max_batch_results` per message, those finished since its last one (a message
        per block costs both ends more than storing the block); a node that does not
        batch yields lists of one. Not retried; raises grpc.aio.AioRpcError (see
        `domain_error`). Closing the iterator cancels the call.
        """
        if max_batch_results < 1:
            raise InvalidArgument(f"max_batch_results must be >= 1, got {max_batch_results}")
        self._chan()
        request = store_pb2.PullRequest(
            source_node=source_node,
            source_data_address=source_data_address,
            keys=[wire.key_to_proto(k) for k in keys],
            tier=tier_to_proto(tier),
            durable=durable,
            max_batch_results=max_batch_results,
        )
        call = self._pull_rpc(request, timeout=timeout_s or self.timeout_s)
        try:
            async for message in call:
                yield list(message.results) if message.results else [message]
        finally:
            if not call.done():
                call.cancel()
