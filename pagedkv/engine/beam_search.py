"""Beam search over shared blocks: `LLM.beam_search(prompts, BeamSearchParams(...))`.

Every beam is a Sequence in the engine's cache. A beam that several candidates continue is
forked (its blocks shared, copy-on-write on the partial last one), so beams share the prompt and
their common prefix; a beam no candidate continues is finished at once and its blocks go back.

Selection follows transformers' `generate(num_beams=k, do_sample=False)` exactly (its default
`early_stopping=False` heuristic): each step takes the top K = max(2, 1 + #eos) * k candidates
over all beams by cumulative log-probability; a candidate ending in EOS (or reaching max_tokens)
among the first k becomes a finished hypothesis scored cum_logprob / generated_len **
length_penalty (only while an improvement is still possible); the best k candidates that do not
end continue. The search ends when every candidate ends, or when no running beam can beat the
worst of k finished hypotheses (best running cum_logprob / current length ** length_penalty).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.sequence import Request, Sequence
from pagedkv.errors import InvalidParamsError, RequestTooLongError

if TYPE_CHECKING:
    from pagedkv.engine.llm_engine import LLMEngine

MAX_BEAM_WIDTH = 64


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams: beam_width >= 1, max_tokens >= 1, temperature 0 (log-probs of
    the raw logits) or > 0 (of logits / temperature), length_penalty as transformers'."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name, lo, hi in (("beam_width", 1, MAX_BEAM_WIDTH), ("max_tokens", 1, 1 << 20)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise InvalidParamsError(f"{name} must be an int in [{lo}, {hi}], got {v!r}")
        for name, lo, hi in (("temperature", 0.0, 100.0), ("length_penalty", -10.0, 10.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
                raise InvalidParamsError(f"{name} must be a number in [{lo}, {hi}], got {v!r}")


@dataclass(slots=True)
class BeamSequence:
    token_ids: list[int]  # generated tokens (EOS included when it ended the beam)
    text: str
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (EOS) | "length"


@dataclass(slots=True)
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]  # best first

    @property
    def token_ids(self) -> list[int]:
        return self.sequences[0].token_ids

    @property
    def text(self) -> str:
        return self.sequences[0].text


@dataclass(slots=True)
class BeamStepStats:
    """KV blocks the live beams hold (shared blocks once) vs one private copy per beam."""

    beams: int
    shared_blocks: int
    copied_blocks: int


@dataclass(slots=True, eq=False)
class _Group:
    """The beams of one prompt."""

    req: Request
    prompt_len: int
    beams: list[tuple[Sequence, float]]  # running beams with their cum log-prob
    finished: list[tuple[float, float, list[int], str]] = field(default_factory=list)
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    done: bool = False


class BeamSearch:
    """Drives an idle LLMEngine for one batch of beam-search prompts, through its public calls:
    `forward` (the step primitive step() uses too: schedule, run, commit or undo, tier writes,
    timing), new_sequence / add_sequence / fork_sequence / finish_sequence, block_ids."""

    def __init__(self, engine: LLMEngine, params: BeamSearchParams,
                 on_step: Callable[[BeamStepStats], None] | None = None) -> None:
        if not isinstance(params, BeamSearchParams):
            raise InvalidParamsError("params must be a BeamSearchParams")
        if not engine.is_idle():
            raise InvalidParamsError("beam search needs an engine with no other requests")
        self.engine = engine
        self.params = params
        self.on_step = on_step
        self.eos = frozenset() if params.ignore_eos else frozenset(engine.eos_ids)
        self.keep = max(2, 1 + len(self.eos)) * params.beam_width
        self._ids = itertools.count()

    def run(self, prompts: list[list[int]]) -> list[BeamSearchOutput]:
        """Beam search for every prompt, in batches whose beams fit the cache unshared (so no
        beam is ever preempted); outputs in prompt order."""
        for ids in prompts:
            self._check(ids)
        out: list[BeamSearchOutput] = []
        batch: list[list[int]] = []
        for ids in prompts:
            if batch and self._worst_blocks(batch + [ids]) > self.engine.cache.num_blocks:
                out += self._run_batch(batch)
                batch = []
            batch.append(ids)
        return out + self._run_batch(batch)

    def _worst_blocks(self, prompts: list[list[int]]) -> int:
        """Blocks the beams of `prompts` could hold if nothing were shared."""
        cache, k = self.engine.cache, self.params.beam_width
        bs, groups = cache.block_size, cache.num_groups
        return sum(k * groups * (-(-(len(ids) + self.params.max_tokens) // bs) + 1)
                   for ids in prompts)

    def _check(self, ids: list[int]) -> None:
        cap = min(self.engine.max_model_len, self.engine.cache.token_capacity)
        if len(ids) >= self.engine.max_model_len:
            raise RequestTooLongError(f"prompt of {len(ids)} tokens leaves no room in a context "
                                      f"of {self.engine.max_model_len}")
        if self._worst_blocks([ids]) > self.engine.cache.num_blocks:
            raise RequestTooLongError(f"{self.params.beam_width} beams of {len(ids)} + "
                                      f"{self.params.max_tokens} tokens do not fit the KV cache "
                                      f"({cap} tokens)")

    def _run_batch(self, prompts: list[list[int]]) -> list[BeamSearchOutput]:
        groups = [self._start(i, ids) for i, ids in enumerate(prompts)]
        of = {g.beams[0][0].seq_id: g for g in groups}
        try:
            while any(not g.done for g in groups):
                samplers, logits = self._forward()
                row_of = {s.seq_id: r for r, s in enumerate(samplers)}
                for g in groups:
                    if g.done or g.beams[0][0].seq_id not in row_of:
                        continue  # still in prefill
                    self._advance(g, logits[[row_of[s.seq_id] for s, _ in g.beams]], of)
                self._report(groups)
        finally:
            for g in groups:
                self._finish(g)
        return [self._output(g) for g in groups]

    # --- one prompt ---------------------------------------------------------------------------

    def _start(self, i: int, ids: list[int]) -> _Group:
        sp = SamplingParams(max_tokens=self.params.max_tokens, ignore_eos=True)
        req = Request(f"beam-{i}", ids, sp, fair_share=False)
        s = self._seq(req, list(ids))
        self.engine.add_sequence(s)
        return _Group(req, len(ids), [(s, 0.0)])

    def _seq(self, req: Request, token_ids: list[int]) -> Sequence:
        s = self.engine.new_sequence(req, next(self._ids), token_ids)
        req.seqs.append(s)
        return s

    def _advance(self, g: _Group, logits: torch.Tensor, of: dict) -> None:
        """One step of transformers' beam search for group g (logits: one row per beam)."""
        p, k = self.params, self.params.beam_width
        beams = g.beams
        x = logits.float()
        if p.temperature > 0:
            x = x / p.temperature
        lp = torch.log_softmax(x, dim=-1) + torch.tensor([c for _, c in beams])[:, None]
        vocab = lp.shape[1]
        top, idx = torch.topk(lp.reshape(-1), min(self.keep, lp.numel()))
        cur = len(beams[0][0].token_ids)  # prompt + generated so far (equal for every beam)
        gen = cur + 1 - g.prompt_len
        at_max = gen >= p.max_tokens or cur + 1 >= self.engine.max_model_len
        nxt: list[tuple[int, int, float]] = []  # (beam, token, cum log-prob)
        new_done = []
        for rank, (score, flat) in enumerate(zip(top.tolist(), idx.tolist(), strict=True)):
            b, tok = divmod(flat, vocab)
            ends = at_max or tok in self.eos
            if ends:
                if rank < k and g.improvable:
                    ids = beams[b][0].token_ids[g.prompt_len :] + [tok]
                    reason = "stop" if tok in self.eos else "length"
                    new_done.append((score / gen**p.length_penalty, score, ids, reason))
            elif len(nxt) < k:
                nxt.append((b, tok, score))
        g.finished = sorted(g.finished + new_done, key=lambda f: -f[0])[:k]
        if not nxt:  # every candidate ended (max_tokens): nothing continues
            self._finish(g)
            return
        self._regroup(g, nxt, of)
        best = nxt[0][2] / (cur + 1 - g.prompt_len) ** p.length_penalty
        worst = g.finished[-1][0] if len(g.finished) == k else -math.inf
        g.improvable = g.improvable and best > worst
        if not g.improvable:
            self._finish(g)

    def _regroup(self, g: _Group, nxt: list[tuple[int, int, float]], of: dict) -> None:
        """Continue the chosen candidates: a beam chosen once appends its token, one chosen m
        times is forked m - 1 times first (blocks shared), one not chosen leaves at once."""
        old = g.beams
        chosen: dict[int, list[tuple[int, float]]] = {}
        for b, tok, score in nxt:
            chosen.setdefault(b, []).append((tok, score))
        new: list[tuple[Sequence, float]] = []
        for b, (s, _) in enumerate(old):
            if b not in chosen:
                self._drop(s)
                continue
            for tok, score in chosen[b][1:]:
                child = self._seq(g.req, list(s.token_ids))
                self._fork(s, child)
                of[child.seq_id] = g
                child.append(tok)
                new.append((child, score))
            s.append(chosen[b][0][0])
            new.append((s, chosen[b][0][1]))
        new.sort(key=lambda t: -t[1])
        g.beams = new

    def _finish(self, g: _Group) -> None:
        for s, _ in g.beams:
            self._drop(s)
        g.beams = []
        g.done = True

    # --- the engine ---------------------------------------------------------------------------

    def _forward(self) -> tuple[list[Sequence], torch.Tensor]:
        """One engine step's forward pass: the sequences that sample now and their logits."""
        done = self.engine.forward()
        while done is None and self.engine.tier_reads_pending():
            done = self.engine.forward()  # its prompts wait on KV tier reads, up to a deadline
        if done is None:
            raise RuntimeError("beam search: nothing could be scheduled")
        return done.plan.samplers, done.logits

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """child (a copy of parent's tokens) shares parent's blocks and runs."""
        self.engine.fork_sequence(parent, child)

    def _drop(self, s: Sequence) -> None:
        """A pruned or finished beam leaves; its blocks go back at once."""
        self.engine.finish_sequence(s, "abort")

    def _report(self, groups: list[_Group]) -> None:
        if self.on_step is None:
            return
        tables = [t for g in groups for s, _ in g.beams
                  if (t := self.engine.block_ids(s)) is not None]  # admitted beams
        if not tables:
            return
        shared = len({b for t in tables for b in t})
        self.on_step(BeamStepStats(len(tables), shared, sum(map(len, tables))))

    def _output(self, g: _Group) -> BeamSearchOutput:
        tok = self.engine.tokenizer
        seqs = [BeamSequence(ids, tok.decode(ids, skip_special_tokens=True), cum, score, why)
                for score, cum, ids, why in g.finished]
        return BeamSearchOutput(list(g.req.prompt_token_ids), seqs)
