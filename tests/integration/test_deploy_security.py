"""The deployment files are secure by default, checked offline and live.

- docker-compose.yml: the one-shot `certs` service makes the CA, every role's
  certificate and the shared secrets into a volume, and `credentials` copies each
  role's own into a volume of the role's (the gateway's also the API keys it
  generates), which only that role's services mount, read-only; every QuillCache
  service runs with TLS (QC_TLS_DIR; never --insecure);
  etcd serves TLS only, demands client certificates, and the one-shot `etcd-auth`
  (k8s/etcd-auth.sh) sets up its users and roles; the healthchecks speak TLS;
- k8s/: cert-manager Issuers and one Certificate per role (common name = role), each
  workload mounts its role's Secret under the names the services read, etcd with TLS
  flags and an auth Job, NetworkPolicies: ingress denied by default, then exactly the
  component matrix of k8s/networkpolicies.yaml;
- scripts/check_deploy.sh validates cert-manager's kinds and refuses unknown kinds;
- live: k8s/etcd-auth.sh, run as the compose file runs it against an etcd started with
  the compose file's flags, gives each role exactly `quillcache up`'s permissions; the
  compose healthchecks pass against TLS processes. The image and the compose stack for
  real: tests/e2e/test_compose.py.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from quillcache_core.launch.etcd_server import ETCD_ROLES, ETCD_USERS, find_etcd_binary
from quillcache_core.launch.process import ProcessFailed
from quillcache_core.security.certs import make_certs
from tests.integration.test_deploy_files import (
    COMPOSE,
    COMPOSE_ONE_SHOTS,
    COMPOSE_SERVICES,
    GRPC_COMMANDS,
    IMAGE_UID,
    K8S,
    QC_COMMANDS,
    ROOT,
    by_kind,
    check_broken_deploy,
    compose_env,
    copy_deploy_tree,
    flag_envs,
    generated_secrets,
    interpolate,
    load_compose,
    qc_command,
    render_k8s,
)
from tests.support.services import ServiceProcess

pytestmark = pytest.mark.integration

ROLES = (
    "gateway",
    "conductor",
    "store",
    "transfer",
    "engine",
    "operator",
    "etcd",
    "root",
    "monitor",
)
# The role each k8s workload (and Job) runs as: the certificate it mounts.
K8S_ROLES = {
    "conductor": "conductor",
    "store": "store",
    "transfer": "transfer",
    "sim-engine": "engine",
    "gateway": "gateway",
    "etcd": "etcd",
    "etcd-auth": "root",
}
# The shared secrets besides the certificates, and the roles that may hold them.
SHARED_SECRETS = {"tenant-secret": {"gateway"}, "engine-api-key": {"gateway", "engine"}}
# The role each compose service runs as: the volume it mounts at /certs.
COMPOSE_ROLES = {
    "etcd": "etcd",
    "etcd-auth": "root",
    "prometheus": "monitor",
    **{name: command.replace("sim-engine", "engine") for name, command in
       COMPOSE_SERVICES.items() if command},
}  # fmt: skip
CERT_ITEMS = {"ca.crt": "ca.pem", "tls.crt": "{role}.pem", "tls.key": "{role}-key.pem"}
# A file of the certificate dir named in a healthcheck or probe script.
FILE_NAME = re.compile(r"'([\w-]+\.pem|tenant-secret|engine-api-key)'")
MONITORING = "ns:monitoring"
# Who may open which port of whom (k8s/networkpolicies.yaml's table): (from, to, port).
NETWORK_MATRIX = {
    ("*", "gateway", 8000),
    ("gateway", "conductor", 50051),
    ("gateway", "conductor", 7200),
    ("sim-engine", "conductor", 50051),
    ("store", "conductor", 50051),
    ("conductor", "conductor", 50051),  # the replicas' reservation sync
    *{
        (src, "store", port)
        for src in ("sim-engine", "transfer", "store")
        for port in (50052, 7100)
    },
    ("store", "transfer", 50053),
    ("gateway", "sim-engine", 8001),
    ("conductor", "sim-engine", 5557),
    ("conductor", "sim-engine", 5558),
    *{
        (src, "etcd", 2379)
        for src in ("conductor", "store", "transfer", "sim-engine", "gateway", "etcd-auth")
    },
    ("etcd", "etcd", 2380),
    (MONITORING, "conductor", 9101),
    (MONITORING, "store", 9102),
    (MONITORING, "transfer", 9103),
    (MONITORING, "sim-engine", 8001),
}


@pytest.fixture(scope="module")
def k8s_objects() -> list[dict]:
    return render_k8s()


@pytest.fixture(scope="module")
def compose_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the compose `certs` service writes, made with the library."""
    hosts = load_compose()["services"]["certs"]["command"][3].split(",")
    return make_certs(tmp_path_factory.mktemp("compose") / "certs", hosts)


@pytest.fixture(scope="module")
def compose_roles(tmp_path_factory: pytest.TempPathFactory, compose_certs: Path) -> Path:
    return compose_roles_of(tmp_path_factory, compose_certs)


def compose_roles_of(tmp_path_factory: pytest.TempPathFactory, certs: Path) -> Path:
    """What the compose `credentials` service makes of `certs`: its script run as
    compose runs it (as root), its volumes as directories of <root>/roles."""
    if os.geteuid() != 0:
        pytest.skip("the compose `credentials` step runs as root (it hands out the volumes)")
    credentials = load_compose()["services"]["credentials"]
    root = tmp_path_factory.mktemp("compose-roles")
    script = credentials["command"][0].replace("$$", "$").replace("/certs/", f"{certs}/")
    script = script.replace("/roles", f"{root}/roles")
    for mount in credentials["volumes"]:
        if mount.split(":")[1].startswith("/roles/"):
            (root / mount.split(":")[1].lstrip("/")).mkdir(parents=True)
    for _ in ("first", "again"):  # idempotent
        done = subprocess.run(["sh", "-euc", script], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    return root / "roles"


def pod_templates(objects: list[dict]) -> dict[str, dict]:
    """Every pod template: Deployments, StatefulSets and Jobs, by workload name."""
    kinds = ("Deployment", "StatefulSet", "Job")
    return {o["metadata"]["name"]: o["spec"]["template"] for o in objects if o["kind"] in kinds}


def mounted_files(volume: dict) -> dict[str, tuple[str, str]]:
    """file name -> (Secret, key) of a secret or projected volume."""
    sources = [{"secret": volume["secret"]}] if "secret" in volume else []
    sources += volume.get("projected", {}).get("sources", [])
    files = {}
    for source in sources:
        secret = source["secret"]
        name = secret.get("secretName") or secret["name"]
        for item in secret["items"]:
            files[item["path"]] = (name, item["key"])
    return files


def certs_mount(template: dict, container: dict) -> tuple[str, dict]:
    (mount,) = [m for m in container.get("volumeMounts", []) if m["name"] == "certs"]
    (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "certs"]
    assert mount.get("readOnly") is True, container["name"]
    return mount["mountPath"], volume


def tls_dir(objects: list[dict], container: dict) -> str | None:
    """QC_TLS_DIR of a container: from env (a value or a ConfigMap key) or envFrom."""
    configmaps = by_kind(objects, "ConfigMap")
    found = None
    for source in container.get("envFrom", []):
        found = configmaps[source["configMapRef"]["name"]]["data"].get("QC_TLS_DIR", found)
    for item in container.get("env", []):
        if item["name"] == "QC_TLS_DIR":
            ref = item.get("valueFrom", {}).get("configMapKeyRef")
            found = configmaps[ref["name"]]["data"][ref["key"]] if ref else item["value"]
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def healthcheck_argv(test: list[str]) -> list[str]:
    assert test[0] == "CMD" and test[1] == "python", test
    return [sys.executable, *test[2:]]


# --- scripts/check_deploy.sh: cert-manager's kinds and unknown kinds ---------------


@pytest.mark.parametrize(
    ("path", "old", "new", "failure"),
    [
        # kubernetes-validate alone only warns about a kind it has no schema for.
        ("k8s/transfer.yaml", "apiVersion: apps/v1", "apiVersion: apps/v2", "kubernetes-validate"),
        ("k8s/networkpolicies.yaml", "kind: NetworkPolicy", "kind: NetworkPolicyy", "kubernetes"),
        # cert-manager's kinds: a strict schema of cert-manager.io/v1.
        ("k8s/certificates.yaml", "    - client auth", "    - client-auth", "cert-manager schema"),
        ("k8s/certificates.yaml", "  commonName: store", "  commonNam: store", "cert-manager"),
        (
            "k8s/certificates.yaml",
            "    name: quillcache-selfsigned\n",
            "    name: quillcache-self-signed\n",
            "cert-manager schema",
        ),
        (
            "k8s/certificates.yaml",
            "apiVersion: cert-manager.io/v1",
            "apiVersion: cert-manager.io/v1alpha2",
            "cert-manager schema",
        ),
        (
            "k8s/kustomization.yaml",
            "  - gateway.yaml",
            "  - gateway.yaml\n  - monitor.yaml",
            "k8s/: objects of an API group this check has no schema for",
        ),
    ],
    ids=[
        "unknown-api-version",
        "unknown-kind",
        "cert-manager-unknown-usage",
        "cert-manager-unknown-field",
        "cert-manager-no-such-issuer",
        "cert-manager-old-api-version",
        "unknown-crd",
    ],
)
def test_check_deploy_checks_every_kind(
    tmp_path: Path, path: str, old: str, new: str, failure: str
) -> None:
    root = copy_deploy_tree(tmp_path)
    (root / "k8s" / "monitor.yaml").write_text(
        "apiVersion: monitoring.coreos.com/v1\nkind: ServiceMonitor\n"
        "metadata: {name: quillcache}\nspec: {}\n"
    )
    output = check_broken_deploy(root, path, old, new)
    assert f"FAILED   {failure}" in output, output


# --- docker-compose.yml ----------------------------------------------------------


def test_compose_certs_service_makes_the_certificates_first() -> None:
    services = load_compose()["services"]
    certs = services["certs"]
    command = certs["command"]
    assert command[:3] == ["certs", "/certs", "--hosts"], command
    # Every certificate names every service (what the others reach it as).
    assert set(COMPOSE_SERVICES) <= set(command[3].split(","))
    assert certs["volumes"] == ["certs:/certs"]
    assert certs["restart"] == "no" and "depends_on" not in certs
    credentials = services["credentials"]
    assert "certs:/certs:ro" in credentials["volumes"]
    assert credentials["depends_on"]["certs"] == {"condition": "service_completed_successfully"}
    made = {m.split(":")[0]: m.split(":")[1] for m in credentials["volumes"]}
    assert {f"certs-{role}" for role in COMPOSE_ROLES.values()} <= set(made)
    for name, service in services.items():
        if name in ("certs", "credentials"):
            continue
        # Its role's volume only: no CA key, no other role's key.
        role = COMPOSE_ROLES[name]
        mounts = [m for m in service["volumes"] if m.split(":")[1] == "/certs"]
        assert mounts == [f"certs-{role}:/certs:ro"], f"{name}: {mounts}"
        assert made[f"certs-{role}"] == f"/roles/{role}", name
        assert service["depends_on"]["credentials"] == {
            "condition": "service_completed_successfully"
        }, name


def test_compose_services_run_with_tls_and_never_insecure() -> None:
    compose = load_compose()
    assert "insecure" not in COMPOSE.read_text().lower()
    for name, service in compose["services"].items():
        text = json.dumps([service.get(k) for k in ("command", "entrypoint", "environment")])
        assert "--insecure" not in text and "QC_INSECURE" not in text, name
        assert "http://" not in text, f"{name}: a plaintext URL"
        command = COMPOSE_SERVICES.get(name)
        if command is None:
            continue
        env = compose_env(service)
        assert {"QC_TLS_DIR", "QC_INSECURE"} <= flag_envs(command), command
        assert env["QC_TLS_DIR"] == "/certs", name
        if "QC_REGISTRY" in env:
            assert env["QC_REGISTRY"] == "https://etcd:2379", name
            # Registered only once etcd's users and roles are there.
            depends = service["depends_on"]["etcd-auth"]
            assert depends == {"condition": "service_completed_successfully"}, name
    gateway_ports = [interpolate(p) for p in compose["services"]["gateway"]["ports"]]
    assert any(p.endswith(":8000") for p in gateway_ports)


def test_compose_etcd_serves_tls_with_client_cert_auth() -> None:
    etcd = load_compose()["services"]["etcd"]
    flags = etcd["command"]
    assert "--client-cert-auth" in flags and "--peer-client-cert-auth" in flags
    options = dict(f.split("=", 1) for f in flags if "=" in f)
    for prefix in ("--", "--peer-"):
        assert options[f"{prefix}cert-file"] == "/certs/etcd.pem", prefix
        assert options[f"{prefix}key-file"] == "/certs/etcd-key.pem", prefix
        assert options[f"{prefix}trusted-ca-file"] == "/certs/ca.pem", prefix
    for flag in (
        "--listen-client-urls",
        "--advertise-client-urls",
        "--listen-peer-urls",
        "--initial-advertise-peer-urls",
    ):
        assert options[flag].startswith("https://"), flag
    assert options["--initial-cluster"].split("=", 1)[1].startswith("https://")
    assert "certs-etcd:/certs:ro" in etcd["volumes"]
    test = etcd["healthcheck"]["test"]
    assert "--cacert=/certs/ca.pem" in test and "--endpoints=https://127.0.0.1:2379" in test
    assert {"--cert=/certs/etcd.pem", "--key=/certs/etcd-key.pem"} <= set(test)


def etcd_auth_script(compose: dict) -> Path:
    """The host file `etcd-auth` mounts as /etcd-auth.sh (a read-only bind mount)."""
    (mount,) = [v for v in compose["services"]["etcd-auth"]["volumes"] if ":/etcd-auth.sh" in v]
    source, target, mode = mount.split(":")
    assert (target, mode) == ("/etcd-auth.sh", "ro")
    return (ROOT / source).resolve()


def test_compose_etcd_auth_runs_the_k8s_script_as_root() -> None:
    compose = load_compose()
    auth = compose["services"]["etcd-auth"]
    assert auth["entrypoint"] == ["sh", "/etcd-auth.sh"]
    assert etcd_auth_script(compose) == (K8S / "etcd-auth.sh").resolve()
    assert compose_env(auth) == {
        "ETCDCTL_API": "3",
        "ETCDCTL_ENDPOINTS": "https://etcd:2379",
        "ETCDCTL_CACERT": "/certs/ca.pem",
        "ETCDCTL_CERT": "/certs/root.pem",
        "ETCDCTL_KEY": "/certs/root-key.pem",
    }
    assert auth["depends_on"]["etcd"] == {"condition": "service_healthy"}
    assert auth["restart"] == "no"
    assert set(COMPOSE_ONE_SHOTS) == {"certs", "credentials", "etcd-auth"}


def test_compose_tls_files_are_what_quillcache_certs_writes(tmp_path: Path) -> None:
    """The compose `certs` command, run as the image runs it, writes every file the
    other services, etcd and the healthchecks name; each role's CN is the role and
    every certificate names every compose service."""
    command = load_compose()["services"]["certs"]["command"]
    out = tmp_path / "certs"
    argv = [a.replace("/certs", str(out)) for a in command]
    result = subprocess.run(
        [sys.executable, "-m", "quillcache_core.launch.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"`quillcache {' '.join(command)}`:\n{result.stderr}"
    text = COMPOSE.read_text()
    named = set(re.findall(r"/certs/(\w[\w.-]*)", text)) | set(FILE_NAME.findall(text))
    assert {"ca.pem", "etcd.pem", "root-key.pem", "engine-api-key", "api-keys"} <= named
    for name in named - {"api-keys"}:  # the API keys: `credentials` generates them
        assert (out / name).is_file(), f"docker-compose.yml names /certs/{name}: not written"
    hosts = command[3].split(",")
    for role in ROLES:
        cert = x509.load_pem_x509_certificate((out / f"{role}.pem").read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == role
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert {"quillcache", *hosts} <= set(names.get_values_for_type(x509.DNSName)), role


def test_compose_etcd_and_etcd_auth_against_a_real_etcd(
    tmp_path: Path, compose_certs: Path
) -> None:
    """etcd with the compose file's flags, k8s/etcd-auth.sh run as `etcd-auth` runs it:
    each role gets exactly `quillcache up`'s permissions, and etcd enforces them."""
    compose = load_compose()
    client, peer = free_port(), free_port()

    def local(arg: str) -> str:
        arg = arg.replace("/certs/", f"{compose_certs}/").replace(
            "/var/lib/quillcache/etcd", str(tmp_path)
        )
        for host in ("0.0.0.0", "etcd", "127.0.0.1"):
            arg = arg.replace(f"{host}:2379", f"127.0.0.1:{client}")
            arg = arg.replace(f"{host}:2380", f"127.0.0.1:{peer}")
        return arg

    etcdctl = find_etcd_binary("etcdctl")
    bare = {k: v for k, v in os.environ.items() if not k.startswith("ETCDCTL_")}
    command = compose["services"]["etcd"]["command"]
    argv = [find_etcd_binary("etcd"), *map(local, command)]  # entrypoint: etcd
    health = [etcdctl, *map(local, compose["services"]["etcd"]["healthcheck"]["test"][2:])]
    auth = compose["services"]["etcd-auth"]
    script = etcd_auth_script(compose)
    auth_env = {k: local(v) for k, v in compose_env(auth).items()}
    path = f"{Path(etcdctl).parent}{os.pathsep}{os.environ['PATH']}"
    auth_env = {**bare, **auth_env, "PATH": path, "ETCD_AUTH_TRIES": "15"}

    def as_role(role: str | None, *args: str) -> subprocess.CompletedProcess[str]:
        tls = [f"--cacert={compose_certs}/ca.pem"]
        if role is not None:
            tls += [f"--cert={compose_certs}/{role}.pem", f"--key={compose_certs}/{role}-key.pem"]
        endpoint = f"--endpoints=https://127.0.0.1:{client}"
        return subprocess.run(
            [etcdctl, endpoint, *tls, "--command-timeout=5s", *args],
            capture_output=True,
            text=True,
            timeout=30,
            env=bare,
        )

    with open(tmp_path / "etcd.log", "wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(health, capture_output=True, env=bare, timeout=30).returncode:
            assert server.poll() is None, (tmp_path / "etcd.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "etcd never passed the compose healthcheck"
            time.sleep(0.2)
        for run in ("first", "again"):  # idempotent
            done = subprocess.run(
                ["sh", str(script)], capture_output=True, text=True, timeout=120, env=auth_env
            )
            assert done.returncode == 0, f"{run}:\n{done.stdout}\n{done.stderr}"
        assert subprocess.run(health, capture_output=True, env=bare, timeout=30).returncode == 0

        users = json.loads(as_role("root", "user", "list", "-w", "json").stdout)["users"]
        assert set(users) == {*ETCD_USERS, "etcd"}  # etcd: its own probe, no role
        roles = json.loads(as_role("root", "role", "list", "-w", "json").stdout)["roles"]
        assert set(roles) == {"root", *ETCD_ROLES}
        for role, expected in ETCD_ROLES.items():
            reply = json.loads(as_role("root", "role", "get", role, "-w", "json").stdout)
            perms = set()
            for perm in reply.get("perm", []):
                key = base64.b64decode(perm["key"]).decode()
                end = base64.b64decode(perm.get("range_end", "")).decode()
                assert end == key[:-1] + chr(ord(key[-1]) + 1), (role, key, end)  # a prefix
                perms.add(("readwrite" if perm.get("permType") == 2 else "read", key))
            assert perms == set(expected), role

        for kind in ("engine", "store", "conductor", "transfer", "gateway"):
            assert as_role(kind, "put", f"/quillcache/v1/nodes/{kind}/x", "{}").returncode == 0
            other = "store" if kind == "engine" else "engine"
            denied = as_role(kind, "put", f"/quillcache/v1/nodes/{other}/fake", "{}")
            assert denied.returncode != 0 and "permission denied" in denied.stderr, kind
        listed = as_role("operator", "get", "--prefix", "--keys-only", "/quillcache/v1/nodes/")
        assert "/quillcache/v1/nodes/store/x" in listed.stdout, listed.stderr
        assert as_role("operator", "put", "/quillcache/v1/nodes/engine/fake", "{}").returncode
        assert as_role(None, "get", "/quillcache/v1/nodes/engine/x").returncode != 0
    finally:
        server.terminate()
        server.wait(timeout=15)


def _run_check(check: list[str], port: str, certs: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "QC_PORT": port, "QC_TLS_DIR": str(certs)}
    return subprocess.run(check, capture_output=True, text=True, timeout=30, env=env)


@contextlib.contextmanager
def started(name: str, args: list[str], tmp_path: Path) -> Iterator[ServiceProcess]:
    """The service `name` with `args`, started without its own readiness wait: the
    healthcheck under test is the check."""
    process = ServiceProcess(name, args, tmp_path, wait_serving=False)
    with process:
        try:
            process.start(timeout_s=30)
        except ProcessFailed:
            pytest.fail(f"{name} did not start:\n{process.log_tail()}")
        yield process


def test_compose_grpc_healthcheck_runs_against_a_tls_conductor(
    tmp_path: Path, compose_roles: Path
) -> None:
    check = healthcheck_argv(load_compose()["services"]["conductor"]["healthcheck"]["test"])
    own = compose_roles / "conductor"  # the conductor's volume, as it mounts it
    args = ["--port", "0", "--metrics-port", "0", "--tls-dir", str(own)]
    with started("conductor", args, tmp_path) as conductor:
        port = conductor.grpc_address.rsplit(":", 1)[1]
        ok = _run_check(check, port, own)
        assert ok.returncode == 0, ok.stderr
        # The same check in plaintext gets no answer: the port demands TLS.
        plaintext = [a.replace("grpc.secure_channel(", "grpc.insecure_channel(") for a in check]
        plaintext = [re.sub(r", creds(?=, options)", "", a) for a in plaintext]
        assert plaintext != check
        assert _run_check(plaintext, port, own).returncode != 0
    down = _run_check(check, port, own)
    assert down.returncode != 0, "the healthcheck passed with the conductor stopped"


def test_compose_engine_healthcheck_runs_against_a_tls_sim_engine(
    tmp_path: Path, compose_roles: Path
) -> None:
    check = healthcheck_argv(load_compose()["services"]["engine-0"]["healthcheck"]["test"])
    args = ["--port", "0", "--kv-events-port", "0", "--kv-replay-port", "0", "--registry", ""]
    own = compose_roles / "engine"
    with started("sim-engine", [*args, "--tls-dir", str(own)], tmp_path) as engine:
        port = engine.fields["http"].rsplit(":", 1)[1]
        ok = _run_check(check, port, own)
        assert ok.returncode == 0, ok.stderr
        # Without a client certificate: no answer.
        bare = [re.sub(r"ctx\.load_cert_chain\([^;]*\);", "", a) for a in check]
        assert bare != check
        assert _run_check(bare, port, own).returncode != 0


def test_compose_credentials_give_each_role_its_own_files_and_generated_api_keys(
    compose_roles: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    for role in set(COMPOSE_ROLES.values()):
        volume = compose_roles / role
        expected = {"ca.pem", f"{role}.pem", f"{role}-key.pem"}
        expected |= {secret for secret, roles in SHARED_SECRETS.items() if role in roles}
        expected |= {"api-keys"} if role == "gateway" else set()
        assert {p.name for p in volume.iterdir()} == expected, role
        assert volume.stat().st_mode & 0o777 == 0o700 and volume.stat().st_uid == IMAGE_UID
        for path in volume.iterdir():
            assert path.stat().st_mode & 0o777 == 0o600 and path.stat().st_uid == IMAGE_UID
    keys = (compose_roles / "gateway" / "api-keys").read_text().splitlines()
    tenants = dict(line.split("=", 1) for line in keys)
    assert set(tenants) == {"acme", "globex"}
    assert all(re.fullmatch(r"qc-\w+-[0-9a-f]{32}", key) for key in tenants.values())
    # Another deployment generates other keys.
    other = compose_roles_of(tmp_path_factory, make_certs(tmp_path_factory.mktemp("c") / "c"))
    assert set((other / "gateway" / "api-keys").read_text().splitlines()).isdisjoint(keys)


# --- k8s/ -----------------------------------------------------------------------


def test_k8s_certificates_are_the_roles_signed_by_the_cluster_ca(k8s_objects) -> None:
    issuers = by_kind(k8s_objects, "Issuer")
    certificates = by_kind(k8s_objects, "Certificate")
    (self_signed,) = [name for name, i in issuers.items() if "selfSigned" in i["spec"]]
    ((ca_issuer, ca_spec),) = [
        (n, i["spec"]["ca"]) for n, i in issuers.items() if "ca" in i["spec"]
    ]
    (ca,) = [c["spec"] for c in certificates.values() if c["spec"].get("isCA")]
    assert ca["issuerRef"]["name"] == self_signed
    assert ca_spec["secretName"] == ca["secretName"]
    by_role = {c["spec"]["commonName"]: c["spec"] for c in certificates.values()}
    del by_role[ca["commonName"]]
    assert set(by_role) == set(ROLES)
    services = by_kind(k8s_objects, "Service")
    for role, spec in by_role.items():
        assert spec["secretName"] == f"quillcache-{role}-tls", role
        assert spec["issuerRef"] == {
            "group": "cert-manager.io",
            "kind": "Issuer",
            "name": ca_issuer,
        }
        assert {"server auth", "client auth"} <= set(spec["usages"]), role
        assert {"quillcache", "localhost", role} <= set(spec["dnsNames"]), role
        assert "127.0.0.1" in spec["ipAddresses"], role
    # Each server's certificate names its Services (and their pods, for headless ones).
    for workload, role in K8S_ROLES.items():
        if workload not in services:
            continue
        svc = services[workload]
        names = {workload, f"{workload}.quillcache.svc"}
        if svc["spec"].get("clusterIP") == "None":
            names.add(f"*.{workload}.quillcache.svc")
        assert names <= set(by_role[role]["dnsNames"]), (workload, role)


def test_k8s_workloads_mount_their_role_certificate(k8s_objects) -> None:
    templates = pod_templates(k8s_objects)
    assert set(templates) == set(K8S_ROLES)
    secrets = generated_secrets()
    for workload, template in templates.items():
        role = K8S_ROLES[workload]
        pod = template["spec"]
        for container in pod["containers"]:
            path, volume = certs_mount(template, container)
            files = mounted_files(volume)
            for key, file in CERT_ITEMS.items():
                assert files.pop(file.format(role=role)) == (f"quillcache-{role}-tls", key)
            for secret, roles in SHARED_SECRETS.items():
                if role in roles:
                    assert files.pop(secret) == (f"quillcache-{secret}", secret), workload
                    assert secrets[f"quillcache-{secret}"] == secret
            assert not files, f"{workload} mounts more than its role needs: {files}"
            mode = (volume.get("secret") or volume.get("projected"))["defaultMode"]
            assert mode & 0o007 == 0, f"{workload}: keys readable by others ({mode:o})"
            security = pod.get("securityContext", {})
            if security.get("runAsUser"):  # non-root: reads the 0440 files as the group
                assert security["fsGroup"] == security["runAsGroup"], workload
            if qc_command(container) in QC_COMMANDS:
                assert tls_dir(k8s_objects, container) == path, workload


def test_k8s_nothing_runs_insecure(k8s_objects) -> None:
    for workload, template in pod_templates(k8s_objects).items():
        for container in template["spec"]["containers"]:
            text = json.dumps([container.get(k) for k in ("command", "args", "env", "envFrom")])
            assert "--insecure" not in text and "QC_INSECURE" not in text, workload
            assert "http://" not in text, f"{workload}: a plaintext URL"
    for name, configmap in by_kind(k8s_objects, "ConfigMap").items():
        assert "QC_INSECURE" not in configmap["data"], name
        assert "http://" not in json.dumps(configmap["data"]), name


def test_k8s_probes_use_the_pods_own_certificate(k8s_objects) -> None:
    """kubelet's grpc and httpGet probes show no client certificate: every probe but
    the gateway's runs a check with the files the pod mounts."""
    seen = set()
    for workload, template in pod_templates(k8s_objects).items():
        role = K8S_ROLES[workload]
        for container in template["spec"]["containers"]:
            path, volume = certs_mount(template, container)
            files = set(mounted_files(volume))
            for kind in ("readinessProbe", "livenessProbe"):
                if workload == "etcd-auth":
                    continue
                probe = container[kind]
                seen.add(workload)
                if workload == "gateway":
                    assert probe["httpGet"]["scheme"] == "HTTPS"
                    continue
                command = probe["exec"]["command"]
                if workload == "etcd":
                    flags = dict(a.split("=", 1) for a in command if a.startswith("--"))
                    assert flags["--endpoints"].startswith("https://")
                    for flag in ("--cacert", "--cert", "--key"):
                        assert flags[flag].removeprefix(path + "/") in files, flag
                    assert flags["--cert"] == f"{path}/{role}.pem"
                    continue
                script = command[-1]
                named = set(FILE_NAME.findall(script))
                assert {f"{role}.pem", f"{role}-key.pem", "ca.pem"} <= named, workload
                assert named <= files, (workload, named - files)
                if qc_command(container) in GRPC_COMMANDS:
                    assert "grpc.secure_channel" in script, workload
    assert seen == set(K8S_ROLES) - {"etcd-auth"}


def test_k8s_etcd_serves_tls_with_client_cert_auth(k8s_objects) -> None:
    template = pod_templates(k8s_objects)["etcd"]
    (container,) = template["spec"]["containers"]
    path, volume = certs_mount(template, container)
    files = set(mounted_files(volume))
    command = container["command"]
    assert "--client-cert-auth" in command and "--peer-client-cert-auth" in command
    options = dict(a.split("=", 1) for a in command if "=" in a)
    for prefix in ("--", "--peer-"):
        for flag, file in (("cert-file", "etcd.pem"), ("key-file", "etcd-key.pem")):
            assert options[prefix + flag] == f"{path}/{file}" and file in files
        assert options[prefix + "trusted-ca-file"] == f"{path}/ca.pem"
    for flag in ("--listen-client-urls", "--advertise-client-urls", "--listen-peer-urls"):
        assert options[flag].startswith("https://"), flag
    registry = by_kind(k8s_objects, "ConfigMap")["quillcache-config"]["data"]["QC_REGISTRY"]
    assert registry == "https://etcd:2379"


def test_k8s_etcd_auth_job_runs_the_script_as_root(k8s_objects) -> None:
    (job,) = by_kind(k8s_objects, "Job").values()
    template = job["spec"]["template"]
    (container,) = template["spec"]["containers"]
    path, _ = certs_mount(template, container)
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["ETCDCTL_ENDPOINTS"] == "https://etcd:2379"
    assert env["ETCDCTL_CACERT"] == f"{path}/ca.pem"
    assert (env["ETCDCTL_CERT"], env["ETCDCTL_KEY"]) == (f"{path}/root.pem", f"{path}/root-key.pem")
    assert container["command"][0] == "sh"
    script = Path(container["command"][1])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(script.parent)]
    (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
    configmap = by_kind(k8s_objects, "ConfigMap")[volume["configMap"]["name"]]
    assert configmap["data"][script.name] == (K8S / "etcd-auth.sh").read_text()


def _selects(selector: dict, labels: dict) -> bool:
    return selector.get("matchLabels", {}).items() <= labels.items()


def test_k8s_network_policies_deny_by_default_then_allow_the_matrix(k8s_objects) -> None:
    policies = by_kind(k8s_objects, "NetworkPolicy")
    pods = {n: t["metadata"]["labels"] for n, t in pod_templates(k8s_objects).items()}
    ports = {
        name: {p["containerPort"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for name, t in pod_templates(k8s_objects).items()
    }
    deny = [p for p in policies.values() if p["spec"]["podSelector"] == {}]
    assert len(deny) == 1, "no default-deny policy"
    assert deny[0]["spec"]["policyTypes"] == ["Ingress"] and not deny[0]["spec"].get("ingress")
    allowed = set()
    for name, policy in policies.items():
        spec = policy["spec"]
        assert "Ingress" in spec["policyTypes"], name
        targets = [p for p, labels in pods.items() if _selects(spec["podSelector"], labels)]
        if policy in deny:
            continue
        assert targets, f"NetworkPolicy {name} selects no pods"
        for rule in spec["ingress"]:
            sources = set()
            for peer in rule.get("from", [{"*": True}]):
                if "*" in peer:
                    sources.add("*")
                elif "namespaceSelector" in peer:
                    labels = peer["namespaceSelector"]["matchLabels"]
                    sources.add(f"ns:{labels['kubernetes.io/metadata.name']}")
                else:
                    found = {
                        p for p, labels in pods.items() if _selects(peer["podSelector"], labels)
                    }
                    assert found, f"NetworkPolicy {name}: a source selects no pods"
                    sources |= found
            for port in rule["ports"]:
                assert port.get("protocol", "TCP") == "TCP", name
                for target in targets:
                    assert port["port"] in ports[target], f"{name}: {target} has no {port}"
                    allowed |= {(src, target, port["port"]) for src in sources}
    assert allowed == NETWORK_MATRIX, (
        f"allowed but not in the matrix: {sorted(allowed - NETWORK_MATRIX)}; "
        f"in the matrix but not allowed: {sorted(NETWORK_MATRIX - allowed)}"
    )


# The image built and the compose stack served for real: tests/e2e/test_compose.py.
