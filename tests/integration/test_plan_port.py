"""The conductor's plan port (PlanStream's messages over plain TCP) with a real process."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
import time

import grpc
import pytest

from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
from quillcache_core.rpc.plan_port import PlanPortClient
from quillcache_gateway.conductor_calls import ConductorCalls
from tests.integration.test_plan_stream import BS, ident, packed_request, put_engine
from tests.support.services import ServiceProcess, wait_until
from tests.support.tls import client_context, tls

pytestmark = pytest.mark.integration


@pytest.fixture
def start_conductor(etcd_server, tmp_path):
    procs = []

    def start(*extra: str) -> ServiceProcess:
        proc = ServiceProcess(
            "conductor",
            ["--registry", etcd_server.client_url, "--seed", "5", *extra],
            tmp_path,
            f"conductor-{len(procs)}",
        ).start()
        procs.append(proc)
        for engine in ("e1", "e2"):
            put_engine(etcd_server, engine)
        stub = conductor_pb2_grpc.ConductorStub(proc.channel("gateway"))
        wait_until(
            lambda: len(stub.Stats(conductor_pb2.StatsRequest(), timeout=5).engines) == 2,
            what="two engines",
        )
        return proc

    yield start
    for proc in procs:
        proc.stop()


def stats(proc) -> conductor_pb2.StatsResponse:
    stub = conductor_pb2_grpc.ConductorStub(proc.channel("gateway"))
    return stub.Stats(conductor_pb2.StatsRequest(), timeout=5)


def test_plan_port_answers_like_the_stream_and_reports_errors_per_call(start_conductor):
    proc = start_conductor()
    address = stats(proc).plan_address
    assert address and address == proc.fields["plan"]

    async def resolve() -> str:
        return address

    async def go():
        client = PlanPortClient(resolve, tls("gateway"))
        replies = await asyncio.gather(
            *(
                client.plan(packed_request(list(range(n, n + 4 * BS))), timeout=10)
                for n in range(200)
            )
        )
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await client.plan(conductor_pb2.PlanRequest(packed_hashes=b"\x01" * 16), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await client.finish(
                conductor_pb2.FinishRequest(
                    reservation_id="nope", outcome=conductor_pb2.FinishRequest.SUCCESS
                ),
                timeout=5,
            )
        open_after_plans = stats(proc).reservations_open
        await asyncio.gather(
            *(
                client.finish(
                    conductor_pb2.FinishRequest(
                        reservation_id=r.reservation_id,
                        outcome=conductor_pb2.FinishRequest.CANCELLED,
                    ),
                    timeout=10,
                )
                for r in replies
            )
        )
        opened, sent = client.connections_opened, client.frames_sent
        await client.close()
        return replies, bad.value, unknown.value, open_after_plans, opened, sent

    replies, bad, unknown, open_after_plans, opened, sent = asyncio.run(go())
    assert len({r.reservation_id for r in replies}) == 200
    assert {r.engine_id for r in replies} == {"e1", "e2"}
    assert all(r.recompute_blocks == 4 for r in replies)
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "model_id" in bad.details()
    assert unknown.code() == grpc.StatusCode.NOT_FOUND and "nope" in unknown.details()
    assert open_after_plans == 200 and stats(proc).reservations_open == 0
    assert opened == 1, "one connection for every call, errors included"
    # The calls made in one turn of the loop went as one frame: 402 calls in a few.
    assert proc.metric("quillcache_plan_port_calls_total") == 402
    assert proc.metric("quillcache_plan_port_frames_total") == sent
    assert 4 <= sent <= 40, f"{sent} frames for 402 calls"


def test_a_bad_frame_closes_only_its_connection_and_is_counted(start_conductor):
    proc = start_conductor()
    host, _, port = stats(proc).plan_address.rpartition(":")
    for frame in (struct.pack(">I", 7) + b"\xff" * 7, struct.pack(">I", 1 << 30)):
        raw = socket.create_connection((host, int(port)), timeout=5)
        with client_context("gateway").wrap_socket(raw) as sock:
            sock.sendall(frame)
            assert sock.recv(16) == b"", "the conductor closed this connection"
    wait_until(
        lambda: proc.metric("quillcache_plan_port_rejected_frames_total") == 2,
        what="two rejected frames",
    )

    async def go():
        client = PlanPortClient(lambda: _const(f"{host}:{port}"), tls("gateway"))
        reply = await client.plan(packed_request(list(range(2 * BS))), timeout=5)
        await client.close()
        return reply

    assert asyncio.run(go()).engine_id in {"e1", "e2"}, "the conductor serves on"


async def _const(value: str) -> str:
    return value


def test_gateway_calls_use_the_port_fall_back_without_it_and_fail_fast_when_dead(
    start_conductor,
):
    with_port = start_conductor()
    without = start_conductor("--plan-port", "-1")
    assert stats(without).plan_address == ""

    async def go():
        out = {}
        for name, proc in (("port", with_port), ("none", without)):
            async with proc.channel("gateway", aio=True) as channel:
                calls = ConductorCalls(channel, tls=tls("gateway"))
                reply = await calls.plan(packed_request(list(range(3 * BS))), 5)
                await calls.finish(
                    conductor_pb2.FinishRequest(
                        reservation_id=reply.reservation_id,
                        outcome=conductor_pb2.FinishRequest.SUCCESS,
                        identity=ident(),
                    ),
                    5,
                )
                out[name] = (calls.transport, calls.fallbacks)
                if name == "port":
                    with_port.kill()
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await calls.plan(packed_request(list(range(3 * BS))), 5)
                    out["dead"] = err.value.code()
                await calls.close()
        return out

    out = asyncio.run(go())
    assert out["port"] == ("plan port", 0)
    assert out["none"] == ("PlanStream", 1)
    assert out["dead"] == grpc.StatusCode.UNAVAILABLE


def test_a_plan_answered_after_its_deadline_has_its_reservation_cancelled(start_conductor):
    """The gateway gave up on a plan (its deadline passed) and planned the request
    elsewhere; the conductor still made it. Its reservation must not hold the engine's
    load (and a drain's wait) until it expires: the late answer cancels it, over the
    plan port and over PlanStream alike."""
    with_port = start_conductor()
    without = start_conductor("--plan-port", "-1")

    async def go(proc):
        async with proc.channel("gateway", aio=True) as channel:
            calls = ConductorCalls(channel, tls=tls("gateway"))
            warm = await calls.plan(packed_request(list(range(3 * BS))), 5)  # connected
            await calls.finish(
                conductor_pb2.FinishRequest(
                    reservation_id=warm.reservation_id,
                    outcome=conductor_pb2.FinishRequest.CANCELLED,
                ),
                5,
            )
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await calls.plan(packed_request(list(range(100, 100 + 3 * BS))), 0.0001)
            deadline = time.monotonic() + 10
            while stats(proc).reservations_open and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            still_open = stats(proc).reservations_open
            cancelled = calls.late_plans_cancelled
            await calls.close()
            return late.value.code(), still_open, cancelled

    for proc in (with_port, without):
        code, still_open, cancelled = asyncio.run(go(proc))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert still_open == 0, "the late plan's reservation is still open"
        assert cancelled == 1


def test_the_plan_port_answers_only_a_gateway_certificate(start_conductor):
    proc = start_conductor()
    host, _, port = stats(proc).plan_address.rpartition(":")
    frame = packed_frame()
    # Plaintext: the TLS server never answers a frame.
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(frame)
        with contextlib.suppress(ConnectionError, TimeoutError):
            assert not sock.recv(16).startswith(frame[:4])
    # TLS without a client certificate: the handshake fails.
    bare = ssl.create_default_context(cafile=str(tls("gateway").ca))
    bare.check_hostname = False
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            with bare.wrap_socket(raw) as sock:
                sock.sendall(frame)
                assert sock.recv(16) == b""
                raise ConnectionError("closed without an answer")
    # A cluster certificate of another role: closed without an answer, and counted.
    for role in ("store", "engine", "operator"):
        raw = socket.create_connection((host, int(port)), timeout=5)
        with client_context(role).wrap_socket(raw) as sock:
            sock.sendall(frame)
            assert sock.recv(16) == b"", f"a {role} got an answer"
    wait_until(
        lambda: proc.metric("quillcache_plan_port_refused_connections_total") == 3,
        what="three refused connections",
    )
    assert proc.metric("quillcache_plan_port_frames_total") == 0


def packed_frame() -> bytes:
    message = conductor_pb2.PlanStreamRequest(
        calls=[conductor_pb2.PlanCall(call_id=1, plan=packed_request(list(range(BS))))]
    ).SerializeToString()
    return struct.pack(">I", len(message)) + message


def test_the_conductors_clock_wakes_once_a_second_busy_or_idle(start_conductor):
    """No 50 ms polling: idle or with reservations open its clock wakes once a second
    (a plan releases the load that is due itself)."""
    proc = start_conductor()
    stub = conductor_pb2_grpc.ConductorStub(proc.channel("gateway"))
    time.sleep(1.0)  # past the start's own work
    before = proc.metric("quillcache_ticks_total")
    time.sleep(3.0)
    assert proc.metric("quillcache_ticks_total") - before <= 5
    replies = [stub.Plan(packed_request(list(range(n, n + 4 * BS))), timeout=5) for n in range(8)]
    before = proc.metric("quillcache_ticks_total")
    time.sleep(3.0)
    assert proc.metric("quillcache_ticks_total") - before <= 5
    assert stats(proc).reservations_open == 8
    for reply in replies:
        stub.Finish(
            conductor_pb2.FinishRequest(
                reservation_id=reply.reservation_id, outcome=conductor_pb2.FinishRequest.CANCELLED
            ),
            timeout=5,
        )
    assert stats(proc).reservations_open == 0
