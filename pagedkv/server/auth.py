"""API keys and tenants.

Each API key is a tenant. A tenant's id is a hash of its key (the key itself is never stored
in a request or a log), and every request of a tenant is salted with that id in the prefix
cache, so tenants never share KV blocks: a hit (and the `cached_tokens` it reports) can only
come from the caller's own earlier requests. Keys are compared in constant time, and against
every key, so the timing does not tell which key almost matched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable


class ApiKeys:
    """The accepted keys; `tenant(header)` is the caller's tenant id, or None if refused."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys: list[tuple[bytes, str]] = []
        for key in keys:
            if not isinstance(key, str) or not key.strip():
                raise ValueError("an API key must be a non-empty string (an empty key would "
                                 "disable authentication)")
            if key != key.strip() or not key.isascii():
                raise ValueError("an API key must be ASCII without surrounding whitespace")
            self._keys.append((key.encode(), tenant_id(key)))
        if not self._keys:
            raise ValueError("no API key given")

    @property
    def admin(self) -> str:
        """The admin's tenant id: the first key's."""
        return self._keys[0][1]

    def tenant(self, authorization: bytes | None) -> str | None:
        """Tenant of an `Authorization: Bearer KEY` header value (scheme case-insensitive,
        RFC 7235), or None."""
        if authorization is None:
            return None
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        token = token.strip()
        found = None
        for key, tenant in self._keys:  # no early exit: constant time in the key list
            if hmac.compare_digest(token, key):
                found = tenant
        return found


def tenant_id(key: str) -> str:
    return hashlib.sha256(b"pagedkv-tenant\x00" + key.encode()).hexdigest()[:16]


def cache_salt(tenant: str | None, salt: str | None) -> str | None:
    """The prefix-cache salt of a request: the tenant's id, plus the request's own salt."""
    if tenant is None:
        return salt
    return tenant if salt is None else f"{tenant}/{salt}"
