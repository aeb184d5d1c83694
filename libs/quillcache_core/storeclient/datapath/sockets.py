"""Blocking socket I/O of the block-data protocol, shared by the store's port and its
clients: whole-block receives and gather sends with the GIL released, kernel-side
timeouts."""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct

UNIX_BUFFER_BYTES = 4 << 20  # a Unix socket's buffers (the kernel caps them at wmem_max)


def tune_socket(sock: socket.socket, io_timeout_s: float) -> None:
    """No Nagle delay after a block header; blocking I/O with a kernel-side timeout.

    A Python socket with a timeout is non-blocking underneath: every send or receive
    becomes poll() plus a partial syscall, each retaking the GIL (poll() was the top
    native frame in a profile of a pull). A blocking socket with SO_RCVTIMEO/SO_SNDTIMEO
    moves a whole block in one syscall (`MSG_WAITALL` on receive) with the GIL released
    throughout (no throughput change measurable on this noisy machine); a stalled peer still ends the call
    after `io_timeout_s` (`is_timeout` tells that error apart). Buffer sizes stay the
    kernel's: setting SO_SNDBUF/SO_RCVBUF turns off TCP's autotuning, which measured no
    faster here."""
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    else:
        # A Unix socket has no autotuning: with the default ~208 KiB a 64 MB load was
        # about 300 hand-overs between sender and receiver, each waking a receiver that
        # shares its core (and the GIL) with an engine's busy main thread.
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, UNIX_BUFFER_BYTES)
    seconds = max(io_timeout_s, 0.001)
    timeval = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    try:
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    except OSError:
        sock.settimeout(seconds)  # no kernel timeouts here: Python's own


def is_timeout(exc: OSError) -> bool:
    """Whether a socket error is an I/O timeout (Python's or the kernel's EAGAIN)."""
    return isinstance(exc, TimeoutError | BlockingIOError | ssl.SSLWantReadError)


def recv_exactly(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` from `sock`; returns the bytes received (short only at end of stream)."""
    got = 0
    total = view.nbytes
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    while got < total:
        n = sock.recv_into(view[got:], total - got, flags)
        if n == 0:
            break
        got += n
    return got


# TLS has no gather write: small parts are joined into writes of about this size.
_TLS_WRITE_BYTES = 256 * 1024


def send_parts(sock: socket.socket, parts: list) -> None:
    """Send the buffers in order with as few syscalls as possible: a gather write in the
    clear (no joining copy); over TLS, one write per run of parts up to about 256 KiB
    joined (a write per part was two Python-level TLS writes a block: a batch of 440
    16 KiB puts took 880)."""
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    if isinstance(sock, ssl.SSLSocket):
        run: list[memoryview] = []
        size = 0
        for view in views:
            if run and size + view.nbytes > _TLS_WRITE_BYTES:
                sock.sendall(run[0] if len(run) == 1 else b"".join(run))
                run, size = [], 0
            run.append(view)
            size += view.nbytes
        if run:
            sock.sendall(run[0] if len(run) == 1 else b"".join(run))
        return
    while views:
        sent = sock.sendmsg(views)
        while sent:
            head = views[0]
            if sent >= head.nbytes:
                sent -= head.nbytes
                views.pop(0)
            else:
                views[0] = head[sent:]
                sent = 0


def drain(sock: socket.socket, nbytes: int, chunk_bytes: int = 1 << 20) -> None:
    """Read and discard `nbytes`; ConnectionError if the stream ends first."""
    scratch = memoryview(bytearray(min(nbytes, chunk_bytes)))
    left = nbytes
    while left:
        view = scratch[: min(left, scratch.nbytes)]
        if recv_exactly(sock, view) < view.nbytes:
            raise ConnectionError("connection closed inside a payload being skipped")
        left -= view.nbytes
