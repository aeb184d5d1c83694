"""The conductor's side of prefill/decode disaggregation: a plan, then the split.

`plan_split` runs the usual plan (the policy chooses the engine that decodes), asks
`routing.disagg.choose` whether another engine should prefill, and if so opens that
engine's own reservation for the prompt. Same contract as `ConductorState`: called from
the event loop only, no sockets.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence

from quillcache_conductor.records import PlanOutcome, Reservation
from quillcache_conductor.state import ConductorState, serves
from quillcache_core.model import RequestShape
from quillcache_core.routing import disagg

logger = logging.getLogger(__name__)


def plan_split(
    state: ConductorState,
    request: RequestShape,
    exclude: Sequence[str] = (),
    mode: str = "auto",
    *,
    first_token_reported: bool = False,
) -> PlanOutcome:
    """`state.plan`, then disaggregation (routing/disagg.py): the planned engine decodes;
    when another engine should prefill, it gets a reservation of its own for the
    prompt, and the decode engine's queued prefill shrinks to the tail it still
    computes."""
    outcome = state.plan(request, exclude, first_token_reported=first_token_reported)
    decision = outcome.decision
    excluded = set(exclude)
    candidates = [
        (info.state, info.record.role)
        for info in state.engines.values()
        if info.state.id not in excluded and serves(info.record, request.model_id)
    ]
    decode = decision.engine
    choice = disagg.choose(
        state.policy.cost_model,
        state.disagg_settings,
        request,
        decode,
        state.engines[decode.id].record.role,
        decision.chosen.est_ttft_us,
        candidates,
        decision.usable or (),
        state.bandwidth,
        mode,
    )
    if not choice.split or choice.prefill is None:
        return PlanOutcome(outcome.reservation_id, decision, choice)
    res = state.reservations[outcome.reservation_id]
    # The decode engine loads the prompt's full blocks and computes the rest (at least
    # one token: a prompt of whole blocks recomputes its last one).
    in_blocks = sum(key.token_count for key in request.blocks)
    last = request.blocks[-1].token_count if request.blocks else 1
    tail = min(res.prefill_tokens, request.input_tokens() - in_blocks or last)
    state.ledger.shrink_prefill(res, decode, tail)
    res.sample_tokens = -1  # its TTFT is the prefill engine's: no sample of this one's speed
    now = state.clock()
    prefill = Reservation(
        id=secrets.token_hex(16),
        engine_id=choice.prefill.id,
        prefill_tokens=choice.prefill_tokens,
        blocks=len(request.blocks),
        created_s=now,
        expires_s=now + state.reservation_ttl_s,
    )
    due = now + (choice.split_us - choice.transfer_us) / 1e6
    state.ledger.add(prefill, choice.prefill, due)
    if state.listener is not None:  # the other replicas count it too
        state.listener.opened(prefill, due - now)
    return PlanOutcome(outcome.reservation_id, decision, choice, prefill.id)


def configure(state: ConductorState, settings: disagg.DisaggSettings) -> None:
    state.disagg_settings = settings
    state.bandwidth = disagg.Bandwidth(settings.default_bytes_per_s)


def transfer_measured(state: ConductorState, nbytes: int, bytes_per_s: float, blocks: int) -> None:
    """A split request's KV (`blocks` blocks, `nbytes` bytes) moved at this rate."""
    if state.bandwidth.observe(nbytes, bytes_per_s, blocks):
        logger.debug(
            "store transfers: %.0f MB/s, %.0f us a block (measured %.0f MB/s, %d blocks)",
            state.bandwidth.bytes_per_s / 1e6,
            state.bandwidth.us_per_block,
            bytes_per_s / 1e6,
            blocks,
        )
