"""The optimistic overlay: what planned requests are about to put in their engines' HBM.

A dict beside the residency index, block hash -> the overlay records of that block (one
per planned request holding it), visible to the next plans at once. Records are
`CacheResidency` tuples on the engine's HBM tier; the reservation that made them keeps
the same objects, so it takes back exactly its own (`forget`). Most are taken back or
replaced by the engine's own events within seconds; an entry costs a tenth of an index
record. `ConductorState` owns the dict and calls these on its event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from quillcache_core.model import CacheResidency, CacheTier, KvBlockKey
from quillcache_core.routing.actions import action_runs
from quillcache_core.routing.policy import PlanDecision

Overlay = dict[str, list[CacheResidency]]


def record(
    overlay: Overlay, decision: PlanDecision, blocks: Sequence[KvBlockKey], nbytes: int, parts: int
) -> list[CacheResidency]:
    """Overlay records on the decision's engine for the `blocks` not already in its HBM
    (an engine whose blocks are `parts` of ours caches whole blocks of its own only)."""
    engine = decision.engine.id
    hbm = CacheTier.HBM
    if parts > 1:
        blocks = blocks[: len(blocks) // parts * parts]
    held = [
        (run.first, run.first + run.count)
        for run in action_runs(decision.actions)
        if run.source_tier is hbm and run.source_node == engine
    ]
    if not held:
        new = blocks
    elif len(held) == 1 and held[0][0] == 0:  # the rule: the hits are a prefix
        new = blocks[held[0][1] :]
    else:
        skip = {i for first, end in held for i in range(first, end)}
        new = [key for i, key in enumerate(blocks) if i not in skip]
    make = tuple.__new__
    records = [make(CacheResidency, (key, engine, hbm, nbytes, 0, 0, False)) for key in new]
    slot = overlay.setdefault
    for made in records:
        slot(made[0][5], []).append(made)  # key.block_hash
    return records


def forget(overlay: Overlay, records: Sequence[CacheResidency]) -> None:
    """Take these records (by identity) out of the overlay."""
    get = overlay.get
    for made in records:
        block_hash = made[0][5]  # made.key.block_hash, without two property calls
        found = get(block_hash)
        if found is None:
            continue
        if len(found) == 1:
            if found[0] is made:
                del overlay[block_hash]
            continue
        for i, other in enumerate(found):
            if other is made:
                del found[i]
                break


def release(overlay: Overlay, engine_id: str, block_hash: str) -> None:
    """No record may claim the block on `engine_id` any longer (its events said so)."""
    found = overlay.get(block_hash)
    if found is None:
        return
    kept = [made for made in found if made[1] != engine_id]  # made.worker_id
    if not kept:
        del overlay[block_hash]
    elif len(kept) < len(found):
        overlay[block_hash] = kept
