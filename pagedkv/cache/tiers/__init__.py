"""KV blocks outside the device pool: a disk or Redis tier shared across restarts and replicas.

`open_tier(spec, fingerprint)` builds a tier from `disk:DIR[?max_size=10GiB]` or
`redis://host:port/db[?ttl=SECONDS]`. A disk tier that cannot be used (unwritable directory,
full disk) logs a clear warning and returns None: serving continues without it.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit, urlunsplit

from pagedkv.cache.tiers.base import BlockTier, TierStats, log
from pagedkv.cache.tiers.connector import TierConnector
from pagedkv.cache.tiers.disk import DiskTier
from pagedkv.cache.tiers.fingerprint import fingerprint, weights_digest
from pagedkv.cache.tiers.record import decode, encode
from pagedkv.cache.tiers.redis_tier import RedisTier
from pagedkv.cache.tiers.writer import BackgroundWriter
from pagedkv.errors import TierConfigError, TierUnavailableError


def _size(text: str) -> int:
    from pagedkv.engine.llm_engine import parse_size

    return parse_size(text)


def open_tier(spec: str, fp: bytes, **kw: float) -> BlockTier | None:
    """A tier from its spec; None (with a warning) when a disk tier cannot be used."""
    if not isinstance(spec, str) or not spec:
        raise TierConfigError("a KV tier is 'disk:DIR' or 'redis://host:port/db'")
    if spec.startswith("disk:"):
        path, _, query = spec[5:].partition("?")
        opts = dict(parse_qsl(query))
        bad = set(opts) - {"max_size"}
        if not path or bad:
            raise TierConfigError(f"bad disk tier {spec!r} (disk:DIR[?max_size=10GiB])")
        cap = _size(opts["max_size"]) if "max_size" in opts else None
        try:
            return DiskTier(path, fp, max_bytes=cap, **kw)
        except TierUnavailableError as exc:
            log.warning("%s; serving continues without the KV tier", exc)
            return None
    if spec.startswith(("redis://", "rediss://", "unix://")):
        parts = urlsplit(spec)
        opts = dict(parse_qsl(parts.query))
        bad = set(opts) - {"ttl"}
        if bad:
            raise TierConfigError(f"unknown redis tier option(s) {sorted(bad)} (only ttl)")
        try:
            ttl = int(opts["ttl"]) if "ttl" in opts else 86400
        except ValueError:
            raise TierConfigError(f"ttl must be whole seconds, got {opts['ttl']!r}") from None
        if ttl < 1:
            raise TierConfigError("ttl must be >= 1 second")
        url = urlunsplit(parts._replace(query=""))
        return RedisTier(url, fp, ttl=ttl, **kw)
    raise TierConfigError(f"unknown KV tier {spec!r}: use 'disk:DIR' or 'redis://host:port/db'")


__all__ = [
    "BackgroundWriter",
    "BlockTier",
    "DiskTier",
    "RedisTier",
    "TierConnector",
    "TierStats",
    "decode",
    "encode",
    "fingerprint",
    "open_tier",
    "weights_digest",
]
