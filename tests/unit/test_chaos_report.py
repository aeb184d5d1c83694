"""`quillcache chaos`'s accounting: which failures count as late (more than 1 s after
the latest fault began), and finding a cluster's process by the port it listens on."""

from __future__ import annotations

import os
import socket

import pytest

from quillcache_bench.chaos import Fault, pid_listening_on, summarize

pytestmark = pytest.mark.unit


def test_failures_within_a_second_of_a_fault_are_not_late():
    faults = [
        Fault(10.0, "conductor", "conductor", "kill", 1),
        Fault(20.0, "etcd", "etcd", "stall", 2),
    ]
    results = [
        (5.0, 0.01, "HTTP 503"),  # before any fault: late
        (10.4, 0.01, "HTTP 502"),  # 0.4 s after the kill
        (11.5, 0.01, "ClientConnectorError"),  # 1.5 s after: late
        (12.0, 0.01, None),
        (20.9, 0.01, "HTTP 503"),  # 0.9 s after the stall began
        (25.0, 0.01, None),
    ]
    summary = summarize(results, faults)
    assert (summary["sent"], summary["failed"], summary["late_failures"]) == (6, 4, 2)
    assert summary["failed_pct"] == 100 * 4 / 6
    assert [r[0] for r in summary["late_examples"]] == [5.0, 11.5]


def test_a_listening_port_names_its_process():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert pid_listening_on(sock.getsockname()[1]) == os.getpid()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening
        assert pid_listening_on(sock.getsockname()[1]) is None
