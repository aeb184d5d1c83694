"""Write registry records the way an operator would: the real etcdctl binary."""

from __future__ import annotations

import json
import os
import subprocess

from quillcache_core.launch.etcd_server import find_etcd_binary


def etcdctl(etcd, *args: str) -> str:
    out = subprocess.run(
        [find_etcd_binary("etcdctl"), "--endpoints", etcd.endpoint, *args],
        capture_output=True,
        env={**os.environ, "ETCDCTL_API": "3"},
        timeout=10,
        check=True,
    )
    return out.stdout.decode()


def put_engine(
    etcd, engine_id: str, *, model: str, tokenizer: str, lease: str | None = None, **fields
) -> None:
    """An engine's node record at /quillcache/v1/nodes/engine/{id} (a real vLLM's way in)."""
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
    etcdctl(etcd, "put", *extra, f"/quillcache/v1/nodes/engine/{engine_id}", json.dumps(record))
