"""`quillcache certs DIR`: a private CA and one certificate per component role.

Every certificate's subject common name is its role (the name etcd's client-cert
auth takes as the user, and the name the services check a caller by). Each carries
the DNS names `quillcache` (the name every QuillCache client verifies a server by),
`localhost`, its role, any `--hosts`, and IP 127.0.0.1, and is good both as a
server and as a client certificate. Keys are EC P-256, written mode 0600.

Layout of DIR::

    ca.pem  ca-key.pem              the certificate authority
    <role>.pem  <role>-key.pem      one pair per role in ROLES
    tenant-secret                   the key of the tenants' cache salts (gateway)
    engine-api-key                  the credential engines demand (gateway, engines)

Run again on the same DIR it keeps what is there and adds what is missing, so a
cluster's certificates survive restarts.

One process's own credentials (`make_instance_credentials`): a directory with only
`ca.pem`, its role's pair under the usual names and the secrets its role reads, the
certificate naming the process as well as its role: common name the role, plus the
URI `quillcache://<role>/<instance>` (`instance_uri`), which `tls.peer_identity` reads.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
import secrets
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The component roles. `root` is etcd's administrator (sets up its users and roles);
# `etcd` is the registry server's own identity; `operator` is a person or a script;
# `monitor` is a metrics scraper (Prometheus): every /metrics takes it, no QuillCache
# RPC does (security/access.py names it nowhere).
ROLES = (
    "gateway",
    "conductor",
    "store",
    "transfer",
    "engine",
    "operator",
    "etcd",
    "root",
    "monitor",
)
SERVER_NAME = "quillcache"
TENANT_SECRET = "tenant-secret"
ENGINE_KEY = "engine-api-key"
VALID_DAYS = 365
# What a process of a role reads beside its pair and the CA certificate.
ROLE_SECRETS = {"gateway": (TENANT_SECRET, ENGINE_KEY), "engine": (ENGINE_KEY,)}
INSTANCE_SCHEME = "quillcache"
_INSTANCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "QuillCache"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _write_secret(path: Path) -> None:
    if path.exists():
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32) + "\n")


def _load_or_make_ca(out: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = out / "ca.pem", out / "ca-key.pem"
    if cert_path.exists() and key_path.exists():
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        return cert, key  # type: ignore[return-value]
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("QuillCache CA"))
        .issuer_name(_name("QuillCache CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS * 5))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def _role_cert(
    role: str,
    hosts: Iterable[str],
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    uris: Iterable[str] = (),
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri) for uri in uris]
    seen: set[str] = set()
    for host in (SERVER_NAME, "localhost", role, "127.0.0.1", *hosts):
        if not host or host in seen:
            continue
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(role))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def make_certs(
    directory: Path | str, hosts: Iterable[str] = (), roles: Iterable[str] = ROLES
) -> Path:
    """Write the CA, each role's pair and the shared secrets into `directory` (kept
    where present); returns the directory."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    ca_cert, ca_key = _load_or_make_ca(out)
    hosts = list(hosts)
    for role in roles:
        cert_path, key_path = out / f"{role}.pem", out / f"{role}-key.pem"
        if cert_path.exists() and key_path.exists():
            continue
        cert, key = _role_cert(role, hosts, ca_cert, ca_key)
        _write_key(key_path, key)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_secret(out / TENANT_SECRET)
    _write_secret(out / ENGINE_KEY)
    return out


def instance_uri(role: str, instance: str) -> str:
    """The URI a process's own certificate carries: `quillcache://<role>/<instance>`."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    if not _INSTANCE_NAME.fullmatch(instance):
        raise ValueError(f"instance name {instance!r}: letters, digits, '.', '_', '-' only")
    return f"{INSTANCE_SCHEME}://{role}/{instance}"


def make_instance_credentials(
    certs: Path | str, directory: Path | str, role: str, instance: str
) -> Path:
    """Write one process's credential directory from the cluster's `certs` (made by
    `make_certs`): `ca.pem`, a pair of its own as `<role>.pem` and `<role>-key.pem`
    naming `instance` (`instance_uri`), and the secrets of ROLE_SECRETS[role]; never
    the CA key, never another pair. Kept while its CA is the cluster's; returns the
    directory, what the process gets as `--tls-dir`."""
    source, out = Path(certs), Path(directory)
    uri = instance_uri(role, instance)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    ca_pem = (source / "ca.pem").read_bytes()
    cert_path, key_path = out / f"{role}.pem", out / f"{role}-key.pem"
    current = (out / "ca.pem").is_file() and (out / "ca.pem").read_bytes() == ca_pem
    if not (current and cert_path.is_file() and key_path.is_file()):
        ca_cert, ca_key = _load_or_make_ca(source)
        cert, key = _role_cert(role, (), ca_cert, ca_key, uris=(uri,))
        _write_key(key_path, key)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (out / "ca.pem").write_bytes(ca_pem)
    for name in ROLE_SECRETS.get(role, ()):
        fd = os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as secret:
            secret.write((source / name).read_bytes())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="quillcache certs",
        description=(
            "Make a private CA and one certificate per component role "
            f"({', '.join(ROLES)}) in DIR, plus the tenant-salt secret and the engine "
            "credential. Keeps whatever DIR already holds."
        ),
    )
    parser.add_argument("dir", help="where to write the certificates and keys")
    parser.add_argument(
        "--hosts",
        default="",
        help="extra host names or IPs every certificate is valid for, comma-separated "
        "(e.g. the compose service names)",
    )
    args = parser.parse_args(argv)
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    out = make_certs(args.dir, hosts)
    print(f"certificates for {', '.join(ROLES)} in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
