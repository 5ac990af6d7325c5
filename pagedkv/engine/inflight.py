"""In-flight prefix dedup: a waiting prompt that shares a full block with a prefill still in
flight waits for that block to be computed, then is admitted with it as a prefix hit.

Without this, requests that arrive together with a common prefix (eight questions about one
document) are admitted in the same step, before any shared block exists, and each computes the
prefix again. SGLang's in-batch prefix caching does the same job.

Rules (all exact: a hit serves the very K/V a fresh prefill would compute):
- the in-flight set holds the block hashes (salt included, read from each sequence's chain) of every running sequence's blocks
  that are not cached yet but will be once its prefill gets there; rebuilt each step, extended
  by each sequence admitted this step;
- a waiting sequence is held when the first block it would have to compute (the one after its
  current prefix hit) is in that set. So it waits at most for the leader's prefill of the shared
  part; when the leader finishes, is aborted or preempted, its hashes leave the set and the
  held sequence goes on (with whatever is cached by then);
- sharing less than one full block, or under another salt, never holds anyone.
"""

from __future__ import annotations

from pagedkv.cache import PagedKVCache
from pagedkv.engine.sequence import Sequence, Status


class InflightPrefixes:
    """The scheduler's in-flight set. `begin_step` once per step, `hold` for each waiting
    sequence considered, `add_leader` for each one admitted, `forget` for one that leaves.
    Reads each sequence's own hash chain (`Sequence.chain`): nothing is hashed here."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self._pending: set[bytes] = set()  # hashes some leader's prefill will register
        self._leaders: dict[int, tuple[Sequence, list[bytes]]] = {}
        self._held_at: dict[int, int] = {}  # held seq_id -> cached tokens when first held
        self.requests_held = 0
        self.tokens_saved = 0

    def _limit(self, s: Sequence) -> int:
        """Blocks of s's chain a prefix hit could serve (the last token is always computed)."""
        return (s.num_ctx - 1) // self.cache.block_size

    def begin_step(self) -> None:
        """Rebuild the set from the leaders still running whose blocks are not all cached."""
        self._pending.clear()
        for sid, (s, chain) in list(self._leaders.items()):
            i = self.cache.cached_prefix_len(chain)
            if s.status is not Status.RUNNING or i == len(chain):
                del self._leaders[sid]  # done, aborted or preempted: it holds no one any more
            else:
                self._pending.update(chain[i:])

    def add_leader(self, s: Sequence) -> None:
        """`s` was just admitted: its blocks not cached yet are in flight until it computes them."""
        assert s.chain is not None, "in-flight dedup needs prefix caching"
        chain = s.chain.hashes[: self._limit(s)]
        i = self.cache.cached_prefix_len(chain)
        if i < len(chain):
            self._leaders[s.seq_id] = (s, chain)
            self._pending.update(chain[i:])

    def hold(self, s: Sequence) -> bool:
        """Should waiting `s` wait for a block another prefill is computing?"""
        if not self._pending or s.chain is None:
            return False
        hashes, limit = s.chain.hashes, self._limit(s)
        i = self.cache.cached_prefix_len(hashes, limit)
        if i < min(limit, len(hashes)) and hashes[i] in self._pending:
            if s.seq_id not in self._held_at:
                self._held_at[s.seq_id] = i * self.cache.block_size
                self.requests_held += 1
            return True
        return False

    def admitted(self, s: Sequence, cached: int) -> None:
        """Count the prompt tokens a held sequence did not have to compute."""
        first = self._held_at.pop(s.seq_id, None)
        if first is not None:
            self.tokens_saved += max(0, cached - first)

    def forget(self, s: Sequence) -> None:
        self._held_at.pop(s.seq_id, None)
