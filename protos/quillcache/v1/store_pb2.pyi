from quillcache.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutChunk(_message.Message):
    __slots__ = ("key", "total_bytes", "checksum", "durable", "tier", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: _common_pb2.BlockKey
    total_bytes: int
    checksum: int
    durable: bool
    tier: _common_pb2.Tier
    data: bytes
    def __init__(self, key: _Optional[_Union[_common_pb2.BlockKey, _Mapping]] = ..., total_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., durable: _Optional[bool] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("key", "tier", "bytes", "durable", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: _common_pb2.BlockKey
    tier: _common_pb2.Tier
    bytes: int
    durable: bool
    checksum: int
    def __init__(self, key: _Optional[_Union[_common_pb2.BlockKey, _Mapping]] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., bytes: _Optional[int] = ..., durable: _Optional[bool] = ..., checksum: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key", "allow_remote", "chunk_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    ALLOW_REMOTE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: _common_pb2.BlockKey
    allow_remote: bool
    chunk_bytes: int
    def __init__(self, key: _Optional[_Union[_common_pb2.BlockKey, _Mapping]] = ..., allow_remote: _Optional[bool] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class GetChunk(_message.Message):
    __slots__ = ("total_bytes", "checksum", "tier", "served_from", "data")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SERVED_FROM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    checksum: int
    tier: _common_pb2.Tier
    served_from: str
    data: bytes
    def __init__(self, total_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., served_from: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[_common_pb2.BlockKey, _Mapping]]] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("exists", "tiers")
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    tiers: _containers.RepeatedScalarFieldContainer[_common_pb2.Tier]
    def __init__(self, exists: _Optional[_Iterable[bool]] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.Tier, str]]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[_common_pb2.BlockKey, _Mapping]]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StoreStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreStatsResponse(_message.Message):
    __slots__ = ("node_id", "dram_bytes", "dram_blocks", "dram_capacity_bytes", "ssd_bytes", "ssd_blocks", "ssd_capacity_bytes", "hits", "misses", "demotions", "evictions", "corrupt_blocks", "peer_fetches", "data_address", "data_socket")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAM_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SSD_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_FETCHES_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    dram_bytes: int
    dram_blocks: int
    dram_capacity_bytes: int
    ssd_bytes: int
    ssd_blocks: int
    ssd_capacity_bytes: int
    hits: int
    misses: int
    demotions: int
    evictions: int
    corrupt_blocks: int
    peer_fetches: int
    data_address: str
    data_socket: str
    def __init__(self, node_id: _Optional[str] = ..., dram_bytes: _Optional[int] = ..., dram_blocks: _Optional[int] = ..., dram_capacity_bytes: _Optional[int] = ..., ssd_bytes: _Optional[int] = ..., ssd_blocks: _Optional[int] = ..., ssd_capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., demotions: _Optional[int] = ..., evictions: _Optional[int] = ..., corrupt_blocks: _Optional[int] = ..., peer_fetches: _Optional[int] = ..., data_address: _Optional[str] = ..., data_socket: _Optional[str] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("source_node", "source_data_address", "keys", "tier", "durable", "max_batch_results")
    SOURCE_NODE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_RESULTS_FIELD_NUMBER: _ClassVar[int]
    source_node: str
    source_data_address: str
    keys: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockKey]
    tier: _common_pb2.Tier
    durable: bool
    max_batch_results: int
    def __init__(self, source_node: _Optional[str] = ..., source_data_address: _Optional[str] = ..., keys: _Optional[_Iterable[_Union[_common_pb2.BlockKey, _Mapping]]] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., durable: _Optional[bool] = ..., max_batch_results: _Optional[int] = ...) -> None: ...

class PullResult(_message.Message):
    __slots__ = ("index", "ok", "bytes", "checksum", "tier", "code", "error", "source_failed", "results")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FAILED_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    ok: bool
    bytes: int
    checksum: int
    tier: _common_pb2.Tier
    code: str
    error: str
    source_failed: bool
    results: _containers.RepeatedCompositeFieldContainer[PullResult]
    def __init__(self, index: _Optional[int] = ..., ok: _Optional[bool] = ..., bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., code: _Optional[str] = ..., error: _Optional[str] = ..., source_failed: _Optional[bool] = ..., results: _Optional[_Iterable[_Union[PullResult, _Mapping]]] = ...) -> None: ...
