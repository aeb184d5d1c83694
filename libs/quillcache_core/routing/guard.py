"""The reuse guard: content matches of another identity are refused, never reused."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from quillcache_core import hotpath
from quillcache_core.model import CacheResidency, IdentityScope


@dataclass(frozen=True, slots=True)
class Refusal:
    """A residency whose content hash matched a request's block but whose identity did not."""

    block_index: int
    block_hash: str
    worker_id: str
    reason: str  # "model", "tokenizer", "adapter" or "tenant"


@dataclass(frozen=True, slots=True)
class ReuseAudit:
    """Per block (in request order), the residencies safe to reuse; plus every refusal."""

    usable: list[list[CacheResidency]]
    refusals: list[Refusal]


def audit_reuse(scope: IdentityScope, located: Sequence[Sequence[CacheResidency]]) -> ReuseAudit:
    """Split located residencies into usable (same identity) and refused (any other).

    `located[i]` are the residencies found by content hash for the request's block i.
    A residency is usable only if model, tokenizer, adapter (including its absence)
    and tenant all equal the request's; the refusal names the first field that
    differs. Pure and O(residencies).
    """
    # A key's first four fields are its identity: one tuple comparison per residency.
    want = (scope.model_id, scope.tokenizer_id, scope.adapter_id, scope.tenant_id)
    # The rule is that everything matches (hashes fold in the identity): one flat
    # pass decides (hotpath.same_scope), and the located lists are then usable as they are.
    same = hotpath.same_scope(located, want) if type(located) is list else None
    if same:  # a list of lists, every copy of this identity: usable as they are
        return ReuseAudit(usable=list(located), refusals=[])
    if same is None and all(residency[0][:4] == want for found in located for residency in found):
        return ReuseAudit(
            usable=[found if isinstance(found, list) else list(found) for found in located],
            refusals=[],
        )
    usable: list[list[CacheResidency]] = []
    refusals: list[Refusal] = []
    for index, found in enumerate(located):
        if all(residency.key[:4] == want for residency in found):
            usable.append(found if isinstance(found, list) else list(found))
            continue
        ok: list[CacheResidency] = []
        for residency in found:
            reason = scope.mismatch(residency.key)
            if reason is None:
                ok.append(residency)
            else:
                refusals.append(
                    Refusal(index, residency.key.block_hash, residency.worker_id, reason)
                )
        usable.append(ok)
    return ReuseAudit(usable=usable, refusals=refusals)
