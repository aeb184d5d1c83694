"""The simulated KV bytes of one block: a deterministic function of its QuillCache hash.

A block's KV is a float16 array shaped [layers, 2, block tokens, kv heads, head dim],
like a model's paged KV. Its content depends only on the block's hash (which folds in
its identity and whole prefix) and the shape, so bytes fetched back from a store can
be checked against what recomputing the block would have produced.

Values are random float16 bit patterns with the exponent capped (|x| < 1, never
inf or NaN). Generating 1 MiB takes about 2 ms: call it from a worker thread.
"""

from __future__ import annotations

from hashlib import blake2b

import numpy as np

from quillcache_core.errors import InvalidArgument

__all__ = ["kv_array", "kv_payload", "payload_bytes"]

# sign, exponent <= 14 (of 31) and mantissa: finite values in (-1, 1)
_MASK = np.uint16(0xBBFF)
_DOMAIN = b"quillcache/sim-engine/kv/v1"


def payload_bytes(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        if dim <= 0:
            raise InvalidArgument(f"KV shape dimensions must be positive, got {shape}")
        count *= dim
    return count * 2


def kv_array(block_hash: str, shape: tuple[int, ...]) -> np.ndarray:
    """The block's KV tensor (float16, C order)."""
    nbytes = payload_bytes(shape)
    seed_material = blake2b(_DOMAIN, digest_size=16)
    seed_material.update(block_hash.encode("utf-8"))
    seed_material.update(repr(tuple(shape)).encode("ascii"))
    seed = int.from_bytes(seed_material.digest(), "little")
    rng = np.random.Generator(np.random.PCG64(seed))
    bits = np.frombuffer(rng.bytes(nbytes), dtype=np.uint16) & _MASK
    return bits.view(np.float16).reshape(shape)


def kv_payload(block_hash: str, shape: tuple[int, ...]) -> bytes:
    """The bytes stored for the block: `kv_array(...).tobytes()`."""
    return kv_array(block_hash, shape).tobytes()
