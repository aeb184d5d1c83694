from quillcache.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferRequest(_message.Message):
    __slots__ = ("source_node", "destination_node", "keys", "destination_tier", "window", "chunk_bytes", "durable")
    SOURCE_NODE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_NODE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_TIER_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    source_node: str
    destination_node: str
    keys: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockKey]
    destination_tier: _common_pb2.Tier
    window: int
    chunk_bytes: int
    durable: bool
    def __init__(self, source_node: _Optional[str] = ..., destination_node: _Optional[str] = ..., keys: _Optional[_Iterable[_Union[_common_pb2.BlockKey, _Mapping]]] = ..., destination_tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., window: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., durable: _Optional[bool] = ...) -> None: ...

class BlockResult(_message.Message):
    __slots__ = ("key", "ok", "error", "bytes", "skipped", "code")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    key: _common_pb2.BlockKey
    ok: bool
    error: str
    bytes: int
    skipped: bool
    code: str
    def __init__(self, key: _Optional[_Union[_common_pb2.BlockKey, _Mapping]] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., bytes: _Optional[int] = ..., skipped: _Optional[bool] = ..., code: _Optional[str] = ...) -> None: ...

class TransferProgress(_message.Message):
    __slots__ = ("blocks_done", "blocks_total", "bytes_done", "bytes_per_s", "results", "finished", "blocks_failed", "blocks_skipped", "elapsed_s")
    BLOCKS_DONE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FAILED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    blocks_done: int
    blocks_total: int
    bytes_done: int
    bytes_per_s: float
    results: _containers.RepeatedCompositeFieldContainer[BlockResult]
    finished: bool
    blocks_failed: int
    blocks_skipped: int
    elapsed_s: float
    def __init__(self, blocks_done: _Optional[int] = ..., blocks_total: _Optional[int] = ..., bytes_done: _Optional[int] = ..., bytes_per_s: _Optional[float] = ..., results: _Optional[_Iterable[_Union[BlockResult, _Mapping]]] = ..., finished: _Optional[bool] = ..., blocks_failed: _Optional[int] = ..., blocks_skipped: _Optional[int] = ..., elapsed_s: _Optional[float] = ...) -> None: ...
