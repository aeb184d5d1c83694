"""The DRAM tier's memory taken up front (`--dram-prefault`): the tier's capacity mapped
and touched in the background when the store starts, so that a block stored later is
copied into memory already faulted in.

Why: a fresh buffer costs its page faults. Measured here, writing 128 MB of 512 KiB
blocks into new buffers took 95-130 ms of CPU, into touched ones 11 ms: a node being
sent an engine's prefills would otherwise spend about 0.1 s of CPU on every 128 MB,
taken from the engines when they share the host. A pool that owns its memory from the
start is also what an operator sizing a node expects (its RSS is its capacity).

The arena is a list of anonymous mappings of `chunk_bytes` each, made with
MAP_POPULATE by a thread at the lowest CPU priority. `carve(n)` hands out the next `n`
bytes of the mapped chunks (a buffer never spans two; a chunk's tail shorter than the
next buffer is left), or None when the chunks made so far have no room: the tier then
allocates as without the arena. The tier recycles carved buffers through its free lists
as any other; one it drops (to make room for another size class) is given back to the
system with `release` (MADV_DONTNEED), so the node's memory stays within its capacity.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading

MIB = 1024 * 1024
CHUNK_BYTES = 64 * MIB

log = logging.getLogger("quillcache.store.dram")


class DramArena:
    def __init__(self, capacity_bytes: int, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self.chunk_bytes = max(mmap.PAGESIZE, int(chunk_bytes) // mmap.PAGESIZE * mmap.PAGESIZE)
        self._lock = threading.Lock()
        self._chunks: list[tuple[mmap.mmap, memoryview]] = []
        self._chunk = 0  # the chunk carved from, and the offset in it
        self._offset = 0
        self._where: dict[int, tuple[int, int, int]] = {}  # id(buffer) -> chunk, offset, size
        self.ready_bytes = 0  # mapped and touched so far
        self.carved_bytes = 0
        self.released_bytes = 0
        self._stop = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="store-dram-prefault", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:  # the node's other work (and the engines beside it) go first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        left = self.capacity_bytes
        try:
            while left > 0 and not self._stop.is_set():
                size = min(self.chunk_bytes, -(-left // mmap.PAGESIZE) * mmap.PAGESIZE)
                try:
                    chunk = mmap.mmap(-1, size, flags=flags)
                except OSError as exc:
                    log.warning("DRAM prefault stopped at %d bytes: %s", self.ready_bytes, exc)
                    return
                try:
                    chunk.madvise(mmap.MADV_HUGEPAGE)
                except (AttributeError, OSError, ValueError):
                    pass
                with self._lock:
                    self._chunks.append((chunk, memoryview(chunk)))
                    self.ready_bytes += size
                left -= size
        finally:
            self.done.set()

    def stop(self) -> None:
        self._stop.set()

    def carve(self, nbytes: int) -> memoryview | None:
        """`nbytes` of touched memory, or None (no mapped chunk has room yet)."""
        with self._lock:
            while self._chunk < len(self._chunks):
                chunk, view = self._chunks[self._chunk]
                if nbytes <= len(chunk) - self._offset:
                    buf = view[self._offset : self._offset + nbytes]
                    self._where[id(buf)] = (self._chunk, self._offset, nbytes)
                    self._offset += nbytes
                    self.carved_bytes += nbytes
                    return buf
                if nbytes > len(chunk):
                    return None  # larger than a chunk: allocated as without the arena
                self._chunk, self._offset = self._chunk + 1, 0
            return None

    def owns(self, buf) -> bool:
        return id(buf) in self._where

    def release(self, buf) -> None:
        """A carved buffer the tier no longer keeps: its pages go back to the system (the
        range is not carved again)."""
        with self._lock:
            where = self._where.pop(id(buf), None)
            if where is None:
                return
            index, offset, size = where
            chunk = self._chunks[index][0]
            start = offset // mmap.PAGESIZE * mmap.PAGESIZE
            end = (offset + size) // mmap.PAGESIZE * mmap.PAGESIZE
            if end > start:
                try:
                    chunk.madvise(mmap.MADV_DONTNEED, start, end - start)
                except (AttributeError, OSError, ValueError):
                    pass
            self.released_bytes += size

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "prefault_bytes": self.ready_bytes,
                "prefault_carved_bytes": self.carved_bytes,
                "prefault_released_bytes": self.released_bytes,
            }
