"""In-flight prefix dedup: a waiting prompt that shares a full block with a prefill still in
flight waits for that block to be computed, then is admitted with it as a prefix hit.

Without this, requests that arrive together with a common prefix (eight questions about one
document) are admitted in the same step, before any shared block exists, and each computes the
prefix again. SGLang's in-batch prefix caching does the same job.

Rules (all exact: a hit serves the very K/V a fresh prefill would compute):
- the in-flight set holds the block hashes (salt included) of every running sequence's blocks
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
from pagedkv.cache.hashing import chain_hashes
from pagedkv.engine.sequence import Sequence, Status


class InflightPrefixes:
    """The scheduler's in-flight set. `begin_step` once per step, `hold` for each waiting
    sequence considered, `add_leader` for each one admitted, `forget` for one that leaves."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self._pending: set[bytes] = set()  # hashes some leader's prefill will register
        self._leaders: dict[int, tuple[Sequence, list[bytes]]] = {}
        self._chains: dict[int, tuple[int, list[bytes]]] = {}  # seq_id -> (len, hashes) cache
        self._held_at: dict[int, int] = {}  # held seq_id -> cached tokens when first held
        self.requests_held = 0
        self.tokens_saved = 0

    def _chain(self, s: Sequence) -> list[bytes]:
        """Hashes of the blocks a prefix hit could serve `s` (computed once per length)."""
        n = s.num_ctx
        got = self._chains.get(s.seq_id)
        if got is None or got[0] != n:
            bs = self.cache.block_size
            got = (n, chain_hashes(s.ctx_ids(0, n), bs, s.request.cache_salt, max_blocks=(n - 1) // bs))
            self._chains[s.seq_id] = got
        return got[1]

    def _cached_blocks(self, chain: list[bytes]) -> int:
        lookup = self.cache.pool.lookup
        i = 0
        while i < len(chain) and lookup(chain[i]) is not None:
            i += 1
        return i

    def begin_step(self) -> None:
        """Rebuild the set from the leaders still running whose blocks are not all cached."""
        self._pending.clear()
        for sid, (s, chain) in list(self._leaders.items()):
            i = self._cached_blocks(chain)
            if s.status is not Status.RUNNING or i == len(chain):
                del self._leaders[sid]  # done, aborted or preempted: it holds no one any more
            else:
                self._pending.update(chain[i:])

    def add_leader(self, s: Sequence) -> None:
        """`s` was just admitted: its blocks not cached yet are in flight until it computes them."""
        chain = self._chain(s)
        self._chains.pop(s.seq_id, None)
        i = self._cached_blocks(chain)
        if i < len(chain):
            self._leaders[s.seq_id] = (s, chain)
            self._pending.update(chain[i:])

    def hold(self, s: Sequence) -> bool:
        """Should waiting `s` wait for a block another prefill is computing?"""
        if not self._pending:
            return False
        chain = self._chain(s)
        i = self._cached_blocks(chain)
        if i < len(chain) and chain[i] in self._pending:
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
        self._chains.pop(s.seq_id, None)
        self._held_at.pop(s.seq_id, None)
