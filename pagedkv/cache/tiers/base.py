"""BlockTier: a store of full KV blocks outside the device pool, keyed by chained hash.

A tier stores one record per block (see record.py) under (namespace, block hash); the
namespace names the model fingerprint and, with a TierKey, the key (replicas with another key or
none never see, count as corrupt, or clear these records). It never raises on I/O trouble during
serving: an unreachable store, a full disk or a corrupt entry (any record that fails to decode or
authenticate, or an entry that is not a regular file or is larger than any valid record) is
counted in `stats`, dropped from the store, logged at most once per `log_interval` seconds, and
reads as a miss (so the engine recomputes); one bad entry never fails the others of a batch.
With a key every record is sealed for the tenant (the request's cache salt) that wrote it and
opens only for that tenant. Subclasses implement the raw byte operations; this class does the
encoding, checking and counting. Thread-safe as far as the subclass' raw operations are (the background
writer calls `put_many` while the engine thread calls `get_many`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from pagedkv.cache.tiers.record import Layout, Parts, decode, encode, max_size
from pagedkv.cache.tiers.seal import TierKey
from pagedkv.errors import CorruptEntryError

log = logging.getLogger("pagedkv.tier")


BACKGROUND_NICE = 19


def background_priority() -> None:
    """Lower the calling thread's CPU priority (Linux: nice applies per thread), for the tier
    writer: its CPU work (record checksums, copies, the Redis client's parsing) would otherwise
    take a core from the engine's OpenMP team in the middle of a step, and every parallel
    region waits for the descheduled worker. A write is never waited for, so it can run in the
    gaps (a full queue drops writes, counted)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass


@dataclass(slots=True)
class TierStats:
    hit_blocks: int = 0
    miss_blocks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    write_drops: int = 0  # blocks not written because the write queue was full
    checksum_failures: int = 0  # corrupt, forged, truncated or mismatched entries (never served)
    errors: int = 0  # I/O or connection errors
    read_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class BlockTier(ABC):
    """contains / get / put of one block's parts, plus batched get_many / put_many."""

    scheme = "tier"

    def __init__(self, fingerprint: bytes, *, key: TierKey | None = None,
                 log_interval: float = 10.0) -> None:
        self.fingerprint = fingerprint
        self.tier_key = key
        self.namespace = fingerprint.hex()[:16] if key is None else key.namespace(fingerprint)
        self.stats = TierStats()
        self.log_interval = log_interval
        self._last_log: dict[str, float] = {}
        self._lock = threading.Lock()  # guards stats
        self.events = None  # a KVEventRecorder: records written, evicted or dropped (medium)

    # --- public API ---------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        try:
            return self._contains_raw(key)
        except Exception as exc:  # noqa: BLE001 - a tier never fails serving
            self._error("contains", exc)
            return False

    def get(self, key: bytes, layout: Layout, tenant: object = None) -> Parts | None:
        return self.get_many([key], layout, tenant)[0]

    def put(self, key: bytes, parts: Parts, tenant: object = None) -> None:
        self.put_many([(key, parts, tenant)])

    def get_many(self, keys: Sequence[bytes], layout: Layout,
                 tenant: object = None) -> list[Parts | None]:
        """Each key's parts, or None (absent, unreachable, or corrupt: counted, dropped)."""
        t0 = time.perf_counter()
        limit = max_size(layout)
        try:
            blobs = self._get_raw(keys, limit)
        except Exception as exc:  # noqa: BLE001
            self._error("get", exc)
            blobs = [None] * len(keys)
        out: list[Parts | None] = []
        nbytes = bad = 0
        for key, blob in zip(keys, blobs, strict=True):
            parts = None
            try:
                if isinstance(blob, CorruptEntryError):
                    raise blob
                if blob is not None and len(blob) > limit:
                    raise CorruptEntryError(f"{len(blob)} bytes, larger than any record")
                if blob is not None:
                    parts = decode(blob, self.fingerprint, key, layout, self.tier_key, tenant)
                    nbytes += len(blob)
            except CorruptEntryError as exc:
                bad += 1
                self._corrupt(key, exc)
            out.append(parts)
        with self._lock:
            self.stats.checksum_failures += bad
            self.stats.bytes_read += nbytes
            self.stats.read_seconds += time.perf_counter() - t0
        return out

    def put_many(self, items: Sequence[tuple[bytes, Parts] | tuple[bytes, Parts, object]]) -> None:
        """Write (key, parts) or (key, parts, tenant) items; the tenant seals the record."""
        if not items:
            return
        blobs = [(it[0], encode(self.fingerprint, it[0], it[1], self.tier_key,
                                it[2] if len(it) > 2 else None)) for it in items]
        try:
            self._put_raw(blobs)
        except Exception as exc:  # noqa: BLE001
            self._error("put", exc)
            return
        with self._lock:
            self.stats.blocks_written += len(blobs)
            self.stats.bytes_written += sum(len(b) for _, b in blobs)
        if self.events is not None:
            self.events.stored([k for k, _ in blobs], None, None, self.medium)
        self._after_put()

    @property
    def medium(self) -> str:
        """The events' medium name of this tier (its scheme, upper case: DISK, REDIS)."""
        return self.scheme.upper()

    def _after_put(self) -> None:  # noqa: B027 - optional hook
        """After a batch is written and recorded (the disk tier's size cap evicts here, so its
        removals follow the stores)."""

    def _record_removed(self, keys: Sequence[bytes]) -> None:
        if self.events is not None and keys:
            self.events.removed(keys, self.medium)

    def _corrupt(self, key: bytes, exc: CorruptEntryError) -> None:
        self._warn("corrupt", f"ignoring a corrupt KV block {key.hex()[:16]}: {exc}")
        try:
            self._discard(key)
        except Exception as err:  # noqa: BLE001 - dropping is best effort
            self._error("delete", err)
        self._record_removed([key])

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
    def _get_raw(self, keys: Sequence[bytes],
                 max_bytes: int) -> list[bytes | bytearray | CorruptEntryError | None]:
        """Each key's stored bytes; None when absent or unreadable (one key's I/O error never
        fails the others); a CorruptEntryError for an entry that cannot be a record (not a
        regular file, over `max_bytes`)."""

    @abstractmethod
    def _put_raw(self, items: Sequence[tuple[bytes, bytes]]) -> None: ...

    @abstractmethod
    def _contains_raw(self, key: bytes) -> bool: ...

    @abstractmethod
    def _discard(self, key: bytes) -> None: ...

    @abstractmethod
    def _clear_raw(self) -> int: ...
