"""A block's key on the wire (`common.BlockKey`), for every service that sends one."""

from __future__ import annotations

from quillcache.v1 import common_pb2
from quillcache_core.model import KvBlockKey


def key_to_proto(key: KvBlockKey) -> common_pb2.BlockKey:
    msg = common_pb2.BlockKey(
        model_id=key.model_id,
        tokenizer_id=key.tokenizer_id,
        tenant_id=key.tenant_id,
        prefix_hash=key.prefix_hash,
        block_hash=key.block_hash,
        block_index=key.block_index,
        token_count=key.token_count,
    )
    if key.adapter_id is not None:
        msg.adapter_id = key.adapter_id
    return msg
