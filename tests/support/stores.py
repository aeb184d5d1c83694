"""Helpers for store and transfer integration tests: a small fleet of real processes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
from quillcache_core.model import CacheTier, KvBlockKey
from quillcache_core.storeclient import wire
from quillcache_core.wire.tiers import tier_from_proto
from tests.support.services import ServiceProcess

MIB = 1024 * 1024
MODEL, TOKENIZER, TENANT = "llama-3-8b", "llama-3", "acme"

# [layers, 2 (K and V), block_tokens, kv_heads, head_dim], float16
SHAPES = {
    "0.5MiB": (8, 2, 16, 8, 128),
    "2MiB": (32, 2, 16, 8, 128),
    "4MiB": (32, 2, 32, 8, 128),
}


def block_key(i: int, tenant: str = TENANT, chain: str = "c") -> KvBlockKey:
    """Block i of a chain: its parent is block i-1 ("root" for the first)."""
    return KvBlockKey(
        model_id=MODEL,
        tokenizer_id=TOKENIZER,
        adapter_id=None,
        tenant_id=tenant,
        prefix_hash="root" if i == 0 else f"{chain}{i - 1:06d}",
        block_hash=f"{chain}{i:06d}",
        block_index=i,
        token_count=16,
    )


def kv_payload(seed: int, shape: tuple[int, ...] = SHAPES["2MiB"]) -> bytes:
    """A KV block as an engine would offload it: float16 values, `shape`."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape, dtype=np.float32).astype(np.float16).tobytes()


class Fleet:
    """Starts conductor, store and transfer processes against one etcd; stops them all."""

    def __init__(self, etcd, tmp_path: Path) -> None:
        self.etcd = etcd
        self.tmp = tmp_path
        self.procs: list[ServiceProcess] = []

    def conductor(self, *extra: str, name: str = "conductor") -> ServiceProcess:
        """A conductor; several need their own `--node-id` (and `name`, for the log)."""
        proc = ServiceProcess(
            "conductor",
            ["--registry", self.etcd.client_url, "--seed", "7", *extra],
            self.tmp,
            name,
        )
        self.procs.append(proc)
        return proc.start()

    def store(
        self,
        node_id: str,
        *extra: str,
        dram: int = 64 * MIB,
        ssd: int = 256 * MIB,
        ttl_s: float = 2.0,
        registry: str | None = None,
    ) -> ServiceProcess:
        proc = ServiceProcess(
            "store",
            [
                "--registry",
                registry or self.etcd.client_url,
                "--node-id",
                node_id,
                "--data-dir",
                str(self.tmp / node_id),
                "--dram-capacity-bytes",
                str(dram),
                "--ssd-capacity-bytes",
                str(ssd),
                "--lease-ttl-s",
                str(ttl_s),
                *extra,
            ],
            self.tmp,
            node_id,
        )
        self.procs.append(proc)
        return proc.start()

    def transfer(self, *extra: str) -> ServiceProcess:
        proc = ServiceProcess(
            "transfer", ["--registry", self.etcd.client_url, *extra], self.tmp, "transfer"
        )
        self.procs.append(proc)
        return proc.start()

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def log_tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail(30)}" for p in self.procs)


@contextmanager
def lone_store(tmp_path: Path, *extra: str) -> Iterator[ServiceProcess]:
    """A store with an in-memory registry (no etcd, no conductor), 32 MiB of DRAM and 64
    MiB of SSD, stopped at the end."""
    fleet = Fleet(None, tmp_path)
    try:
        yield fleet.store("solo", *extra, registry="memory", dram=32 * MIB, ssd=64 * MIB)
    finally:
        fleet.stop()


def locate(conductor: ServiceProcess, key: KvBlockKey) -> list[tuple[str, CacheTier]]:
    """(node id, tier) of every store holding `key`'s hash under its identity."""
    with conductor.channel("store") as channel:
        reply = conductor_pb2_grpc.ConductorStub(channel).Locate(
            conductor_pb2.LocateRequest(
                identity=wire.identity_of(key), block_hashes=[key.block_hash]
            ),
            timeout=5,
        )
    return sorted(
        (loc.node_id, tier_from_proto(loc.tier))
        for loc in reply.blocks[0].locations
        if loc.kind == "store"
    )


def run(coro):
    """Run one coroutine on a fresh loop (tests are synchronous)."""
    return asyncio.run(coro)
