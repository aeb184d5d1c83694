"""Write registry records the way an operator would: the real etcdctl binary.

Against a TLS etcd (the `etcd_server` fixture) etcdctl shows a certificate of the
session's CA; etcd takes its common name as the user, so `role` decides what the call
may do: `root` (the default) anything, `engine` write engine records, `operator` read.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator

from quillcache_core.launch.etcd_server import find_etcd_binary


def etcdctl_argv(etcd, *args: str, role: str = "root") -> list[str]:
    """The etcdctl command line for `etcd` as `role` (no TLS flags for a plaintext etcd)."""
    return [
        find_etcd_binary("etcdctl"),
        "--endpoints",
        etcd.client_url,
        *etcd.etcdctl_args(role),
        *args,
    ]


def etcdctl(
    etcd, *args: str, role: str = "root", input: bytes | None = None, check: bool = True
) -> str:
    """Run etcdctl against `etcd` as `role`; its stdout (CalledProcessError on failure
    when `check`; then the stderr is in the exception's `stderr`)."""
    out = subprocess.run(
        etcdctl_argv(etcd, *args, role=role),
        input=input,
        capture_output=True,
        env={**os.environ, "ETCDCTL_API": "3"},
        timeout=10,
        check=check,
    )
    return out.stdout.decode()


def put_engine(
    etcd,
    engine_id: str,
    *,
    model: str,
    tokenizer: str,
    lease: str | None = None,
    role: str = "engine",
    **fields,
) -> None:
    """An engine's node record at /quillcache/v1/nodes/engine/{id} (a real vLLM's way
    in), written as `role` (an engine: only engines may write engine records)."""
    record = {
        "kind": "engine",
        "id": engine_id,
        "address": "",
        "locality_domain": fields.pop("locality_domain", "rack-a"),
        "base_url": f"http://127.0.0.1:1/{engine_id}",
        "model": model,
        "tokenizer": tokenizer,
        **fields,
    }
    extra = [f"--lease={lease}"] if lease else []
    etcdctl(
        etcd,
        "put",
        *extra,
        f"/quillcache/v1/nodes/engine/{engine_id}",
        json.dumps(record),
        role=role,
    )


@contextlib.contextmanager
def paused(etcd) -> Iterator[float]:
    """Stall `etcd` (SIGSTOP) for the block, as a hung host or a long GC pause would:
    its sockets stay open, nothing answers, leases run out. SIGCONT on exit, even on
    failure. Yields the monotonic time of the stop."""
    pid = etcd.pid
    assert pid is not None, "etcd is not running"
    os.kill(pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        os.kill(pid, signal.SIGCONT)
