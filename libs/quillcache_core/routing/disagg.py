"""Prefill/decode disaggregation: split a request across two engines, or keep it on one.

The routing policy has chosen the engine that will decode (and stream) a request. This
module decides, per request, whether another engine should compute the prompt first and
hand its KV over through the store pool (split), or whether the decode engine should
prefill it itself (colocated). Pure: no clock, no sockets; every input is passed in.

The cost of each, in microseconds (the terms of the seed's `CostModel`):

    colocated = est_ttft(d)                     queue, fetch and prefill on d (the policy's)
              + stall(d)                        d's running decodes wait for that prefill:
                                                running_decodes(d) * prefill(d)
    split(p)  = queue(p) + prefill(p)           p computes what it does not hold
              + stall(p)                        running_decodes(p) * prefill(p)
              + transfer                        bytes d lacks / measured store bandwidth
              + load(d)                         d reads them from its store node (DRAM)
              + overhead                        the second engine call

The client's first token is the prefill engine's (the gateway streams it at once and
the decode engine continues from it), so a split's transfer, load and second call delay
its second token rather than its first; they are priced all the same, as time the client
waits for its answer either way.

The stall is the point of disaggregation: a long prompt prefilled on an engine that is
decoding for others stops every one of those streams for the prefill's duration (their
inter-token latency); a prefill-only engine has no streams to stop. The output length
gates it: a request that decodes a few tokens gains nothing from a second engine
(`min_decode_tokens`). The transfer is priced with the rate the stores were measured at
(`Bandwidth`, fed by the gateway's transfers), so a slow network makes splits rarer.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from quillcache_core.model import MIB, CacheResidency, CacheTier, CostModel, RequestShape
from quillcache_core.model import WorkerState as Engine

logger = logging.getLogger(__name__)

MODES = ("auto", "colocated", "split")
PREFILL, DECODE, BOTH = "prefill", "decode", "both"


@dataclass(frozen=True, slots=True)
class DisaggSettings:
    """The conductor's disaggregation knobs (`--disagg*` flags)."""

    enabled: bool = True  # False: every plan is colocated, whatever the request asks
    min_decode_tokens: int = 32  # shorter expected outputs stay colocated (auto mode)
    margin: float = 0.1  # split only when at least this share cheaper than colocated
    overhead_us: float = 3_000.0  # the extra engine call and its bookkeeping
    default_bytes_per_s: float = 500e6  # the store bandwidth until one is measured


class Bandwidth:
    """Store-to-store transfers as measured: exponentially weighted means of the rate
    (bytes per second) and of the time one block's move took (its latency share too).

    Until a transfer is measured, a block costs `block_bytes / default_bytes_per_s`.
    Measured, it costs what the last transfers did per block: the real KV size of a
    block (which the conductor's configured block bytes only estimate) and the real
    network, fixed costs included, as a deployment observes them.
    """

    def __init__(self, default_bytes_per_s: float, weight: float = 0.3):
        self.bytes_per_s = float(default_bytes_per_s)
        self.us_per_block = 0.0  # 0 = not measured yet
        self.weight = weight
        self.samples = 0

    def observe(self, nbytes: int, bytes_per_s: float, blocks: int) -> bool:
        """Fold in one measured transfer; False when it is not a measurement."""
        if nbytes <= 0 or blocks <= 0 or not math.isfinite(bytes_per_s) or bytes_per_s <= 0:
            return False
        per_block = nbytes / bytes_per_s * 1e6 / blocks
        if self.samples == 0:
            self.bytes_per_s, self.us_per_block = bytes_per_s, per_block
        else:
            self.bytes_per_s += self.weight * (bytes_per_s - self.bytes_per_s)
            self.us_per_block += self.weight * (per_block - self.us_per_block)
        self.samples += 1
        return True

    def block_us(self, block_bytes: int) -> float:
        """The expected time of one block's move, in microseconds."""
        if self.us_per_block > 0:
            return self.us_per_block
        return block_bytes / self.bytes_per_s * 1e6


@dataclass(frozen=True, slots=True)
class SplitChoice:
    """The decision for one request. `prefill` is None for a colocated plan."""

    split: bool
    prefill: Engine | None
    reason: str
    colocated_us: float = 0.0
    split_us: float = 0.0
    transfer_us: float = 0.0
    transfer_blocks: int = 0
    prefill_tokens: int = 0  # what the prefill engine computes (split)


def leading_held(
    usable: Sequence[Sequence[CacheResidency]], engine: Engine, *, with_store: bool
) -> int:
    """Leading blocks of the request in `engine`'s HBM (and, `with_store`, its store node)."""
    held = 0
    me, store = engine.id, engine.store_node_id
    for found in usable:
        if not any(
            (r.worker_id == me and r.tier is CacheTier.HBM)
            or (with_store and store and r.worker_id == store)
            for r in found
        ):
            break
        held += 1
    return held


def hbm_prefixes(usable: Sequence[Sequence[CacheResidency]]) -> dict[str, int]:
    """Per worker, how many leading blocks of the request it holds in HBM (one pass over
    the residencies, instead of one per engine: a plan prices every prefill candidate)."""
    held: dict[str, int] = {}
    alive: set[str] | None = None
    hbm = CacheTier.HBM
    for index, found in enumerate(usable):
        here = {r.worker_id for r in found if r.tier is hbm}
        alive = here if alive is None else alive & here
        if not alive:
            break
        for worker in alive:
            held[worker] = index + 1
    return held


def choose(
    cost_model: CostModel,
    settings: DisaggSettings,
    request: RequestShape,
    decode: Engine,
    decode_role: str,
    colocated_ttft_us: float,
    candidates: Sequence[tuple[Engine, str]],
    usable: Sequence[Sequence[CacheResidency]],
    bandwidth: Bandwidth,
    mode: str = "auto",
) -> SplitChoice:
    """Split or colocated for a request the policy placed on `decode`.

    `candidates` are the other eligible engines with their roles. Who may prefill: in
    "auto" mode, for an engine of role `both` only engines of role `prefill` (a fleet
    of `both` engines, the default, is never split unasked: the operator opts in by
    giving engines roles), for a `decode` engine those of role `prefill` or `both`;
    asked to "split", any `prefill` or `both` engine. `colocated_ttft_us` is the policy's estimate of the
    request's TTFT on `decode`. `usable` is the guard's per-block residencies (the
    request's usable prefix). A `decode`-only engine is split whenever any engine can
    prefill for it (colocated is then only a fallback); `mode` "colocated" never
    splits, "split" always does when it can.
    """
    if mode not in MODES:
        mode = "auto"
    may = (PREFILL,) if mode == "auto" and decode_role == BOTH else (PREFILL, BOTH)
    prefillers = [e for e, role in candidates if role in may and e.id != decode.id]
    if not settings.enabled:
        return SplitChoice(False, None, "colocated; disaggregation off")
    if mode == "colocated":
        return SplitChoice(False, None, "colocated; asked for")
    if not prefillers:
        return SplitChoice(False, None, "colocated; no other engine can prefill")
    tokens = request.input_tokens()
    out = request.estimated_decode_tokens
    if mode == "auto" and decode_role != DECODE and out < settings.min_decode_tokens:
        # Nothing to weigh (and the plan's hot path stays short).
        return SplitChoice(
            False, None, f"colocated; short output ({out} < {settings.min_decode_tokens} tokens)"
        )
    cum = [0, *itertools.accumulate(key.token_count for key in request.blocks)]  # tokens of n
    # The prompt's full blocks the engine can load; at least one token is always computed.
    full = len(request.blocks) if tokens > cum[-1] else max(0, len(request.blocks) - 1)
    in_hbm = hbm_prefixes(usable)
    d_hbm = min(full, in_hbm.get(decode.id, 0))
    d_pool = min(full, leading_held(usable, decode, with_store=True))
    colocated_prefill = float(cost_model.prefill_cost_us(tokens - cum[d_hbm]))
    stall_d = decode.running_decodes * colocated_prefill
    colocated = colocated_ttft_us + stall_d
    block_mb = max(1, -(-request.block_bytes // MIB))
    load_us_per_block = cost_model.cpu_dram_us_per_mb * block_mb
    best = SplitChoice(False, None, "", split_us=math.inf)
    for p in prefillers:
        p_hbm = min(full, in_hbm.get(p.id, 0))
        compute = tokens - cum[p_hbm]
        prefill_us = float(cost_model.prefill_cost_us(compute))
        queue_us = float(cost_model.queue_cost_us(p))
        # A prefill engine on the decode engine's store node writes the blocks where
        # the decode engine loads them: nothing to move.
        same_store = bool(p.store_node_id) and p.store_node_id == decode.store_node_id
        moved = 0 if same_store else max(0, full - d_pool)
        transfer_us = moved * bandwidth.block_us(request.block_bytes)
        load_us = max(0, full - d_hbm) * load_us_per_block
        cost = (
            queue_us
            + prefill_us
            + p.running_decodes * prefill_us
            + transfer_us
            + load_us
            + settings.overhead_us
        )
        if cost < best.split_us:
            best = SplitChoice(
                True,
                p,
                "",
                colocated_us=colocated,
                split_us=cost,
                transfer_us=transfer_us,
                transfer_blocks=moved,
                prefill_tokens=compute,
            )
    terms = (
        f"prompt {tokens} tok, output {out} tok; colocated {colocated / 1000:.1f} ms "
        f"({decode.running_decodes} decodes on {decode.id} stall {stall_d / 1000:.1f} ms); "
        f"split via {best.prefill.id} {best.split_us / 1000:.1f} ms (transfer "
        f"{best.transfer_blocks} blocks {best.transfer_us / 1000:.1f} ms, "
        f"{bandwidth.bytes_per_s / 1e6:.0f} MB/s{'' if bandwidth.samples else ' assumed'})"
    )
    if decode_role == DECODE:
        why = "decode-only engine"
    elif mode == "split":
        why = "asked for"
    elif out < settings.min_decode_tokens:
        reason = f"colocated; short output ({out} < {settings.min_decode_tokens} tokens)"
        return _with(best, False, reason)
    elif d_hbm and tokens - cum[d_hbm] <= request.blocks[0].token_count:
        return _with(best, False, f"colocated; {decode.id} holds the prompt; {terms}")
    elif best.split_us < colocated * (1.0 - settings.margin):
        why = "cheaper"
    else:
        return _with(best, False, f"colocated; cheaper; {terms}")
    logger.debug("split %s: %s", request.id, terms)
    return _with(best, True, f"split; {why}; {terms}")


def _with(choice: SplitChoice, split: bool, reason: str) -> SplitChoice:
    return SplitChoice(
        split,
        choice.prefill if split else None,
        reason,
        colocated_us=choice.colocated_us,
        split_us=choice.split_us,
        transfer_us=choice.transfer_us,
        transfer_blocks=choice.transfer_blocks if split else 0,
        prefill_tokens=choice.prefill_tokens if split else 0,
    )
