"""The SSD tier's in-memory shapes: a block's meta row, a queued write, a prepared put;
and the malloc tuning its large values want."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import msgpack

from quillcache_core.model import KvBlockKey
from quillcache_core.storeclient.blockcodec import (
    decode_identity,
    encode_identity,
)

log = logging.getLogger(__name__)

MIB = 1024 * 1024
_META_VERSION = 1
_RECENT_WRITER_S = 0.05


@dataclass(slots=True)
class _Meta:
    key: KvBlockKey
    payload_len: int
    record_len: int
    checksum: int
    seq: int

    def pack(self) -> bytes:
        return msgpack.packb(
            [
                _META_VERSION,
                encode_identity(self.key),
                self.payload_len,
                self.record_len,
                self.checksum,
                self.seq,
            ],
            use_bin_type=True,
        )

    @classmethod
    def unpack(cls, raw: bytes) -> _Meta:
        version, ident, payload_len, record_len, digest, seq = msgpack.unpackb(raw, raw=False)
        if version != _META_VERSION:
            raise ValueError(f"unknown meta version {version}")
        return cls(decode_identity(ident), payload_len, record_len, digest, seq)


class _Op:
    __slots__ = ("kind", "sk", "record", "meta", "durable", "done", "error", "nbytes")

    def __init__(self, kind: str, sk: bytes, record=None, meta=None, durable=False):
        self.kind = kind  # "put" | "delete" | "barrier"
        self.sk = sk
        self.record = record
        self.meta = meta
        self.durable = durable
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.nbytes = len(record) if record is not None else 0

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class _Prepared:
    __slots__ = ("key", "sk", "n", "digest", "header", "view", "record", "op")

    def __init__(self, key, sk, n, digest, header, view):
        self.key = key
        self.sk = sk
        self.n = n
        self.digest = digest
        self.header = header
        self.view = view
        self.record = None
        self.op: _Op | None = None
