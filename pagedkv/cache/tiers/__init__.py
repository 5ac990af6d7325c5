"""KV blocks outside the device pool: a disk or Redis tier shared across restarts and replicas.

`open_tier(spec, fingerprint)` builds a tier from `disk:DIR[?max_size=10GiB]` or
`redis://host:port/db[?ttl=SECONDS]`, with an optional TierKey (`key=`) that authenticates and
encrypts every record per tenant (seal.py). A disk tier that cannot be used (unwritable directory,
full disk) logs a clear warning and returns None: serving continues without it.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit, urlunsplit

from pagedkv.cache.sizing import parse_size
from pagedkv.cache.tiers.base import BlockTier, TierStats, log
from pagedkv.cache.tiers.connector import TierConnector
from pagedkv.cache.tiers.disk import DiskTier
from pagedkv.cache.tiers.fingerprint import fingerprint, model_fingerprint, weights_digest
from pagedkv.cache.tiers.record import decode, encode
from pagedkv.cache.tiers.redis_tier import RedisTier
from pagedkv.cache.tiers.seal import TierKey
from pagedkv.cache.tiers.writer import BackgroundWriter
from pagedkv.errors import TierConfigError, TierUnavailableError


def parse_spec(spec: str) -> tuple[str, str, dict[str, int]]:
    """('disk', DIR, {max_bytes}) or ('redis', URL without query, {ttl}); TierConfigError."""
    if not isinstance(spec, str) or not spec:
        raise TierConfigError("a KV tier is 'disk:DIR' or 'redis://host:port/db'")
    if spec.startswith("disk:"):
        path, _, query = spec[5:].partition("?")
        opts = dict(parse_qsl(query))
        if not path or set(opts) - {"max_size"}:
            raise TierConfigError(f"bad disk tier {spec!r} (disk:DIR[?max_size=10GiB])")
        try:
            cap = parse_size(opts["max_size"]) if "max_size" in opts else None
        except ValueError as exc:
            raise TierConfigError(f"max_size: {exc}") from None
        if cap is not None and cap < 1:
            raise TierConfigError("max_size must be positive")
        return "disk", path, {} if cap is None else {"max_bytes": cap}
    if spec.startswith(("redis://", "rediss://", "unix://")):
        parts = urlsplit(spec)
        opts = dict(parse_qsl(parts.query))
        if set(opts) - {"ttl"}:
            raise TierConfigError(f"unknown redis tier option(s) {sorted(set(opts) - {'ttl'})}")
        try:
            ttl = int(opts.get("ttl", 86400))
        except ValueError:
            raise TierConfigError(f"ttl must be whole seconds, got {opts['ttl']!r}") from None
        if ttl < 1:
            raise TierConfigError("ttl must be >= 1 second")
        return "redis", urlunsplit(parts._replace(query="")), {"ttl": ttl}
    raise TierConfigError(f"unknown KV tier {spec!r}: use 'disk:DIR' or 'redis://host:port/db'")


def open_tier(spec: str, fp: bytes, **kw: object) -> BlockTier | None:
    """A tier from its spec; None (with a warning) when a disk tier cannot be used."""
    kind, target, opts = parse_spec(spec)
    if kind == "redis":
        return RedisTier(target, fp, **opts, **kw)
    try:
        return DiskTier(target, fp, **opts, **kw)
    except TierUnavailableError as exc:
        log.warning("%s; serving continues without the KV tier", exc)
        return None


__all__ = [
    "BackgroundWriter",
    "BlockTier",
    "DiskTier",
    "RedisTier",
    "TierConnector",
    "TierKey",
    "TierStats",
    "decode",
    "encode",
    "fingerprint",
    "model_fingerprint",
    "open_tier",
    "parse_spec",
    "weights_digest",
]
