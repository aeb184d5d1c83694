"""Facts of vLLM's KV-event wire format shared by the encoder (sim engine) and the
decoder (conductor): each event's positional field order after its tag.

The test publisher (tests/support/vllm_publisher.py) keeps its own copy on purpose:
it is an independent encoder, so a wrong order here cannot hide from the tests.
"""

STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
