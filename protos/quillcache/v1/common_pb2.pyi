from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_REMOTE_HBM: _ClassVar[Tier]
    TIER_CPU_DRAM: _ClassVar[Tier]
    TIER_LOCAL_SSD: _ClassVar[Tier]
    TIER_OBJECT_STORE: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_HBM: Tier
TIER_REMOTE_HBM: Tier
TIER_CPU_DRAM: Tier
TIER_LOCAL_SSD: Tier
TIER_OBJECT_STORE: Tier

class Identity(_message.Message):
    __slots__ = ("model_id", "tokenizer_id", "adapter_id", "tenant_id", "cache_salt")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tokenizer_id: str
    adapter_id: str
    tenant_id: str
    cache_salt: str
    def __init__(self, model_id: _Optional[str] = ..., tokenizer_id: _Optional[str] = ..., adapter_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class BlockKey(_message.Message):
    __slots__ = ("model_id", "tokenizer_id", "adapter_id", "tenant_id", "prefix_hash", "block_hash", "block_index", "token_count")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tokenizer_id: str
    adapter_id: str
    tenant_id: str
    prefix_hash: str
    block_hash: str
    block_index: int
    token_count: int
    def __init__(self, model_id: _Optional[str] = ..., tokenizer_id: _Optional[str] = ..., adapter_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., prefix_hash: _Optional[str] = ..., block_hash: _Optional[str] = ..., block_index: _Optional[int] = ..., token_count: _Optional[int] = ...) -> None: ...

class BlockRef(_message.Message):
    __slots__ = ("block_hash", "token_count", "bytes")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    block_hash: str
    token_count: int
    bytes: int
    def __init__(self, block_hash: _Optional[str] = ..., token_count: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class Slo(_message.Message):
    __slots__ = ("ttft_ms", "tpot_ms")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: int
    tpot_ms: int
    def __init__(self, ttft_ms: _Optional[int] = ..., tpot_ms: _Optional[int] = ...) -> None: ...
