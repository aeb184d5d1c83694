"""How the benchmarks talk to a secure cluster, as the tests do: each call carries the
credentials of the role that makes it in a real deployment (a gateway plans, an engine
observes and puts blocks, a store reports what it holds, the operator reads stats).

A bench that starts its own processes makes a certificate dir in its temp dir
(`bench_certs`) and passes `--tls-dir` to each (`security_args`); a bench against a
`LocalCluster` or an endpoints file takes the operator's certificate from the
endpoints' "tls" entry. With `--insecure` (a bench's flag for measuring the plaintext
stack, e.g. to compare with results from before TLS) every helper gives None and the
processes get `--insecure`.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from quillcache_core.security.certs import make_certs
from quillcache_core.security.tls import Tls

INSECURE_HELP = (
    "measure the plaintext stack (no certificates, no role checks; development mode), "
    "e.g. to compare with results from before TLS; the default is mutual TLS everywhere"
)


def bench_certs(directory: Path, insecure: bool = False) -> Path | None:
    """A CA and every role's certificate in `directory`/certs; None when insecure."""
    return None if insecure else make_certs(Path(directory) / "certs")


def security_args(certs: Path | None) -> list[str]:
    """The flags every `quillcache <service>` process needs."""
    return ["--insecure"] if certs is None else ["--tls-dir", str(certs)]


def role_tls(certs: Path | None, role: str) -> Tls | None:
    """`role`'s certificates in `certs`; None when insecure."""
    return None if certs is None else Tls.from_dir(certs, role)


def operator_tls(endpoints: dict) -> Tls | None:
    """The operator's certificates an endpoints file names (`quillcache up` writes
    them under "tls"); None for an --insecure cluster."""
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
