"""`docker-compose.yml` for real: the images built from the Dockerfiles, the stack up under
podman-compose, used as a user would (Prometheus included: every process scraped over
TLS), then down with nothing left behind.

Runs where podman is installed (`.ci/run` installs it with `scripts/containers.sh`);
skipped elsewhere. The test's traffic stays on loopback (the ports the compose file
publishes there) and on the compose network it made (`podman exec` in a container).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import httpx2
import openai
import pytest
import yaml

from quillcache.v1 import conductor_pb2, conductor_pb2_grpc
from tests.support.services import wait_until

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "containers.sh"
COMPOSE = ROOT / "docker-compose.yml"
ALERTS = ROOT / "k8s" / "monitoring" / "alerts.yaml"
MODEL = "sim-model"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        shutil.which("podman") is None, reason="podman is not installed (scripts/containers.sh)"
    ),
]

# Stats of the store in this container, over its own gRPC port with its own certificate.
STORE_STATS = """
import json, os, grpc
from quillcache.v1 import store_pb2, store_pb2_grpc
read = lambda name: open('/certs/' + name, 'rb').read()
creds = grpc.ssl_channel_credentials(read('ca.pem'), read('store-key.pem'), read('store.pem'))
channel = grpc.secure_channel('127.0.0.1:' + os.environ['QC_PORT'], creds,
                              options=[('grpc.ssl_target_name_override', 'quillcache')])
s = store_pb2_grpc.StoreStub(channel).Stats(store_pb2.StoreStatsRequest(), timeout=5)
print(json.dumps({'ssd_blocks': s.ssd_blocks, 'dram_blocks': s.dram_blocks}))
"""


def published_port() -> int:
    """A free loopback port below the kernel's ephemeral range, for the stack to publish.

    A podman run that is interrupted (a killed test) leaves its port-forward rules in
    the host's NAT table, and they catch every later connection to that port on
    127.0.0.1. Outside the ephemeral range, such a leftover can never catch a port the
    kernel hands to another test's server."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        port = secrets.randbelow(low - 20000) + 20000
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        if not port_rules(port):
            return port
    raise RuntimeError(f"no free port in 20000-{low}")


def iptables(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["iptables", "-t", "nat", *args], capture_output=True, text=True)


def port_rules(port: int) -> list[str]:
    """The host's NAT rules that forward this port (podman's port-forwarding)."""
    if shutil.which("iptables") is None:
        return []
    rules = iptables("-S").stdout.splitlines()
    return [rule for rule in rules if f"--dport {port} " in rule]


def remove_leftover_networks() -> list[str]:
    """Remove the networks of earlier interrupted runs of this test (no container left on
    them), with the port-forward rules podman left for their containers. Returns their
    names."""
    names = subprocess.run(
        ["podman", "network", "ls", "--format", "{{.Name}}"], capture_output=True, text=True
    ).stdout.split()
    removed = []
    for name in (n for n in names if n.startswith("qce2e")):
        users = subprocess.run(
            ["podman", "ps", "-a", "--filter", f"network={name}", "--format", "{{.Names}}"],
            capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
        if users:
            continue  # a stack running now (another run's): not ours to touch
        if shutil.which("iptables") is not None:
            chains = set()
            for rule in iptables("-S", "NETAVARK-HOSTPORT-DNAT").stdout.splitlines():
                if rule.startswith("-A ") and f"dnat name: {name} " in rule:
                    iptables("-D", *shlex.split(rule)[1:])
                    chains.add(rule.rsplit("-j ", 1)[1].strip())
            for chain in chains:
                if not any(f"-j {chain}" in r for r in iptables("-S").stdout.splitlines()):
                    iptables("-F", chain)
                    iptables("-X", chain)
        subprocess.run(["podman", "network", "rm", "-f", name], capture_output=True)
        removed.append(name)
    return removed


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.project = f"qce2e{secrets.token_hex(3)}"
        self.tmp = tmp
        self.gateway_port = published_port()
        self.prometheus_port = published_port()
        self.conductor_port = published_port()
        self.ports = [
            self.gateway_port,
            published_port(),
            self.conductor_port,
            self.prometheus_port,
        ]
        self.env = {
            **os.environ,
            "QC_GATEWAY_HOST": "127.0.0.1",
            "QC_GATEWAY_PORT": str(self.gateway_port),
            "QC_ETCD_PORT": str(self.ports[1]),
            "QC_CONDUCTOR_PORT": str(self.conductor_port),
            "QC_PROMETHEUS_PORT": str(self.prometheus_port),
            # Small engine caches and store DRAM: evicted blocks reach the stores' SSD.
            "QC_HBM_BLOCKS": "64",
            "QC_STORE_DRAM_BYTES": str(8 * 1024 * 1024),
        }
        exports = subprocess.run(
            [str(SCRIPT), "env"], capture_output=True, text=True, check=True
        ).stdout
        for part in exports.split()[1:]:
            name, _, value = part.partition("=")
            self.env[name] = value
        self.compose = [sys.executable, "-m", "podman_compose", "-p", self.project]
        self.ca = tmp / "ca.pem"
        self.api_keys: dict[str, str] = {}  # generated by the stack's `credentials`
        self.certs = tmp / "certs"  # the operator's and the monitor's pairs, once up

    def run(self, *args: str, timeout: float = 120, check: bool = True):
        return subprocess.run(
            list(args), cwd=ROOT, env=self.env, capture_output=True, text=True,
            timeout=timeout, check=check,
        )  # fmt: skip

    def podman(self, *args: str, **kwargs):
        return self.run("podman", *args, **kwargs)

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def up(self) -> None:
        # podman 4.3 ignores `condition: service_healthy` and fails on --requires chains
        # through exited one-shot services: start everything at once (--no-deps) and let
        # the services' own retries and `restart: unless-stopped` order them.
        self.run(*self.compose, "up", "-d", "--no-deps", timeout=300)
        wait_until(self._ca_copied, timeout_s=60, what="the certificates")
        wait_until(self._serving, timeout_s=120, interval_s=0.5, what="the gateway serving")

    def _ca_copied(self) -> bool:
        done = self.podman("cp", f"{self.container('gateway')}:/certs/ca.pem", str(self.ca),
                           check=False)  # fmt: skip
        keys = self.podman("exec", self.container("gateway"), "cat", "/certs/api-keys",
                           check=False)  # fmt: skip
        self.api_keys = dict(line.split("=", 1) for line in keys.stdout.split())
        return done.returncode == 0 and keys.returncode == 0

    def _serving(self) -> bool:
        client = self.client()
        reply = client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=1)
        return reply.http_response.status_code == 200

    def client(self, key: str = "") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"https://127.0.0.1:{self.gateway_port}/v1",
            api_key=key or self.api_keys["acme"],
            max_retries=0,
            http_client=httpx2.Client(verify=ssl.create_default_context(cafile=str(self.ca))),
        )

    def copy_pair(self, service: str, role: str) -> tuple[Path, Path]:
        """`role`'s certificate and key out of a container's /certs, as an operator
        takes them (`podman cp`; the one-shot `certs` has them all)."""
        self.certs.mkdir(exist_ok=True)
        pair = self.certs / f"{role}.pem", self.certs / f"{role}-key.pem"
        for path in pair:
            self.podman("cp", f"{self.container(service)}:/certs/{path.name}", str(path))
        return pair

    def prometheus(self, path: str, cert: tuple[Path, Path] | None = None, **params: str) -> dict:
        """GET Prometheus's HTTP API over HTTPS, verified by the CA, with `cert` (the
        operator's by default); the `data` of a successful answer."""
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.load_cert_chain(*(cert or self.copy_pair("certs", "operator")))
        with httpx2.Client(verify=ctx, timeout=10) as client:
            reply = client.get(f"https://127.0.0.1:{self.prometheus_port}{path}", params=params)
        reply.raise_for_status()
        body = reply.json()
        assert body["status"] == "success", body
        return body["data"]

    def store_stats(self, service: str) -> dict:
        out = self.podman("exec", self.container(service), "python", "-c", STORE_STATS)
        return json.loads(out.stdout)

    def state(self, service: str) -> tuple[str, int]:
        out = self.podman(
            "inspect", self.container(service), "--format", "{{.State.Status}} {{.State.Pid}}"
        ).stdout.split()
        return out[0], int(out[1])

    def down(self) -> list[str]:
        self.run(*self.compose, "down", "-v", "-t", "5", timeout=180, check=False)
        left = self.podman(
            "ps", "-a", "--filter", f"label=io.podman.compose.project={self.project}",
            "--format", "{{.Names}}",
        )  # fmt: skip
        volumes = self.podman("volume", "ls", "--format", "{{.Name}}").stdout.split()
        networks = self.podman("network", "ls", "--format", "{{.Name}}").stdout.split()
        return (
            left.stdout.split()
            + [v for v in volumes + networks if v.startswith(self.project)]
            + [rule for port in self.ports for rule in port_rules(port)]
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    started = time.monotonic()
    subprocess.run([str(SCRIPT), "all"], cwd=ROOT, check=True, timeout=600)
    for name in remove_leftover_networks():
        print(f"removed {name}, left by an interrupted run")
    print(f"\nimage ready in {time.monotonic() - started:.1f}s")
    s = Stack(tmp_path_factory.mktemp("compose"))
    try:
        s.up()
        print(f"stack serving {time.monotonic() - started:.1f}s after the start")
        yield s
    except BaseException:
        for service in ("etcd", "etcd-auth", "conductor", "conductor-1", "gateway", "prometheus"):
            print(s.podman("logs", "--tail", "20", s.container(service), check=False).stderr)
        raise
    finally:
        assert s.down() == [], "compose down left containers, volumes, networks or port rules"


def test_chat_and_completions_through_the_gateway_and_the_second_request_hits(stack):
    client = stack.client()
    messages = [
        {"role": "system", "content": "You are the support assistant of Acme. " * 8},
        {"role": "user", "content": "Where is my order?"},
    ]
    first = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4
    )
    assert first.parse().choices[0].message.content
    second = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4
    )
    assert int(second.headers["x-quillcache-hit-blocks"]) > 0
    assert second.headers["x-quillcache-engine"] == first.headers["x-quillcache-engine"]
    text = client.completions.create(model=MODEL, prompt="Say something.", max_tokens=4)
    assert text.choices[0].text
    with pytest.raises(openai.AuthenticationError):
        stack.client("not-a-key").completions.create(model=MODEL, prompt="x", max_tokens=1)


def long_running_services() -> set[str]:
    """Every compose service that is a process to watch (not a one-shot)."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    return {name for name, service in services.items() if service.get("restart") != "no"}


def test_prometheus_scrapes_every_process_over_tls(stack):
    """Every process of the stack is a target, scraped over HTTPS with the monitoring
    certificate and up; QuillCache's metrics are queryable from each kind of process."""
    operator = stack.copy_pair("certs", "operator")
    seen: list[dict] = []

    def all_up() -> list[dict] | None:
        targets = stack.prometheus("/api/v1/targets", operator, state="active")["activeTargets"]
        seen[:] = targets
        return targets if targets and all(t["health"] == "up" for t in targets) else None

    try:
        targets = wait_until(all_up, timeout_s=90, interval_s=1, what="every target up")
    except AssertionError:
        for target in seen:
            print(target["scrapeUrl"], target["health"], target["lastError"])
        raise
    assert {urlsplit(t["scrapeUrl"]).hostname for t in targets} == long_running_services()
    assert all(t["scrapeUrl"].startswith("https://") for t in targets), targets

    # The gateway answered requests (the fixture's): its counter has a sample.
    query = "sum(quillcache_gateway_requests_total)"
    served = stack.prometheus("/api/v1/query", operator, query=query)["result"]
    assert served and float(served[0]["value"][1]) > 0, served
    # Each kind of QuillCache process exposes quillcache_* metrics.
    query = 'count by (job) ({__name__=~"quillcache_.+"})'
    by_job = stack.prometheus("/api/v1/query", operator, query=query)["result"]
    jobs = {sample["metric"]["job"] for sample in by_job}
    assert {"conductor", "store", "transfer", "engine", "gateway"} <= jobs, by_job


def test_prometheus_loads_the_alerting_rules_when_there(stack):
    groups = stack.prometheus("/api/v1/rules")["groups"]
    expected = (
        [g["name"] for g in yaml.safe_load(ALERTS.read_text())["groups"]] if ALERTS.exists() else []
    )
    assert sorted(g["name"] for g in groups) == sorted(expected)


def test_prometheus_and_its_certificate_open_nothing_else(stack):
    """Prometheus's port wants a client certificate of the CA; its own certificate reads
    metrics but may call no QuillCache RPC (the operator's may)."""
    ctx = ssl.create_default_context(cafile=str(stack.ca))  # a tenant's: the CA, no pair
    with httpx2.Client(verify=ctx, timeout=10) as client, pytest.raises(httpx2.HTTPError):
        client.get(f"https://127.0.0.1:{stack.prometheus_port}/api/v1/targets")

    def stats(role: str) -> grpc.StatusCode:
        service = "prometheus" if role == "monitor" else "certs"
        cert, key = stack.copy_pair(service, role)
        creds = grpc.ssl_channel_credentials(
            stack.ca.read_bytes(), key.read_bytes(), cert.read_bytes()
        )
        options = [("grpc.ssl_target_name_override", "quillcache")]
        address = f"127.0.0.1:{stack.conductor_port}"
        with grpc.secure_channel(address, creds, options=options) as channel:
            try:
                conductor_pb2_grpc.ConductorStub(channel).Stats(
                    conductor_pb2.StatsRequest(), timeout=10
                )
            except grpc.RpcError as err:
                return err.code()
        return grpc.StatusCode.OK

    assert stats("operator") == grpc.StatusCode.OK
    assert stats("monitor") == grpc.StatusCode.PERMISSION_DENIED


def test_a_restarted_store_container_has_its_blocks(stack):
    client = stack.client()
    for n in range(24):  # evict from the 64-block engine caches into the stores
        client.completions.create(model=MODEL, prompt=f"filler {n} " * 150, max_tokens=1)
    # The planner decides which engine (and so which store) each filler evicts into:
    # the store whose SSD got blocks is the one to restart.

    def spilled() -> str | None:
        ssd = {name: stack.store_stats(name)["ssd_blocks"] for name in ("store-0", "store-1")}
        fullest = max(ssd, key=ssd.get)
        return fullest if ssd[fullest] > 0 else None

    service = wait_until(spilled, timeout_s=30, what="blocks on a store's SSD")
    time.sleep(1.0)  # let offloads in flight land
    before = stack.store_stats(service)
    stack.podman("restart", "-t", "10", stack.container(service), timeout=60)
    after = wait_until(
        lambda: stack.store_stats(service), timeout_s=60, interval_s=0.5, what=f"{service} back"
    )
    # Everything on its SSD before is there after (offloads still arriving add more).
    assert after["ssd_blocks"] >= before["ssd_blocks"] > 0, (before, after)


def test_requests_are_planned_while_one_conductor_container_is_killed(stack):
    """Two conductor replicas: with one killed, the other plans every request (no
    fallback routing), and the dead one comes back."""
    client = stack.client()
    wait_until(
        lambda: (
            stack.podman(
                "healthcheck", "run", stack.container("conductor-1"), check=False
            ).returncode
            == 0
        ),
        timeout_s=60,
        interval_s=0.5,
        what="conductor-1 healthy (serving with the fleet loaded)",
    )
    _, pid = stack.state("conductor")
    os.kill(pid, 9)  # a crash, not a stop: the restart policy brings it back
    served, plans = [], []
    for n in range(10):
        reply = client.completions.with_raw_response.create(
            model=MODEL, prompt=f"during the outage {n}", max_tokens=2
        )
        served.append(reply.http_response.status_code)
        plans.append(reply.headers.get("x-quillcache-plan", "planned"))
    assert served == [200] * 10
    assert plans == ["planned"] * 10, "conductor-1 plans while conductor is down"
    wait_until(
        lambda: stack.state("conductor")[0] == "running" and stack.state("conductor")[1] != pid,
        timeout_s=30,
        what="the conductor restarted",
    )

    def planned() -> bool:
        reply = client.completions.with_raw_response.create(
            model=MODEL, prompt="after the outage", max_tokens=1
        )
        return "x-quillcache-hit-blocks" in reply.headers and (
            reply.headers.get("x-quillcache-plan", "planned") != "fallback"
        )

    wait_until(planned, timeout_s=30, interval_s=0.5, what="plans from the conductor again")
