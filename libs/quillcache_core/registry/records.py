"""Node records: the registry's keys (`/quillcache/v1/nodes/{kind}/{id}`), the JSON
record each node writes, and the join/leave/update events watchers see.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from quillcache_core.errors import InvalidArgument

log = logging.getLogger(__name__)


NODES_PREFIX = "/quillcache/v1/nodes/"
NODE_KINDS = ("engine", "store", "conductor", "transfer", "gateway")

EventType = Literal["join", "leave", "update"]
JOIN: EventType = "join"
LEAVE: EventType = "leave"
UPDATE: EventType = "update"

NodeKey = tuple[str, str]

# What an engine does for a request split across engines (prefill/decode disaggregation):
# `prefill` engines compute prompts and write their KV to the pool, `decode` engines load
# that KV and generate; `both` (the default) do either, or a whole request.
ENGINE_ROLES = ("prefill", "decode", "both")

# Where an engine is in its life (scale-in): `serving` takes requests; `draining` takes
# no new one while it saves its hot KV to the pool and finishes what it runs; `drained`
# is done and takes no traffic. Only the engine (its role) writes its record.
ENGINE_STATES = ("serving", "draining", "drained")


# --------------------------------------------------------------------------- keys


def _check_part(what: str, value: object) -> str:
    if not isinstance(value, str) or not value or "/" in value:
        raise InvalidArgument(f"node {what} must be a non-empty string without '/': {value!r}")
    return value


def node_key(kind: str, id: str) -> str:
    """`/quillcache/v1/nodes/{kind}/{id}`; kind and id are non-empty and contain no '/'."""
    return f"{NODES_PREFIX}{_check_part('kind', kind)}/{_check_part('id', id)}"


def kind_prefix(kind: str | None) -> str:
    """The key prefix for one kind (with the trailing '/'), or for all nodes."""
    if kind is None:
        return NODES_PREFIX
    return f"{NODES_PREFIX}{_check_part('kind', kind)}/"


def parse_node_key(key: str | bytes) -> NodeKey | None:
    """(kind, id) from a registry key, or None if the key is not a node key."""
    if isinstance(key, bytes):
        try:
            key = key.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not key.startswith(NODES_PREFIX):
        return None
    parts = key[len(NODES_PREFIX) :].split("/")
    if len(parts) != 2 or not parts[0] or not parts[1]:
        return None
    return parts[0], parts[1]


# ------------------------------------------------------------------------ records

_STR_FIELDS = (
    "address",
    "locality_domain",
    "base_url",
    "kv_events_endpoint",
    "kv_replay_endpoint",
    "model",
    "tokenizer",
    "store_node",
    "version",
    "data_address",
    "role",
    "state",
)


@dataclass(frozen=True)
class NodeRecord:
    """What one node tells the fleet about itself.

    `kind` and `id` come from the key; the JSON value holds the rest. Unknown JSON keys
    are kept in `extra` (and written back by `to_json`), so older readers tolerate
    newer writers.
    """

    kind: str
    id: str
    address: str  # host:port of the node's gRPC server, or "" if it has none
    locality_domain: str
    base_url: str = ""
    kv_events_endpoint: str = ""
    kv_replay_endpoint: str = ""
    model: str = ""
    tokenizer: str = ""
    store_node: str = ""
    capacity_bytes: int = 0
    version: str = ""
    start_time_s: float = 0.0
    data_address: str = ""  # host:port of a store's raw TCP block-data port, or ""
    block_size: int = 0  # an engine's KV block size in tokens (0 = not said)
    role: str = "both"  # an engine's disaggregation role: one of ENGINE_ROLES
    state: str = "serving"  # an engine's life: one of ENGINE_STATES
    # The TTL of the lease its owner keeps, written by the registry on each renewal (see
    # `registry.renewals`); 0 for a writer that promises no renewals (etcdctl, older
    # nodes). Not part of a record's identity: the same node on another TTL is equal.
    lease_ttl_s: float = field(default=0.0, compare=False)
    extra: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _check_part("kind", self.kind)
        _check_part("id", self.id)
        if self.role not in ENGINE_ROLES:
            raise InvalidArgument(
                f"node {self.kind}/{self.id}: role must be one of {', '.join(ENGINE_ROLES)},"
                f" got {self.role!r}"
            )
        if self.state not in ENGINE_STATES:
            raise InvalidArgument(
                f"node {self.kind}/{self.id}: state must be one of {', '.join(ENGINE_STATES)},"
                f" got {self.state!r}"
            )

    @property
    def key(self) -> str:
        return node_key(self.kind, self.id)

    def to_json(self) -> bytes:
        body: dict[str, Any] = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name != "extra":
                body[f.name] = getattr(self, f.name)
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, kind: str, id: str, data: bytes | str) -> NodeRecord:
        """Decode a stored value. `kind`/`id` come from the key and win over the body.

        Unknown keys go to `extra`; missing (or null) known keys take their defaults.
        Raises InvalidArgument for invalid JSON, a non-object, or a known key whose
        value has the wrong type."""
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"node {kind}/{id}: value is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise InvalidArgument(
                f"node {kind}/{id}: value must be a JSON object, got {type(body).__name__}"
            )
        values: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for name, value in body.items():
            if name in ("kind", "id"):
                continue
            if name in _STR_FIELDS:
                if value is None:
                    continue
                if not isinstance(value, str):
                    raise InvalidArgument(f"node {kind}/{id}: {name} must be a string")
                if name in ("role", "state") and not value:
                    continue  # unset: the default
                values[name] = value
            elif name in ("capacity_bytes", "block_size"):
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidArgument(
                        f"node {kind}/{id}: {name} must be a non-negative integer"
                    )
                values[name] = value
            elif name in ("start_time_s", "lease_ttl_s"):
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise InvalidArgument(f"node {kind}/{id}: {name} must be a number")
                if name == "lease_ttl_s" and not (math.isfinite(value) and value >= 0):
                    raise InvalidArgument(f"node {kind}/{id}: lease_ttl_s must be >= 0")
                values[name] = float(value)
            else:
                extra[name] = value
        values.setdefault("address", "")
        values.setdefault("locality_domain", "")
        return cls(kind=kind, id=id, extra=extra, **values)


@dataclass(frozen=True)
class NodeEvent:
    """A change in the fleet. For a "leave", `record` is the last known record."""

    type: EventType
    record: NodeRecord

    @property
    def kind(self) -> str:
        return self.record.kind

    @property
    def id(self) -> str:
        return self.record.id


def check_ttl(ttl_s: float) -> float:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not ttl_s > 0:
        raise InvalidArgument(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
    if not math.isfinite(ttl_s):
        raise InvalidArgument("ttl_s must be finite")
    return float(ttl_s)


def diff_records(
    told: dict[NodeKey, NodeRecord], now: dict[NodeKey, NodeRecord]
) -> list[NodeEvent]:
    """Events that move a watcher from what it was told to the current state."""
    events = [NodeEvent(LEAVE, rec) for key, rec in told.items() if key not in now]
    for key, rec in now.items():
        old = told.get(key)
        if old is None:
            events.append(NodeEvent(JOIN, rec))
        elif old != rec:
            events.append(NodeEvent(UPDATE, rec))
    return events


def record_data_address(record: NodeRecord) -> str:
    """A store record's block-data address ("" if it has none). Records written by
    nodes older than the `data_address` field carry it in `extra`."""
    return record.data_address or str(record.extra.get("data_address") or "")
