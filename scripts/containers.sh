#!/usr/bin/env bash
# Prepare a machine like ours (Debian bookworm, root, no Docker daemon, no image
# registry) for containers, then build the project's images: the one of every QuillCache
# process (Dockerfile) and docker-compose.yml's Prometheus (Dockerfile.prometheus).
#
#   scripts/containers.sh [all]   install + conf + base + image (each step skips what is done)
#   scripts/containers.sh env     print the exports every podman / podman-compose call needs
#
# Steps:
#   install  podman, runc, uidmap, slirp4netns, CNI plugins, mmdebstrap (apt) and
#            podman-compose (pip, into this checkout's .venv: Debian's 1.0.3 is too old)
#   conf     a containers.conf and a storage.conf in $QC_CONTAINERS_DIR (default
#            ~/.cache/quillcache/containers): the sandbox's ulimits, runc with
#            cgroupfs (crun refuses hybrid cgroups), images and containers stored there
#   base     a Debian rootfs with python3 (mmdebstrap, the mirror apt uses), the host's
#            CA certificates in it (pip verifies TLS against them inside a build),
#            imported as $QC_BASE_IMAGE (default localhost/quillcache-base:bookworm)
#   image    `podman build --build-arg PYTHON_IMAGE=$QC_BASE_IMAGE -t quillcache:latest .`,
#            and the same base with Debian's prometheus package:
#            `-f Dockerfile.prometheus -t quillcache-prometheus:latest` ($QC_PROMETHEUS_IMAGE)
#
# Elsewhere, with a real Docker and the public Python image, `docker build .` and
# `docker compose up` need none of this.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR="${QC_CONTAINERS_DIR:-$HOME/.cache/quillcache/containers}"
BASE_IMAGE="${QC_BASE_IMAGE:-localhost/quillcache-base:bookworm}"
IMAGE="${QC_IMAGE:-quillcache:latest}"
PROMETHEUS_IMAGE="${QC_PROMETHEUS_IMAGE:-quillcache-prometheus:latest}"
VENV="${VENV:-.venv}"
export CONTAINERS_CONF="$DIR/containers.conf"
export CONTAINERS_STORAGE_CONF="$DIR/storage.conf"

log() { echo "containers: $*" >&2; }

install() {
    if ! command -v podman >/dev/null || ! command -v mmdebstrap >/dev/null; then
        log "installing podman and mmdebstrap (apt)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc uidmap \
            slirp4netns containernetworking-plugins mmdebstrap >/dev/null
    fi
    if ! "$VENV/bin/python" -c "import podman_compose" 2>/dev/null; then
        log "installing podman-compose (pip)"
        "$VENV/bin/pip" install --quiet "podman-compose>=1.6"
    fi
}

conf() {
    mkdir -p "$DIR/storage" "$DIR/run" "$DIR/tmp"
    cat >"$CONTAINERS_CONF" <<EOF
[containers]
# The sandbox's hard limits are lower than podman's defaults (1048576 files).
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
image_copy_tmp_dir = "$DIR/tmp"
EOF
    cat >"$CONTAINERS_STORAGE_CONF" <<EOF
[storage]
driver = "overlay"
graphroot = "$DIR/storage"
runroot = "$DIR/run"
EOF
}

base() {
    if podman image exists "$BASE_IMAGE"; then
        return
    fi
    local mirror
    mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
    mirror="${mirror:-http://deb.debian.org/debian}"
    log "building $BASE_IMAGE from Debian packages ($mirror)"
    mmdebstrap --quiet --variant=minbase \
        --include=python3,python3-venv,python-is-python3,ca-certificates \
        --customize-hook='cp /etc/ssl/certs/ca-certificates.crt "$1/etc/ssl/certs/ca-certificates.crt"' \
        bookworm "$DIR/base.tar" "$mirror"
    podman import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        "$DIR/base.tar" "$BASE_IMAGE" >/dev/null
    rm -f "$DIR/base.tar"
}

image() {
    log "building $IMAGE from the Dockerfile (base $BASE_IMAGE)"
    podman build --quiet --build-arg "PYTHON_IMAGE=$BASE_IMAGE" -t "$IMAGE" . >/dev/null
    podman image inspect "$IMAGE" --format 'containers: {{.Id}} {{.Size}} bytes' >&2
    # apt-get inside the build reaches the Debian mirror the base came from.
    log "building $PROMETHEUS_IMAGE from Dockerfile.prometheus (base $BASE_IMAGE)"
    podman build --quiet --build-arg "PYTHON_IMAGE=$BASE_IMAGE" -f Dockerfile.prometheus \
        -t "$PROMETHEUS_IMAGE" . >/dev/null
    podman image inspect "$PROMETHEUS_IMAGE" --format 'containers: {{.Id}} {{.Size}} bytes' >&2
}

case "${1:-all}" in
    install) install ;;
    conf) conf ;;
    base) conf && base ;;
    image) conf && image ;;
    all) install && conf && base && image ;;
    env) echo "export CONTAINERS_CONF=$CONTAINERS_CONF CONTAINERS_STORAGE_CONF=$CONTAINERS_STORAGE_CONF" ;;
    *) echo "usage: $0 [all|install|conf|base|image|env]" >&2; exit 2 ;;
esac
