"""`quillcache drain ENGINE_ID`: take an engine out of service without losing its cache.

1. The engine is found in the conductors' fleet (an id none of them lists: exit 2,
   NOT_FOUND) and told to save (`POST /sim/drain` phase "save" on a sim engine, as
   the operator): its hottest blocks its store node lacks go there, while it still
   serves. The command waits until a conductor locates every one of them in the pool.
2. Every conductor replica the endpoints file names is told (`Conductor.Drain`, the
   operator's): from its answer on, it plans no new request to the engine, and plans
   the engine's prefixes as FETCH from the pool on the others.
3. The engine is told to stop (phase "stop"): it writes state `draining` into its own
   registry record (only the engine role may: every replica, a restarted one too,
   learns it from the registry), waits for the requests it runs, and writes `drained`.
4. The replicas are asked again until none holds an open request on the engine.

An engine without that endpoint (vLLM) is left out of planning by the replicas all the
same; what it held and the pool lacks is then recomputed elsewhere. Prints one JSON
object; exit 1 if requests were still open at the deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc

from quillcache.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from quillcache_core.security.credentials import operator_context, operator_tls
from quillcache_core.security.tls import grpc_channel

RPC_TIMEOUT_S = 10.0
POLL_S = 0.1
LOCATE_CHUNK = 4096  # hashes per Locate (below the conductor's limit)


class DrainFailed(Exception):
    """A drain that cannot go on: the message says why, the code is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="quillcache drain",
        description="Drain an engine: no new requests, its hot KV saved to the pool, its "
        "requests finished. Uses the endpoints file's operator certificate.",
    )
    parser.add_argument("engine_id", help="the engine's id in the fleet")
    parser.add_argument(
        "--endpoints",
        default="quillcache-endpoints.json",
        help="the endpoints file `quillcache up` wrote (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=60.0, help="wait for its requests at most this long"
    )
    parser.add_argument(
        "--save-blocks",
        type=int,
        default=None,
        help="the hottest cached blocks to consider saving (default: all the engine holds)",
    )
    args = parser.parse_args(argv)
    if not 0 < args.timeout_s <= 3600:
        parser.error("--timeout-s must be in (0, 3600]")
    if args.save_blocks is not None and args.save_blocks < 0:
        parser.error("--save-blocks must be >= 0")
    return args


def stubs(endpoints: dict) -> Iterator[tuple[str, conductor_pb2_grpc.ConductorStub]]:
    """Each conductor replica the endpoints file names, as the operator."""
    tls = operator_tls(endpoints)
    for address in endpoints.get("conductors") or [endpoints["conductor"]]:
        with grpc_channel(address, tls, aio=False) as channel:
            yield address, conductor_pb2_grpc.ConductorStub(channel)


def call(address: str, method, request):
    try:
        return method(request, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as exc:
        raise DrainFailed(f"conductor {address}: {exc.code().name}: {exc.details()}") from None


def find_engine(endpoints: dict, engine_id: str) -> str:
    """The engine's base URL, from the first replica that lists it; DrainFailed (exit 2,
    NOT_FOUND) when none does."""
    for address, stub in stubs(endpoints):
        stats = call(address, stub.Stats, conductor_pb2.StatsRequest())
        for engine in stats.engines:
            if engine.engine_id == engine_id:
                return engine.base_url
    raise DrainFailed(f"NOT_FOUND: no conductor knows engine {engine_id!r}", code=2)


def tell_conductors(endpoints: dict, engine_id: str) -> int:
    """Drain on every replica; returns the engine's requests still open on them."""
    request = conductor_pb2.DrainRequest(engine_id=engine_id)
    return sum(call(a, stub.Drain, request).inflight_requests for a, stub in stubs(endpoints))


def tell_engine(
    base_url: str, context: ssl.SSLContext | None, body: dict, timeout_s: float
) -> dict | None:
    """The engine's answer to one drain phase, or None when it has no drain endpoint."""
    request = urllib.request.Request(
        base_url + "/sim/drain",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise DrainFailed(f"engine {base_url}: HTTP {exc.code}: {exc.read()[:300]!r}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise DrainFailed(f"engine {base_url}: {exc}") from None


def wait_in_pool(endpoints: dict, saved: list[dict], deadline: float) -> int:
    """Wait until the first replica locates every saved block on a store node; returns
    how many it still does not at the deadline."""
    with contextlib.closing(stubs(endpoints)) as replicas:
        address, stub = next(replicas)  # the replicas see the same stores
        return _wait_located(address, stub, saved, deadline)


def _wait_located(address: str, stub, saved: list[dict], deadline: float) -> int:
    while True:
        lacking = 0
        for group in saved:
            identity = common_pb2.Identity(
                model_id=group["model_id"],
                tokenizer_id=group["tokenizer_id"],
                tenant_id=group["tenant_id"],
                **({"adapter_id": group["adapter_id"]} if group["adapter_id"] else {}),
            )
            hashes = group["block_hashes"]
            for start in range(0, len(hashes), LOCATE_CHUNK):
                found = call(
                    address,
                    stub.Locate,
                    conductor_pb2.LocateRequest(
                        identity=identity, block_hashes=hashes[start : start + LOCATE_CHUNK]
                    ),
                )
                lacking += sum(
                    not any(loc.kind == "store" for loc in block.locations)
                    for block in found.blocks
                )
        if not lacking or time.monotonic() >= deadline:
            return lacking
        time.sleep(POLL_S)


def wait_idle(endpoints: dict, engine_id: str, deadline: float) -> int:
    """Ask the replicas until none holds an open request on the engine; returns how many
    are still open at the deadline (0 = idle)."""
    while True:
        still_open = tell_conductors(endpoints, engine_id)
        if not still_open or time.monotonic() >= deadline:
            return still_open
        time.sleep(POLL_S)


def drain(endpoints: dict, args: argparse.Namespace) -> dict:
    deadline = time.monotonic() + args.timeout_s
    base_url = find_engine(endpoints, args.engine_id)
    context = operator_context(endpoints)
    save = {"phase": "save"}
    if args.save_blocks is not None:
        save["save_blocks"] = args.save_blocks
    saved = tell_engine(base_url, context, save, args.timeout_s)
    not_in_pool = 0 if saved is None else wait_in_pool(endpoints, saved["saved"], deadline)
    tell_conductors(endpoints, args.engine_id)
    stop = {"phase": "stop", "timeout_s": max(0.0, deadline - time.monotonic())}
    stopped = None if saved is None else tell_engine(base_url, context, stop, args.timeout_s + 30)
    return {
        "engine_id": args.engine_id,
        "saved_blocks": None if saved is None else saved["saved_blocks"],
        "hot_blocks": None if saved is None else saved["hot_blocks"],
        "not_in_pool": not_in_pool,
        "state": "left out of planning (no drain endpoint)"
        if stopped is None
        else stopped["state"],
        "open_requests": wait_idle(endpoints, args.engine_id, deadline),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        endpoints = json.loads(Path(args.endpoints).read_text())
    except (OSError, ValueError) as exc:
        print(f"quillcache drain: cannot read {args.endpoints}: {exc}", file=sys.stderr)
        return 2
    try:
        report = drain(endpoints, args)
    except DrainFailed as exc:
        print(f"quillcache drain: {exc}", file=sys.stderr)
        return exc.code
    print(json.dumps(report))
    return 1 if report["open_requests"] else 0
