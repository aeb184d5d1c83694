"""Shared fixtures. `support/` (next to this file) holds helpers the tests import."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from quillcache_core.launch.etcd_server import EtcdServer

# Faster elections than etcd's defaults (100 ms / 1000 ms): quicker start and restart,
# and a minimum lease TTL of 1 s instead of 2 s.
ETCD_TEST_ARGS = ("--heartbeat-interval", "50", "--election-timeout", "500")


@pytest.fixture
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A fresh single-member etcd on 127.0.0.1 (free ports, temp data dir) per test.

    Supports `restart()` / `restart(wipe_data=True)` on the same ports and data dir."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd"), extra_args=ETCD_TEST_ARGS)
    server.start()
    try:
        yield server
    finally:
        server.close()
