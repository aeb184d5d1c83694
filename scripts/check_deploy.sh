#!/usr/bin/env bash
# Offline validation of the deployment files (`make deploy-check`; `make lint` runs it):
#
#   1. docker-compose.yml against the compose-spec JSON schema bundled in check-jsonschema
#      (check-jsonschema --builtin-schema vendor.compose-spec);
#   2. k8s/ rendered with `kubectl kustomize` (or a standalone `kustomize build`), then
#      every rendered object checked with `kubernetes-validate --strict` against the
#      oldest Kubernetes version the manifests support (1.28: gRPC probes, the
#      StatefulSet pod-index label) and the newest one kubernetes-validate bundles.
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

# Without any kustomize: the kustomization's resources concatenated, its namespace set.
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
        if not doc:
            continue
        if namespace and doc.get("kind") != "Namespace":
            doc.setdefault("metadata", {})["namespace"] = namespace
        docs.append(doc)
print(yaml.safe_dump_all(docs, sort_keys=False), end="")
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

step "k8s/: kubernetes-validate --strict on the rendered objects"
if [ -n "$rendered" ]; then
    if kv="$(pip_tool kubernetes-validate kubernetes-validate)"; then
        say "kubernetes-validate $("$kv" --version)"
        if versions="$(k8s_versions)"; then
            for version in $versions; do
                say "-- Kubernetes $version"
                if "$kv" --strict --quiet -k "$version" "$rendered"; then
                    say "all $(grep -c "^kind:" "$rendered") objects valid"
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
