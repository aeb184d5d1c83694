"""Shared fixtures. `support/` (next to this file) holds helpers the tests import.

Where a test lives: `unit/` (pure logic, marker `unit`), `integration/` (real processes
on loopback, `integration`), `e2e/` (the whole local cluster, `e2e`); every file sets
its directory's marker as `pytestmark`. The tests of a module are named after it:
`unit/test_<module>.py` (`conductor/ledger.py` -> `unit/test_ledger.py`), or
`test_<service>_<module>.py` where two services have a module of that name; a feature
that crosses modules is named after the feature (`test_plans_replay.py`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from quillcache_core.launch.etcd_server import EtcdServer
from tests.support.tls import certs_dir

# Faster elections than etcd's defaults (100 ms / 1000 ms): quicker start and restart,
# and a minimum lease TTL of 1 s instead of 2 s.
ETCD_TEST_ARGS = ("--heartbeat-interval", "50", "--election-timeout", "500")


def _etcd(tmp_path_factory: pytest.TempPathFactory, *, secure: bool) -> Iterator[EtcdServer]:
    server = EtcdServer(
        tmp_path_factory.mktemp("etcd"),
        extra_args=ETCD_TEST_ARGS,
        tls_dir=certs_dir() if secure else None,
    )
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A fresh single-member etcd on 127.0.0.1 (free ports, temp data dir) per test,
    secure as in production: TLS with client certificates of the session's CA
    (`tests.support.tls`) and RBAC, each role writing only its own kind's records.

    Clients: `etcd_server.client_url` (https://) with `tls(role)`, or
    `etcd_server.tls(role)`; etcdctl via `tests.support.etcdctl`.
    Supports `restart()` / `restart(wipe_data=True)` on the same ports and data dir."""
    yield from _etcd(tmp_path_factory, secure=True)


@pytest.fixture
def plain_etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """Like `etcd_server`, but plaintext and without auth (`--insecure` setups)."""
    yield from _etcd(tmp_path_factory, secure=False)
