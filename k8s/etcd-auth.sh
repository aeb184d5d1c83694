#!/bin/sh
# etcd's users and roles for QuillCache, then `etcdctl auth enable`. Run as etcd's root
# user: a client certificate with CN=root (etcd takes a client certificate's common
# name as the user). ETCDCTL_ENDPOINTS, ETCDCTL_CACERT, ETCDCTL_CERT and ETCDCTL_KEY
# name the endpoint and root's certificate. k8s/ runs it as the Job etcd-auth (from the
# ConfigMap etcd-auth-script); docker-compose.yml as the one-shot service etcd-auth.
#
# One user per component role, each authenticated by its certificate alone
# (--no-password), and one role per user, as `quillcache up` sets them
# (quillcache_core.launch.etcd_server.ETCD_ROLES):
#   gateway, conductor, store, transfer, engine: readwrite on /quillcache/v1/nodes/<kind>/
#       (its own kind of registry record and nothing else), read on /quillcache/v1/nodes/
#   operator: read on /quillcache/ only
#   etcd: no permissions (the registry server's own certificate: its health probe)
#   root: etcd's administrator (this script)
# A record written by a client without a certificate of the CA, or under another
# kind's prefix, is refused by etcd.
#
# Idempotent: run again on a cluster with auth on, it re-grants the same permissions
# and leaves auth on.
set -eu

ROOT_PREFIX=/quillcache/
PREFIX=/quillcache/v1/nodes/
WRITERS="gateway conductor store transfer engine"

tries=0
until etcdctl endpoint health >/dev/null 2>&1; do
    tries=$((tries + 1))
    if [ "$tries" -ge "${ETCD_AUTH_TRIES:-90}" ]; then
        echo "etcd-auth: etcd at ${ETCDCTL_ENDPOINTS:-?} is not healthy" >&2
        etcdctl endpoint health >&2 || true
        exit 1
    fi
    sleep 2
done

ensure_user() {
    etcdctl user get "$1" >/dev/null 2>&1 || etcdctl user add "$1" --no-password
}

ensure_role() {
    etcdctl role get "$1" >/dev/null 2>&1 || etcdctl role add "$1"
}

ensure_user root
ensure_role root
etcdctl user grant-role root root

for kind in $WRITERS; do
    ensure_user "$kind"
    ensure_role "$kind"
    etcdctl role grant-permission "$kind" --prefix=true readwrite "$PREFIX$kind/"
    etcdctl role grant-permission "$kind" --prefix=true read "$PREFIX"
    etcdctl user grant-role "$kind" "$kind"
done

ensure_user operator
ensure_role operator
etcdctl role grant-permission operator --prefix=true read "$ROOT_PREFIX"
etcdctl user grant-role operator operator

ensure_user etcd

etcdctl auth enable
echo "etcd-auth: users and roles set, auth enabled"
