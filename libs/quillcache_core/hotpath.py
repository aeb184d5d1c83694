"""The planner's per-block passes: compiled (`_hotpath.c`) when the extension built, in
Python otherwise.

A plan's work that grows with the prompt is a few passes over its blocks: look each hash
up in the memory index, check every copy's identity (the guard), group the blocks into
runs of the same copies (the cost planner). In Python each pass costs 10-30 µs for a
128-block prompt; the C versions do them in one loop each. Both halves have the same
contract, and the tests run each on the same inputs.

`pip install -e .` builds the extension (pyproject.toml's ext-modules, optional: a
machine without a C compiler gets the Python half). QUILLCACHE_PURE_PYTHON=1 in the
environment selects the Python half anyway.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from itertools import chain, compress, count, repeat
from operator import eq, is_, itemgetter, ne, sub

try:
    from quillcache_core import _hotpath as compiled
except ImportError:  # pragma: no cover - depends on the build
    compiled = None
if os.environ.get("QUILLCACHE_PURE_PYTHON"):
    compiled = None

_SLICE = 16  # hashes locate_py looks up at a time when it stops at a miss
_key = itemgetter(0)  # CacheResidency.key
_identity = itemgetter(slice(0, 4))  # a KvBlockKey's (model, tokenizer, adapter, tenant)
_first = itemgetter(0)
_copy_mark = itemgetter(slice(1, 4))  # a residency's (worker_id, tier, bytes)
_ONE_COPY = frozenset({1})
_dict = dict
_LIST = frozenset({list})


def locate_py(
    by_hash: dict, hashes: list, stop_at_miss: bool, pending: str
) -> tuple[list, list[int] | None]:
    """(found, todo): found[i] for hashes[i] is [record] for a one-record cell, the
    records of a dict cell holding one key, None for any other dict cell (todo lists
    those positions, None when there is none). A hash held nowhere ends found when
    `stop_at_miss`, else gets []."""
    get = by_hash.get
    if stop_at_miss:
        # In slices: a lookup past the first miss is wasted, and a miss is the dearest
        # lookup in a large dict (cold probes).
        cells = list(map(get, hashes[:_SLICE]))
        if None in cells:
            del cells[cells.index(None) :]
        else:
            for start in range(_SLICE, len(hashes), _SLICE):
                more = list(map(get, hashes[start : start + _SLICE]))
                if None in more:
                    cells += more[: more.index(None)]
                    break
                cells += more
        found = [[cell] for cell in cells]
    else:
        cells = list(map(get, hashes))
        found = [[cell] for cell in cells]
        if None in cells:
            for i in compress(count(), map(is_, cells, repeat(None))):
                found[i] = []
    todo = None
    if _dict in set(map(type, cells)):
        for i in compress(count(), map(is_, map(type, cells), repeat(_dict))):
            cell = cells[i]
            if len(cell) == 1 and pending not in cell:
                for records in cell.values():
                    if type(records) is _dict:
                        found[i] = list(records.values())
                        break
                else:
                    found[i] = None
            else:
                found[i] = None
            if found[i] is None:
                if todo is None:
                    todo = []
                todo.append(i)
    return found, todo


def same_scope_py(located: list, want: tuple) -> bool | None:
    """Whether every record's key has `want`'s four identity fields first; None when
    `located` is not a list of lists (the caller then decides)."""
    if not set(map(type, located)) <= _LIST:
        return None
    return all(map(eq, map(_identity, map(_key, chain.from_iterable(located))), repeat(want)))


def block_runs_py(usable: Sequence[Sequence]) -> list[tuple[int, int]] | None:
    """(first block, block count) of each run of blocks with the same (worker, tier,
    bytes) copies, in the same order."""
    n = len(usable)
    if not n:
        return []
    if set(map(len, usable)) == _ONE_COPY:
        # One copy per block (the rule): its (worker, tier, bytes) is the mark.
        marks = list(map(_copy_mark, map(_first, usable)))
    else:
        # Each block's copies in order; a one-copy block's mark is its 1-tuple (no
        # block with another count can equal it).
        marks = list(map(tuple, map(map, repeat(_copy_mark), usable)))
    # A run starts at 0 and wherever a block's mark differs from the one before.
    starts = [0, *compress(range(1, n), map(ne, marks[1:], marks))]
    return list(zip(starts, map(sub, [*starts[1:], n], starts), strict=True))


def use(fast: bool) -> None:
    """Select the compiled half (when built) or the Python half, for every caller."""
    global locate, same_scope, block_runs
    if fast and compiled is not None:
        locate, same_scope, block_runs = (
            compiled.locate,
            compiled.same_scope,
            compiled.block_runs,
        )
    else:
        locate, same_scope, block_runs = locate_py, same_scope_py, block_runs_py


locate = locate_py
same_scope = same_scope_py
block_runs = block_runs_py
use(True)
