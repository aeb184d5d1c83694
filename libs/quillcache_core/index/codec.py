"""The record encoding the key-value backends (lmdb, rocksdb) share.

A record's key is a msgpack array of ten fields, written field by field so that the
fields of a block key form a byte prefix: (block_hash, model, tokenizer, adapter,
tenant, prefix_hash, block_index, token_count, worker, tier). A scope (model,
tokenizer, adapter, tenant, parent hash) packs the same way for prefix scans; its
value is (bytes, last_access_ms, ref_count, pinned).
"""

from __future__ import annotations

from collections.abc import Callable

import msgpack

from quillcache_core.errors import Corrupt
from quillcache_core.model import CacheResidency, CacheTier, KvBlockKey

REC_HEADER = b"\x9a"  # msgpack fixarray, 10 elements
TIERS = {tier.value: tier for tier in CacheTier}
unpackb = msgpack.unpackb
Pack = Callable[[object], bytes]


def key_prefix(pack: Pack, key: KvBlockKey) -> bytes:
    """The record-key prefix shared by every record of `key` (all workers, tiers)."""
    return b"".join(
        (
            REC_HEADER,
            pack(key.block_hash),
            pack(key.model_id),
            pack(key.tokenizer_id),
            pack(key.adapter_id),
            pack(key.tenant_id),
            pack(key.prefix_hash),
            pack(key.block_index),
            pack(key.token_count),
        )
    )


def scope_prefix(
    pack: Pack,
    model_id: str,
    tokenizer_id: str,
    adapter_id: str | None,
    tenant_id: str,
    parent: str,
) -> bytes:
    """A prefix-scan scope: the identity and the parent block's hash."""
    return pack(model_id) + pack(tokenizer_id) + pack(adapter_id) + pack(tenant_id) + pack(parent)


def decode_record(rec_key: bytes, value: bytes) -> CacheResidency:
    """The residency a record key and its value hold; Corrupt for an unknown tier."""
    f = unpackb(rec_key)
    nbytes, last_access_ms, ref_count, pinned = unpackb(value)
    try:
        tier = TIERS[f[9]]
    except KeyError:
        raise Corrupt(f"index record with unknown tier {f[9]!r}") from None
    return CacheResidency(
        key=KvBlockKey(f[1], f[2], f[3], f[4], f[5], f[0], f[6], f[7]),
        worker_id=f[8],
        tier=tier,
        bytes=nbytes,
        last_access_ms=last_access_ms,
        ref_count=ref_count,
        pinned=pinned,
    )
