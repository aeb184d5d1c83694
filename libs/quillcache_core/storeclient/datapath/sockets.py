"""Blocking socket I/O of the block-data protocol, shared by the store's port and its
clients: whole-block receives and gather sends with the GIL released, and a deadline
per call."""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import struct
import time

UNIX_BUFFER_BYTES = 4 << 20  # a Unix socket's buffers (the kernel caps them at wmem_max)
_TIMEVAL = struct.Struct("ll")


def tune_socket(sock: socket.socket, io_timeout_s: float) -> None:
    """No Nagle delay after a block header; blocking I/O with a deadline: every call of
    this module on `sock` (a receive of a whole view, a send of all its parts) ends
    within `io_timeout_s` or raises a timeout (`is_timeout`), however slowly the peer
    reads or writes.

    In the clear, a blocking socket with SO_RCVTIMEO/SO_SNDTIMEO: a Python socket with a
    timeout is non-blocking underneath, and every send or receive becomes poll() plus a
    partial syscall, each retaking the GIL (poll() was the top native frame in a profile
    of a pull); the kernel's timeout moves a whole block in one syscall (`MSG_WAITALL`
    on receive) with the GIL released throughout. Over TLS, Python's own timeout: the
    kernel's does not reach through the ssl module, whose blocking reads and writes
    retry after every timed-out syscall (a silent peer held a read for ever). Buffer
    sizes stay the kernel's: setting SO_SNDBUF/SO_RCVBUF turns off TCP's autotuning,
    which measured no faster here."""
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
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(seconds)
        return
    try:
        sock.settimeout(None)
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            _set_kernel_timeout(sock, option, seconds)
    except OSError:
        sock.settimeout(seconds)  # no kernel timeouts here: Python's own


def _set_kernel_timeout(sock: socket.socket, option: int, seconds: float) -> None:
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(whole, int((seconds - whole) * 1e6)))


class _Deadline:
    """What is left of one call's time on a socket: the socket's timeout runs from the
    call's start, so each syscall after the first gets only the remainder (a peer that
    trickles a byte at a time cannot stretch the call); `restore` gives the socket its
    own timeout back for the next call."""

    __slots__ = ("_sock", "_option", "_budget", "_end", "_armed")

    def __init__(self, sock: socket.socket, option: int, start: float) -> None:
        self._sock = sock
        self._option = option
        timeout = sock.gettimeout()
        if timeout is None:
            whole, micros = _TIMEVAL.unpack(
                sock.getsockopt(socket.SOL_SOCKET, option, _TIMEVAL.size)
            )
            timeout = whole + micros / 1e6
        self._budget = timeout
        self._end = start + timeout
        self._armed = False

    def arm(self) -> None:
        """Give the next syscall what is left; TimeoutError when nothing is."""
        left = self._end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"socket call took longer than its {self._budget:g}s")
        self._armed = True
        self._apply(left)

    def restore(self) -> None:
        if self._armed:
            self._apply(self._budget)

    def _apply(self, seconds: float) -> None:
        if self._sock.gettimeout() is None:
            _set_kernel_timeout(self._sock, self._option, max(seconds, 0.001))
        else:
            self._sock.settimeout(seconds)


def is_timeout(exc: OSError) -> bool:
    """Whether a socket error is an I/O timeout (Python's or the kernel's EAGAIN)."""
    return isinstance(exc, TimeoutError | BlockingIOError | ssl.SSLWantReadError)


def wait_readable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether `sock` has something to read (bytes, or its end) within `timeout_s`."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(timeout_s, 0.0) * 1000))


def recv_exactly(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` from `sock`; returns the bytes received (short only at end of stream).
    Raises a timeout when `view` is not filled within the socket's io timeout."""
    total = view.nbytes
    if total == 0:
        return 0
    start = time.monotonic()
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    got = sock.recv_into(view, total, flags)
    if got == total or got == 0:
        return got
    deadline = _Deadline(sock, socket.SO_RCVTIMEO, start)
    try:
        while got < total:
            deadline.arm()
            n = sock.recv_into(view[got:], total - got, flags)
            if n == 0:
                break
            got += n
    finally:
        deadline.restore()
    return got


# TLS has no gather write: small parts are joined into writes of about this size.
_TLS_WRITE_BYTES = 256 * 1024


def send_parts(sock: socket.socket, parts: list) -> None:
    """Send the buffers in order with as few syscalls as possible: a gather write in the
    clear (no joining copy); over TLS, one write per run of parts up to about 256 KiB
    joined (a write per part was two Python-level TLS writes a block: a batch of 440
    16 KiB puts took 880). Raises a timeout when they are not all sent within the
    socket's io timeout."""
    start = time.monotonic()
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    deadline: _Deadline | None = None
    try:
        if isinstance(sock, ssl.SSLSocket):
            writes: list[memoryview] = []
            run: list[memoryview] = []
            size = 0
            for view in views:
                if run and size + view.nbytes > _TLS_WRITE_BYTES:
                    writes.append(run[0] if len(run) == 1 else memoryview(b"".join(run)))
                    run, size = [], 0
                run.append(view)
                size += view.nbytes
            if run:
                writes.append(run[0] if len(run) == 1 else memoryview(b"".join(run)))
            views = writes
        first = True
        while views:
            if not first:
                deadline = deadline or _Deadline(sock, socket.SO_SNDTIMEO, start)
                deadline.arm()
            first = False
            if isinstance(sock, ssl.SSLSocket):
                sent = sock.send(views[0])
            else:
                sent = sock.sendmsg(views)
            while sent:
                head = views[0]
                if sent >= head.nbytes:
                    sent -= head.nbytes
                    views.pop(0)
                else:
                    views[0] = head[sent:]
                    sent = 0
    finally:
        if deadline is not None:
            deadline.restore()


def drain(sock: socket.socket, nbytes: int, chunk_bytes: int = 1 << 20) -> None:
    """Read and discard `nbytes`; ConnectionError if the stream ends first."""
    scratch = memoryview(bytearray(min(nbytes, chunk_bytes)))
    left = nbytes
    while left:
        view = scratch[: min(left, scratch.nbytes)]
        if recv_exactly(sock, view) < view.nbytes:
            raise ConnectionError("connection closed inside a payload being skipped")
        left -= view.nbytes
