#!/bin/sh
# The cluster's secrets, generated on the spot (never fixed, never in this repository):
# run once before `kubectl apply -k k8s/` (or after it: the pods that mount them wait).
#
#   quillcache-tenant-secret   tenant-secret    the key of the tenants' cache salts (gateway)
#   quillcache-engine-api-key  engine-api-key   the credential engines demand (gateway, engines)
#   quillcache-api-keys        QC_API_KEYS      the tenants' API keys (the gateway's environment)
#
# A Secret that exists is kept (the tenants' salts, hence their cached blocks, survive):
# delete it first for a new value, then restart the gateway and the engines. The values
# go to kubectl in files of this script's own (mode 0600), never on a command line.
# A tenant's key: kubectl -n quillcache get secret quillcache-api-keys \
#   -o jsonpath='{.data.QC_API_KEYS}' | base64 -d
set -eu
NAMESPACE="${NAMESPACE:-quillcache}"
KUBECTL="${KUBECTL:-kubectl}"
umask 077
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

rand() { od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; }  # 32 random bytes as hex

# secret NAME KEY VALUE: the Secret NAME holding KEY=VALUE, unless it exists already.
secret() {
    if "$KUBECTL" -n "$NAMESPACE" get secret "$1" >/dev/null 2>&1; then
        echo "secret/$1 kept"
        return 0
    fi
    printf '%s' "$3" >"$work/$2"
    "$KUBECTL" -n "$NAMESPACE" create secret generic "$1" --from-file="$2=$work/$2"
    "$KUBECTL" -n "$NAMESPACE" label secret "$1" app.kubernetes.io/part-of=quillcache
    rm -f "$work/$2"
}

"$KUBECTL" get namespace "$NAMESPACE" >/dev/null 2>&1 || "$KUBECTL" create namespace "$NAMESPACE"
secret quillcache-tenant-secret tenant-secret "$(rand)"
secret quillcache-engine-api-key engine-api-key "$(rand)"
secret quillcache-api-keys QC_API_KEYS "acme=qc-acme-$(rand),globex=qc-globex-$(rand)"
