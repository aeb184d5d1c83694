"""The certificates `quillcache certs` makes, and the tenants' salts."""

from __future__ import annotations

import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from quillcache_core.errors import InvalidArgument
from quillcache_core.security.certs import ROLES, main, make_certs
from quillcache_core.security.tenants import tenant_salt
from quillcache_core.security.tls import Tls

pytestmark = pytest.mark.unit


def load(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_one_certificate_per_role_signed_by_the_ca_with_the_role_as_its_name(tmp_path):
    assert main([str(tmp_path / "certs"), "--hosts", "store-0,10.1.2.3"]) == 0
    out = tmp_path / "certs"
    ca = load(out / "ca.pem")
    for role in ROLES:
        cert = load(out / f"{role}.pem")
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == role
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert {"quillcache", "localhost", role, "store-0"} <= set(
            names.get_values_for_type(x509.DNSName)
        )
        assert {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("10.1.2.3")} <= set(
            names.get_values_for_type(x509.IPAddress)
        )
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
        assert stat.S_IMODE((out / f"{role}-key.pem").stat().st_mode) == 0o600
    for secret in ("tenant-secret", "engine-api-key", "ca-key.pem"):
        assert stat.S_IMODE((out / secret).stat().st_mode) == 0o600


def test_running_again_keeps_what_is_there(tmp_path):
    make_certs(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    (tmp_path / "store.pem").unlink()
    (tmp_path / "store-key.pem").unlink()
    make_certs(tmp_path)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert set(after) == set(before)
    changed = {name for name in before if before[name] != after[name]}
    assert changed == {"store.pem", "store-key.pem"}, "only the missing pair is new"
    load(tmp_path / "store.pem").verify_directly_issued_by(load(tmp_path / "ca.pem"))


def test_a_missing_certificate_or_role_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidArgument, match="quillcache certs"):
        Tls.from_dir(tmp_path, "store")
    make_certs(tmp_path)
    with pytest.raises(InvalidArgument, match="unknown role"):
        Tls.from_dir(tmp_path, "admin")
    assert Tls.from_dir(tmp_path, "gateway").engine_key() == (
        (tmp_path / "engine-api-key").read_text().strip()
    )


def test_a_tenants_salt_is_keyed_never_its_name():
    secret = b"0" * 64
    acme = tenant_salt(secret, "acme")
    assert acme == tenant_salt(secret, "acme"), "stable: the same keys after a restart"
    assert len(acme) == 32 and "acme" not in acme
    assert acme != tenant_salt(secret, "globex")
    assert acme != tenant_salt(b"1" * 64, "acme"), "another cluster's secret, other keys"
    with pytest.raises(ValueError):
        tenant_salt(b"", "acme")


def test_every_method_of_our_services_has_its_roles():
    """A new RPC without a rule would be refused to everyone: list it in RULES."""
    from quillcache.v1 import conductor_pb2, store_pb2, transfer_pb2
    from quillcache_core.security.access import RULES

    for module in (conductor_pb2, store_pb2, transfer_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                name = f"/{service.full_name}/{method.name}"
                assert RULES.get(name), f"{name} has no allowed roles"
