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

A key only proposes a candidate: one kept under another scope is never returned (the
scope is compared, not only hashed: a gateway's tenant never reuses another's prompt),
and the caller measures the prefix the two really share (`common_prefix`) and reuses
that much, so a hash collision costs time, never a wrong result. Keys live in this
process only (Python's hash is seeded per process).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count
from typing import Any


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

    def find(self, scope: Any, keys: list[int]) -> tuple[int, Any, Any] | None:
        """(serial, sequence, payload) of the entry of `scope` filed under the longest of
        `keys` (from `keys(scope, ...)`), or None."""
        by_key, entries = self._by_key, self._entries
        for key in reversed(keys):
            serial = by_key.get(key)
            if serial is not None:
                kept_scope, _, seq, payload = entries[serial]
                if kept_scope != scope:
                    continue  # a collision of two scopes' keys
                entries.move_to_end(serial)
                return serial, seq, payload
        return None

    def put(
        self, scope: Any, keys: list[int], seq: Any, payload: Any, replaces: int | None = None
    ) -> None:
        """Keep `seq` of `scope` with `payload` under `keys`; `replaces` (a serial from
        `find` whose sequence `seq` extends) is dropped. The oldest entry goes beyond
        `size`."""
        if self.size <= 0 or not keys:
            return
        if replaces is not None:
            self._drop(replaces)
        serial = next(self._serials)
        self._entries[serial] = (scope, keys, seq, payload)
        by_key = self._by_key
        for key in keys:
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
