"""Talking to a running cluster with the credentials its endpoints file names.

`quillcache up` (and `LocalCluster.start`) write the operator's client certificate
under "tls"; tenants use their API keys over HTTPS, verifying the gateway by the CA.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx2
import openai

from quillcache_core.security.credentials import operator_context, operator_tls, tenant_context
from quillcache_core.security.tls import Tls, grpc_channel


def https(endpoints: dict) -> ssl.SSLContext | None:
    """For urllib/aiohttp calls to any HTTPS port of the cluster, as the operator."""
    return operator_context(endpoints)


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


def salt_of(certs_dir: Path, tenant: str) -> str:
    """A tenant's cache salt as the gateway computes it: only a holder of the cluster's
    tenant secret can (a test acting for the gateway)."""
    from quillcache_core.security.tenants import tenant_salt

    return tenant_salt(Tls.from_dir(certs_dir, "gateway").secret(), tenant)
