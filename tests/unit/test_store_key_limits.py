"""Block keys at the store's doors: every field within what a record's header holds
(the largest accepted key still encodes and decodes), one byte more refused with
INVALID_ARGUMENT naming the field, on gRPC and on the data port; and the data path's
socket calls end at their deadline however slowly the peer trickles."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from quillcache_core.errors import InvalidArgument
from quillcache_core.model import KvBlockKey
from quillcache_core.storeclient import blockcodec, wire
from quillcache_core.storeclient.blockcodec import KEY_INT_END, MAX_KEY_FIELD_BYTES
from quillcache_core.storeclient.datapath import protocol as dataproto
from quillcache_core.storeclient.datapath.sockets import is_timeout, recv_exactly, tune_socket

pytestmark = pytest.mark.unit

STRING_FIELDS = ("model_id", "tokenizer_id", "adapter_id", "tenant_id", "prefix_hash", "block_hash")


def key(**fields) -> KvBlockKey:
    base = KvBlockKey("m", "t", None, "acme", "root", "b0", 0, 16)
    return base._replace(**fields)


def largest_key() -> KvBlockKey:
    return key(**{name: "x" * MAX_KEY_FIELD_BYTES for name in STRING_FIELDS})._replace(
        block_index=KEY_INT_END - 1, token_count=KEY_INT_END - 1
    )


def test_the_largest_accepted_key_fits_a_record_header():
    big = largest_key()
    assert blockcodec.check_key(big) is big
    assert len(blockcodec.encode_identity(big)) <= blockcodec.MAX_IDENTITY_BYTES
    record = blockcodec.encode_record(big, b"payload")
    assert blockcodec.decode(record, big)[0] == big
    assert wire.key_from_proto(wire.key_to_proto(big)) == big


@pytest.mark.parametrize("field", STRING_FIELDS)
@pytest.mark.parametrize("value", ["x" * (MAX_KEY_FIELD_BYTES + 1), "é" * 513])
def test_a_field_one_byte_over_is_refused_naming_it(field, value):
    too_long = key(**{field: value})
    with pytest.raises(InvalidArgument, match=rf"keys\[3\]\.{field} is \d+ bytes"):
        wire.key_from_proto(wire.key_to_proto(too_long), "keys[3]")
    ident = blockcodec.encode_identity(too_long)
    with pytest.raises(InvalidArgument, match=field):
        dataproto.decode_put_identity(ident)
    frame = dataproto.encode_request([key(), too_long])
    with pytest.raises(InvalidArgument, match=rf"keys\[1\]\.{field}"):
        dataproto.decode_request_body(frame[dataproto.REQUEST_HEADER.size :])


@pytest.mark.parametrize("value", [-1, KEY_INT_END, (1 << 64) - 1])
def test_data_port_keys_with_integers_beyond_uint32_are_refused(value):
    for field in ("block_index", "token_count"):
        ident = blockcodec.encode_identity(key(**{field: value}))
        with pytest.raises(InvalidArgument, match=field):
            dataproto.decode_put_identity(ident)


def test_a_receive_ends_at_its_deadline_while_the_peer_trickles():
    """A peer sending a byte every 0.1 s never lets the kernel's timeout fire, yet a
    receive of 100 bytes with a 0.5 s deadline gives up after about 0.5 s."""
    ours, theirs = socket.socketpair()
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.1):
            try:
                theirs.send(b"x")
            except OSError:
                return

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    try:
        tune_socket(ours, 0.5)
        started = time.monotonic()
        with pytest.raises(OSError) as timed_out:
            recv_exactly(ours, memoryview(bytearray(100)))
        assert is_timeout(timed_out.value)
        assert time.monotonic() - started < 1.5
        # The next call has the socket's whole timeout again.
        theirs.send(b"y" * 200)
        assert recv_exactly(ours, memoryview(bytearray(150))) == 150
    finally:
        stop.set()
        sender.join(2)
        ours.close()
        theirs.close()
