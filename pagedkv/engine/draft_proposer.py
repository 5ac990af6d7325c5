"""DraftProposer: a draft model proposes each decoding sequence's draft tokens, its own KV
cache kept in step with the target's (vLLM's "draft_model" method).

Per step (`SpecDecoder.drafts` -> `drafts`), for the decoding sequences the policy lets draft
(k_i tokens each):
1. Catch-up: the draft's sequence (same id and hash chain as the target's) grows to the
   target's context; the tokens it has not computed yet (1 after a rejection, 2 after all k
   were accepted, a whole prompt the first time, in chunks of at most `max_catch_up` tokens
   per step) run in ONE forward pass over every such sequence: its last row gives draft 1.
2. Drafts 2..k: each is one forward pass over every sequence still drafting (the whole batch,
   never per sequence), its input the draft before, written in the draft cache's lookahead
   slots (`try_lookahead`: never hashed, never shared).
3. After verification (`accepted(s, m)`): the draft's first min(m, k - 1) lookahead slots hold
   accepted tokens and become its cached tokens (`accept_lookahead`: full blocks hashed now),
   the rest are given back. Rejected positions are never read again and are overwritten.

Invariant between steps: a sequence the draft knows holds a prefix of its target's context
(ids from the shared chain), K/V written for every token it holds up to `num_written`, no
lookahead; every block it hashed holds accepted tokens only. Whatever the target does to a
sequence (preempt, finish, abort, context shift: `forget`; fork: `fork`; prefix reset: `reset`)
is done to the draft's through these hooks, so the two caches never disagree about a token.

Draft tokens per request kind: greedy takes the draft's argmax (q a point mass); a seeded
sampled request takes the Gumbel-max of the draft's row under the target row's own
position-keyed noise (rejection.py), so a draft agreeing with the target is accepted; other
sampled requests draw x from the draft's warped distribution q and keep q's row, so rejection
sampling accepts with min(1, p(x) / q(x)) and corrects from max(0, p - q) (vLLM's rule). The
draft's rows see the request's penalties, bias and min_tokens as if its drafts were generated
(Sampler.adjust with the drafts ahead).

A draft failure (an exception in its forward pass) never fails the step: the sequences it was
drafting for lose their draft state (freed, recomputed later) and verify no drafts.
"""

from __future__ import annotations

import logging
import time

import torch

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.engine.draft_model import DraftModel
from pagedkv.engine.sampler import Sampler
from pagedkv.engine.spec_decode import DECAY, MARGIN, StepCost, _Rate
from pagedkv.engine.step_plan import ScheduledPrefill, StepPlan, build_plan
from pagedkv.errors import OutOfBlocksError

logger = logging.getLogger(__name__)

_EMPTY_TABLE = torch.zeros((0, 1), dtype=torch.int32)


class DraftProposer:
    """The draft model's proposals and its cache's bookkeeping; the draft cache's only client."""

    def __init__(self, draft: DraftModel, sampler: Sampler, max_catch_up: int,
                 weight_ratio: float) -> None:
        self.draft = draft
        self.cache = draft.cache
        self.runner = draft.runner
        self.sampler = sampler
        self.max_catch_up = max(1, max_catch_up)  # draft tokens computed per step at most
        self.ratio = weight_ratio  # draft / target weight bytes: its cost until measured
        self.cost = StepCost()  # the draft's forward seconds by rows (catch-up and drafts)
        self.rate = _Rate()  # the engine's decayed acceptance: each sequence's prior
        self.probs: dict[int, torch.Tensor] = {}  # seq id -> q rows [k, V] (sampled drafts)
        self.forward_seconds = 0.0
        self._step_seconds = 0.0  # since take_step_seconds
        self.forwards = 0
        self.failures = 0

    # --- the policy -----------------------------------------------------------------------------

    def drafts(self, spec, decodes: list, rows: int, budget: int,  # noqa: ANN001
               max_model_len: int | None) -> list[list[int]]:
        """Draft tokens for each of `decodes` (a step with `rows` token rows so far, at most
        `budget` drafts in all): how many first (the policy), then the draft model's tokens."""
        ks = [spec.limit(s, max_model_len) for s in decodes]
        if spec.config.adaptive:
            keep = self._plan(spec, decodes, ks, rows, budget)
        else:
            keep = []
            for k in ks:
                keep.append(max(0, min(k, budget)))
                budget -= keep[-1]
        return self.propose(decodes, keep)

    def _plan(self, spec, decodes: list, ks: list[int], rows: int,  # noqa: ANN001
              budget: int) -> list[int]:
        """How many drafts each sequence proposes: SpecDecoder's rule (the j-th draft of a
        sequence accepted at rate a is worth a**j tokens, taken best first while each one's
        tokens per second beat the step's by the batch's margin), its seconds being a verify
        row of the target (c of the target's fit) plus the draft's forward passes: draft j of
        any sequence opens forward j (a + b seconds), each more sequence in it adds b (the
        draft's measured line; until measured, the target's scaled by the weight ratio), and a
        sequence's first draft also pays the draft's catch-up over the context it has not
        computed (b per token, spread over the tokens it has left to generate: a prompt is
        caught up once). Judged against the decode rows alone (`rows`, which counts this
        step's prefill chunks too, is not used): the draft's cost is the same whatever else
        the step computes, and must pay in the steps that decode only."""
        keep = [0] * len(decodes)
        if budget <= 0 or not any(ks):
            return keep
        a, b, c = spec.cost.coef()
        step = a + b * len(decodes)  # the step's predicted seconds so far (draft passes too)
        bar = 1 + MARGIN * (1 - 1 / len(decodes))
        a_d, b_d = self.line(spec.cost)
        prior = self.rate.value
        cands = []
        for i, (s, k) in enumerate(zip(decodes, ks, strict=True)):
            if k > 0:
                r = spec.state(s).rate(prior)
                cands.extend((r ** (j + 1), j, i) for j in range(k))
        cands.sort(key=lambda x: (-x[0], x[1]))
        opened = [False] * max(ks)
        tokens, taken = float(len(decodes)), 0
        for g, j, i in cands:
            if taken >= budget:
                break
            if j != keep[i]:
                continue
            more = c + b_d + (0.0 if opened[j] else a_d)
            if j == 0:
                more += b_d * self._lag(decodes[i])
            if g * step <= bar * tokens * more:
                continue
            keep[i] += 1
            tokens += g
            step += more
            opened[j] = True
            taken += 1
        for i, k in enumerate(ks):
            if k and not keep[i]:  # skipped: drift back toward the prior, to try again later
                st = spec.state(decodes[i])
                st.accepted *= DECAY
                st.tried *= DECAY
        return keep

    def _lag(self, s) -> float:  # noqa: ANN001
        """Draft tokens s's catch-up computes, per token s has left to generate."""
        sid = s.seq_id
        done = self.cache.seq(sid).num_written if sid in self.cache else 0
        left = s.request.params.max_tokens - (len(s.token_ids) - s.num_prompt)
        return max(0, s.num_ctx - 1 - done) / max(1, left)

    def line(self, target: StepCost) -> tuple[float, float]:
        """(a, b): one draft forward pass of r rows takes a + b * r seconds."""
        if self.cost.xx[0] > 1e-9:
            return self.cost.line()
        a, b = target.line()
        return a * self.ratio, b * self.ratio

    def take_step_seconds(self) -> float:
        """The draft's forward seconds since the last call (taken out of the step's, for the
        target's cost fit)."""
        dt, self._step_seconds = self._step_seconds, 0.0
        return dt

    # --- proposing ------------------------------------------------------------------------------

    def propose(self, decodes: list, keep: list[int]) -> list[list[int]]:
        """Up to keep[i] draft tokens for decodes[i] (fewer where the draft's blocks or its
        catch-up budget do not reach); [] for the rest."""
        want = [(i, s, k) for i, (s, k) in enumerate(zip(decodes, keep, strict=True)) if k > 0]
        out: list[list[int]] = [[] for _ in decodes]
        if not want:
            return out
        try:
            for i, _, toks in self._propose(want):
                out[i] = toks
        except Exception:
            self.failures += 1
            logger.exception("the draft model failed; its sequences verify no drafts this step")
            for _, s, _ in want:
                self.forget(s)
            return [[] for _ in decodes]
        except BaseException:
            for _, s, _ in want:
                self.forget(s)
            raise
        return out

    def _propose(self, want: list[tuple[int, object, int]]) -> list[tuple[int, object, list[int]]]:
        cache = self.cache
        chunks: list[ScheduledPrefill] = []
        singles: list = []
        ready: list[list] = []  # [index, seq, k]: their last token is computed this step
        room = self.max_catch_up
        creating: set[int] = set()
        for i, s, k in want:
            if room <= 0 or not self._sync(s, creating):
                continue
            w, n = cache.seq(s.seq_id).num_written, s.num_ctx
            take = min(n - w, room)
            room -= take
            if take == 1:
                singles.append(s)
            else:
                chunks.append(ScheduledPrefill(s, w, w + take))
            if w + take == n:
                ready.append([i, s, k])
        if not chunks and not singles:
            return []
        plan = build_plan(cache, chunks, singles)
        logits = self._run(plan, observe=all(c.end - c.start <= 2 for c in chunks))
        for c in chunks:
            cache.mark_computed(c.seq.seq_id, c.end)
        for s in singles:
            cache.mark_computed(s.seq_id, s.num_ctx)
        if not ready:
            return []
        row_of = {id(s): r for r, s in enumerate(plan.samplers)}
        seqs = [s for _, s, _ in ready]
        x = logits[torch.tensor([row_of[id(s)] for s in seqs])]
        toks, qs = self.sampler.draft_tokens(x, seqs, [[] for _ in seqs], 0)
        drafts = [[t] for t in toks]
        probs = [[q] for q in qs]
        for r in ready:
            if r[2] > 1 and not cache.try_lookahead(r[1].seq_id, r[2] - 1):
                r[2] = 1
        for j in range(1, max(r[2] for r in ready)):
            part = [m for m, r in enumerate(ready) if r[2] > j]
            seqs = [ready[m][1] for m in part]
            logits = self._run(self._depth_plan(seqs, j, [drafts[m][-1] for m in part]))
            toks, qs = self.sampler.draft_tokens(logits, seqs, [drafts[m] for m in part], j)
            for m, t, q in zip(part, toks, qs, strict=True):
                drafts[m].append(t)
                probs[m].append(q)
        for (_, s, _), q in zip(ready, probs, strict=True):
            if q[0] is not None:
                self.probs[s.seq_id] = torch.stack(q)
        return [(r[0], r[1], d) for r, d in zip(ready, drafts, strict=True)]

    def _sync(self, s, creating: set[int]) -> bool:  # noqa: ANN001
        """The draft's sequence for s, created or grown (not computed) to s's context; False
        when its blocks do not fit, or a sibling sample is being created this step (it computes
        the shared prompt; this one finds its blocks as prefix hits next step)."""
        cache = self.cache
        if s.seq_id not in cache:
            if id(s.request) in creating:
                return False
            ids = s.chain if s.chain is not None else s.num_ctx
            if isinstance(cache.try_create(s.seq_id, ids, computed=False), OutOfBlocksError):
                return False
            creating.add(id(s.request))
            return True
        grow = s.num_ctx - cache.num_tokens(s.seq_id)
        if grow > 0:
            try:
                cache.append(s.seq_id, grow, computed=False)
            except OutOfBlocksError:
                return False
        return True

    def _depth_plan(self, seqs: list, j: int, inputs: list[int]) -> StepPlan:
        """The forward pass of draft j + 1: each sequence's row at lookahead position j - 1
        (position num_ctx - 1 + j), its input the draft before."""
        n = len(seqs)
        slots, tables, lens = self.cache.decode_tensors([s.seq_id for s in seqs],
                                                        drafts=[j] * n)
        last = torch.arange(1, n + 1) * (j + 1) - 1  # each sequence's last row
        slots, tables, lens = slots[last], tables[last], lens[last]
        meta = AttentionMetadata(
            slot_mapping=slots, prefill_query_lens=[], prefill_context_lens=[],
            prefill_block_tables=_EMPTY_TABLE, decode_block_tables=tables,
            decode_seq_lens=lens, max_decode_seq_len=int(lens.max()))
        return StepPlan(decodes=list(seqs), input_ids=torch.tensor(inputs, dtype=torch.int64),
                        positions=lens.to(torch.int64) - 1, meta=meta, metas=(meta,),
                        logits_indices=torch.arange(n), samplers=list(seqs))

    def _run(self, plan: StepPlan, observe: bool = True) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.runner.run(plan)
        dt = time.perf_counter() - t0
        self.forward_seconds += dt
        self._step_seconds += dt
        self.forwards += 1
        if observe:
            self.cost.observe(plan.num_tokens, dt)
        return logits

    # --- the target's events ----------------------------------------------------------------------

    def accepted(self, s, m: int) -> None:  # noqa: ANN001
        """The target accepted s's first m drafts (s still running): the draft keeps the
        accepted ones its lookahead computed, and gives the other slots back."""
        self.probs.pop(s.seq_id, None)
        if s.seq_id in self.cache:
            st = self.cache.seq(s.seq_id)
            self.cache.accept_lookahead(s.seq_id, min(m, st.lookahead))

    def forget(self, s) -> None:  # noqa: ANN001
        """s left the running set (preempted, finished, aborted) or its context was edited
        (context shift): its draft sequence goes (its hashed blocks stay cached)."""
        self.probs.pop(s.seq_id, None)
        if s.seq_id in self.cache:
            self.cache.free(s.seq_id)

    def fork(self, parent, child) -> None:  # noqa: ANN001
        """child (a copy of parent) shares the draft's blocks of parent, as in the target."""
        if parent.seq_id in self.cache:
            self.accepted(parent, 0)
            self.cache.fork(parent.seq_id, child.seq_id, chain=child.chain)

    def reset(self) -> None:
        """The target's prefix cache was emptied: the draft's too."""
        self.cache.reset_prefix_cache()

    def q_rows(self, s, n: int) -> torch.Tensor | None:  # noqa: ANN001
        """The distributions s's first n drafts were drawn from (None: point masses)."""
        q = self.probs.get(s.seq_id)
        return None if q is None or not n else q[:n]

    def stats(self) -> dict[str, float]:
        c = self.cache.stats()
        return {"spec_decode_draft_forward_seconds": self.forward_seconds,
                "spec_decode_draft_kv_usage": c.usage,
                "spec_decode_draft_failures": self.failures}


__all__ = ["DraftProposer"]
