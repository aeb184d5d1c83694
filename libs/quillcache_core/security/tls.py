"""Mutual TLS for every QuillCache port: credentials, channels, and who is calling.

A process knows its certificates by a directory (`quillcache certs` wrote it) and
its role: `Tls.from_dir(dir, role)` reads `ca.pem`, `<role>.pem` and `<role>-key.pem`.
`Tls` is None in `--insecure` mode, and every helper here then gives plaintext.

Servers demand a client certificate signed by the CA; the caller's role is its
certificate's common name (`peer_role`), and a process's own certificate also names the
process (`peer_identity`: the URI `quillcache://<role>/<instance>`). Clients verify
the server's certificate against the CA under the name `quillcache`, which every
certificate carries.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import grpc

from quillcache_core.errors import InvalidArgument
from quillcache_core.process.settings import opt
from quillcache_core.security.certs import (
    ENGINE_KEY,
    INSTANCE_SCHEME,
    ROLES,
    SERVER_NAME,
    TENANT_SECRET,
)


@dataclass(frozen=True)
class Tls:
    """One process's view of the cluster's PKI: the CA and its own pair."""

    ca: Path
    cert: Path
    key: Path
    role: str

    @classmethod
    def from_dir(cls, directory: str | Path, role: str) -> Tls:
        if role not in ROLES:
            raise InvalidArgument(f"unknown role {role!r}; one of {', '.join(ROLES)}")
        base = Path(directory)
        tls = cls(base / "ca.pem", base / f"{role}.pem", base / f"{role}-key.pem", role)
        for path in (tls.ca, tls.cert, tls.key):
            if not path.is_file():
                raise InvalidArgument(
                    f"{path} is missing: make the certificates with `quillcache certs {base}`"
                )
        return tls

    @property
    def directory(self) -> Path:
        return self.ca.parent

    def secret(self, name: str = TENANT_SECRET) -> bytes:
        """A shared secret of the certificate directory (the tenant-salt key, the
        engine credential), stripped of whitespace."""
        path = self.directory / name
        if not path.is_file():
            raise InvalidArgument(f"{path} is missing: run `quillcache certs {self.directory}`")
        return path.read_bytes().strip()

    def engine_key(self) -> str:
        return self.secret(ENGINE_KEY).decode()

    # --- gRPC -----------------------------------------------------------------------

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.ca.read_bytes(),
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.key.read_bytes(),
            certificate_chain=self.cert.read_bytes(),
        )

    # --- asyncio / HTTP ---------------------------------------------------------------

    def server_context(self) -> ssl.SSLContext:
        """For a TLS listener that demands a client certificate from the CA."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.ca))
        ctx.load_cert_chain(str(self.cert), str(self.key))
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """For connecting to a cluster server: its certificate must come from the CA
        (checked by name `quillcache`, see `SERVER_NAME`); ours goes along."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca))
        ctx.load_cert_chain(str(self.cert), str(self.key))
        ctx.check_hostname = False  # the role check replaces it; names differ per deploy
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


@dataclass(frozen=True)
class TlsSettings:
    """The two security settings every service shares (a base of its config)."""

    tls_dir: str = opt(
        "",
        "directory of the cluster's certificates (made by `quillcache certs DIR`): "
        "every port demands a client certificate of its CA and every call is checked "
        "against the caller's role",
    )
    insecure: bool = opt(False, "plaintext, no certificates, no role checks: for development only")

    def __post_init__(self) -> None:
        if not self.tls_dir and not self.insecure:
            raise InvalidArgument(
                "TLS is required: pass --tls-dir DIR (make it with `quillcache certs DIR`), "
                "or --insecure for development"
            )

    def tls(self, role: str) -> Tls | None:
        """This process's certificates as `role`; None in --insecure mode."""
        if self.insecure:
            return None
        return Tls.from_dir(self.tls_dir, role)


def grpc_channel(
    address: str,
    tls: Tls | None,
    options: Sequence[tuple[str, object]] = (),
    *,
    aio: bool = True,
):
    """A channel to a cluster gRPC server: mutual TLS, or plaintext when `tls` is None."""
    options = list(options)
    if tls is None:
        maker = grpc.aio.insecure_channel if aio else grpc.insecure_channel
        return maker(address, options=options)
    options.append(("grpc.ssl_target_name_override", SERVER_NAME))
    maker = grpc.aio.secure_channel if aio else grpc.secure_channel
    return maker(address, tls.channel_credentials(), options=options)


def add_port(server, address: str, tls: Tls | None) -> int:
    """Bind `address` on a grpc(.aio) server: mutual TLS, or plaintext without `tls`."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def role_of_cert(cert: dict | None) -> str | None:
    """The role (common name) in a certificate as `SSLSocket.getpeercert()` gives it."""
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for name, value in rdn:
            if name == "commonName":
                return value
    return None


def peer_role(context) -> str | None:
    """The role of a gRPC call's client (its certificate's common name), or None."""
    try:
        names = context.auth_context().get("x509_common_name")
    except Exception:  # noqa: BLE001 - an insecure server has no auth context
        return None
    if not names:
        return None
    value = names[0]
    return value.decode() if isinstance(value, bytes) else value


class PeerIdentity(NamedTuple):
    """Who a call comes from: its certificate's role, and the process it names ("" for
    a certificate of the whole role, as `quillcache certs` makes)."""

    role: str
    instance: str


def peer_identity(context) -> PeerIdentity | None:
    """The (role, instance) of a gRPC call's client; None on a plaintext server.

    The instance is the `quillcache://<role>/<instance>` URI of the certificate whose
    role is its common name; a certificate with none, or with several, names no
    instance."""
    try:
        auth = context.auth_context()
    except Exception:  # noqa: BLE001 - an insecure server has no auth context
        return None
    names = auth.get("x509_common_name")
    if not names:
        return None
    role = _text(names[0])
    prefix = f"{INSTANCE_SCHEME}://{role}/"
    named = [u[len(prefix) :] for u in map(_text, auth.get("peer_uri", ())) if u.startswith(prefix)]
    return PeerIdentity(role, named[0] if len(named) == 1 and named[0] else "")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
