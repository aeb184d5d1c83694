import pytest

from quillcache_core.model import CacheResidency, CacheTier
from quillcache_core.routing.guard import audit_reuse
from tests.unit.factories import make_request

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("tenant", {"tenant": "globex"}),
        ("model", {"model": "mistral-7b"}),
        ("tokenizer", {"tokenizer": "mistral"}),
        ("adapter", {"adapter": "lora-sql"}),
    ],
)
def test_guard_refuses_same_content_hash_of_another_identity(field, kwargs):
    mine = make_request(2)
    theirs = make_request(2, **kwargs)
    # Same content hash (as an external hash would be), other identity.
    forged = theirs.blocks[0]._replace(block_hash=mine.blocks[0].block_hash)
    located = [
        [
            CacheResidency(forged, "e1", CacheTier.HBM, 1),
            CacheResidency(mine.blocks[0], "e2", CacheTier.HBM, 1),
        ],
        [],
    ]
    audit = audit_reuse(mine.scope(), located)
    assert [r.worker_id for r in audit.usable[0]] == ["e2"]
    assert audit.usable[1] == []
    assert len(audit.refusals) == 1
    refusal = audit.refusals[0]
    assert (refusal.block_index, refusal.worker_id, refusal.reason) == (0, "e1", field)
    assert refusal.block_hash == mine.blocks[0].block_hash


def test_base_model_request_refuses_adapter_block_and_back():
    base = make_request(1)
    lora = make_request(1, adapter="lora-a")
    located = [[CacheResidency(lora.blocks[0], "e1", CacheTier.HBM, 1)]]
    assert audit_reuse(base.scope(), located).refusals[0].reason == "adapter"
    located = [[CacheResidency(base.blocks[0], "e1", CacheTier.HBM, 1)]]
    assert audit_reuse(lora.scope(), located).refusals[0].reason == "adapter"
