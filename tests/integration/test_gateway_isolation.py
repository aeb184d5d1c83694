"""What one tenant or client does at the gateway never reaches another: its timing, its
memory, its in-flight places, the gateway's log, its connections.

Each test checks what a client could try: tokenizing work that depends on what another
tenant sent, refused prompts that pile up in the gateway's memory, a key in a malformed
header line that ends up in the log, connections held open by trickled headers or
bodies, a slow upload that holds its tenant's place, request ids that count others'.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import threading
import time
from pathlib import Path

import aiohttp
import grpc
import pytest

from quillcache_core.identity import tokenize
from tests.support.gateway_fakes import FakeConductor, _serve_conductor, completion, gateway_setup
from tests.support.services import ServiceProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

KEYS = "acme=k-acme,globex=k-globex"


def document(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.getrandbits(40):x}" for _ in range(words))


async def post(s, key: str, body: dict) -> tuple[int, dict, bytes]:
    headers = {"Authorization": f"Bearer {key}"}
    async with s.session.post(s.url + "/v1/completions", json=body, headers=headers) as reply:
        return reply.status, dict(reply.headers), await reply.read()


def test_a_tenants_tokenizing_work_does_not_depend_on_what_another_tenant_sent(monkeypatch):
    computed: list[str] = []  # the pieces whose ids were computed, not found in a memo
    piece_id = tokenize._piece_id
    monkeypatch.setattr(tokenize, "_piece_id", lambda p: computed.append(p) or piece_id(p))
    secret, other = document(1, 3000), document(2, 3000)

    async def globex_work_after(acme_sent: str) -> int:
        async with gateway_setup(api_keys=KEYS) as s:
            assert (await post(s, "k-acme", completion(prompt=acme_sent)))[0] == 200
            computed.clear()
            assert (await post(s, "k-globex", completion(prompt=secret)))[0] == 200
            return len(computed)

    same, different = asyncio.run(globex_work_after(secret)), asyncio.run(globex_work_after(other))
    assert same == different == len(set(tokenize._PIECES.findall(secret)))


def test_each_tenants_memo_stays_within_its_bytes():
    async def main():
        async with gateway_setup(api_keys=KEYS, tenant_memo_bytes=2 * 2**20) as s:
            for seed in range(12):  # 12 distinct prompts of about 270 KB each
                assert (await post(s, "k-acme", completion(prompt=document(seed, 25_000))))[
                    0
                ] == 200
            memos = s.gateway.memos
            assert 2**20 < memos.of("acme").nbytes <= 2 * 2**20
            assert memos.of("globex").nbytes == 0  # acme's traffic took none of globex's

    asyncio.run(main())


@contextlib.contextmanager
def gateway_process(tmp_path: Path, *args: str):
    """A gateway process (plaintext) before a fake conductor in a thread of its own that
    refuses every plan as the conductor refuses a prompt of too many blocks."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict = {}

    async def serve():
        conductor = FakeConductor([("e1", "http://127.0.0.1:9")])
        conductor.refuse = (grpc.StatusCode.INVALID_ARGUMENT, "Plan: too many blocks")
        box["server"], box["port"] = await _serve_conductor(conductor)
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop)
    assert ready.wait(10)
    conductor = f"127.0.0.1:{box['port']}"
    gateway = ServiceProcess(
        "gateway",
        ["--insecure", "--conductor", conductor, "--api-keys", KEYS, *args],
        tmp_path,
        wait_serving=False,
    )
    try:
        gateway.start(timeout_s=30)
        yield gateway
    except BaseException:
        print(gateway.log_tail())
        raise
    finally:
        gateway.stop()
        asyncio.run_coroutine_threadsafe(box["server"].stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_refused_oversized_prompts_leave_the_gateways_memory_bounded(tmp_path):
    with gateway_process(tmp_path) as gateway:
        url = gateway.fields["http"] + "/v1/completions"
        bodies = [json.dumps(completion(prompt=document(s, 350_000))).encode() for s in range(14)]
        assert all(3.5 * 2**20 < len(b) < 4 * 2**20 for b in bodies)

        async def main():
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer k-acme"}) as s:
                sizes = []
                for body in bodies:
                    async with s.post(url, data=body) as reply:
                        assert reply.status == 400
                        error = (await reply.json())["error"]
                        assert set(error) == {"message", "type", "param", "code"}
                    sizes.append(rss_mib(gateway.proc.pid))
                return sizes

        sizes = asyncio.run(main())
        # Past the first requests' peak, the rest are answered in the same memory (a
        # kept prompt costs tens of MiB each: 10 more would add hundreds).
        assert max(sizes[4:]) < max(sizes[:4]) + 64, sizes


def test_a_malformed_header_line_never_puts_its_key_in_the_log(tmp_path):
    with gateway_process(tmp_path) as gateway:
        host, port = gateway.fields["http"].removeprefix("http://").split(":")
        lines = [
            b"Authorization: Bearer k-acme\x01",
            b"Bearer k-acme",
            b"Authorization : Bearer k-acme",
            b"X-Key: k-acme\x7f",
        ]
        for line in lines:
            with socket.create_connection((host, int(port)), timeout=10) as conn:
                conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + line + b"\r\n\r\n")
                assert b" 400 " in conn.recv(4096)[:20]
        with socket.create_connection((host, int(port)), timeout=10) as conn:  # still serving
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert conn.recv(4096).startswith(b"HTTP/1.1 200")
        log = gateway.log_path.read_bytes()
        assert b"k-acme" not in log
        assert b"BadHttpMessage" in log  # what was wrong is logged, not what it read


def _closed_within(
    conn: socket.socket, limit_s: float, trickle: bytes = b""
) -> tuple[float, bytes]:
    """Seconds until the gateway closes `conn` (sending `trickle` a byte at a time every
    0.2 s meanwhile), and what it answered."""
    conn.settimeout(0.2)
    started, answer = time.monotonic(), b""
    for i in range(int(limit_s / 0.2)):
        with contextlib.suppress(OSError):
            if i < len(trickle):
                conn.sendall(trickle[i : i + 1])
        try:
            data = conn.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        if not data:
            break
        answer += data
    else:
        raise AssertionError(f"still open after {limit_s} s; answered {answer[:200]!r}")
    return time.monotonic() - started, answer


def test_slow_headers_slow_bodies_and_idle_connections_are_closed_in_time():
    async def main():
        async with gateway_setup(
            api_keys=KEYS, header_timeout_s=1.0, body_timeout_s=1.5, idle_timeout_s=2.0
        ) as s:
            port = s.gateway.port
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k-acme\r\n"

            def slow_headers():
                with socket.create_connection(("127.0.0.1", port)) as conn:
                    return _closed_within(conn, 6, trickle=head * 10)

            def slow_body():
                with socket.create_connection(("127.0.0.1", port)) as conn:
                    conn.sendall(
                        head + b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"
                    )
                    return _closed_within(conn, 6, trickle=b" " * 400)

            def idle():
                with socket.create_connection(("127.0.0.1", port)) as conn:
                    conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    return _closed_within(conn, 8)

            loop = asyncio.get_running_loop()
            (h_s, h_answer), (b_s, b_answer), (i_s, i_answer) = await asyncio.gather(
                loop.run_in_executor(None, slow_headers),
                loop.run_in_executor(None, slow_body),
                loop.run_in_executor(None, idle),
            )
            assert 0.8 < h_s < 3 and h_answer == b""
            assert 1.2 < b_s < 3.5 and b_answer.startswith(b"HTTP/1.1 408")
            assert (
                json.loads(b_answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
            )
            assert 1.8 < i_s < 4.5 and i_answer.startswith(b"HTTP/1.1 200")
            text = await s.metrics()
            assert 'gateway_connections_timed_out_total{phase="headers"} 1' in text
            assert 'gateway_connections_timed_out_total{phase="idle"} 1' in text

    asyncio.run(main())


def test_a_slow_upload_holds_no_in_flight_place_of_its_tenant():
    async def main():
        async with gateway_setup(
            api_keys=KEYS, tenant_limits="acme=concurrent:1", body_timeout_s=5.0
        ) as s:
            reader, writer = await asyncio.open_connection("127.0.0.1", s.gateway.port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k-acme\r\n"
                b"Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n{"
            )
            await writer.drain()
            await asyncio.sleep(0.3)  # the upload is under way (its headers were read)
            assert (await post(s, "k-acme", completion()))[0] == 200
            writer.close()

    asyncio.run(main())


def test_request_ids_of_consecutive_requests_are_not_sequential():
    async def main():
        async with gateway_setup(api_keys=KEYS) as s:
            ids = [
                (await post(s, "k-acme", completion()))[1]["x-quillcache-request-id"]
                for _ in range(4)
            ]
            ids.append(
                (await post(s, "k-globex", completion(max_tokens=0)))[1]["x-quillcache-request-id"]
            )
            numbers = [int(i.removeprefix("qc-"), 16) for i in ids]
            assert len(set(ids)) == 5
            assert all(abs(a - b) > 2**32 for a, b in zip(numbers, numbers[1:], strict=False))

    asyncio.run(main())
