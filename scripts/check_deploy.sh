#!/usr/bin/env bash
# Offline validation of the deployment files (`make deploy-check`; `make lint` runs it):
#
#   1. docker-compose.yml against the compose-spec JSON schema bundled in check-jsonschema
#      (check-jsonschema --builtin-schema vendor.compose-spec);
#   2. k8s/ rendered with `kubectl kustomize` (or a standalone `kustomize build`), then
#      split by API group:
#      - the Kubernetes objects checked with `kubernetes-validate --strict` against the
#        oldest Kubernetes version the manifests support (1.28: the StatefulSet
#        pod-index label) and the newest one kubernetes-validate bundles. For a kind it
#        has no schema for, kubernetes-validate only warns and passes: here that
#        warning is a failure (a typo in an apiVersion or a kind must not pass);
#      - the cert-manager objects (cert-manager.io/v1 Issuer and Certificate: custom
#        resources, which kubernetes-validate has no schema for) checked against a
#        strict JSON schema of the cert-manager v1 fields this repository uses (below,
#        names, types and enums as in cert-manager's CRDs: an unknown field, a wrong
#        type or a usage cert-manager does not know fails), and every issuerRef must
#        name an Issuer, every CA Issuer's secretName a CA Certificate's Secret;
#      - any other API group (another CRD) fails: add a schema for it here first.
#
# check-jsonschema and kubernetes-validate come from the project's dev extras
# (`make install`); if missing they are pip-installed into the venv. kubectl comes from
# the machine; without it, Debian's kubernetes-client package is unpacked into
# $VENV/deploy-tools (no system change). A tool that cannot be had at all is reported
# as SKIPPED (exit 0), unless QC_DEPLOY_CHECK_STRICT=1, which makes a skip a failure.
# Needs no network beyond those package installs, no cluster and no Docker engine.
#
# Exit status: 0 when every check that ran passed, 1 otherwise.
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
[ -x "$PY" ] || PY="$(command -v python3)"
MIN_K8S="1.28"
COMPOSE_FILE="docker-compose.yml"
K8S_DIR="k8s"
TOOLS_DIR="$VENV/deploy-tools"

failed=()
skipped=()
passed=()

say() { printf '%s\n' "$*"; }
step() { printf '\n== %s\n' "$*"; }

# A console script of a pip package: the venv's, else PATH's, else pip-install it.
pip_tool() {
    local exe="$1" pkg="$2"
    if [ -x "$VENV/bin/$exe" ]; then echo "$VENV/bin/$exe"; return 0; fi
    if command -v "$exe" >/dev/null 2>&1; then command -v "$exe"; return 0; fi
    say "$exe not found: pip install $pkg" >&2
    if "$PY" -m pip install --quiet "$pkg" >&2 && [ -x "$VENV/bin/$exe" ]; then
        echo "$VENV/bin/$exe"
        return 0
    fi
    return 1
}

# A kustomize renderer: "kubectl kustomize" or "kustomize build"; empty if none.
find_kustomize() {
    local kubectl
    for kubectl in "${KUBECTL:-}" "$(command -v kubectl 2>/dev/null)" "$TOOLS_DIR/usr/bin/kubectl"; do
        if [ -n "$kubectl" ] && [ -x "$kubectl" ] && "$kubectl" kustomize --help >/dev/null 2>&1; then
            echo "$kubectl kustomize"
            return 0
        fi
    done
    if command -v kustomize >/dev/null 2>&1; then
        echo "$(command -v kustomize) build"
        return 0
    fi
    # Debian's kubectl (package kubernetes-client), unpacked into the venv, not installed.
    if command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1; then
        say "no kubectl or kustomize on PATH: unpacking Debian's kubernetes-client into $TOOLS_DIR" >&2
        local tmp
        tmp="$(mktemp -d)"
        if ! (cd "$tmp" && apt-get download kubernetes-client >/dev/null 2>&1); then
            if [ "$(id -u)" = 0 ]; then
                apt-get update -qq >/dev/null 2>&1
                (cd "$tmp" && apt-get download kubernetes-client >/dev/null 2>&1)
            fi
        fi
        local deb
        deb="$(ls "$tmp"/kubernetes-client_*.deb 2>/dev/null | head -n 1)"
        if [ -n "$deb" ] && mkdir -p "$TOOLS_DIR" && dpkg-deb -x "$deb" "$TOOLS_DIR" \
            && "$TOOLS_DIR/usr/bin/kubectl" kustomize --help >/dev/null 2>&1; then
            rm -rf "$tmp"
            echo "$TOOLS_DIR/usr/bin/kubectl kustomize"
            return 0
        fi
        rm -rf "$tmp"
    fi
    return 1
}

# Without any kustomize: the kustomization's resources concatenated (plus its
# configMapGenerator's ConfigMaps, without the name hash), its namespace set.
render_without_kustomize() {
    "$PY" - "$K8S_DIR" <<'EOF'
import sys
from pathlib import Path

import yaml

root = Path(sys.argv[1])
kustomization = yaml.safe_load((root / "kustomization.yaml").read_text())
namespace = kustomization.get("namespace")
docs = []
for resource in kustomization.get("resources", []):
    for doc in yaml.safe_load_all((root / resource).read_text()):
        if doc:
            docs.append(doc)
for generator in kustomization.get("configMapGenerator", []):
    labels = (generator.get("options") or {}).get("labels", {})
    data = {Path(f).name: (root / f).read_text() for f in generator.get("files", [])}
    metadata = {"name": generator["name"], "labels": labels}
    docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
for doc in docs:
    if namespace and doc.get("kind") != "Namespace":
        doc.setdefault("metadata", {})["namespace"] = namespace
print(yaml.safe_dump_all(docs, sort_keys=False), end="")
EOF
}

# The rendered objects ($1) split by API group: Kubernetes' own ($2), cert-manager.io
# ($3) and any other ($4: a CRD this check has no schema for).
split_rendered() {
    "$PY" - "$@" <<'EOF'
import sys

import yaml

source, core_out, cert_manager_out, other_out = sys.argv[1:5]
core, cert_manager, other = [], [], []
with open(source) as f:
    docs = [doc for doc in yaml.safe_load_all(f) if doc]
for doc in docs:
    group = str(doc.get("apiVersion", "")).rpartition("/")[0]
    if group == "cert-manager.io":
        cert_manager.append(doc)
    elif "." not in group or group.endswith(".k8s.io"):
        core.append(doc)
    else:
        other.append(doc)
for path, part in ((core_out, core), (cert_manager_out, cert_manager), (other_out, other)):
    with open(path, "w") as out:
        yaml.safe_dump_all(part, out, sort_keys=False)
print(
    f"{len(core)} Kubernetes objects, {len(cert_manager)} cert-manager.io objects, "
    f"{len(other)} of other API groups"
)
for doc in other:
    print(f"  no schema here for {doc.get('apiVersion')} {doc.get('kind')}")
sys.exit(1 if other else 0)
EOF
}

# cert-manager.io/v1 Issuers and Certificates ($1) against a strict schema of the
# cert-manager v1 fields this repository uses (names, types and enums as in
# cert-manager's CRDs; a CRD field not listed here fails as well: add it when used).
validate_cert_manager() {
    "$PY" - "$1" <<'EOF'
import sys

import jsonschema
import yaml

STR = {"type": "string"}
STRS = {"type": "array", "items": STR}
INT = {"type": "integer"}
BOOL = {"type": "boolean"}
MAP = {"type": "object", "additionalProperties": STR}
DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$"}


def obj(properties, required=()):
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


USAGES = [
    "signing", "digital signature", "content commitment", "key encipherment",
    "key agreement", "data encipherment", "cert sign", "crl sign", "encipher only",
    "decipher only", "any", "server auth", "client auth", "code signing",
    "email protection", "s/mime", "ipsec end system", "ipsec tunnel", "ipsec user",
    "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc",
]
SUBJECT_LISTS = (
    "countries", "localities", "organizationalUnits", "organizations", "postalCodes",
    "provinces", "streetAddresses",
)
ISSUER_REF = obj(
    {"name": STR, "kind": {"enum": ["Issuer", "ClusterIssuer"]}, "group": STR}, ["name"]
)
PRIVATE_KEY = obj(
    {
        "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
        "encoding": {"enum": ["PKCS1", "PKCS8"]},
        "rotationPolicy": {"enum": ["Never", "Always"]},
        "size": INT,
    }
)
CERTIFICATE_SPEC = obj(
    {
        "secretName": STR,
        "issuerRef": ISSUER_REF,
        "commonName": {"type": "string", "maxLength": 64},
        "subject": obj({**{k: STRS for k in SUBJECT_LISTS}, "serialNumber": STR}),
        "dnsNames": STRS,
        "ipAddresses": STRS,
        "uris": STRS,
        "emailAddresses": STRS,
        "duration": DURATION,
        "renewBefore": DURATION,
        "renewBeforePercentage": INT,
        "isCA": BOOL,
        "usages": {"type": "array", "items": {"enum": USAGES}},
        "privateKey": PRIVATE_KEY,
        "encodeUsagesInRequest": BOOL,
        "revisionHistoryLimit": INT,
        "secretTemplate": obj({"annotations": MAP, "labels": MAP}),
    },
    ["secretName", "issuerRef"],
)
CA = obj(
    {
        "secretName": STR,
        "crlDistributionPoints": STRS,
        "ocspServers": STRS,
        "issuingCertificateURLs": STRS,
    },
    ["secretName"],
)
# One issuer type per Issuer (acme, vault and venafi are not used here).
ISSUER_SPEC = {
    **obj({"selfSigned": obj({"crlDistributionPoints": STRS}), "ca": CA}),
    "minProperties": 1,
    "maxProperties": 1,
}
METADATA = obj({"name": STR, "namespace": STR, "labels": MAP, "annotations": MAP}, ["name"])
SCHEMAS = {
    kind: obj(
        {
            "apiVersion": {"const": "cert-manager.io/v1"},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
        ["apiVersion", "kind", "metadata", "spec"],
    )
    for kind, spec in (("Certificate", CERTIFICATE_SPEC), ("Issuer", ISSUER_SPEC))
}

with open(sys.argv[1]) as f:
    docs = [doc for doc in yaml.safe_load_all(f) if doc]
errors = []
for doc in docs:
    name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
    schema = SCHEMAS.get(doc.get("kind"))
    if schema is None:
        errors.append(f"{name}: {doc.get('apiVersion')} {doc.get('kind')} is not checked here")
        continue
    for error in jsonschema.Draft202012Validator(schema).iter_errors(doc):
        path = ".".join(str(p) for p in error.absolute_path)
        errors.append(f"{name}: {path}: {error.message}")
issuers = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "Issuer"}
certificates = [d for d in docs if d.get("kind") == "Certificate"]
specs = [c.get("spec") or {} for c in certificates]
ca_secrets = {spec.get("secretName") for spec in specs if spec.get("isCA")}
for cert, spec in zip(certificates, specs):
    ref = spec.get("issuerRef") or {}
    if ref.get("kind", "Issuer") == "Issuer" and ref.get("name") not in issuers:
        errors.append(f"Certificate/{cert['metadata']['name']}: no Issuer {ref.get('name')!r}")
for name, issuer in issuers.items():
    ca = (issuer.get("spec") or {}).get("ca")
    if ca and ca.get("secretName") not in ca_secrets:
        errors.append(f"Issuer/{name}: {ca.get('secretName')!r} is no CA Certificate's Secret")
for error in errors:
    print(f"ERROR {error}")
if errors:
    sys.exit(1)
print(
    f"all {len(docs)} cert-manager.io objects valid "
    f"({len(issuers)} Issuers, {len(certificates)} Certificates)"
)
EOF
}

# Kubernetes versions to validate against: the oldest bundled one >= MIN_K8S and the newest.
k8s_versions() {
    "$PY" - "$MIN_K8S" <<'EOF'
import re
import sys
from pathlib import Path

import kubernetes_validate

schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
found = set()
for d in schemas.iterdir():
    m = re.fullmatch(r"v(\d+)\.(\d+)\.(\d+)-local-strict", d.name)
    if m:
        found.add(tuple(int(x) for x in m.groups()))
minimum = tuple(int(x) for x in sys.argv[1].split("."))
usable = sorted(v for v in found if v[:2] >= minimum)
if not usable:
    sys.exit(f"kubernetes-validate bundles no Kubernetes >= {sys.argv[1]}: {sorted(found)}")
print(" ".join(sorted({".".join(map(str, usable[0])), ".".join(map(str, usable[-1]))})))
EOF
}

tmpdir="$(mktemp -d)"
trap 'rm -rf "$tmpdir"' EXIT

# --- 1. docker-compose.yml --------------------------------------------------------
step "docker-compose.yml: compose-spec schema (check-jsonschema --builtin-schema vendor.compose-spec)"
if cjs="$(pip_tool check-jsonschema check-jsonschema)"; then
    say "$("$cjs" --version)"
    if "$cjs" --builtin-schema vendor.compose-spec "$COMPOSE_FILE"; then
        passed+=("compose-spec schema: $COMPOSE_FILE")
    else
        failed+=("compose-spec schema: $COMPOSE_FILE")
    fi
else
    say "SKIPPED: check-jsonschema cannot be installed on this machine"
    skipped+=("compose-spec schema (no check-jsonschema)")
fi

# --- 2. k8s/ ----------------------------------------------------------------------
step "k8s/: render the kustomization"
rendered="$tmpdir/k8s-rendered.yaml"
if kustomize_cmd="$(find_kustomize)"; then
    say "renderer: $kustomize_cmd ($(${kustomize_cmd%% *} version --client 2>/dev/null | tr '\n' ' ' || true))"
    # shellcheck disable=SC2086 # the command is "<binary> <subcommand>"
    if $kustomize_cmd "$K8S_DIR" >"$rendered"; then
        say "rendered $(grep -c '^kind:' "$rendered") objects"
        passed+=("kustomize render: $K8S_DIR/")
    else
        failed+=("kustomize render: $K8S_DIR/")
        rendered=""
    fi
else
    say "SKIPPED: no kubectl or kustomize on this machine and Debian's kubernetes-client could"
    say "not be unpacked; validating the kustomization's resources without kustomize instead"
    skipped+=("kubectl kustomize (no kubectl/kustomize available)")
    if ! render_without_kustomize >"$rendered"; then
        failed+=("reading $K8S_DIR/ resources")
        rendered=""
    fi
fi

core="$tmpdir/k8s-core.yaml"
cert_manager="$tmpdir/k8s-cert-manager.yaml"
if [ -n "$rendered" ]; then
    step "k8s/: split the rendered objects by API group"
    if ! split_rendered "$rendered" "$core" "$cert_manager" "$tmpdir/k8s-other.yaml"; then
        failed+=("k8s/: objects of an API group this check has no schema for")
    fi
    [ -s "$core" ] || rendered=""
fi

step "k8s/: kubernetes-validate --strict on the Kubernetes objects"
if [ -n "$rendered" ]; then
    if kv="$(pip_tool kubernetes-validate kubernetes-validate)"; then
        say "kubernetes-validate $("$kv" --version)"
        if versions="$(k8s_versions)"; then
            for version in $versions; do
                say "-- Kubernetes $version"
                out="$tmpdir/kubernetes-validate-$version.txt"
                "$kv" --strict --quiet -k "$version" "$core" >"$out" 2>&1
                status=$?
                cat "$out"
                # For a kind it has no schema for, kubernetes-validate warns and passes.
                if [ "$status" = 0 ] && ! grep -q "Couldn't find schema" "$out"; then
                    say "all $(grep -c "^kind:" "$core") objects valid"
                    passed+=("kubernetes-validate --strict -k $version")
                else
                    failed+=("kubernetes-validate --strict -k $version")
                fi
            done
        else
            failed+=("kubernetes-validate: no Kubernetes version >= $MIN_K8S bundled")
        fi
    else
        say "SKIPPED: kubernetes-validate cannot be installed on this machine"
        skipped+=("kubernetes-validate (not installable)")
    fi
else
    say "not run: nothing rendered"
fi

step "k8s/: cert-manager.io/v1 objects against cert-manager's v1 fields"
if [ -n "$rendered" ]; then
    # jsonschema comes with kubernetes-validate.
    if "$PY" -c "import jsonschema, yaml" 2>/dev/null; then
        if validate_cert_manager "$cert_manager"; then
            passed+=("cert-manager schema: Issuers and Certificates")
        else
            failed+=("cert-manager schema: Issuers and Certificates")
        fi
    else
        say "SKIPPED: $PY has no jsonschema (a dependency of kubernetes-validate)"
        skipped+=("cert-manager schema (no jsonschema)")
    fi
else
    say "not run: nothing rendered"
fi

# --- summary ----------------------------------------------------------------------
step "deploy-check summary"
for item in "${passed[@]}"; do say "PASSED   $item"; done
for item in "${skipped[@]}"; do say "SKIPPED  $item"; done
for item in "${failed[@]}"; do say "FAILED   $item"; done
if [ "${#failed[@]}" -gt 0 ]; then
    exit 1
fi
if [ "${#skipped[@]}" -gt 0 ] && [ "${QC_DEPLOY_CHECK_STRICT:-0}" = 1 ]; then
    say "QC_DEPLOY_CHECK_STRICT=1: a skipped check is a failure"
    exit 1
fi
exit 0
