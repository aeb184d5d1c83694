"""Fixtures shared by the integration tests of this folder."""

from __future__ import annotations

import pytest

from tests.support.stores import Fleet


@pytest.fixture
def fleet(etcd_server, tmp_path):
    """etcd + conductor + store nodes (+ transfer) as processes; logs printed on failure."""
    f = Fleet(etcd_server, tmp_path)
    try:
        yield f
    except BaseException:
        print(f.log_tails())
        raise
    finally:
        f.stop()
