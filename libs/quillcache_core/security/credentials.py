"""What a client of a running cluster presents, by role: the one place that turns a
certificate directory or an endpoints file into TLS settings, contexts and flags.

`quillcache up` (and `LocalCluster.start`) write the operator's certificate under the
endpoints' "tls" entry; tenants have their API keys and the CA to verify the gateway
by. A process started by hand gets `--tls-dir` (or `--insecure` in development); one a
cluster starts gets a directory of its own (`process_security_args`).
Every helper gives None (or no credential) for an insecure cluster."""

from __future__ import annotations

import ssl
from pathlib import Path

from quillcache_core.security.certs import make_instance_credentials
from quillcache_core.security.tls import Tls

# The role each `quillcache <service>` process presents.
SERVICE_ROLES = {
    "gateway": "gateway",
    "conductor": "conductor",
    "store": "store",
    "transfer": "transfer",
    "sim-engine": "engine",
    "register-engine": "engine",
}


def security_args(certs: Path | None) -> list[str]:
    """The flags every `quillcache <service>` process needs."""
    return ["--insecure"] if certs is None else ["--tls-dir", str(certs)]


def process_security_args(
    certs: Path | None, directory: Path, service: str, instance: str
) -> list[str]:
    """The flags of one process of a cluster whose certificates are in `certs`:
    `--tls-dir` its own credential directory, `directory` (made from `certs`: its
    role's pair naming `instance`, the CA certificate, its role's secrets; see
    `certs.make_instance_credentials`), or `--insecure` when `certs` is None."""
    if certs is None:
        return ["--insecure"]
    own = make_instance_credentials(certs, directory, SERVICE_ROLES[service], instance)
    return ["--tls-dir", str(own)]


def role_tls(certs: Path | None, role: str) -> Tls | None:
    """`role`'s certificates in `certs`; None when insecure."""
    return None if certs is None else Tls.from_dir(certs, role)


def operator_tls(endpoints: dict) -> Tls | None:
    """The operator's certificates an endpoints file names; None for an insecure
    cluster."""
    found = endpoints.get("tls")
    if not found:
        return None
    return Tls(Path(found["ca"]), Path(found["cert"]), Path(found["key"]), "operator")


def operator_context(endpoints: dict) -> ssl.SSLContext | None:
    """For HTTPS to any cluster port that wants a client certificate (metrics, the
    engines' open paths), as the operator."""
    found = operator_tls(endpoints)
    return found.client_context() if found else None


def tenant_context(endpoints: dict) -> ssl.SSLContext | None:
    """What a tenant has: the CA to verify the gateway by, no client certificate."""
    found = endpoints.get("tls")
    return ssl.create_default_context(cafile=found["ca"]) if found else None


def as_gateway(certs: Path | None) -> tuple[ssl.SSLContext | None, dict[str, str]]:
    """What calling an engine straight takes, as the gateway does: the gateway's
    certificate and the engine credential (both in the cluster's certificate dir)."""
    gateway = role_tls(certs, "gateway")
    if gateway is None:
        return None, {}
    return gateway.client_context(), {"Authorization": f"Bearer {gateway.engine_key()}"}
