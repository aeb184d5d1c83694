"""The test session's certificates: one CA and every role's pair, made once.

Every test that talks to a QuillCache process does it with these, as the role the
call needs (a gateway plans, an engine puts blocks, an operator reads stats).
"""

from __future__ import annotations

import functools
import ssl
import tempfile
from pathlib import Path

from quillcache_core.security.certs import make_certs
from quillcache_core.security.tls import Tls, grpc_channel


@functools.cache
def certs_dir() -> Path:
    """The session's certificate directory (made on first use, removed at exit)."""
    holder = tempfile.TemporaryDirectory(prefix="qc-test-certs-")
    certs_dir._holder = holder  # type: ignore[attr-defined] - kept alive for the session
    return make_certs(Path(holder.name) / "certs")


def tls(role: str = "operator") -> Tls:
    return Tls.from_dir(certs_dir(), role)


def channel(address: str, role: str = "operator", *, aio: bool = False, options=()):
    """A mutual-TLS gRPC channel to `address` as `role` (sync unless `aio`)."""
    return grpc_channel(address, tls(role), options, aio=aio)


def client_context(role: str = "operator") -> ssl.SSLContext:
    """An SSL context for HTTPS to a cluster port (metrics, engines) as `role`."""
    return tls(role).client_context()


def engine_auth() -> dict[str, str]:
    """The header engines demand: the gateway's engine credential."""
    return {"Authorization": f"Bearer {tls('gateway').engine_key()}"}


def gateway_session(**kwargs):
    """An aiohttp session that talks to engines as the gateway does (its certificate
    and the engine credential)."""
    import aiohttp

    headers = {**engine_auth(), **kwargs.pop("headers", {})}
    connector = aiohttp.TCPConnector(ssl=client_context("gateway"))
    return aiohttp.ClientSession(connector=connector, headers=headers, **kwargs)


def grpcurl_args(role: str = "operator") -> list[str]:
    """grpcurl's flags for a mutual-TLS call as `role`."""
    t = tls(role)
    return ["-cacert", str(t.ca), "-cert", str(t.cert), "-key", str(t.key)]
