"""Talking to a running cluster with the credentials its endpoints file names.

`quillcache up` (and `LocalCluster.start`) write the operator's client certificate
under "tls"; tenants use their API keys over HTTPS, verifying the gateway by the CA.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx2
import openai

from quillcache_core.security.tls import Tls, grpc_channel


def operator_tls(endpoints: dict) -> Tls | None:
    found = endpoints.get("tls")
    if not found:
        return None
    return Tls(Path(found["ca"]), Path(found["cert"]), Path(found["key"]), "operator")


def https(endpoints: dict) -> ssl.SSLContext | None:
    """For urllib/aiohttp calls to any HTTPS port of the cluster, as the operator."""
    found = operator_tls(endpoints)
    return found.client_context() if found else None


def tenant_context(endpoints: dict) -> ssl.SSLContext | None:
    """What a tenant has: the CA to verify the gateway by, no client certificate."""
    found = endpoints.get("tls")
    return ssl.create_default_context(cafile=found["ca"]) if found else None


def openai_client(endpoints: dict, tenant: str = "acme", **kwargs) -> openai.OpenAI:
    context = tenant_context(endpoints)
    return openai.OpenAI(
        base_url=endpoints["gateway_url"] + "/v1",
        api_key=endpoints["api_keys"][tenant],
        http_client=httpx2.Client(verify=context if context else True, timeout=120),
        **kwargs,
    )


def conductor_channel(endpoints: dict, *, aio: bool = False):
    """A gRPC channel to the conductor as the operator (Stats, Locate)."""
    return grpc_channel(endpoints["conductor"], operator_tls(endpoints), aio=aio)


def as_gateway(certs_dir: Path) -> tuple[ssl.SSLContext, dict[str, str]]:
    """What a test needs to call an engine straight, as the gateway does: the gateway's
    certificate and the engine credential (both in the cluster's certificate dir)."""
    gateway = Tls.from_dir(certs_dir, "gateway")
    return gateway.client_context(), {"Authorization": f"Bearer {gateway.engine_key()}"}


def salt_of(certs_dir: Path, tenant: str) -> str:
    """A tenant's cache salt as the gateway computes it: only a holder of the cluster's
    tenant secret can (a test acting for the gateway)."""
    from quillcache_core.security.tenants import tenant_salt

    return tenant_salt(Tls.from_dir(certs_dir, "gateway").secret(), tenant)
