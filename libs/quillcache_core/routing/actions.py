"""A plan's per-block actions (hit, fetch, recompute), and the runs they are held as."""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from typing import NamedTuple

from quillcache_core.model import (
    CacheTier,
)

logger = logging.getLogger(__name__)


class ActionKind(enum.Enum):
    LOCAL_HIT = "local_hit"  # the engine holds the block itself (HBM or its own tiers)
    FETCH = "fetch"  # load the block from a store node
    RECOMPUTE = "recompute"  # prefill the block's tokens


class BlockAction(NamedTuple):
    """What the engine does with one block (a NamedTuple: 128 are built per plan)."""

    kind: ActionKind
    block_index: int
    block_hash: str
    source_node: str | None = None
    source_tier: CacheTier | None = None
    cost_us: float = 0.0


class ActionRun(NamedTuple):
    """Consecutive blocks with the same action and source.

    `block_cost_us` is each block's cost for LOCAL_HIT and FETCH; a RECOMPUTE block
    costs its own tokens' prefill. `cost_us` is the whole run's.
    """

    kind: ActionKind
    first: int
    count: int
    source_node: str | None
    source_tier: CacheTier | None
    block_cost_us: float
    cost_us: float


class ActionRuns(Sequence[BlockAction]):
    """A decision's per-block actions held as runs; the blocks are expanded on demand.

    The conductor reads `runs` (a plan's two or three runs instead of 128 objects);
    anything that indexes or iterates gets the same BlockActions a list would hold.
    """

    __slots__ = ("runs", "_blocks", "_per_token", "_expanded")

    def __init__(self, runs: list[ActionRun], blocks: Sequence, per_token: float) -> None:
        self.runs = runs
        self._blocks = blocks
        self._per_token = per_token
        self._expanded: list[BlockAction] | None = None

    def _list(self) -> list[BlockAction]:
        if self._expanded is None:
            blocks, make = self._blocks, BlockAction._make
            out: list[BlockAction] = []
            for run in self.runs:
                span = range(run.first, run.first + run.count)
                if run.kind is ActionKind.RECOMPUTE:
                    per_token = self._per_token
                    out.extend(
                        make(
                            (
                                run.kind,
                                i,
                                blocks[i].block_hash,
                                None,
                                None,
                                float(per_token * blocks[i].token_count),
                            )
                        )
                        for i in span
                    )
                else:
                    out.extend(
                        make(
                            (
                                run.kind,
                                i,
                                blocks[i].block_hash,
                                run.source_node,
                                run.source_tier,
                                run.block_cost_us,
                            )
                        )
                        for i in span
                    )
            self._expanded = out
        return self._expanded

    def __len__(self) -> int:
        return sum(run.count for run in self.runs)

    def __getitem__(self, index):
        return self._list()[index]

    def __iter__(self):
        return iter(self._list())

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __repr__(self) -> str:
        return f"ActionRuns({self.runs!r})"


def action_runs(actions: Sequence[BlockAction]) -> list[ActionRun]:
    """The runs of any decision's actions (ActionRuns keeps them; a list is grouped)."""
    if isinstance(actions, ActionRuns):
        return actions.runs
    runs: list[ActionRun] = []
    for action in actions:
        last = runs[-1] if runs else None
        if (
            last is not None
            and last.kind is action.kind
            and last.source_node == action.source_node
            and last.source_tier is action.source_tier
            and last.first + last.count == action.block_index
        ):
            runs[-1] = last._replace(count=last.count + 1, cost_us=last.cost_us + action.cost_us)
        else:
            runs.append(
                ActionRun(
                    action.kind,
                    action.block_index,
                    1,
                    action.source_node,
                    action.source_tier,
                    0.0 if action.kind is ActionKind.RECOMPUTE else action.cost_us,
                    action.cost_us,
                )
            )
    return runs
