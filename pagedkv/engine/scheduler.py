"""Continuous batching: the engine's only client of the KV cache.

Each step, `schedule()`: (1) every running sequence in decode gets one token slot, preempting the
newest running sequences (recompute: blocks freed, back to the front of the queue) until the
blocks they need are free; (2) running sequences still in prefill continue in chunks; (3) waiting
sequences are admitted first-come-first-served while their prompt's blocks are free, under
`max_num_seqs` and a token budget of `max_num_batched_tokens` per step (a long prompt is chunked,
so it never stalls the decodes already running). A waiting prompt that shares a full block with a
prefill still in flight is held until that block is computed, then admitted as a prefix hit
(`dedup_inflight_prefixes`, see `inflight.py`). The result is a `StepPlan`: everything the
model runner needs, built once.

After the forward pass, `commit(plan)` records the K/V as written (only now do full blocks get
their prefix hashes), and `postprocess(seqs, tokens)` appends the sampled tokens, finishes
sequences on a stop token or a length limit and frees their blocks. If the forward pass fails,
`undo(plan)` puts the step's sequences back in the queue with nothing of theirs cached.
"""

from __future__ import annotations

from collections import deque

from pagedkv.cache import PagedKVCache
from pagedkv.cache.hashing import HashChain
from pagedkv.engine import fair_share
from pagedkv.engine.context_shift import ContextShift
from pagedkv.engine.inflight import InflightPrefixes
from pagedkv.engine.sampler import FAILED
from pagedkv.engine.sequence import Sequence, Status
from pagedkv.engine.spec_decode import SpecDecoder
from pagedkv.engine.step_plan import ScheduledPrefill, StepPlan, build_plan
from pagedkv.engine.tier_reads import TierReads


class Scheduler:
    """Owns the waiting queue and the running set; drives `PagedKVCache` for both.

    Invariants between steps: a running sequence is in the cache with `num_ctx - 1` tokens
    (decode: the newest token is not computed yet) or fewer (prefill); its `num_scheduled`
    counts the context tokens scheduled so far (the cache's `num_written` counts the committed
    ones: K/V written, full blocks hashed).
    A waiting sequence holds no blocks. With prefix caching every sequence has its `chain`
    (built at `add`, copied at `fork`), which the cache and the in-flight set read.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        max_model_len: int | None = None,
        dedup_inflight_prefixes: bool = True,
        context_shift: ContextShift | None = None,
        tier_read_timeout: float = 0.1,
        spec: SpecDecoder | None = None,
    ) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.num_preemptions = 0
        self.num_fair_preemptions = 0  # of those, for another request's fair share
        self._under: set[int] | None = None  # this step's under-quota waiting seq ids
        self.context_shift = context_shift  # None: a full context finishes with "length"
        self.num_context_shifts = 0
        dedup = dedup_inflight_prefixes and cache.enable_prefix_caching
        self.inflight = InflightPrefixes(cache) if dedup else None
        self.tier_reads = TierReads(cache, tier_read_timeout)
        self.spec = spec  # speculative decoding's proposer and policy (None: off)

    # --- queue --------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (after any prompt cut); its hash chain is built here, once."""
        if self.cache.enable_prefix_caching and seq.chain is None:
            seq.chain = HashChain(self.cache.block_size, seq.ctx_ids(0, seq.num_ctx),
                                  seq.request.cache_salt)
        self.waiting.append(seq)

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """`child` (a copy of parent's tokens) shares parent's blocks and joins the running set.
        Returns the number of blocks shared."""
        child.n_keep, child.n_dropped = parent.n_keep, parent.n_dropped
        child.chain = None if parent.chain is None else parent.chain.prefix(len(parent.chain))
        self.cache.fork(parent.seq_id, child.seq_id, chain=child.chain)
        if self.spec is not None:
            self.spec.fork(parent, child)
        child.num_scheduled = parent.num_scheduled
        child.status = Status.RUNNING
        self.running.append(child)
        return self.cache.held_blocks(child.seq_id)

    # --- one step -----------------------------------------------------------------------------

    def schedule(self, speculate: bool = False) -> StepPlan:
        """The step's plan. `speculate` (engine.step with speculative decoding on): decoding
        sequences may also verify draft tokens, with what the token budget and free blocks
        leave after everything else (drafts never preempt nor hold back a prompt)."""
        budget = self.max_num_batched_tokens
        order = self._rebalance()
        decodes = self._reserve_decodes()
        if decodes:
            self.cache.append_one_each([s.seq_id for s in decodes], computed=False)
            for s in decodes:
                s.num_scheduled = s.num_ctx
            budget -= len(decodes)
        prefills: list[ScheduledPrefill] = []
        for s in self.running:
            if budget <= 0:
                break
            if s.is_prefill:
                budget -= self._schedule_chunk(s, budget, prefills)
        if order:
            budget = self._admit_waiting(order, budget, prefills)
        drafts = None
        if speculate and self.spec is not None and decodes:
            drafts = self._reserve_drafts(decodes, prefills, budget)
        return build_plan(self.cache, prefills, decodes, drafts)

    def _reserve_drafts(self, decodes: list[Sequence], prefills: list[ScheduledPrefill],
                        budget: int) -> list[list[int]]:
        """The policy's drafts, each with its lookahead slots reserved; a sequence whose slots
        do not fit verifies none (a value, not an error: nothing is preempted for drafts)."""
        rows = len(decodes) + sum(p.end - p.start for p in prefills)
        drafts = self.spec.drafts(decodes, rows, budget, self.max_model_len)  # type: ignore[union-attr]
        try_lookahead = self.cache.try_lookahead
        for i, (s, d) in enumerate(zip(decodes, drafts, strict=True)):
            if d and not try_lookahead(s.seq_id, len(d)):
                drafts[i] = []
                self.spec.unverified(s)  # type: ignore[union-attr]
        return drafts

    def accept(self, s: Sequence, drafted: int, appended: int) -> None:
        """After a speculative step's tokens were appended to s (still running): the drafts
        the target agreed with (appended - 1: the last token is uncomputed, as after any
        decode) become cached tokens, the other lookahead slots go back."""
        if drafted:
            self.cache.accept_lookahead(s.seq_id, appended - 1)
            s.num_scheduled += appended - 1  # num_ctx - 1 again: in decode
            self.spec.accepted(s, appended - 1)  # type: ignore[union-attr]

    def _rebalance(self) -> list[Sequence]:
        """Fair shares (fair_share.py), only while something waits or forks pushed the
        running set over max_num_seqs: preempt the newest sequences of requests over their
        quota for the waiting ones under theirs; returns the admission order."""
        if not self.waiting and len(self.running) <= self.max_num_seqs:
            self._under = None
            return []
        fair = fair_share.plan(self.running, self.waiting, self.max_num_seqs)
        for s in fair.victims:
            self.preempt(s)
            self.num_fair_preemptions += 1
        self._under = fair.under
        return fair.order

    def _admit_waiting(self, order: list[Sequence], budget: int,
                       prefills: list[ScheduledPrefill]) -> int:
        """Admit waiting sequences in `order` while slots, budget and blocks last. A held one
        (in-flight prefix) keeps its place; an over-quota one is admitted only when no
        under-quota one was left waiting. Returns the budget left."""
        under = self._under or set()
        if self.inflight is not None:
            self.inflight.begin_step()
        skipped_under = admitted = False
        reading = 0  # held for their tier reads: each counts as a slot about to be taken
        for s in order:
            if budget <= 0 or len(self.running) + reading >= self.max_num_seqs:
                break
            if s.status is not Status.WAITING:
                continue
            if s.seq_id not in under and skipped_under:
                break  # borrowed slots only when nobody under quota waits
            if self.inflight is not None and self.inflight.hold(s):
                skipped_under |= s.seq_id in under
                continue  # keeps its place in line; later prompts that share nothing go ahead
            if self.tier_reads.hold(s):
                skipped_under |= s.seq_id in under
                reading += 1
                continue
            if not self._admit(s):
                break
            admitted = True
            budget -= self._schedule_chunk(s, budget, prefills)
        if admitted:
            self.waiting = deque(s for s in self.waiting if s.status is Status.WAITING)
        return budget

    def _reserve_decodes(self) -> list[Sequence]:
        """Decoding sequences, after preempting the newest until their new blocks fit."""
        cache = self.cache
        while True:
            decodes = [s for s in self.running if not s.is_prefill]
            need = cache.blocks_needed_one_each([s.seq_id for s in decodes])
            if need <= cache.num_free_blocks or len(self.running) <= 1:
                return decodes
            self.preempt(self.running[-1])

    def _schedule_chunk(self, s: Sequence, budget: int, out: list[ScheduledPrefill]) -> int:
        n = min(s.num_ctx - s.num_scheduled, budget)
        out.append(ScheduledPrefill(s, s.num_scheduled, s.num_scheduled + n))
        s.num_scheduled += n
        return n

    def _admit(self, s: Sequence) -> bool:
        """Allocate the blocks of a waiting sequence's tokens; False (nothing changed) if short."""
        tokens = s.chain if s.chain is not None else s.num_ctx  # no caching: a bare count
        cached = self.cache.try_create(s.seq_id, tokens, computed=False, reserve=self._headroom(),
                                       tier_read=self.tier_reads.read_of(s))
        if not isinstance(cached, int):
            return False
        self.tier_reads.forget(s)
        if self.inflight is not None:
            self.inflight.admitted(s, cached)
            self.inflight.add_leader(s)
        if s.request.first_token_time is None and s.index == 0:
            s.request.num_cached_tokens = cached
            s.request.num_tier_cached_tokens = self.cache.seq(s.seq_id).tier_tokens
        s.num_scheduled = cached
        s.status = Status.RUNNING
        self.running.append(s)
        return True

    def _headroom(self) -> int:
        """Blocks to keep free when admitting: about one step of growth for the running
        decodes, so a new prompt does not take the blocks they need next (and get preempted
        straight away, its prefill wasted)."""
        if not self.running:
            return 0
        return min(len(self.running) // self.cache.block_size + 1, self.cache.num_blocks // 100 + 1)

    # --- after the forward pass ---------------------------------------------------------------

    def commit(self, plan: StepPlan) -> None:
        """The plan's K/V are written: full blocks get their prefix hashes now, not before."""
        bs = self.cache.block_size
        mark = self.cache.mark_computed
        for p in plan.prefills:
            if p.seq.status is Status.RUNNING:
                mark(p.seq.seq_id, p.end)
        for s in plan.decodes:
            n = s.num_ctx
            if n % bs == 0:  # a block just filled (partial blocks are never hashed)
                mark(s.seq_id, n)

    def postprocess(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Append each sampled token; finish (and free) sequences that hit a stop token or a
        length limit, setting `finish_reason`. Returns the sequences that finished."""
        done = []
        cap = self.max_model_len
        for s, tok in zip(seqs, tokens, strict=True):
            if tok == FAILED:  # its logits could not be sampled: it ends alone, nothing appended
                self.finish(s, "error")
                done.append(s)
                continue
            s.append(tok)
            req = s.request
            reason = None
            if tok in req.stop_ids:
                reason = "stop"
            elif len(s.token_ids) - s.num_prompt >= req.params.max_tokens or (
                cap is not None and s.num_ctx >= cap and not self._shift(s)
            ):
                reason = "length"
            if reason is not None:
                self.finish(s, reason)
                done.append(s)
        return done

    def _shift(self, s: Sequence) -> bool:
        """s filled the context: shift it if context shift is on (True), else it finishes."""
        if self.context_shift is None:
            return False
        if self.spec is not None:  # a draft model's cache recomputes the shifted context; its
            self.spec.forget(s)  # sequence goes first, while the chain still holds its context
        if not self.context_shift.apply(self.cache, s):
            return False
        self.num_context_shifts += 1
        return True

    def undo(self, plan: StepPlan) -> None:
        """The forward pass failed: the plan's sequences go back to the front of the queue with
        their blocks freed (nothing of this step was hashed), to be recomputed."""
        planned = {id(p.seq) for p in plan.prefills} | {id(s) for s in plan.decodes}
        for s in reversed(self.running):
            if id(s) in planned:
                self.preempt(s, count=False)

    # --- leaving ------------------------------------------------------------------------------

    def preempt(self, s: Sequence, *, count: bool = True) -> None:
        """Recompute preemption: free the blocks, requeue at the front."""
        self.running.remove(s)
        self.cache.free(s.seq_id)
        if self.spec is not None:
            self.spec.forget(s)
        s.num_scheduled = 0
        s.status = Status.WAITING
        self.waiting.appendleft(s)
        self.num_preemptions += count

    def finish(self, s: Sequence, reason: str) -> None:
        """A finished or aborted sequence leaves; its blocks go back at once."""
        if s.status is Status.RUNNING:
            self.running.remove(s)
            if not s.is_prefill:  # every context token the cache holds has its K/V by now
                self.cache.mark_computed(s.seq_id, self.cache.num_tokens(s.seq_id))
            self.cache.free(s.seq_id)  # (its partial last block stays, for partial hits)
            if self.spec is not None:
                self.spec.forget(s)
        elif s.status is Status.WAITING:
            self.waiting.remove(s)
            self.tier_reads.forget(s)
            if self.inflight is not None:
                self.inflight.forget(s)
        s.status = Status.FINISHED
        s.finish_reason = reason
