"""Small builders for unit tests of the pure core."""

from __future__ import annotations

from quillcache_core.identity.keys import request_blocks
from quillcache_core.model import MIB, CacheResidency, CacheTier, RequestShape, WorkerState
from quillcache_core.registry import NodeRecord

MODEL = "llama-3-8b"
TOKENIZER = "llama-3"
TENANT = "acme"


def make_request(
    n_blocks: int,
    *,
    tenant: str = TENANT,
    block_size: int = 16,
    extra_tokens: int = 0,
    decode_tokens: int = 32,
    seed: int = 0,
    adapter: str | None = None,
    model: str = MODEL,
    tokenizer: str = TOKENIZER,
) -> RequestShape:
    tokens = [(seed * 7919 + i) % 32000 for i in range(n_blocks * block_size + extra_tokens)]
    blocks = request_blocks(
        tokens,
        block_size,
        model_id=model,
        tokenizer_id=tokenizer,
        adapter_id=adapter,
        tenant_id=tenant,
    )
    return RequestShape(
        id=f"req-{seed}",
        model_id=model,
        tokenizer_id=tokenizer,
        adapter_id=adapter,
        tenant_id=tenant,
        blocks=tuple(blocks),
        estimated_decode_tokens=decode_tokens,
        prompt_tokens=len(tokens),
    )


def resident(request: RequestShape, worker: str, tier: CacheTier, blocks=None, nbytes=2 * MIB):
    """Residency records of `blocks` (indices, default all) of `request` on `worker`."""
    indices = range(len(request.blocks)) if blocks is None else blocks
    return {i: [CacheResidency(request.blocks[i], worker, tier, nbytes)] for i in indices}


def usable_from(request: RequestShape, *maps) -> list[list[CacheResidency]]:
    out: list[list[CacheResidency]] = [[] for _ in request.blocks]
    for mapping in maps:
        for index, found in mapping.items():
            out[index].extend(found)
    return out


def engine(id_: str, domain: str = "rack-a", store: str | None = None, **load) -> WorkerState:
    worker = WorkerState(id=id_, locality_domain=domain, store_node_id=store)
    for name, value in load.items():
        setattr(worker, name, value)
    return worker


def engine_record(
    node: str,
    *,
    events: bool = False,
    start_time_s: float = 100.0,
    store_node: str = "",
    state: str = "serving",
) -> NodeRecord:
    """An engine's registry record serving MODEL (its KV events over ZMQ if `events`)."""
    return NodeRecord(
        kind="engine",
        id=node,
        address="",
        locality_domain="rack-a",
        base_url=f"http://{node}",
        model=MODEL,
        tokenizer=TOKENIZER,
        start_time_s=start_time_s,
        kv_events_endpoint=f"tcp://{node}:5557" if events else "",
        store_node=store_node,
        state=state,
    )
