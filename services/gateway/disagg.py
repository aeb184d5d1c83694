"""Carrying out a split plan (prefill/decode disaggregation), as vLLM's disaggregated
serving proxy does: a prefill call, then the decode call that reuses the prompt's KV.

1. **Prefill.** The client's request goes to the plan's prefill engine with
   `max_tokens` 1, not streamed, and the plan marked `"disagg": "prefill"`: the engine
   computes the prompt and writes its full blocks to its store node before it answers
   (the sim engine's offload, vLLM's QuillCache connector).
2. **Transfer.** When the two engines have different store nodes, the transfer service
   prefetches those blocks into the decode engine's store node (resolved in the
   registry; the gateway's role may Prefetch). The measured bytes per second go back to
   the conductor with the prefill's Finish: it prices the next splits' transfers.
3. **Decode.** The client's own request goes to the decode engine with a plan whose
   FETCH actions name those blocks on its store node: it loads them instead of
   recomputing, and the answer streams to the client as any other.

Nothing here fails a request. A prefill that fails, answers an error or takes longer
than its deadline leaves the request to the decode engine alone (it computes the
prompt: colocated). A transfer that fails or is slow sends the decode call to the
prefill engine instead, which holds the prompt in its own cache (colocated there). The
client's TTFT is counted from its request, so the split's cost is in it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import grpc

from quillcache.v1 import common_pb2, conductor_pb2, transfer_pb2, transfer_pb2_grpc
from quillcache_core.process.metrics import MetricsRegistry
from quillcache_core.registry import open_registry
from quillcache_core.security.tls import Tls, grpc_channel
from quillcache_core.wire.keys import key_to_proto
from quillcache_gateway.errors import ApiError

logger = logging.getLogger(__name__)

HEADER = "x-quillcache-disagg"  # client: auto | split | colocated; answer: what was done
MODES = ("auto", "split", "colocated")
SUCCESS = conductor_pb2.FinishRequest.SUCCESS
ERROR = conductor_pb2.FinishRequest.ERROR
CANCELLED = conductor_pb2.FinishRequest.CANCELLED


def requested_mode(value: str | None) -> str:
    """The client's `x-quillcache-disagg` header; a 400 ApiError if it names no mode."""
    if value is None or not value.strip():
        return ""
    mode = value.strip().lower()
    if mode not in MODES:
        raise ApiError(
            400, f"{HEADER} must be one of {', '.join(MODES)}, got {value!r}", param=HEADER
        )
    return mode


def answer_headers(plan, notes: dict[str, str]) -> dict[str, str]:
    """The plan's disaggregation headers: what was chosen and why, then what was done."""
    if not plan.disagg:
        return notes
    return {HEADER: plan.disagg_reason or plan.disagg, **notes}


def prefill_body(payload: dict, salt: str, plan: dict) -> bytes:
    """The prefill call: the client's request cut to one token, whole, not streamed."""
    body = {k: v for k, v in payload.items() if k not in ("stream", "stream_options")}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["n"] = 1
    body["stream"] = False
    body["cache_salt"] = salt
    params = body.get("kv_transfer_params")
    body["kv_transfer_params"] = {
        **(params if isinstance(params, dict) else {}),
        "quillcache": plan,
    }
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass(slots=True)
class SplitResult:
    """What became of a split plan: the engine to send the decode call to, and why."""

    plan: conductor_pb2.PlanResponse  # the plan the decode call carries (and Finishes)
    fetch_blocks: int = 0  # leading prompt blocks the decode engine can load
    fetch_node: str = ""  # the store node it loads them from
    fetch_address: str = ""
    headers: dict[str, str] = field(default_factory=dict)


class Disaggregator:
    """The gateway's side of split plans. `post` and `submit_finish` are the gateway's
    (its engine connection pool, its Finish queue)."""

    def __init__(
        self,
        *,
        registry_url: str,
        tls: Tls | None,
        metrics: MetricsRegistry,
        prefill_timeout_s: float = 30.0,
        transfer_timeout_s: float = 5.0,
    ) -> None:
        self.registry_url = registry_url
        self.tls = tls
        self.prefill_timeout_s = prefill_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._registry = None
        self._transfer: tuple[str, transfer_pb2_grpc.TransferStub, grpc.aio.Channel] | None = None
        self.splits = metrics.counter(
            "gateway_disagg_requests_total",
            "split plans, by what became of them (split, or the fallback taken)",
            ["outcome"],
        )
        self.transfer_bytes = metrics.counter(
            "gateway_disagg_transfer_bytes_total", "KV bytes moved between store nodes for splits"
        )

    async def close(self) -> None:
        if self._transfer is not None:
            await self._transfer[2].close()
            self._transfer = None
        if self._registry is not None:
            await self._registry.close()
            self._registry = None

    # --- the transfer service --------------------------------------------------------

    async def _transfer_stub(self) -> transfer_pb2_grpc.TransferStub | None:
        if self._transfer is not None:
            return self._transfer[1]
        if not self.registry_url or self.registry_url == "memory":
            return None
        if self._registry is None:
            self._registry = open_registry(self.registry_url, self.tls)
        nodes = [r for r in await self._registry.list("transfer") if r.address]
        if not nodes:
            return None
        if self._transfer is not None:  # another split resolved it meanwhile
            return self._transfer[1]
        address = sorted(nodes, key=lambda r: r.id)[0].address
        channel = grpc_channel(address, self.tls)
        stub = transfer_pb2_grpc.TransferStub(channel)
        self._transfer = (address, stub, channel)
        return stub

    async def _forget_transfer(self) -> None:
        found, self._transfer = self._transfer, None
        if found is not None:
            await found[2].close()

    async def prefetch(self, source: str, destination: str, keys) -> tuple[int, int, float]:
        """Copy `keys` (in prompt order) into `destination`'s DRAM; returns the leading
        blocks now there, the bytes moved and the measured bytes per second."""
        stub = await self._transfer_stub()
        if stub is None:
            raise LookupError("no transfer service registered")
        request = transfer_pb2.TransferRequest(
            source_node=source,
            destination_node=destination,
            keys=[key_to_proto(k) for k in keys],
        )
        last = None
        async for progress in stub.Prefetch(request, timeout=self.transfer_timeout_s):
            last = progress
        if last is None:
            return 0, 0, 0.0
        leading = 0
        for result in last.results:
            if not result.ok:
                break
            leading += 1
        return leading, int(last.bytes_done), float(last.bytes_per_s)

    # --- one split request -----------------------------------------------------------

    async def split(self, gateway, call, plan, path: str):
        """Steps 1 and 2: the prefill call and the KV's move. Returns the plan for the
        decode call: `plan` with FETCH actions for the moved blocks, or a colocated
        fallback's (see the module's doc). The answer's headers go to `call.notes`."""
        try:
            result = await self._split(gateway, call, plan, path)
        except BaseException:
            # The client left (or the gateway stops) mid-split: both reservations end now.
            # `_split` finishes the prefill's only after its last await.
            if gateway.open_plans.take(plan):
                _finish(gateway, plan.reservation_id, CANCELLED)
            _finish(gateway, plan.prefill_reservation_id, CANCELLED)
            raise
        call.notes.update(result.headers)
        if result.fetch_blocks:
            plan = result.plan
            del plan.actions[:]
            plan.actions.add(
                kind=conductor_pb2.BlockAction.FETCH,
                block_index=0,
                block_hash=call.hashes[0],
                block_count=result.fetch_blocks,
                source_node=result.fetch_node,
                source_tier=common_pb2.TIER_CPU_DRAM,
            )
            plan.hit_blocks = 0
            plan.fetch_blocks = result.fetch_blocks
            plan.recompute_blocks = len(call.hashes) - result.fetch_blocks
        return result.plan

    async def _split(self, gateway, call, plan, path: str) -> SplitResult:
        started = time.perf_counter()
        headers = {
            "x-quillcache-prefill-engine": plan.prefill_engine_id,
            "x-quillcache-decode-engine": plan.engine_id,
        }
        reason = ""
        try:
            async with asyncio.timeout(self.prefill_timeout_s):
                ok, detail = await self._prefill_call(gateway, call, plan, path)
        except TimeoutError:
            ok, detail = False, f"prefill slower than {self.prefill_timeout_s:g}s"
        prefill_ms = (time.perf_counter() - started) * 1000
        headers["x-quillcache-prefill-ms"] = f"{prefill_ms:.1f}"
        if not ok:
            # The decode engine computes the prompt itself: colocated there.
            _finish(gateway, plan.prefill_reservation_id, ERROR)
            self.splits.inc(outcome="prefill_failed")
            logger.warning("split of %s: %s; decoding colocated", call.request_id, detail)
            headers["x-quillcache-prefill-engine"] = plan.engine_id
            headers[HEADER] = f"colocated; fallback: {detail}"
            return SplitResult(plan, headers=headers)
        # The prompt's full blocks but for its last token, which the decode engine computes.
        usable = (len(call.job.tokens) - 1) // call.block_size * call.block_size
        keys = call.ident.identity.keys(call.job.tokens[:usable], call.block_size)
        moved, nbytes, rate = len(keys), 0, 0.0
        source, dest = plan.prefill_store_node, plan.decode_store_node
        fetch_node = dest or source
        if source and dest and source != dest and keys:
            try:
                async with asyncio.timeout(self.transfer_timeout_s):  # the lookup too
                    moved, nbytes, rate = await self.prefetch(source, dest, keys)
            except Exception as exc:  # noqa: BLE001 - whatever failed, the request goes on
                moved, reason = 0, f"transfer failed: {_short(exc)}"
                if not isinstance(exc, LookupError):
                    await self._forget_transfer()  # resolved again for the next split
                else:
                    # No transfer service: the decode engine reads the prefill's store.
                    moved, fetch_node, reason = len(keys), source, ""
        if not source:
            moved = 0
            reason = reason or "the prefill engine has no store node"
        if moved == 0 and keys:
            # The KV did not make it: the prefill engine, which holds it, decodes.
            fallback = conductor_pb2.PlanResponse()
            fallback.CopyFrom(plan)
            fallback.reservation_id = plan.prefill_reservation_id
            fallback.engine_id = plan.prefill_engine_id
            fallback.engine_base_url = plan.prefill_engine_base_url
            del fallback.actions[:]
            # The decode engine's reservation is done with; the prefill's carries on.
            if gateway.open_plans.take(plan):
                _finish(gateway, plan.reservation_id, CANCELLED)
            gateway.open_plans.add(fallback)
            self.splits.inc(outcome="transfer_failed")
            logger.warning(
                "split of %s: %s; decoding on %s", call.request_id, reason, plan.prefill_engine_id
            )
            headers["x-quillcache-decode-engine"] = plan.prefill_engine_id
            headers[HEADER] = f"colocated; fallback: {reason or 'no block moved'}"
            return SplitResult(fallback, headers=headers)
        finish = conductor_pb2.FinishRequest(
            reservation_id=plan.prefill_reservation_id,
            outcome=SUCCESS,
            ttft_ms=prefill_ms,
            transfer_bytes=nbytes,
            transfer_bytes_per_s=rate,
            transfer_blocks=moved if nbytes else 0,
        )
        if call.packed:  # the prefill engine holds the prompt now
            finish.identity.CopyFrom(call.ident.finish_identity)
            finish.observe_packed_hashes = call.packed
            finish.observe_block_tokens = call.block_size
        gateway._finishes.submit(finish)  # noqa: SLF001 - the gateway's Finish queue
        self.transfer_bytes.inc(nbytes)
        self.splits.inc(outcome="split")
        headers["x-quillcache-transfer-blocks"] = str(moved if source != dest else 0)
        headers["x-quillcache-transfer-ms"] = (
            f"{(time.perf_counter() - started) * 1000 - prefill_ms:.1f}"
        )
        headers[HEADER] = f"split; {plan.disagg_reason.removeprefix('split; ')}"
        # The decode engine reads its own store node (which pulls from a peer if needed).
        return SplitResult(plan, moved, fetch_node, "", headers)

    async def _prefill_call(self, gateway, call, plan, path: str) -> tuple[bool, str]:
        engine_plan = gateway._plan_json(plan, call)  # noqa: SLF001 - the engine's plan shape
        engine_plan.update(
            reservation_id=plan.prefill_reservation_id,
            engine_id=plan.prefill_engine_id,
            fetch=[],
            disagg="prefill",
        )
        body = prefill_body(call.job.payload, call.ident.identity.cache_salt, engine_plan)
        try:
            reply = await gateway._upstream.post(  # noqa: SLF001 - the gateway's engine pool
                plan.prefill_engine_base_url.rstrip("/"),
                path,
                body,
                b"x-quillcache-request-id: " + call.request_id.encode() + b"\r\n",
            )
        except Exception as exc:  # noqa: BLE001 - any failure of the call means colocated
            return False, f"prefill on {plan.prefill_engine_id} failed: {_short(exc)}"
        try:
            data = await reply.read_all()
        except Exception as exc:  # noqa: BLE001
            return False, f"prefill on {plan.prefill_engine_id} failed: {_short(exc)}"
        finally:
            reply.release()
        if reply.status != 200:
            return False, f"prefill on {plan.prefill_engine_id} answered {reply.status}"
        logger.debug("prefill of %s: %s", call.request_id, data[:200])
        return True, ""


def _finish(gateway, reservation_id: str, outcome: int) -> None:
    if reservation_id:
        gateway._finishes.submit(  # noqa: SLF001 - the gateway's Finish queue
            conductor_pb2.FinishRequest(reservation_id=reservation_id, outcome=outcome)
        )


def _short(exc: BaseException) -> str:
    """One line for a header and a log: no CR/LF, ASCII, bounded."""
    if isinstance(exc, grpc.aio.AioRpcError):
        text = f"{exc.code().name}: {exc.details()}"
    else:
        text = str(exc) or repr(exc)
    text = " ".join(text.split())
    return text.encode("ascii", "replace").decode()[:120]
