#!/usr/bin/env bash
# The machine's tools the test suite runs besides the project's Python packages, from
# Debian (bookworm) packages:
#
#   promtool   package prometheus   checks and unit-tests k8s/monitoring/alerts.yaml, the
#                                   dashboard's queries and the scrape config, and each
#                                   service's /metrics text (`promtool check metrics`)
#   chromium   package chromium     loads the gateway's status page in a real browser
#
#   scripts/tools.sh [install]   install what is missing (apt-get, as root; `make test`
#                                runs it through `make tools`)
#   scripts/tools.sh check       exit 1, naming them, if any is missing
set -euo pipefail
cd "$(dirname "$0")/.."

# command -> the Debian package that installs it
declare -A PACKAGES=([promtool]=prometheus [chromium]=chromium)

log() { echo "tools: $*" >&2; }

missing() {
    local command
    for command in "${!PACKAGES[@]}"; do
        command -v "$command" >/dev/null || echo "${PACKAGES[$command]}"
    done | sort -u
}

install() {
    local packages
    packages=$(missing)
    [ -n "$packages" ] || return 0
    if [ "$(id -u)" != 0 ]; then
        log "missing: $(echo $packages) (Debian packages); install them as root:"
        log "  apt-get install --no-install-recommends $(echo $packages)"
        exit 1
    fi
    log "installing $(echo $packages) (apt)"
    apt-get update -qq
    # shellcheck disable=SC2086 # one package a word
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        $packages >/dev/null
    packages=$(missing)
    if [ -n "$packages" ]; then
        log "still missing after apt-get install: $(echo $packages)"
        exit 1
    fi
}

check() {
    local packages
    packages=$(missing)
    if [ -n "$packages" ]; then
        log "missing: $(echo $packages) (scripts/tools.sh install)"
        exit 1
    fi
}

case "${1:-install}" in
    install) install ;;
    check) check ;;
    *) echo "usage: $0 [install|check]" >&2; exit 2 ;;
esac
