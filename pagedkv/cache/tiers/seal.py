"""TierKey: the server key that authenticates and encrypts KV tier records (`--kv-tier-key`).

One secret (at least 16 bytes; `openssl rand -hex 32`) shared by the replicas that share a
tier. Every record is sealed with AES-256-GCM under a key derived per tenant,
HKDF-SHA256(secret, info = tenant), with a fresh random 96-bit nonce and the record's model
fingerprint and block hash as associated data. Invariants:
- without the secret, a store reader learns nothing of a record but its length, and cannot
  forge or alter one (a failed tag is a corrupt entry: counted, dropped, recomputed);
- one tenant's derived key never opens another tenant's record, nor a record moved to another
  block hash or model;
- `key_id` names the secret (an HMAC of a constant, never the secret) so that replicas with
  another key, or none, use another namespace of the store and never see these records.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from functools import lru_cache
from pathlib import Path

from pagedkv.errors import CorruptEntryError, TierConfigError

NONCE = 12
TAG = 16
MIN_SECRET = 16
_INFO = b"pagedkv kv-tier record v2\x00"


def tenant_bytes(tenant: object) -> bytes:
    """The tenant's HKDF info: a request's cache salt (tenant id, or tenant/salt), or none."""
    return b"\x00" if tenant is None else b"\x01" + str(tenant).encode("utf-8", "surrogatepass")


class TierKey:
    """A tier secret; `seal`/`open` one record body for one tenant."""

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes | bytearray) or len(secret) < MIN_SECRET:
            raise TierConfigError(f"a KV tier key needs at least {MIN_SECRET} bytes of secret "
                                  "(e.g. `openssl rand -hex 32`)")
        self._secret = bytes(secret)
        self.key_id = hmac.new(self._secret, b"pagedkv kv-tier key id", "sha256").digest()[:8]
        self._aead = lru_cache(maxsize=4096)(self._derive)

    def __repr__(self) -> str:  # never the secret
        return f"TierKey(id={self.key_id.hex()})"

    @classmethod
    def parse(cls, text: str) -> TierKey:
        """A key written in hex or base64 (TierConfigError otherwise)."""
        text = text.strip()
        try:
            secret = bytes.fromhex(text)
        except ValueError:
            try:
                secret = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                raise TierConfigError("a KV tier key is hex or base64 text") from None
        return cls(secret)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> TierKey:
        try:
            text = Path(path).read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as exc:
            raise TierConfigError(f"cannot read the KV tier key file {path}: {exc}") from None
        return cls.parse(text)

    def _derive(self, tenant: bytes):  # noqa: ANN202 - an AESGCM
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO + tenant)
        return AESGCM(hkdf.derive(self._secret))

    def namespace(self, fingerprint: bytes) -> str:
        """16 hex digits naming (fingerprint, this key) in a store."""
        return hashlib.sha256(fingerprint + self.key_id).hexdigest()[:16]

    def seal(self, body: bytes, aad: bytes, tenant: object) -> bytes:
        """nonce | ciphertext | tag of `body` for `tenant`."""
        nonce = os.urandom(NONCE)
        return nonce + self._aead(tenant_bytes(tenant)).encrypt(nonce, body, aad)

    def open(self, sealed: memoryview, aad: bytes, tenant: object) -> bytearray:
        """The body of `seal`'s output (a fresh writable buffer); CorruptEntryError when the
        tag fails (another key or tenant, altered, truncated or moved)."""
        from cryptography.exceptions import InvalidTag

        if len(sealed) < NONCE + TAG:
            raise CorruptEntryError("sealed record too short")
        out = bytearray(len(sealed) - NONCE - TAG)
        try:
            self._aead(tenant_bytes(tenant)).decrypt_into(sealed[:NONCE], sealed[NONCE:], aad, out)
        except InvalidTag:
            raise CorruptEntryError("record fails authentication (another key or tenant, or "
                                    "altered)") from None
        return out
