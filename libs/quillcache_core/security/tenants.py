"""Tenants' cache salts: a keyed hash of the tenant, never its name.

The salt goes into every block key of the tenant (and to vLLM as `cache_salt`), so
two tenants never share a block and nobody can compute another tenant's keys, or
probe whether a prompt of theirs is cached, without the cluster's tenant secret
(`quillcache certs` makes it; only the gateway reads it).
"""

from __future__ import annotations

import hashlib
import hmac

SALT_HEX_DIGITS = 32  # 128 bits


def tenant_salt(secret: bytes, tenant: str) -> str:
    """HMAC-SHA256 of the tenant under the secret, as 32 hex digits."""
    if not secret:
        raise ValueError("the tenant secret is empty")
    mac = hmac.new(secret, b"quillcache-tenant-salt\0" + tenant.encode("utf-8"), hashlib.sha256)
    return mac.hexdigest()[:SALT_HEX_DIGITS]
