"""Tier read-ahead in the scheduler: a waiting sequence's KV tier blocks are fetched off the
engine thread, and it is admitted when they have arrived or its deadline has passed.

Rules:
- the first time admission considers a waiting sequence, the tier blocks that would follow
  its device hits are asked for (`PagedKVCache.read_ahead`: the reader thread fetches and
  verifies them); the sequence is held, keeping its place in line (later prompts go ahead),
  while the read runs and its deadline is ahead (`timeout` seconds after the ask, moved on by
  each batch of blocks that arrives: a store that answers is waited for);
- then it is admitted with what has arrived (`try_create(tier_read=...)` copies those blocks
  into the pool on the engine thread) and computes the rest: a stalled store costs the
  request at most `timeout` seconds of TTFT and never another stream's next token;
- the read is dropped once its sequence is admitted, finishes or is aborted; a sequence that
  could not be admitted (no free blocks) keeps its read and tries again.
"""

from __future__ import annotations

import time

from pagedkv.cache import PagedKVCache
from pagedkv.cache.tiers.reader import TierRead
from pagedkv.engine.sequence import Sequence


class TierReads:
    """The scheduler's read-aheads: `hold` for each waiting sequence considered, `read_of`
    at its admission, `forget` once admitted or gone; `pending`/`wait` for an idle engine."""

    def __init__(self, cache: PagedKVCache, timeout: float) -> None:
        self.cache = cache
        self.timeout = timeout
        self._reads: dict[int, TierRead] = {}  # seq_id -> TierRead
        self.requests_held = 0
        self.timeouts = 0  # reads still running at their deadline (the rest was computed)

    def hold(self, s: Sequence) -> bool:
        """Should waiting `s` wait for its tier read? Starts the read on first sight."""
        if self.cache.tier is None or s.chain is None:
            return False
        read = self._reads.get(s.seq_id)
        if read is None:
            read = self.cache.read_ahead(s.chain, self.timeout)
            if read is None:
                return False
            self._reads[s.seq_id] = read
            self.requests_held += 1
        return read.waiting

    def read_of(self, s: Sequence) -> TierRead | None:
        return self._reads.get(s.seq_id)

    def forget(self, s: Sequence) -> None:
        read = self._reads.pop(s.seq_id, None)
        if read is not None:
            if not read.done:
                self.timeouts += 1
            read.cancel()

    def pending(self) -> list[TierRead]:
        return [r for r in self._reads.values() if r.waiting]

    def wait(self) -> None:
        """Nothing else to run: block until a pending read is done or the earliest deadline."""
        pending = self.pending()
        if pending:
            left = min(r.deadline for r in pending) - time.monotonic()
            self.cache.wait_reads(pending, left)
