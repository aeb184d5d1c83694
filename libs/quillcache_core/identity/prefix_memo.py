"""The recent sequences a gateway has worked on, found by the longest opening they share
with a new one.

The gateway tokenizes a prompt and hashes its blocks; most prompts open like a recent
one (a conversation's next turn, a document asked about again). `PrefixMemo` keeps the
last `size` sequences (a str or bytes each, with what was computed from it) and finds,
for a new sequence, the kept one sharing the most whole `chunk`s with it from the start.
Each kept sequence is filed under one key per whole chunk: a chain of Python hashes of
the scope and the chunks up to there. A lookup computes the new sequence's chain (one
pass, one hash per chunk) and tries its keys from the longest down, so a conversation's
previous turn is found even when many conversations open with the same system prompt
(a single key per opening found only the last of them).

A key only proposes a candidate: one kept under another scope is never taken (the
scope is compared, not only hashed: a gateway's tenant never reuses another's prompt),
and `lookup` measures the opening the two really share (`common_prefix`), which is all
the caller reuses, so a hash collision costs time, never a wrong result. Keys live in
this process only (Python's hash is seeded per process). A sequence kept after one it
extends whole (a conversation's next turn) replaces it.

A memo is bounded twice: at most `size` sequences and at most `max_bytes` (a kept
sequence's text, its keys and what the caller says its payload costs); the oldest go
first, and a sequence that alone costs more is not kept. Give each tenant its own memo:
what one keeps then never decides what another finds, or how fast.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from itertools import count
from typing import Any, NamedTuple


class Lookup(NamedTuple):
    """What `PrefixMemo.lookup` found for a sequence; `keep` files the sequence with it."""

    scope: Any
    keys: list[int]  # the sequence's chain keys
    shared: int  # length of the opening it shares with the kept sequence found (0: none)
    payload: Any  # that sequence's payload, None when none was found
    extends: int | None  # its serial when the new sequence extends it whole


DEFAULT_MAX_BYTES = 64 * 1024 * 1024
KEY_BYTES = 120  # a chain key: its int, its place in the entry's list and in `_by_key`
ENTRY_BYTES = 200  # an entry's tuple and its place in `_entries`


class PrefixMemo:
    """The last `size` sequences with a payload each, at most `max_bytes` in all (see the
    module's docstring). Not thread-safe."""

    def __init__(self, size: int, chunk: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if chunk <= 0:
            raise ValueError("chunk must be positive")
        self.size = size
        self.chunk = chunk
        self.max_bytes = max_bytes
        self.nbytes = 0  # what the kept entries cost, as `keep` counts it
        # serial -> (scope, keys, sequence, payload, cost in bytes)
        self._entries: OrderedDict[int, tuple[Any, list[int], Any, Any, int]] = OrderedDict()
        self._by_key: dict[int, int] = {}  # chain key -> the newest entry filed under it
        self._serials = count()

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self, scope: Any, seq: str | bytes, chunk: int = 0) -> list[int]:
        """The chain keys of `seq`'s whole chunks of `chunk` (default the memo's)
        elements; empty when it has none."""
        step = chunk or self.chunk
        key = hash(scope)
        out = []
        append = out.append
        for start in range(0, len(seq) - step + 1, step):
            key = hash((key, seq[start : start + step]))
            append(key)
        return out

    def lookup(self, scope: Any, seq: str | bytes, chunk: int = 0) -> Lookup:
        """The kept sequence of `scope` filed under the longest of `seq`'s chain keys
        (by chunks of `chunk`, default the memo's: the same for a scope's every lookup),
        and the opening the two share."""
        keys = self.keys(scope, seq, chunk)
        by_key, entries = self._by_key, self._entries
        for key in reversed(keys):
            serial = by_key.get(key)
            if serial is None:
                continue
            kept_scope, _, kept, payload, _ = entries[serial]
            if kept_scope != scope:
                continue  # a collision of two scopes' keys
            entries.move_to_end(serial)
            shared = common_prefix(seq, kept)
            return Lookup(scope, keys, shared, payload, serial if shared == len(kept) else None)
        return Lookup(scope, keys, 0, None, None)

    def keep(self, found: Lookup, seq: Any, payload: Any, payload_bytes: int = 0) -> None:
        """Keep `seq` (the sequence `found` was looked up for) with `payload` (which
        costs `payload_bytes`), in place of the sequence found if `seq` extends it
        whole. The oldest entries go beyond `size` or `max_bytes`; a sequence costing
        more than `max_bytes` alone is not kept."""
        cost = sys.getsizeof(seq) + KEY_BYTES * len(found.keys) + ENTRY_BYTES + payload_bytes
        if self.size <= 0 or not found.keys or cost > self.max_bytes:
            return
        if found.extends is not None:
            self._drop(found.extends)
        serial = next(self._serials)
        self._entries[serial] = (found.scope, found.keys, seq, payload, cost)
        self.nbytes += cost
        by_key = self._by_key
        for key in found.keys:
            by_key[key] = serial
        while len(self._entries) > self.size or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, serial: int) -> None:
        entry = self._entries.pop(serial, None)
        if entry is None:
            return
        self.nbytes -= entry[4]
        by_key = self._by_key
        for key in entry[1]:
            if by_key.get(key) == serial:
                del by_key[key]


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two str or bytes (slice compares, no
    Python step per character)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low]; a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low
