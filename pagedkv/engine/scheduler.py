"""Continuous batching: which sequences run this step, and how many tokens each computes.

Each step: (1) every running sequence in decode gets one token, preempting the newest running
sequences (recompute: blocks freed, back to the front of the queue) until the blocks they need
are free; (2) running sequences still in prefill continue in chunks; (3) waiting sequences are
admitted first-come-first-served while their prompt's blocks are free, under `max_num_seqs` and a
token budget of `max_num_batched_tokens` per step (a long prompt is chunked, so it never stalls
the decodes already running).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedkv.cache import PagedKVCache
from pagedkv.engine.sequence import Sequence, Status
from pagedkv.errors import OutOfBlocksError


@dataclass(slots=True)
class ScheduledPrefill:
    seq: Sequence
    start: int  # first position computed this step
    end: int  # one past the last


@dataclass(slots=True)
class SchedulerOutput:
    prefills: list[ScheduledPrefill] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(
        self, cache: PagedKVCache, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.num_preemptions = 0
        self._admissions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence already in the cache (a fork) joins the running set."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decodes = self._reserve_decodes()
        if decodes:
            self.cache.append_one_each([s.seq_id for s in decodes], [s.token_ids[-1] for s in decodes])
            for s in decodes:
                s.num_computed = len(s.token_ids)
            out.decodes = decodes
            budget -= len(decodes)
        for s in self.running:
            if budget <= 0:
                break
            if s.is_prefill:
                budget -= self._schedule_chunk(s, budget, out)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if not self._admit(self.waiting[0]):
                break
            s = self.waiting.popleft()
            budget -= self._schedule_chunk(s, budget, out)
        return out

    def _reserve_decodes(self) -> list[Sequence]:
        """Decoding sequences, after preempting the newest until their new blocks fit."""
        cache = self.cache
        while True:
            decodes = [s for s in self.running if not s.is_prefill]
            need = sum(cache.blocks_needed(1, s.seq_id) for s in decodes)
            if need <= cache.num_free_blocks or len(self.running) <= 1:
                return decodes
            self.preempt(self.running[-1])

    def _schedule_chunk(self, s: Sequence, budget: int, out: SchedulerOutput) -> int:
        n = min(len(s.token_ids) - s.num_computed, budget)
        out.prefills.append(ScheduledPrefill(s, s.num_computed, s.num_computed + n))
        s.num_computed += n
        self.cache.mark_computed(s.seq_id, s.num_computed)
        return n

    def _admit(self, s: Sequence) -> bool:
        """Allocate the blocks of a waiting sequence's tokens; False (nothing changed) if short."""
        try:
            cached = self.cache.create(s.seq_id, s.token_ids, extra_key=s.request.cache_salt,
                                       computed=False, reserve=self._headroom())
        except OutOfBlocksError:
            return False
        if s.request.first_token_time is None and s.index == 0:
            s.request.num_cached_tokens = cached
            s.request.num_tier_cached_tokens = self.cache.seq(s.seq_id).tier_tokens
        s.num_computed = cached
        s.status = Status.RUNNING
        self._admissions += 1
        s.admitted = self._admissions
        self.running.append(s)
        return True

    def _headroom(self) -> int:
        """Blocks to keep free when admitting: about one step of growth for the running
        decodes, so a new prompt does not take the blocks they need next (and get preempted
        straight away, its prefill wasted)."""
        if not self.running:
            return 0
        return min(len(self.running) // self.cache.block_size + 1, self.cache.num_blocks // 100 + 1)

    def preempt(self, s: Sequence) -> None:
        """Recompute preemption: free the blocks, requeue at the front."""
        self.running.remove(s)
        self.cache.free(s.seq_id)
        s.num_computed = 0
        s.status = Status.WAITING
        self.waiting.appendleft(s)
        self.num_preemptions += 1

    def finish(self, s: Sequence) -> None:
        """A finished or aborted sequence leaves; its blocks go back at once."""
        if s in self.running:
            self.running.remove(s)
        elif s in self.waiting:
            self.waiting.remove(s)
        if s.seq_id in self.cache:
            self.cache.free(s.seq_id)
        s.status = Status.FINISHED
