"""KV events exactly as vLLM publishes them (vllm/distributed/kv_events.py).

Encoding (pure functions): events as tagged arrays (`["BlockStored", ...]`, trailing
defaulted fields omitted) in a positional batch `[ts, events, data_parallel_rank]`, or
as tagged maps (`{"type": "BlockStored", ...}`, defaulted fields omitted) in a map
batch `{"ts", "events", "data_parallel_rank"}`: both are in the wild.

`KvEventPublisher` adds vLLM's sockets: a PUB socket sending 3 frames per batch (topic,
8-byte big-endian sequence from 0, msgpack payload) and a ROUTER replay socket that
answers a start sequence (8-byte BE) with (topic, seq, payload) for every buffered batch
at or after it, then (b"", -1 as signed 8-byte BE, b""), as vLLM's does.

ZMQ sockets have no authentication and the events carry every tenant's token ids and
cache salt, so given a directory the sockets are unix-domain ones in it (`ipc://`), the
directory mode 0700: only this user's processes can connect. TCP only without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from quillcache_core.errors import InvalidArgument
from quillcache_core.kvevents.fields import REMOVED_FIELDS, STORED_FIELDS
from quillcache_simengine.kvcache import CachedBlock, extra_keys_for

__all__ = [
    "ENCODINGS",
    "KvEventPublisher",
    "all_cleared",
    "block_removed",
    "block_stored",
    "encode_batch",
]

log = logging.getLogger(__name__)

ENCODINGS = ("array", "map")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"

# The first `required` fields of each event have no default in vLLM and are always sent.
_STORED_REQUIRED = 7
_REMOVED_REQUIRED = 2


def _check_encoding(encoding: str) -> str:
    if encoding not in ENCODINGS:
        raise InvalidArgument(f"event encoding must be one of {ENCODINGS}, got {encoding!r}")
    return encoding


def _encode(tag: str, values: dict[str, Any], names: tuple[str, ...], required: int, enc: str):
    if enc == "map":
        out: dict[str, Any] = {"type": tag}
        for i, name in enumerate(names):
            value = values.get(name)
            if i < required or value is not None:
                out[name] = value
        return out
    fields = [values.get(name) for name in names]
    while len(fields) > required and fields[-1] is None:
        fields.pop()
    return [tag, *fields]


def block_stored(blocks: Sequence[CachedBlock], block_size: int, encoding: str) -> Any:
    """BlockStored for consecutive blocks of one request (their chain, in order)."""
    if not blocks:
        raise InvalidArgument("BlockStored needs at least one block")
    extra = [extra_keys_for(b.index, b.cache_salt) for b in blocks]
    tokens: list[int] = []
    for b in blocks:
        tokens.extend(b.token_ids)
    values = {
        "block_hashes": [b.engine_hash for b in blocks],
        "parent_block_hash": blocks[0].parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": MEDIUM_GPU,
        "lora_name": None,
        "extra_keys": extra if any(e is not None for e in extra) else None,
    }
    return _encode(
        "BlockStored", values, STORED_FIELDS, _STORED_REQUIRED, _check_encoding(encoding)
    )


def block_removed(engine_hashes: Sequence[int], encoding: str) -> Any:
    values = {"block_hashes": list(engine_hashes), "medium": MEDIUM_GPU}
    return _encode(
        "BlockRemoved", values, REMOVED_FIELDS, _REMOVED_REQUIRED, _check_encoding(encoding)
    )


def all_cleared(encoding: str) -> Any:
    return _encode("AllBlocksCleared", {}, (), 0, _check_encoding(encoding))


def encode_batch(events: Sequence[Any], encoding: str, *, ts: float, dp_rank: int = 0) -> bytes:
    if _check_encoding(encoding) == "map":
        batch: Any = {"ts": ts, "events": list(events), "data_parallel_rank": dp_rank}
    else:
        batch = [ts, list(events), dp_rank]
    return msgpack.packb(batch, use_bin_type=True)


def stored_runs(blocks: Sequence[CachedBlock]) -> list[list[CachedBlock]]:
    """Split newly stored blocks into chains: a run breaks where a block's parent is not
    the previous block (a block in between was cached already)."""
    runs: list[list[CachedBlock]] = []
    for block in blocks:
        if runs and block.parent == runs[-1][-1].engine_hash:
            runs[-1].append(block)
        else:
            runs.append([block])
    return runs


class KvEventPublisher:
    """PUB + ROUTER replay on `host` (TCP), or with `ipc_dir` the unix sockets
    `<ipc_dir>/<ipc_name>-events` and `-replay` (`private_dir`). Call `start` in the
    event loop, `close` at the end.

    `publish` never blocks: a PUB socket drops messages for a slow subscriber (which
    then sees a gap and replays)."""

    def __init__(
        self,
        host: str,
        *,
        pub_port: int = 0,
        replay_port: int = 0,
        encoding: str = "array",
        buffer_batches: int = 10_000,
        topic: bytes = b"",
        dp_rank: int = 0,
        ipc_dir: str = "",
        ipc_name: str = "engine",
    ) -> None:
        self.encoding = _check_encoding(encoding)
        self.topic = topic
        self.dp_rank = dp_rank
        self._host = host
        self._ports = (pub_port, replay_port)
        self._ipc = (ipc_dir, ipc_name)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._next_seq = 0
        self._ctx: zmq.Context | None = None
        self._actx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.endpoint = ""
        self.replay_endpoint = ""
        self.batches_sent = 0
        self.batches_dropped = 0
        self.replays_served = 0
        # Tests: batches are numbered and kept for replay but not sent (lost on the way).
        self.losing = False

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def start(self) -> None:
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        binds = self._binds()
        pub.bind(binds[0])
        self._pub = pub
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        router = self._actx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(binds[1])
        self._router = router
        self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._task = asyncio.get_running_loop().create_task(
            self._serve_replay(router), name="replay"
        )
        log.info("KV events on %s (replay %s, %s encoding)", *self.endpoints(), self.encoding)

    def _binds(self) -> tuple[str, str]:
        ipc_dir, name = self._ipc
        if ipc_dir:
            base = private_dir(ipc_dir)
            return f"ipc://{base}/{name}-events", f"ipc://{base}/{name}-replay"
        pub_port, replay_port = self._ports
        return _bind_address(self._host, pub_port), _bind_address(self._host, replay_port)

    def endpoints(self, advertise_host: str | None = None) -> tuple[str, str]:
        """(events, replay) endpoints, a TCP one's host replaced by `advertise_host`."""
        if advertise_host is None:
            return self.endpoint, self.replay_endpoint
        return _with_host(self.endpoint, advertise_host), _with_host(
            self.replay_endpoint, advertise_host
        )

    def publish(self, events: Sequence[Any], *, ts: float | None = None) -> int:
        """Send one batch of encoded events; returns its sequence number."""
        payload = encode_batch(
            events, self.encoding, ts=time.time() if ts is None else ts, dp_rank=self.dp_rank
        )
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        if self._pub is None or self.losing:
            return seq
        try:
            self._pub.send_multipart(
                [self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
            )
            self.batches_sent += 1
        except zmq.Again:
            self.batches_dropped += 1
        return seq

    def buffered(self, start: int = 0) -> list[tuple[int, bytes]]:
        """The buffered (seq, payload) batches at or after `start`, oldest first."""
        return [item for item in self._buffer if item[0] >= start]

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await router.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                if router.closed or exc.errno == zmq.ETERM:
                    return
                log.warning("replay socket: %s", exc)
                await asyncio.sleep(0.05)
                continue
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("replay socket: ignoring a request of %d frames", len(frames))
                continue
            client, _empty, start_bytes = frames
            start = int.from_bytes(start_bytes, "big", signed=True)
            for seq, payload in self.buffered(start):
                # vLLM's frames: the topic, then the live socket's two
                await router.send_multipart(
                    [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                )
            await router.send_multipart([client, b"", b"", END_SEQ, b""])
            self.replays_served += 1
            log.debug("replayed from %d to a subscriber", start)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        for ctx in (self._ctx, self._actx):
            if ctx is not None:
                ctx.term()
        self._ctx = self._actx = None


def private_dir(path: str) -> Path:
    """`path` as a directory only this user may open: made mode 0700 if missing;
    InvalidArgument if it is another user's or open to group or others."""
    base = Path(path).absolute()
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = base.stat()
    if mode.st_uid != os.getuid() or mode.st_mode & 0o077:
        raise InvalidArgument(
            f"KV event socket directory {base} must be this user's, mode 0700 "
            f"(it is {mode.st_mode & 0o777:o}, uid {mode.st_uid})"
        )
    return base


def _bind_address(host: str, port: int) -> str:
    return f"tcp://{host}:{port}" if port else f"tcp://{host}:*"


def _with_host(endpoint: str, host: str) -> str:
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return endpoint  # a unix socket has no host
    _old, _, port = rest.rpartition(":")
    return f"{scheme}://{host}:{port}"
