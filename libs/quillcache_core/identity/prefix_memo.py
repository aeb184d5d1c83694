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
"""

from __future__ import annotations

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


class PrefixMemo:
    """The last `size` sequences with a payload each (see the module's docstring)."""

    def __init__(self, size: int, chunk: int) -> None:
        if chunk <= 0:
            raise ValueError("chunk must be positive")
        self.size = size
        self.chunk = chunk
        self._entries: OrderedDict[int, tuple[Any, list[int], Any, Any]] = OrderedDict()
        self._by_key: dict[int, int] = {}  # chain key -> the newest entry filed under it
        self._serials = count()

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self, scope: Any, seq: str | bytes) -> list[int]:
        """The chain keys of `seq`'s whole chunks (empty when it has none)."""
        step = self.chunk
        key = hash(scope)
        out = []
        append = out.append
        for start in range(0, len(seq) - step + 1, step):
            key = hash((key, seq[start : start + step]))
            append(key)
        return out

    def lookup(self, scope: Any, seq: str | bytes) -> Lookup:
        """The kept sequence of `scope` filed under the longest of `seq`'s chain keys,
        and the opening the two share."""
        keys = self.keys(scope, seq)
        by_key, entries = self._by_key, self._entries
        for key in reversed(keys):
            serial = by_key.get(key)
            if serial is None:
                continue
            kept_scope, _, kept, payload = entries[serial]
            if kept_scope != scope:
                continue  # a collision of two scopes' keys
            entries.move_to_end(serial)
            shared = common_prefix(seq, kept)
            return Lookup(scope, keys, shared, payload, serial if shared == len(kept) else None)
        return Lookup(scope, keys, 0, None, None)

    def keep(self, found: Lookup, seq: Any, payload: Any) -> None:
        """Keep `seq` (the sequence `found` was looked up for) with `payload`, in place
        of the sequence found if `seq` extends it whole. The oldest entry goes beyond
        `size`."""
        if self.size <= 0 or not found.keys:
            return
        if found.extends is not None:
            self._drop(found.extends)
        serial = next(self._serials)
        self._entries[serial] = (found.scope, found.keys, seq, payload)
        by_key = self._by_key
        for key in found.keys:
            by_key[key] = serial
        while len(self._entries) > self.size:
            self._drop(next(iter(self._entries)))

    def _drop(self, serial: int) -> None:
        entry = self._entries.pop(serial, None)
        if entry is None:
            return
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
