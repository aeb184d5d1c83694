"""Each tenant's memos of the work its prompts took, bounded in bytes.

The gateway remembers what recent prompts cost to prepare: the built-in tokenizer's
piece ids, recent long texts and pieces with their token ids (`TokenMemo`), recent
prompts' block hashes (`RecentChains`). Every tenant has its own, made at the start for
the tenants the API keys name, each `--tenant-memo-bytes` at most and all of them
`--memo-bytes` at most: no tenant's traffic fills, evicts or warms another's, so how
fast a prompt is prepared says nothing about what another tenant sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from quillcache_core.identity.hashing import RecentChains
from quillcache_core.identity.tokenize import PIECE_ENTRIES, TokenMemo


@dataclass(frozen=True, slots=True)
class TenantMemo:
    tokens: TokenMemo  # half of the tenant's bytes
    chains: RecentChains  # the other half

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.chains.nbytes


class TenantMemos:
    """The tenants' memos. A tenant not named at the start (none, while the API keys stay
    those of the start) gets a memo that keeps nothing."""

    def __init__(self, tenants: Iterable[str], total_bytes: int, tenant_bytes: int) -> None:
        names = sorted(set(tenants))
        self.tenant_bytes = min(tenant_bytes, total_bytes // max(1, len(names)))
        self._memos = {name: _memo(self.tenant_bytes) for name in names}
        self._none = _memo(0)

    def of(self, tenant: str) -> TenantMemo:
        return self._memos.get(tenant, self._none)

    @property
    def nbytes(self) -> int:
        return sum(memo.nbytes for memo in self._memos.values())


def _memo(max_bytes: int) -> TenantMemo:
    half = max_bytes // 2
    texts, prompts = (PIECE_ENTRIES, 64) if max_bytes else (0, 0)
    return TenantMemo(TokenMemo(half, texts=texts), RecentChains(size=prompts, max_bytes=half))
