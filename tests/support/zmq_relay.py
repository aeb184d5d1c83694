"""A ZMQ relay that can drop messages: a network fault between a publisher and us.

SUB (connected to the real publisher) -> PUB (bound where the subscriber is told the
publisher is). `drop_next()` makes it swallow the next message whole, as a lost packet
or a subscriber's overflowing queue would; while `losing` is set it swallows every
message; everything else passes unchanged.
"""

from __future__ import annotations

import threading

import zmq


class DroppingRelay:
    def __init__(self, upstream: str, downstream_port: int) -> None:
        self.upstream = upstream
        self.downstream = f"tcp://127.0.0.1:{downstream_port}"
        self.forwarded = 0
        self.dropped = 0
        self.losing = False
        self._drop = threading.Event()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="zmq-relay", daemon=True)

    def start(self) -> DroppingRelay:
        self._thread.start()
        return self

    def drop_next(self) -> None:
        self._drop.set()

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.upstream)  # connects whenever the publisher binds
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self.downstream)
        try:
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if self._drop.is_set() or self.losing:
                    self._drop.clear()
                    self.dropped += 1
                    continue
                pub.send_multipart(frames)
                self.forwarded += 1
        finally:
            sub.close()
            pub.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.term()
