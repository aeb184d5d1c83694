import subprocess
import sys
import time
from array import array

import pytest

from quillcache_core.errors import InvalidArgument
from quillcache_core.identity.hashing import block_hashes, identity_digest, packed_block_hashes
from quillcache_core.identity.keys import request_blocks

pytestmark = pytest.mark.unit

IDENT = identity_digest("m", "t", None, "acme")


def test_only_full_blocks_are_hashed_and_chain_shares_prefix():
    a = block_hashes(list(range(40)), 16, IDENT)
    b = block_hashes(list(range(32)) + [999] * 16, 16, IDENT)
    assert len(a) == 2 and len(b) == 3
    assert a == b[:2]
    c = block_hashes([1] + list(range(1, 48)), 16, IDENT)
    assert all(x != y for x, y in zip(c, b, strict=True)), (
        "a changed first block changes every hash"
    )


@pytest.mark.parametrize(
    "other",
    [
        ("m2", "t", None, "acme", None),
        ("m", "t2", None, "acme", None),
        ("m", "t", "lora-a", "acme", None),
        ("m", "t", None, "globex", None),
        ("m", "t", None, "acme", "salt"),
    ],
)
def test_every_identity_field_changes_the_hash(other):
    tokens = list(range(32))
    assert block_hashes(tokens, 16, IDENT) != block_hashes(tokens, 16, identity_digest(*other))


def test_fields_cannot_run_into_each_other():
    assert identity_digest("ab", "c", None, "x") != identity_digest("a", "bc", None, "x")
    assert identity_digest("m", "t", None, "x") != identity_digest("m", "t", "", "x")


def test_same_hash_in_another_process():
    code = (
        "from quillcache_core.identity.hashing import *;"
        "print(block_hashes(list(range(64)), 16, identity_digest('m','t',None,'acme'))[-1])"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    ).stdout.strip()
    assert other == block_hashes(list(range(64)), 16, IDENT)[-1]


def test_keys_chain_parent_hashes():
    keys = request_blocks(
        list(range(48)), 16, model_id="m", tokenizer_id="t", adapter_id=None, tenant_id="acme"
    )
    assert [k.block_index for k in keys] == [0, 1, 2]
    assert keys[0].prefix_hash == "root"
    assert keys[1].prefix_hash == keys[0].block_hash
    assert keys[2].prefix_hash == keys[1].block_hash
    assert all(len(k.block_hash) == 32 and k.token_count == 16 for k in keys)


@pytest.mark.parametrize("bad", [[-1], [2**32], ["x"], [1.5]])
def test_bad_token_ids_are_rejected(bad):
    with pytest.raises(InvalidArgument):
        block_hashes(bad * 16, 16, IDENT)


def test_bad_block_size_is_rejected():
    with pytest.raises(InvalidArgument):
        block_hashes([1, 2], 0, IDENT)


def test_128_block_prompt_hashes_well_under_a_millisecond():
    tokens = list(range(128 * 16))
    best = min(_timed(lambda: block_hashes(tokens, 16, IDENT)) for _ in range(50))
    assert best < 1e-3, f"best of 50: {best * 1e6:.0f} us"


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_packed_block_hashes_equal_block_hashes_run_by_run():
    tokens = [(i * 7919) % 50000 for i in range(10 * 16 + 5)]
    packed = array("I", tokens).tobytes()
    if sys.byteorder == "big":
        packed = b"".join(t.to_bytes(4, "little") for t in tokens)
    whole = block_hashes(tokens, 16, IDENT)
    assert packed_block_hashes(packed, 16, IDENT) == whole
    # A run in the middle of a buffer, chained from the block before it.
    assert packed_block_hashes(packed, 16, IDENT, whole[2], first_token=48, count=4) == whole[3:7]
    assert packed_block_hashes(packed, 16, IDENT, whole[8], first_token=144, count=9) == whole[9:]
    with pytest.raises(InvalidArgument):
        packed_block_hashes(packed, 0, IDENT)


def test_hashes_follow_the_documented_formula():
    """h[i] = BLAKE2b-128(h[i-1] || identity digest || block i as little-endian u32),
    computed here from hashlib directly: a faster implementation must not move a hash,
    or the gateway and the conductor (and stored records) stop agreeing."""
    import hashlib

    tokens = [(i * 104729) % 70000 for i in range(3 * 16)]
    prev = bytes(16)
    expected = []
    for block in range(3):
        data = b"".join(t.to_bytes(4, "little") for t in tokens[block * 16 : (block + 1) * 16])
        prev = hashlib.blake2b(prev + IDENT + data, digest_size=16).digest()
        expected.append(prev.hex())
    assert block_hashes(tokens, 16, IDENT) == expected
    assert block_hashes(tokens[16:], 16, IDENT, expected[0]) == expected[1:]
    packed = b"".join(t.to_bytes(4, "little") for t in tokens)
    assert packed_block_hashes(packed, 16, IDENT, expected[0], first_token=16) == expected[1:]
