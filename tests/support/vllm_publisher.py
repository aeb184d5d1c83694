"""A test stand-in for vLLM's KV-event publisher, byte-compatible on the wire.

`VllmEventEncoder` builds payloads the way vLLM's msgspec structs serialise them:

- encoding "array": tagged arrays (`["BlockStored", block_hashes, parent, ...]`) in a
  positional batch `[ts, events, data_parallel_rank]`, trailing defaulted fields
  omitted;
- encoding "map": tagged maps (`{"type": "BlockStored", ...}`, defaulted fields
  omitted) in a map batch `{"ts", "events", "data_parallel_rank"}`;
- encoding "sglang": SGLang's own publisher, tagged arrays with every field sent
  and none of vLLM's later ones (`[tag, block_hashes, parent, token_ids, block_size,
  lora_id, medium]`), a salted request's blocks followed by a metadata map
  `{"cache_salt": ...}`, in a batch `[ts, events, attn_dp_rank]`.

Engine block hashes are SHA-256 over (parent, tokens, extra keys) with a per-engine
seed, like vLLM's, reported as the digest's low 64 bits ("u64"), the same bits as a
signed integer ("i64"), or the whole 32-byte digest ("bytes32"). The encoder keeps a
prefix cache like the engine's, so storing a prompt reports only blocks not yet
cached, chained from the last cached one; a request's cache salt goes into the
first block's `extra_keys` entry (after the LoRA name), later blocks carry only the
LoRA name (or None).

`VllmStylePublisher` adds the sockets: a PUB bound to a free loopback port sending
(topic, 8-byte BE sequence from 0, payload), and a ROUTER replay socket (served by a
background thread) that answers a start sequence with (topic, seq, payload) for every
buffered batch at or after it, then (b"", -1, b""), vLLM's frames. Sequences listed in `drop` (or armed with `skip_next`) are
buffered but never sent live, to force a gap.

Run as a script for integration tests: it prints `READY <pub> <replay>` and then reads
one JSON command per line from stdin, answering `OK <seq>` (the batch's sequence
number; -1 when nothing was published) or `ERR <message>`:

    {"op": "store", "tokens": [...], "salt": "acme", "lora": null}
    {"op": "remove", "tokens": [...], "salt": "acme", "last": 2}   # last 2 blocks (default all)
    {"op": "clear"}
    {"op": "corrupt", "tokens": [...], "tokens2": [...], "kind": "token_count_mismatch"}
    {"op": "skip_next"}     # the next batch is buffered for replay but not sent live
    {"op": "quit"}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)
HASH_STYLES = ("u64", "i64", "bytes32")
ENCODINGS = ("array", "map")  # vLLM's
SGLANG = "sglang"

# Field names in vLLM's order; the first `required` have no default and are always sent.
STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
STORED_REQUIRED = 7
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
REMOVED_REQUIRED = 2


def _wire_hash(digest: bytes, style: str) -> int | bytes:
    if style == "bytes32":
        return digest
    low = int.from_bytes(digest[-8:], "big")
    if style == "u64":
        return low
    return low - (1 << 64) if low >= 1 << 63 else low


def encode_event(tag: str, values: dict[str, Any], encoding: str) -> Any:
    """One event as vLLM's tagged struct serialises it (defaulted trailing fields omitted)."""
    if encoding == SGLANG:
        if tag == "BlockStored":
            fields = [values.get(name) for name in STORED_FIELDS[:6]]
            if values.get("cache_salt"):
                fields.append({"cache_salt": values["cache_salt"]})
            return [tag, *fields]
        if tag == "BlockRemoved":
            return [tag, values.get("block_hashes"), values.get("medium")]
        return [tag]
    if tag == "BlockStored":
        names, required = STORED_FIELDS, STORED_REQUIRED
    elif tag == "BlockRemoved":
        names, required = REMOVED_FIELDS, REMOVED_REQUIRED
    else:
        names, required = (), 0
    if encoding == "map":
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


def encode_batch(
    events: Sequence[Any], encoding: str, *, ts: float, dp_rank: int | None = 0
) -> bytes:
    """A batch payload; `events` are already encoded with `encode_event`."""
    if encoding == "map":
        batch: Any = {"ts": ts, "events": list(events)}
        if dp_rank is not None:
            batch["data_parallel_rank"] = dp_rank
    else:
        batch = [ts, list(events)]
        if dp_rank is not None:
            batch.append(dp_rank)
    return msgpack.packb(batch, use_bin_type=True)


class VllmEventEncoder:
    """Events for prompts, with an engine-like prefix cache deciding what is new."""

    def __init__(
        self,
        *,
        encoding: str = "array",
        hash_style: str = "u64",
        block_size: int = 16,
        medium: str | None = "GPU",
        dp_rank: int | None = 0,
        seed: bytes | None = None,
    ) -> None:
        if encoding not in (*ENCODINGS, SGLANG):
            raise ValueError(f"encoding must be one of {(*ENCODINGS, SGLANG)}")
        if hash_style not in HASH_STYLES:
            raise ValueError(f"hash_style must be one of {HASH_STYLES}")
        self.encoding = encoding
        self.hash_style = hash_style
        self.block_size = block_size
        self.medium = medium
        self.dp_rank = dp_rank
        self.seed = seed if seed is not None else os.urandom(16)
        self.cached: set[bytes] = set()

    def digests(
        self, tokens: Sequence[int], salt: str | None = None, lora: str | None = None
    ) -> list[bytes]:
        """Engine digests of the full blocks of a prompt (vLLM-style chain)."""
        out: list[bytes] = []
        parent = self.seed
        bs = self.block_size
        for i in range(len(tokens) // bs):
            extra = self.extra_keys_for(i, salt, lora)
            raw = msgpack.packb([parent, list(tokens[i * bs : (i + 1) * bs]), extra])
            parent = hashlib.sha256(raw).digest()
            out.append(parent)
        return out

    @staticmethod
    def extra_keys_for(block: int, salt: str | None, lora: str | None) -> list[Any] | None:
        keys: list[Any] = []
        if lora:
            keys.append(lora)
        if block == 0 and salt:
            keys.append(salt)
        return keys or None

    def wire_hash(self, digest: bytes) -> int | bytes:
        return _wire_hash(digest, self.hash_style)

    def stored_event(
        self,
        tokens: Sequence[int],
        salt: str | None = None,
        lora: str | None = None,
        *,
        medium: str | None = None,
        only_new: bool = True,
    ) -> Any | None:
        """BlockStored for the prompt's blocks not cached yet (None if there are none)."""
        digests = self.digests(tokens, salt, lora)
        first = 0
        if only_new:
            while first < len(digests) and digests[first] in self.cached:
                first += 1
        if first >= len(digests):
            return None
        bs = self.block_size
        new = digests[first:]
        self.cached.update(new)
        extra = [self.extra_keys_for(i, salt, lora) for i in range(first, len(digests))]
        values = {
            "block_hashes": [self.wire_hash(d) for d in new],
            "parent_block_hash": self.wire_hash(digests[first - 1]) if first else None,
            "token_ids": list(tokens[first * bs : len(digests) * bs]),
            "block_size": bs,
            "lora_id": None if lora is None else 1,
            "medium": self.medium if medium is None else medium,
            "lora_name": lora,
            "extra_keys": extra if any(e is not None for e in extra) else None,
            "cache_salt": salt,  # SGLang's metadata (vLLM carries it in extra_keys)
        }
        return encode_event("BlockStored", values, self.encoding)

    def removed_event(
        self,
        tokens: Sequence[int],
        salt: str | None = None,
        lora: str | None = None,
        *,
        last: int | None = None,
        medium: str | None = None,
    ) -> Any:
        """BlockRemoved for the prompt's last `last` blocks (default: all of them)."""
        digests = self.digests(tokens, salt, lora)
        chosen = digests if last is None else digests[len(digests) - last :]
        self.cached.difference_update(chosen)
        values = {
            "block_hashes": [self.wire_hash(d) for d in reversed(chosen)],
            "medium": self.medium if medium is None else medium,
        }
        return encode_event("BlockRemoved", values, self.encoding)

    def cleared_event(self) -> Any:
        self.cached.clear()
        return encode_event("AllBlocksCleared", {}, self.encoding)

    def malformed_event(self, kind: str = "token_count_mismatch") -> Any:
        """An event the decoder must reject with reason `kind`."""
        values: dict[str, Any] = {
            "block_hashes": [self.wire_hash(hashlib.sha256(b"bad").digest())],
            "parent_block_hash": None,
            "token_ids": list(range(self.block_size)),
            "block_size": self.block_size,
            "lora_id": None,
            "medium": self.medium,
            "lora_name": None,
        }
        if kind == "token_count_mismatch":
            values["token_ids"] = values["token_ids"][:-1]
        elif kind == "bad_tokens":
            values["token_ids"] = [-1] * self.block_size
        elif kind == "bad_hash":
            values["block_hashes"] = ["not-a-hash"]
        elif kind == "bad_block_size":
            values["block_size"] = 0
        elif kind == "bad_medium":
            values["medium"] = "TAPE"
        elif kind == "unknown_event":
            return encode_event("BlockTeleported", {}, self.encoding)
        else:
            raise ValueError(f"unknown malformed kind {kind!r}")
        return encode_event("BlockStored", values, self.encoding)

    def batch(self, events: Sequence[Any], ts: float | None = None) -> bytes:
        return encode_batch(
            events, self.encoding, ts=time.time() if ts is None else ts, dp_rank=self.dp_rank
        )


class VllmStylePublisher:
    """PUB + ROUTER replay, framed as vLLM's ZmqEventPublisher does."""

    def __init__(
        self,
        encoder: VllmEventEncoder | None = None,
        *,
        host: str = "127.0.0.1",
        buffer_steps: int = 1000,
        topic: bytes = b"",
        drop: set[int] | None = None,
    ) -> None:
        self.encoder = encoder or VllmEventEncoder()
        self.topic = topic
        self.drop = set(drop or ())
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(f"tcp://{host}:*")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(f"tcp://{host}:*")
        self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._next_seq = 0
        self._skip_next = False
        self._running = True
        self.replays_served = 0
        self._thread = threading.Thread(target=self._serve_replay, daemon=True, name="replay")
        self._thread.start()

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def skip_next(self) -> int:
        """The next batch is buffered (replayable) but not sent live; returns its seq."""
        self._skip_next = True
        return self._next_seq

    def publish(self, events: Sequence[Any]) -> int:
        """Publish one batch of encoded events; returns its sequence number."""
        payload = self.encoder.batch(events)
        return self.publish_payload(payload)

    def publish_payload(self, payload: bytes) -> int:
        seq = self._next_seq
        self._next_seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        if self._skip_next or seq in self.drop:
            self._skip_next = False
            return seq
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while self._running:
            try:
                if not dict(poller.poll(50)):
                    continue
                frames = self._router.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frames) != 3:
                continue
            client, _empty, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            with self._lock:
                pending = [(s, p) for s, p in self._buffer if s >= start]
            for seq, payload in pending:
                self._router.send_multipart(
                    [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                )
            self._router.send_multipart([client, b"", b"", END_SEQ, b""])
            self.replays_served += 1

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> VllmStylePublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run_command(pub: VllmStylePublisher, cmd: dict[str, Any]) -> int | None:
    """Execute one CLI command; returns the published seq, -1 for none, None to quit."""
    enc = pub.encoder
    op = cmd.get("op")
    tokens = cmd.get("tokens", [])
    salt, lora = cmd.get("salt"), cmd.get("lora")
    medium = cmd.get("medium")
    if op == "store":
        event = enc.stored_event(tokens, salt, lora, medium=medium)
        return -1 if event is None else pub.publish([event])
    if op == "remove":
        return pub.publish(
            [enc.removed_event(tokens, salt, lora, last=cmd.get("last"), medium=medium)]
        )
    if op == "clear":
        return pub.publish([enc.cleared_event()])
    if op == "corrupt":
        events = []
        first = enc.stored_event(tokens, salt, lora)
        if first is not None:
            events.append(first)
        events.append(enc.malformed_event(cmd.get("kind", "token_count_mismatch")))
        second = enc.stored_event(cmd.get("tokens2", []), salt, lora)
        if second is not None:
            events.append(second)
        return pub.publish(events)
    if op == "skip_next":
        return pub.skip_next()
    if op == "quit":
        return None
    raise ValueError(f"unknown op {op!r}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoding", choices=(*ENCODINGS, SGLANG), default="array")
    parser.add_argument("--hash-style", choices=HASH_STYLES, default="u64")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--medium", default="GPU")
    parser.add_argument("--dp-rank", type=int, default=0)
    parser.add_argument("--buffer", type=int, default=1000)
    parser.add_argument(
        "--drop", type=int, action="append", default=[], help="never send this seq live"
    )
    args = parser.parse_args(argv)
    encoder = VllmEventEncoder(
        encoding=args.encoding,
        hash_style=args.hash_style,
        block_size=args.block_size,
        medium=args.medium,
        dp_rank=args.dp_rank,
    )
    with VllmStylePublisher(encoder, buffer_steps=args.buffer, drop=set(args.drop)) as pub:
        print(f"READY {pub.endpoint} {pub.replay_endpoint}", flush=True)
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                seq = _run_command(pub, json.loads(line))
            except Exception as exc:  # report and keep serving
                print(f"ERR {type(exc).__name__}: {exc}", flush=True)
                continue
            if seq is None:
                print("OK -1", flush=True)
                break
            print(f"OK {seq}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
