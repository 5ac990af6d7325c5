"""`redis://host:port/db`: blocks in a Redis shared by every replica (redis-py, pipelined).

Keys are `pagedkv:<namespace>:<block hash>` (the namespace names the model fingerprint and the
tier key, if any); values are checksummed (no key) or sealed records with a TTL
(`ttl` seconds, default a day). The memory cap is Redis' own (`maxmemory` plus an LRU
`maxmemory-policy`): the tier never counts bytes itself. When Redis is unreachable, every call
is a miss for `retry_after` seconds (no connection attempt, no stall of the engine step), errors
are counted and logged once per interval, and the next call after that retries: redis-py's pool
reconnects when Redis is back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from pagedkv.cache.tiers.base import BlockTier


class RedisTier(BlockTier):
    scheme = "redis"

    def __init__(self, url: str, fingerprint: bytes, *, ttl: int | None = 86400,
                 retry_after: float = 1.0, timeout: float = 2.0, **kw: object) -> None:
        super().__init__(fingerprint, **kw)
        import redis

        self.url = url
        self.ttl = ttl
        self.retry_after = retry_after
        self.prefix = b"pagedkv:" + self.namespace.encode() + b":"
        self.client = redis.Redis.from_url(url, socket_timeout=timeout,
                                           socket_connect_timeout=min(timeout, 1.0))
        self._down_until = 0.0
        self._dlock = threading.Lock()
        try:
            self.client.ping()
        except Exception as exc:  # noqa: BLE001 - down at start: keep going, retry later
            self._error("connect", exc)

    def describe(self) -> str:
        return self.url

    def key(self, h: bytes) -> bytes:
        return self.prefix + h.hex().encode()

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _error(self, op: str, exc: BaseException) -> None:
        with self._dlock:
            self._down_until = time.monotonic() + self.retry_after
        super()._error(op, exc)

    def _guard(self) -> None:
        if self.is_down:
            raise ConnectionError("redis marked down; retrying later")

    # --- raw operations -----------------------------------------------------------------------

    def _get_raw(self, keys: Sequence[bytes], max_bytes: int) -> list[bytes | None]:
        if self.is_down:
            return [None] * len(keys)
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.get(self.key(k))
        return pipe.execute()

    def _put_raw(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        self._guard()
        pipe = self.client.pipeline(transaction=False)
        for k, blob in items:
            pipe.set(self.key(k), blob, ex=self.ttl)
        pipe.execute()

    def _contains_raw(self, key: bytes) -> bool:
        if self.is_down:
            return False
        return bool(self.client.exists(self.key(key)))

    def _discard(self, key: bytes) -> None:
        try:
            self.client.delete(self.key(key))
        except Exception as exc:  # noqa: BLE001
            self._error("delete", exc)

    def _clear_raw(self) -> int:
        self._guard()
        n = 0
        batch = []
        for k in self.client.scan_iter(match=self.prefix + b"*", count=500):
            batch.append(k)
            if len(batch) >= 500:
                n += self.client.delete(*batch)
                batch = []
        if batch:
            n += self.client.delete(*batch)
        return n

    def close(self) -> None:
        self.client.close()
