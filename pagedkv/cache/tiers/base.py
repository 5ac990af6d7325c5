"""BlockTier: a store of full KV blocks outside the device pool, keyed by chained hash.

A tier stores one record per block (see record.py) under (model fingerprint, block hash). It
never raises on I/O trouble during serving: an unreachable store, a full disk or a corrupt entry
is counted in `stats`, logged at most once per `log_interval` seconds, and reads as a miss (so the
engine recomputes). Subclasses implement the raw byte operations; this class does the encoding,
checking and counting. Thread-safe as far as the subclass' raw operations are (the background
writer calls `put_many` while the engine thread calls `get_many`).
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from pagedkv.cache.tiers.record import Layout, Parts, decode, encode
from pagedkv.errors import CorruptEntryError

log = logging.getLogger("pagedkv.tier")


@dataclass(slots=True)
class TierStats:
    hit_blocks: int = 0
    miss_blocks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    write_drops: int = 0  # blocks not written because the write queue was full
    checksum_failures: int = 0  # corrupt, truncated or mismatched entries (never served)
    errors: int = 0  # I/O or connection errors
    read_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class BlockTier(ABC):
    """contains / get / put of one block's parts, plus batched get_many / put_many."""

    scheme = "tier"

    def __init__(self, fingerprint: bytes, *, log_interval: float = 10.0) -> None:
        self.fingerprint = fingerprint
        self.stats = TierStats()
        self.log_interval = log_interval
        self._last_log: dict[str, float] = {}
        self._lock = threading.Lock()  # guards stats

    # --- public API ---------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        try:
            return self._contains_raw(key)
        except Exception as exc:  # noqa: BLE001 - a tier never fails serving
            self._error("contains", exc)
            return False

    def get(self, key: bytes, layout: Layout) -> Parts | None:
        return self.get_many([key], layout)[0]

    def put(self, key: bytes, parts: Parts) -> None:
        self.put_many([(key, parts)])

    def get_many(self, keys: Sequence[bytes], layout: Layout) -> list[Parts | None]:
        """Each key's parts, or None (absent, unreachable, or corrupt: counted, dropped)."""
        t0 = time.perf_counter()
        try:
            blobs = self._get_raw(keys)
        except Exception as exc:  # noqa: BLE001
            self._error("get", exc)
            blobs = [None] * len(keys)
        out: list[Parts | None] = []
        nbytes = bad = 0
        for key, blob in zip(keys, blobs, strict=True):
            if blob is None:
                out.append(None)
                continue
            try:
                out.append(decode(blob, self.fingerprint, key, layout))
                nbytes += len(blob)
            except CorruptEntryError as exc:
                bad += 1
                out.append(None)
                self._warn("corrupt", f"ignoring a corrupt KV block {key.hex()[:16]}: {exc}")
                self._discard(key)
        with self._lock:
            self.stats.checksum_failures += bad
            self.stats.bytes_read += nbytes
            self.stats.read_seconds += time.perf_counter() - t0
        return out

    def put_many(self, items: Sequence[tuple[bytes, Parts]]) -> None:
        if not items:
            return
        blobs = [(key, encode(self.fingerprint, key, parts)) for key, parts in items]
        try:
            self._put_raw(blobs)
        except Exception as exc:  # noqa: BLE001
            self._error("put", exc)
            return
        with self._lock:
            self.stats.blocks_written += len(blobs)
            self.stats.bytes_written += sum(len(b) for _, b in blobs)

    def count(self, field: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.stats, field, getattr(self.stats, field) + n)

    def clear(self) -> int:
        """Remove this model's entries; returns how many (best effort on errors)."""
        try:
            return self._clear_raw()
        except Exception as exc:  # noqa: BLE001
            self._error("clear", exc)
            return 0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections/files."""

    def describe(self) -> str:
        return self.scheme

    # --- logging ------------------------------------------------------------------------------

    def _error(self, op: str, exc: BaseException) -> None:
        self.count("errors")
        self._warn(f"error:{op}", f"KV tier {self.describe()}: {op} failed ({exc!r}); "
                   "serving continues, blocks are recomputed")

    def _warn(self, kind: str, msg: str) -> None:
        now = time.monotonic()
        if now - self._last_log.get(kind, -1e18) >= self.log_interval:
            self._last_log[kind] = now
            log.warning(msg)

    # --- raw operations (subclasses) ----------------------------------------------------------

    @abstractmethod
    def _get_raw(self, keys: Sequence[bytes]) -> list[bytes | bytearray | None]: ...

    @abstractmethod
    def _put_raw(self, items: Sequence[tuple[bytes, bytes]]) -> None: ...

    @abstractmethod
    def _contains_raw(self, key: bytes) -> bool: ...

    @abstractmethod
    def _discard(self, key: bytes) -> None: ...

    @abstractmethod
    def _clear_raw(self) -> int: ...
