from quillcache.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrainRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("engine_id", "inflight_requests", "state")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    inflight_requests: int
    state: str
    def __init__(self, engine_id: _Optional[str] = ..., inflight_requests: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("request_id", "identity", "blocks", "prompt_tokens", "expected_decode_tokens", "slo", "exclude_engines", "packed_hashes", "block_tokens", "block_bytes", "action_runs", "max_others", "disagg", "reports_first_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_ENGINES_FIELD_NUMBER: _ClassVar[int]
    PACKED_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTION_RUNS_FIELD_NUMBER: _ClassVar[int]
    MAX_OTHERS_FIELD_NUMBER: _ClassVar[int]
    DISAGG_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    identity: _common_pb2.Identity
    blocks: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockRef]
    prompt_tokens: int
    expected_decode_tokens: int
    slo: _common_pb2.Slo
    exclude_engines: _containers.RepeatedScalarFieldContainer[str]
    packed_hashes: bytes
    block_tokens: int
    block_bytes: int
    action_runs: bool
    max_others: int
    disagg: str
    reports_first_token: bool
    def __init__(self, request_id: _Optional[str] = ..., identity: _Optional[_Union[_common_pb2.Identity, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[_common_pb2.BlockRef, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ..., expected_decode_tokens: _Optional[int] = ..., slo: _Optional[_Union[_common_pb2.Slo, _Mapping]] = ..., exclude_engines: _Optional[_Iterable[str]] = ..., packed_hashes: _Optional[bytes] = ..., block_tokens: _Optional[int] = ..., block_bytes: _Optional[int] = ..., action_runs: _Optional[bool] = ..., max_others: _Optional[int] = ..., disagg: _Optional[str] = ..., reports_first_token: _Optional[bool] = ...) -> None: ...

class BlockAction(_message.Message):
    __slots__ = ("kind", "block_index", "block_hash", "source_node", "source_address", "source_tier", "cost_us", "block_count")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[BlockAction.Kind]
        LOCAL_HIT: _ClassVar[BlockAction.Kind]
        FETCH: _ClassVar[BlockAction.Kind]
        RECOMPUTE: _ClassVar[BlockAction.Kind]
    KIND_UNSPECIFIED: BlockAction.Kind
    LOCAL_HIT: BlockAction.Kind
    FETCH: BlockAction.Kind
    RECOMPUTE: BlockAction.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TIER_FIELD_NUMBER: _ClassVar[int]
    COST_US_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    kind: BlockAction.Kind
    block_index: int
    block_hash: str
    source_node: str
    source_address: str
    source_tier: _common_pb2.Tier
    cost_us: int
    block_count: int
    def __init__(self, kind: _Optional[_Union[BlockAction.Kind, str]] = ..., block_index: _Optional[int] = ..., block_hash: _Optional[str] = ..., source_node: _Optional[str] = ..., source_address: _Optional[str] = ..., source_tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., cost_us: _Optional[int] = ..., block_count: _Optional[int] = ...) -> None: ...

class EngineCost(_message.Message):
    __slots__ = ("engine_id", "cost_us", "est_ttft_us", "queue_us", "fetch_us", "prefill_us", "decode_us", "prefix_blocks", "hit_blocks", "fetch_blocks", "score")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    COST_US_FIELD_NUMBER: _ClassVar[int]
    EST_TTFT_US_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    FETCH_US_FIELD_NUMBER: _ClassVar[int]
    PREFILL_US_FIELD_NUMBER: _ClassVar[int]
    DECODE_US_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FETCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    cost_us: float
    est_ttft_us: float
    queue_us: float
    fetch_us: float
    prefill_us: float
    decode_us: float
    prefix_blocks: int
    hit_blocks: int
    fetch_blocks: int
    score: float
    def __init__(self, engine_id: _Optional[str] = ..., cost_us: _Optional[float] = ..., est_ttft_us: _Optional[float] = ..., queue_us: _Optional[float] = ..., fetch_us: _Optional[float] = ..., prefill_us: _Optional[float] = ..., decode_us: _Optional[float] = ..., prefix_blocks: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., fetch_blocks: _Optional[int] = ..., score: _Optional[float] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("block_index", "block_hash", "worker_id", "reason")
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    block_index: int
    block_hash: str
    worker_id: str
    reason: str
    def __init__(self, block_index: _Optional[int] = ..., block_hash: _Optional[str] = ..., worker_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("reservation_id", "engine_id", "engine_base_url", "actions", "est_ttft_ms", "chosen", "others", "refusals", "policy", "hit_blocks", "fetch_blocks", "recompute_blocks", "plan_us", "prefill_engine_id", "prefill_engine_base_url", "prefill_reservation_id", "prefill_store_node", "decode_store_node", "disagg", "disagg_reason", "index_behind_ms")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BASE_URL_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    EST_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    OTHERS_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FETCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PLAN_US_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_BASE_URL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_STORE_NODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_STORE_NODE_FIELD_NUMBER: _ClassVar[int]
    DISAGG_FIELD_NUMBER: _ClassVar[int]
    DISAGG_REASON_FIELD_NUMBER: _ClassVar[int]
    INDEX_BEHIND_MS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    engine_id: str
    engine_base_url: str
    actions: _containers.RepeatedCompositeFieldContainer[BlockAction]
    est_ttft_ms: float
    chosen: EngineCost
    others: _containers.RepeatedCompositeFieldContainer[EngineCost]
    refusals: _containers.RepeatedCompositeFieldContainer[Refusal]
    policy: str
    hit_blocks: int
    fetch_blocks: int
    recompute_blocks: int
    plan_us: int
    prefill_engine_id: str
    prefill_engine_base_url: str
    prefill_reservation_id: str
    prefill_store_node: str
    decode_store_node: str
    disagg: str
    disagg_reason: str
    index_behind_ms: int
    def __init__(self, reservation_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., engine_base_url: _Optional[str] = ..., actions: _Optional[_Iterable[_Union[BlockAction, _Mapping]]] = ..., est_ttft_ms: _Optional[float] = ..., chosen: _Optional[_Union[EngineCost, _Mapping]] = ..., others: _Optional[_Iterable[_Union[EngineCost, _Mapping]]] = ..., refusals: _Optional[_Iterable[_Union[Refusal, _Mapping]]] = ..., policy: _Optional[str] = ..., hit_blocks: _Optional[int] = ..., fetch_blocks: _Optional[int] = ..., recompute_blocks: _Optional[int] = ..., plan_us: _Optional[int] = ..., prefill_engine_id: _Optional[str] = ..., prefill_engine_base_url: _Optional[str] = ..., prefill_reservation_id: _Optional[str] = ..., prefill_store_node: _Optional[str] = ..., decode_store_node: _Optional[str] = ..., disagg: _Optional[str] = ..., disagg_reason: _Optional[str] = ..., index_behind_ms: _Optional[int] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("reservation_id", "outcome", "ttft_ms", "output_tokens", "identity", "observe_blocks", "observe_packed_hashes", "observe_block_tokens", "transfer_bytes", "transfer_bytes_per_s", "transfer_blocks", "delivered_cached_tokens")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[FinishRequest.Outcome]
        SUCCESS: _ClassVar[FinishRequest.Outcome]
        ERROR: _ClassVar[FinishRequest.Outcome]
        CANCELLED: _ClassVar[FinishRequest.Outcome]
        PREFILLED: _ClassVar[FinishRequest.Outcome]
    OUTCOME_UNSPECIFIED: FinishRequest.Outcome
    SUCCESS: FinishRequest.Outcome
    ERROR: FinishRequest.Outcome
    CANCELLED: FinishRequest.Outcome
    PREFILLED: FinishRequest.Outcome
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    OBSERVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OBSERVE_PACKED_HASHES_FIELD_NUMBER: _ClassVar[int]
    OBSERVE_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    outcome: FinishRequest.Outcome
    ttft_ms: float
    output_tokens: int
    identity: _common_pb2.Identity
    observe_blocks: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockRef]
    observe_packed_hashes: bytes
    observe_block_tokens: int
    transfer_bytes: int
    transfer_bytes_per_s: float
    transfer_blocks: int
    delivered_cached_tokens: int
    def __init__(self, reservation_id: _Optional[str] = ..., outcome: _Optional[_Union[FinishRequest.Outcome, str]] = ..., ttft_ms: _Optional[float] = ..., output_tokens: _Optional[int] = ..., identity: _Optional[_Union[_common_pb2.Identity, _Mapping]] = ..., observe_blocks: _Optional[_Iterable[_Union[_common_pb2.BlockRef, _Mapping]]] = ..., observe_packed_hashes: _Optional[bytes] = ..., observe_block_tokens: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., transfer_bytes_per_s: _Optional[float] = ..., transfer_blocks: _Optional[int] = ..., delivered_cached_tokens: _Optional[int] = ...) -> None: ...

class FinishResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PlanCall(_message.Message):
    __slots__ = ("call_id", "plan", "finish")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    plan: PlanRequest
    finish: FinishRequest
    def __init__(self, call_id: _Optional[int] = ..., plan: _Optional[_Union[PlanRequest, _Mapping]] = ..., finish: _Optional[_Union[FinishRequest, _Mapping]] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PlanCallResult(_message.Message):
    __slots__ = ("call_id", "plan", "finish", "error")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    plan: PlanResponse
    finish: FinishResponse
    error: CallError
    def __init__(self, call_id: _Optional[int] = ..., plan: _Optional[_Union[PlanResponse, _Mapping]] = ..., finish: _Optional[_Union[FinishResponse, _Mapping]] = ..., error: _Optional[_Union[CallError, _Mapping]] = ...) -> None: ...

class PlanStreamRequest(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[PlanCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[PlanCall, _Mapping]]] = ...) -> None: ...

class PlanStreamResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PlanCallResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PlanCallResult, _Mapping]]] = ...) -> None: ...

class ObserveRequest(_message.Message):
    __slots__ = ("engine_id", "identity", "blocks")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    identity: _common_pb2.Identity
    blocks: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockRef]
    def __init__(self, engine_id: _Optional[str] = ..., identity: _Optional[_Union[_common_pb2.Identity, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[_common_pb2.BlockRef, _Mapping]]] = ...) -> None: ...

class ObserveResponse(_message.Message):
    __slots__ = ("recorded",)
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    recorded: int
    def __init__(self, recorded: _Optional[int] = ...) -> None: ...

class LocateRequest(_message.Message):
    __slots__ = ("identity", "block_hashes")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    identity: _common_pb2.Identity
    block_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, identity: _Optional[_Union[_common_pb2.Identity, _Mapping]] = ..., block_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class Location(_message.Message):
    __slots__ = ("node_id", "address", "tier", "kind")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    tier: _common_pb2.Tier
    kind: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., kind: _Optional[str] = ...) -> None: ...

class BlockLocations(_message.Message):
    __slots__ = ("block_hash", "locations")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    block_hash: str
    locations: _containers.RepeatedCompositeFieldContainer[Location]
    def __init__(self, block_hash: _Optional[str] = ..., locations: _Optional[_Iterable[_Union[Location, _Mapping]]] = ...) -> None: ...

class LocateResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockLocations]
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockLocations, _Mapping]]] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("engine_id", "ts_ms", "identity", "bytes_per_block", "events", "source_kind", "sequence")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_KIND_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    ts_ms: int
    identity: _common_pb2.Identity
    bytes_per_block: int
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    source_kind: str
    sequence: int
    def __init__(self, engine_id: _Optional[str] = ..., ts_ms: _Optional[int] = ..., identity: _Optional[_Union[_common_pb2.Identity, _Mapping]] = ..., bytes_per_block: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., source_kind: _Optional[str] = ..., sequence: _Optional[int] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "lora_name", "group_idx", "bytes_per_block", "cache_salt", "identity", "first_block_index")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[str]
    parent_block_hash: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    medium: str
    lora_name: str
    group_idx: int
    bytes_per_block: int
    cache_salt: str
    identity: _common_pb2.Identity
    first_block_index: int
    def __init__(self, block_hashes: _Optional[_Iterable[str]] = ..., parent_block_hash: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., medium: _Optional[str] = ..., lora_name: _Optional[str] = ..., group_idx: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., cache_salt: _Optional[str] = ..., identity: _Optional[_Union[_common_pb2.Identity, _Mapping]] = ..., first_block_index: _Optional[int] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium", "group_idx")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[str]
    medium: str
    group_idx: int
    def __init__(self, block_hashes: _Optional[_Iterable[str]] = ..., medium: _Optional[str] = ..., group_idx: _Optional[int] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IngestResponse(_message.Message):
    __slots__ = ("applied", "rejected", "errors", "linger_ms")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    LINGER_MS_FIELD_NUMBER: _ClassVar[int]
    applied: int
    rejected: int
    errors: _containers.RepeatedScalarFieldContainer[str]
    linger_ms: int
    def __init__(self, applied: _Optional[int] = ..., rejected: _Optional[int] = ..., errors: _Optional[_Iterable[str]] = ..., linger_ms: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("engine_id", "base_url", "locality_domain", "inflight_requests", "queued_prefill_tokens", "resident_blocks", "store_node", "model", "tokenizer", "role", "block_size")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    LOCALITY_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_NODE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    base_url: str
    locality_domain: str
    inflight_requests: int
    queued_prefill_tokens: int
    resident_blocks: int
    store_node: str
    model: str
    tokenizer: str
    role: str
    block_size: int
    def __init__(self, engine_id: _Optional[str] = ..., base_url: _Optional[str] = ..., locality_domain: _Optional[str] = ..., inflight_requests: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., resident_blocks: _Optional[int] = ..., store_node: _Optional[str] = ..., model: _Optional[str] = ..., tokenizer: _Optional[str] = ..., role: _Optional[str] = ..., block_size: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("policy", "index_backend", "resident_records", "resident_bytes", "plans", "events_applied", "events_rejected", "reservations_open", "reservations_expired", "engines", "guard_refusals", "plan_address", "block_tokens")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    INDEX_BACKEND_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_RECORDS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_OPEN_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    GUARD_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    PLAN_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    index_backend: str
    resident_records: int
    resident_bytes: int
    plans: int
    events_applied: int
    events_rejected: int
    reservations_open: int
    reservations_expired: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineStats]
    guard_refusals: int
    plan_address: str
    block_tokens: int
    def __init__(self, policy: _Optional[str] = ..., index_backend: _Optional[str] = ..., resident_records: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., plans: _Optional[int] = ..., events_applied: _Optional[int] = ..., events_rejected: _Optional[int] = ..., reservations_open: _Optional[int] = ..., reservations_expired: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineStats, _Mapping]]] = ..., guard_refusals: _Optional[int] = ..., plan_address: _Optional[str] = ..., block_tokens: _Optional[int] = ...) -> None: ...

class SyncRequest(_message.Message):
    __slots__ = ("conductor_id",)
    CONDUCTOR_ID_FIELD_NUMBER: _ClassVar[int]
    conductor_id: str
    def __init__(self, conductor_id: _Optional[str] = ...) -> None: ...

class ReservationOpened(_message.Message):
    __slots__ = ("reservation_id", "engine_id", "prefill_tokens", "blocks", "prefill_s", "expires_s", "identity", "block_hashes", "prefix_hashes", "block_indexes", "token_counts", "bytes_per_block", "packed_hashes", "first_parent", "first_index", "block_tokens")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_S_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEXES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PACKED_HASHES_FIELD_NUMBER: _ClassVar[int]
    FIRST_PARENT_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    engine_id: str
    prefill_tokens: int
    blocks: int
    prefill_s: float
    expires_s: float
    identity: _common_pb2.Identity
    block_hashes: _containers.RepeatedScalarFieldContainer[str]
    prefix_hashes: _containers.RepeatedScalarFieldContainer[str]
    block_indexes: _containers.RepeatedScalarFieldContainer[int]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    bytes_per_block: int
    packed_hashes: bytes
    first_parent: str
    first_index: int
    block_tokens: int
    def __init__(self, reservation_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., prefill_tokens: _Optional[int] = ..., blocks: _Optional[int] = ..., prefill_s: _Optional[float] = ..., expires_s: _Optional[float] = ..., identity: _Optional[_Union[_common_pb2.Identity, _Mapping]] = ..., block_hashes: _Optional[_Iterable[str]] = ..., prefix_hashes: _Optional[_Iterable[str]] = ..., block_indexes: _Optional[_Iterable[int]] = ..., token_counts: _Optional[_Iterable[int]] = ..., bytes_per_block: _Optional[int] = ..., packed_hashes: _Optional[bytes] = ..., first_parent: _Optional[str] = ..., first_index: _Optional[int] = ..., block_tokens: _Optional[int] = ...) -> None: ...

class ReservationClosed(_message.Message):
    __slots__ = ("reservation_id", "linger_s", "resident", "sample")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    LINGER_S_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    linger_s: float
    resident: bool
    sample: SpeedSample
    def __init__(self, reservation_id: _Optional[str] = ..., linger_s: _Optional[float] = ..., resident: _Optional[bool] = ..., sample: _Optional[_Union[SpeedSample, _Mapping]] = ...) -> None: ...

class SpeedSample(_message.Message):
    __slots__ = ("model_id", "tokens", "ttft_us", "fetch_us")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_US_FIELD_NUMBER: _ClassVar[int]
    FETCH_US_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tokens: int
    ttft_us: float
    fetch_us: float
    def __init__(self, model_id: _Optional[str] = ..., tokens: _Optional[int] = ..., ttft_us: _Optional[float] = ..., fetch_us: _Optional[float] = ...) -> None: ...

class LoadDeltas(_message.Message):
    __slots__ = ("conductor_id", "start_time_s", "snapshot", "opened", "closed", "heartbeat_s", "prefilled")
    CONDUCTOR_ID_FIELD_NUMBER: _ClassVar[int]
    START_TIME_S_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_FIELD_NUMBER: _ClassVar[int]
    conductor_id: str
    start_time_s: float
    snapshot: bool
    opened: _containers.RepeatedCompositeFieldContainer[ReservationOpened]
    closed: _containers.RepeatedCompositeFieldContainer[ReservationClosed]
    heartbeat_s: float
    prefilled: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, conductor_id: _Optional[str] = ..., start_time_s: _Optional[float] = ..., snapshot: _Optional[bool] = ..., opened: _Optional[_Iterable[_Union[ReservationOpened, _Mapping]]] = ..., closed: _Optional[_Iterable[_Union[ReservationClosed, _Mapping]]] = ..., heartbeat_s: _Optional[float] = ..., prefilled: _Optional[_Iterable[str]] = ...) -> None: ...
