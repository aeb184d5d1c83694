"""A ZMQ relay that can drop messages: a network fault between a publisher and us.

SUB (connected to the real publisher) -> PUB (bound where the subscriber is told the
publisher is). `drop_next()` makes it swallow the next message whole, as a lost packet
or a subscriber's overflowing queue would; while `losing` is set it swallows every
message; everything else passes unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import zmq

from quillcache_core.launch.cluster import LocalCluster
from quillcache_core.launch.vllm_engine import free_port


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


@contextlib.contextmanager
def relayed_vllm_cluster(
    data_dir, *, timeout_s: float, engine_options: dict[int, dict], **cluster_args
) -> Iterator[tuple[LocalCluster, dict, DroppingRelay]]:
    """A vLLM `LocalCluster` whose engine-0 publishes its KV events through a
    `DroppingRelay` (its own port, the relay's port what the conductors subscribe to),
    without the pool connector: vLLM's own prefix cache is what these tests follow.
    `engine_options` adds to or overrides any engine's; yields (cluster, endpoints, relay)."""
    events_port, relay_port = free_port(), free_port()
    relay = DroppingRelay(f"tcp://127.0.0.1:{events_port}", relay_port).start()
    relayed = {
        "events_port": events_port,
        "kv_events_endpoint": f"tcp://127.0.0.1:{relay_port}",
        "connector": False,
    }
    options = {**engine_options, 0: {**relayed, **engine_options.get(0, {})}}
    cluster = LocalCluster(
        data_dir, log=lambda *_: None, engine_kind="vllm", engine_options=options, **cluster_args
    )
    try:
        yield cluster, cluster.start(timeout_s=timeout_s), relay
    finally:
        cluster.stop()
        relay.stop()
