"""Context shift (llama.cpp's): a sequence that fills the context goes on generating.

When a running sequence's context reaches max_model_len, the scheduler's post-step bookkeeping
keeps its first `n_keep` tokens (a system prompt), drops the next `n_discard` (default: half of
the rest, as llama.cpp) and moves the others down: `PagedKVCache.remove` then `shift`, which
re-rotates their K by -n_discard through the model's RoPE callback, so every cached K is the K of
RoPE at its new position. The Sequence keeps all its tokens (outputs, penalties and text are
unchanged); `n_keep` / `n_dropped` say which of them the context holds. A prompt longer than the
context is cut the same way before it is computed (kept: n_keep + the latest tokens).

Invariants: a shifted sequence's context is token_ids[:n_keep] + token_ids[n_keep + n_dropped:]
with n_keep fixed per sequence; its positions stay below max_model_len; a shift is all or
nothing (it is skipped, and the sequence finishes with "length", when the blocks that copying
shared blocks may take are not free).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.cache import PagedKVCache
from pagedkv.engine.sequence import Sequence
from pagedkv.errors import CacheConfigError

SHIFT_PROMPT_FACTOR = 8  # prompts up to 8 contexts long are cut; longer ones are refused


@dataclass(frozen=True, slots=True)
class ContextShift:
    n_keep: int = 0
    n_discard: int | None = None  # None: half of what follows n_keep

    def check(self, max_model_len: int, capacity: int) -> None:
        """n_keep leaves something to drop; a full context fits the whole cache."""
        n, k, d = max_model_len, self.n_keep, self.n_discard
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n - 3:
            raise CacheConfigError(f"n_keep must be an int in [0, {n - 3}], got {k!r}")
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise CacheConfigError(f"n_discard must be a positive int or None, got {d!r}")
        if n > capacity:
            raise CacheConfigError(f"context shift needs max_model_len ({n}) within the KV cache "
                                   f"({capacity} tokens)")

    def cut_prompt(self, s: Sequence, max_model_len: int) -> None:
        """A prompt at or over the context: keep n_keep + the latest half of the rest."""
        n = len(s.token_ids)
        if n >= max_model_len:
            tail = (max_model_len - self.n_keep) // 2
            s.n_keep, s.n_dropped = self.n_keep, n - self.n_keep - tail

    def apply(self, cache: PagedKVCache, s: Sequence) -> int:
        """Shift s (its newest token appended, not yet computed). Returns the tokens dropped;
        0, with nothing changed, when there is nothing to drop or too few free blocks."""
        n = s.num_ctx - 1  # tokens in the cache
        room = n - self.n_keep
        drop = room // 2 if self.n_discard is None else min(self.n_discard, room)
        if drop < 1 or (s.n_dropped and s.n_keep != self.n_keep) or s.num_scheduled < n:
            return 0
        bs = cache.block_size
        if cache.num_free_blocks < 2 * (-(-n // bs) - self.n_keep // bs):
            return 0  # remove + shift may copy every shared block they touch
        cache.mark_computed(s.seq_id, n)  # the step's K/V are written (commit ran before)
        cache.remove(s.seq_id, self.n_keep, self.n_keep + drop)  # s.chain loses them too
        cache.shift(s.seq_id, self.n_keep, n - drop, -drop)
        s.num_scheduled -= drop
        s.n_keep, s.n_dropped = self.n_keep, s.n_dropped + drop
        return drop
