"""CacheTier <-> the protos' Tier enum, for every service that speaks it."""

from __future__ import annotations

from quillcache.v1 import common_pb2
from quillcache_core.model import CacheTier

TIER_TO_PROTO = {
    CacheTier.HBM: common_pb2.TIER_HBM,
    CacheTier.REMOTE_HBM: common_pb2.TIER_REMOTE_HBM,
    CacheTier.CPU_DRAM: common_pb2.TIER_CPU_DRAM,
    CacheTier.LOCAL_SSD: common_pb2.TIER_LOCAL_SSD,
    CacheTier.OBJECT_STORE: common_pb2.TIER_OBJECT_STORE,
}
TIER_FROM_PROTO = {value: tier for tier, value in TIER_TO_PROTO.items()}


def tier_to_proto(tier: CacheTier | None) -> int:
    return common_pb2.TIER_UNSPECIFIED if tier is None else TIER_TO_PROTO[tier]


def tier_from_proto(value: int) -> CacheTier | None:
    """The tier of a proto enum value; None for TIER_UNSPECIFIED or an unknown value."""
    return TIER_FROM_PROTO.get(value)
