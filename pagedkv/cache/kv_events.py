"""KVEventRecorder: what the cache and its tiers did to the set of findable blocks, in order.

The cache records an event when a block becomes findable by a prefix lookup (stored: its hash
registered once its K/V are written, or a block loaded from a tier / snapshot), when it stops
being findable (removed: evicted, truncated, rewritten) and when the whole index is emptied
(cleared). A tier records a store once a record is written and a removal when one is evicted
or dropped. Each event names its medium (`DEVICE`: the engine's pool, what vLLM calls "GPU";
`DISK`, `REDIS`: the tiers). The engine takes the device events once per step
(`take`) and publishes them as one batch (engine/kv_events.py); a tier's recorder is drained
by the publisher thread, since tier writes happen on the tier's own thread.

Invariant (tested by replaying the events): applying every event taken so far, in order, to an
empty set of hashes gives exactly the hashes `PagedKVCache.cached_blocks()` lists.

Privacy: a block whose chain carries an extra key (the tenant's cache salt) is published
without its token ids (an empty list): its hash is salted, so no router can match it to
another tenant's prompt, and the ids would only tell a subscriber the tenant's text.

Thread-safe: one lock around the list (the tier's writer thread records while the publisher
thread takes).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

DEVICE, DISK, REDIS = "GPU", "DISK", "REDIS"


@dataclass(slots=True, frozen=True)
class Stored:
    hashes: tuple[bytes, ...]
    parent: bytes | None  # hash of the block before the first one (None: a root, or unknown)
    token_ids: tuple[int, ...]  # len(hashes) * block_size ids, or () when withheld / unknown
    medium: str


@dataclass(slots=True, frozen=True)
class Removed:
    hashes: tuple[bytes, ...]
    medium: str


@dataclass(slots=True, frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


class KVEventRecorder:
    """An ordered list of cache events; a stored event that continues the previous one's chain
    (same medium) and consecutive removals of one medium are merged."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self.recorded = 0  # events recorded since start (merged removals count once)

    def stored(self, hashes: Sequence[bytes], parent: bytes | None,
               token_ids: Sequence[int] | None, medium: str = DEVICE) -> None:
        if not hashes:
            return
        ids = tuple(token_ids) if token_ids else ()
        with self._lock:
            last = self._events[-1] if self._events else None
            if (isinstance(last, Stored) and last.medium == medium and parent == last.hashes[-1]
                    and bool(ids) == bool(last.token_ids)):  # the run goes on: one event
                self._events[-1] = Stored(last.hashes + tuple(hashes), last.parent,
                                          last.token_ids + ids, medium)
                return
            self._events.append(Stored(tuple(hashes), parent, ids, medium))
            self.recorded += 1

    def removed(self, hashes: Sequence[bytes], medium: str = DEVICE) -> None:
        if not hashes:
            return
        with self._lock:
            last = self._events[-1] if self._events else None
            if isinstance(last, Removed) and last.medium == medium:
                self._events[-1] = Removed(last.hashes + tuple(hashes), medium)
                return
            self._events.append(Removed(tuple(hashes), medium))
            self.recorded += 1

    def cleared(self) -> None:
        self._add(Cleared())

    def _add(self, ev: Event) -> None:
        with self._lock:
            self._events.append(ev)
            self.recorded += 1

    def take(self) -> list[Event]:
        """The events recorded since the last take, oldest first (the list is emptied)."""
        with self._lock:
            out, self._events = self._events, []
        return out

    def __len__(self) -> int:
        return len(self._events)
