"""`quillcache bench --live ENDPOINTS_JSON`: a small chat workload against a running cluster.

Multi-turn conversations of every tenant in the endpoints file's `api_keys` (a shared
system prompt per tenant; each turn sends the whole conversation so far, the real
answers included) start as a Poisson process and go through the gateway's OpenAI API
(`/v1/chat/completions`, streaming). TTFT is the time from sending a request to the
first chunk with content; the `x-quillcache-*` headers give the engine and the plan's
hit, fetch and recompute blocks.

The conductor's policy is fixed per process, so only the running conductor's policy
is measured (read from its Stats call); comparing policies live means restarting the
cluster with `quillcache up --policy NAME` and running this again.

Against a secure cluster (the endpoints file has "tls": the operator's certificate
and the CA) the requests go as a tenant's do: HTTPS to the gateway verified by the
CA, with the tenant's API key, no client certificate; the conductor's Stats call is
made as the operator (mutual TLS). An --insecure cluster's file has no "tls": plain
HTTP and gRPC then.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from quillcache_bench.common import Progress, read_chat_stream, render_table, write_results
from quillcache_core.errors import InvalidArgument
from quillcache_core.security.credentials import operator_tls, tenant_context

REQUEST_TIMEOUT_S = 120.0


@dataclass
class _Sample:
    tenant: str
    ttft_s: float | None = None
    total_s: float = 0.0
    ok: bool = False
    engine: str = ""
    hit_blocks: int = 0
    fetch_blocks: int = 0
    recompute_blocks: int = 0
    plan_us: int = 0
    completion_tokens: int = 0
    error: str = ""


@dataclass
class _Run:
    samples: list[_Sample] = field(default_factory=list)


def run_live(args) -> int:
    path = Path(args.live)
    try:
        endpoints = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"--live: cannot read endpoints file {path}: {exc}") from None
    for key in ("gateway_url", "api_keys"):
        if key not in endpoints:
            raise InvalidArgument(f"--live: {path} has no {key!r} (written by `quillcache up`?)")
    if not endpoints["api_keys"]:
        raise InvalidArgument(f"--live: {path} lists no api_keys")
    if args.live_requests <= 0 or args.live_rate <= 0:
        raise InvalidArgument("--live-requests and --live-rate must be positive")
    policy = asyncio.run(_conductor_policy(endpoints.get("conductor", ""), endpoints))
    started = time.monotonic()
    run = asyncio.run(_drive(endpoints, args))
    duration = time.monotonic() - started
    _report(args, endpoints, policy, run, duration)
    return 0


async def _conductor_policy(address: str, endpoints: dict) -> str:
    if not address:
        return "unknown (no conductor address in the endpoints file)"
    try:
        from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
        from quillcache_core.security.tls import grpc_channel

        async with grpc_channel(address, operator_tls(endpoints)) as channel:
            stats = await conductor_pb2_grpc.ConductorStub(channel).Stats(
                conductor_pb2.StatsRequest(), timeout=5
            )
        return stats.policy or "unknown"
    except Exception as exc:  # the figures are still worth having without the name
        return f"unknown (conductor Stats failed: {exc!r})"


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(f"w{rng.randrange(2000)}" for _ in range(rng.randint(low, high)))


async def _drive(endpoints: dict, args) -> _Run:
    rng = random.Random(args.seed)
    gateway = endpoints["gateway_url"].rstrip("/")
    keys: dict[str, str] = dict(endpoints["api_keys"])
    tenants = sorted(keys)
    system = {t: f"You are {t}'s assistant. " + _words(rng, 300, 600) for t in tenants}
    run = _Run()
    progress = Progress("live bench", args.live_requests)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    context = tenant_context(endpoints)  # a tenant verifies the gateway by the CA
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ssl=context if context is not None else True),
        timeout=timeout,
    ) as session:
        model = await _model(session, gateway, keys[tenants[0]])
        budget = args.live_requests
        tasks = []
        while budget > 0:
            turns = min(budget, rng.randint(2, 4))
            budget -= turns
            tenant = rng.choice(tenants)
            conv_rng = random.Random(rng.random())
            tasks.append(
                asyncio.create_task(
                    _conversation(
                        session,
                        gateway,
                        keys[tenant],
                        tenant,
                        model,
                        system[tenant],
                        turns,
                        conv_rng,
                        run,
                        progress,
                    )
                )
            )
            await asyncio.sleep(rng.expovariate(args.live_rate))
        await asyncio.gather(*tasks)
    return run


async def _model(session: aiohttp.ClientSession, gateway: str, key: str) -> str:
    try:
        async with session.get(
            f"{gateway}/v1/models", headers={"Authorization": f"Bearer {key}"}
        ) as reply:
            data = await reply.json()
        return data["data"][0]["id"]
    except (TimeoutError, aiohttp.ClientError, KeyError, IndexError, ValueError):
        return "sim-model"


async def _conversation(
    session, gateway, key, tenant, model, system, turns, rng, run, progress
) -> None:
    messages = [{"role": "system", "content": system}]
    for _ in range(turns):
        messages.append({"role": "user", "content": _words(rng, 20, 80)})
        sample, answer = await _one(
            session, gateway, key, tenant, model, messages, rng.randint(32, 96)
        )
        run.samples.append(sample)
        progress.advance()
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(rng.uniform(0.2, 1.0))  # the user reads, then types


async def _one(session, gateway, key, tenant, model, messages, max_tokens):
    sample = _Sample(tenant)
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer = ""
    sent = time.perf_counter()
    try:
        async with session.post(
            f"{gateway}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
        ) as reply:
            h = reply.headers
            sample.engine = h.get("x-quillcache-engine", "")
            sample.hit_blocks = int(h.get("x-quillcache-hit-blocks", 0) or 0)
            sample.fetch_blocks = int(h.get("x-quillcache-fetch-blocks", 0) or 0)
            sample.recompute_blocks = int(h.get("x-quillcache-recompute-blocks", 0) or 0)
            sample.plan_us = int(h.get("x-quillcache-plan-us", 0) or 0)
            if reply.status != 200:
                sample.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
                return sample, ""
            answer, usage = await read_chat_stream(reply.content, sent, sample)
            if usage:
                sample.completion_tokens = int(usage.get("completion_tokens", 0))
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        sample.error = repr(exc)[:200]
    sample.total_s = time.perf_counter() - sent
    if sample.ok and sample.ttft_s is None:
        sample.ok = False
        sample.error = "stream ended without content"
    return sample, answer


def _report(args, endpoints: dict, policy: str, run: _Run, duration: float) -> None:
    samples = run.samples
    ok = [s for s in samples if s.ok]
    ttft_ms = np.array([s.ttft_s * 1000 for s in ok]) if ok else np.array([np.nan])
    blocks = sum(s.hit_blocks + s.fetch_blocks + s.recompute_blocks for s in ok) or 1
    engines = Counter(s.engine for s in ok)
    served = np.array([engines.get(e, 0) for e in _engine_ids(endpoints, engines)], dtype=float)
    plan = np.array([s.plan_us for s in ok]) if ok else np.array([0])
    figures = {
        "requests": len(samples),
        "completed": len(ok),
        "errors": len(samples) - len(ok),
        "ttft_mean_ms": float(np.mean(ttft_ms)),
        "ttft_p50_ms": float(np.percentile(ttft_ms, 50)),
        "ttft_p99_ms": float(np.percentile(ttft_ms, 99)),
        "goodput": sum(1 for s in ok if s.ttft_s * 1000 <= args.slo_ms) / max(1, len(samples)),
        "throughput_rps": len(ok) / duration,
        "output_tokens_per_s": sum(s.completion_tokens for s in ok) / duration,
        "hit_block_share": sum(s.hit_blocks for s in ok) / blocks,
        "fetch_block_share": sum(s.fetch_blocks for s in ok) / blocks,
        "recompute_block_share": sum(s.recompute_blocks for s in ok) / blocks,
        "served_max_over_mean": float(served.max() / served.mean()) if served.sum() else 0.0,
        "served_per_engine": dict(engines),
        "plan_p50_us": float(np.percentile(plan, 50)),
        "plan_p99_us": float(np.percentile(plan, 99)),
    }
    print()
    print(f"live run against {endpoints['gateway_url']}: conductor policy {policy}")
    print(
        render_table(
            [
                "policy",
                "requests",
                "errors",
                "TTFT mean ms",
                "TTFT p99 ms",
                "goodput %",
                "req/s",
                "out tok/s",
                "hit %",
                "fetch %",
                "recompute %",
                "served max/mean",
                "plan p50 us",
            ],
            [
                (
                    policy,
                    figures["requests"],
                    figures["errors"],
                    figures["ttft_mean_ms"],
                    figures["ttft_p99_ms"],
                    100 * figures["goodput"],
                    figures["throughput_rps"],
                    figures["output_tokens_per_s"],
                    100 * figures["hit_block_share"],
                    100 * figures["fetch_block_share"],
                    100 * figures["recompute_block_share"],
                    figures["served_max_over_mean"],
                    figures["plan_p50_us"],
                )
            ],
        )
    )
    print(
        "\nOnly the running conductor's policy was measured: the policy is fixed per "
        "conductor process. To compare, restart with `quillcache up --policy NAME` and run "
        "again; the goals against the reference policies are evaluated by the simulated "
        "run (`quillcache bench` without --live). Hit/fetch/recompute shares are of "
        "prompt blocks as planned (x-quillcache-* headers), not as executed."
    )
    errors = [s.error for s in samples if s.error][:5]
    if errors:
        print("first errors:\n  " + "\n  ".join(errors))
    payload = {
        "mode": "live",
        "policy": policy,
        "gateway_url": endpoints["gateway_url"],
        "tls": bool(endpoints.get("tls")),
        "config": {
            "requests": args.live_requests,
            "conversation_rate": args.live_rate,
            "seed": args.seed,
            "slo_ms": args.slo_ms,
        },
        "figures": figures,
        "duration_s": duration,
    }
    path = write_results("fleet-live", payload, args.out_dir)
    print(f"wrote {path}")


def _engine_ids(endpoints: dict, seen: Counter) -> list[str]:
    """Every engine that could have served (those seen; the file lists URLs, not ids)."""
    count = max(len(endpoints.get("engines") or []), len(seen))
    ids = sorted(seen)
    return ids + [f"(idle {i})" for i in range(count - len(ids))]
