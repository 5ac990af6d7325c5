"""Token sampling for one step, batched: one call per step with the logits and the sequences.

Order (as vLLM): logit_bias and min_tokens masks -> repetition, frequency, presence penalties ->
the grammar mask of structured-output rows (only those rows pay for it) -> greedy rows take the argmax -> the other rows: temperature -> min_p -> top-k -> top-p -> one
float64 CDF per row inverted at one uniform draw (exact up to float64 rounding).

Invariants:
- A row that cannot be sampled (NaN or +inf logits, or nothing left to sample) yields FAILED and
  does not affect any other row.
- Seeded rows draw their noise from their own generator only, so their tokens do not depend on
  what else is in the batch.
- Per-step work is bounded by the batch and the vocabulary, never by output length: penalty
  counts are kept per sequence and updated with the tokens added since the last step.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pagedkv.engine.rejection import accept_greedy, accept_sampled, gumbel_tokens
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.structured import GrammarCompiler, GrammarMatcher, apply_masks
from pagedkv.model import qkernel

FAILED = -1  # the token of a row that could not be sampled
_NEG_INF = float("-inf")


class _Request(Protocol):
    params: SamplingParams


class SampledSeq(Protocol):
    """What the sampler reads of a sequence (engine/sequence.py's Sequence fits)."""

    token_ids: list[int]  # prompt + generated so far
    request: _Request
    generator: torch.Generator | None
    grammar: GrammarMatcher | None

    @property
    def num_prompt(self) -> int: ...

    @property
    def finished(self) -> bool: ...


def generator_for(seed: int, index: int) -> torch.Generator:
    """The generator of sample `index` of a request seeded with `seed` (any int64): its seed is a
    63-bit hash of both, so every int64 is valid and samples of one request differ."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def position_generator(seed: int, index: int, position: int) -> torch.Generator:
    """The generator of the token at `position` of sample `index` of a seeded request
    (speculative decoding's seeded rows: rejection.gumbel_tokens)."""
    digest = hashlib.blake2b(f"{seed}:{index}:{position}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def _keyed(s: SampledSeq) -> bool:
    """A seeded random row of a speculating request: sampled by position-keyed Gumbel-max."""
    p = s.request.params
    return p.seed is not None and not p.greedy and getattr(s.request, "speculate", False)


def _gumbel(x: torch.Tensor, s: SampledSeq, first: int) -> list[int]:
    """Rows of s's adjusted logits x [n, V] for positions first, first + 1, ...."""
    p = s.request.params
    gens = [position_generator(p.seed, getattr(s, "index", 0), first + j)  # type: ignore[arg-type]
            for j in range(x.shape[0])]
    return gumbel_tokens(warp(x, [p] * x.shape[0]), gens)


@dataclass(slots=True, eq=False)
class _History:
    """Per-sequence sampler state, updated incrementally: which tokens the prompt + output hold
    (`seen`), how often each was generated (`counts`), and the request's constant tensors."""

    seq: SampledSeq  # keeps id(seq) from being reused while the history lives
    seen: torch.Tensor  # [V] bool, prompt + output
    counts: torch.Tensor  # [V] float32, output only
    n: int  # token_ids[:n] are accounted for
    bias_ids: torch.Tensor
    bias_vals: torch.Tensor
    banned: torch.Tensor  # ids masked until min_tokens were generated


class Sampler:
    """`sampler(logits [R, V], seqs)` -> R token ids (FAILED where a row cannot be sampled)."""

    def __init__(self, eos_ids: Iterable[int] = (), grammars: GrammarCompiler | None = None
                 ) -> None:
        self.eos_ids = sorted(set(eos_ids))
        self.grammars = grammars  # fills the masks of rows whose sequence has a grammar
        self._hist: dict[int, _History] = {}  # by id(seq); the history holds the seq itself
        self.mask_seconds = 0.0  # computing and applying grammar masks, over the sampler's life
        self.mask_rows = 0  # rows masked
        self.mask_early = 0  # of which masks computed by the worker during the forward pass
        self._pool: Any = None  # the mask worker (one thread), made on first use
        self._early: tuple[list[tuple[Any, int]], Any] | None = None  # (matcher, consumed) -> masks

    def prefetch(self, seqs: Sequence[SampledSeq]) -> None:
        """Start computing the masks of these rows' grammars on the mask worker (the engine
        calls this before the forward pass, so they are computed while it runs). The sampler
        uses them only if its constrained rows hold the same matchers in the same states
        (same objects, same number of tokens consumed); otherwise it computes its own.
        Contract: the matchers are not advanced until this sampler has run or `settle()`
        returned (the worker reads them until then)."""
        self.settle()
        g = self.grammars
        matchers = [s.grammar for s in seqs if s.grammar is not None]
        if g is None or not matchers:
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-masks")

        def fill() -> torch.Tensor:
            out = torch.zeros((len(matchers), g.words), dtype=torch.int32)
            g.fill_masks(matchers, out)  # type: ignore[arg-type]
            return out

        self._early = ([(m, m.consumed) for m in matchers], self._pool.submit(fill))

    def settle(self) -> tuple[list[tuple[Any, int]], torch.Tensor] | None:
        """Wait for the worker's masks (if any were asked for) and take them: (matcher states,
        masks), or None (none asked, or the worker failed: the sampler then computes its own)."""
        early, self._early = self._early, None
        if early is None:
            return None
        try:
            return early[0], early[1].result()
        except Exception:  # the inline path recomputes and meets the same error itself
            return None

    def close(self) -> None:
        """Stop the mask worker (idempotent)."""
        self.settle()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __call__(self, logits: torch.Tensor, seqs: Sequence[SampledSeq],
                 known: torch.Tensor | None = None) -> list[int]:
        """`known` [R] int64: rows whose token the model's greedy head already took (the first
        maximum of the row as it is), -1 for the others."""
        params = [s.request.params for s in seqs]
        x = self.adjust(logits, seqs)
        # one reduction gives argmax and its value (first maximum, as argmax);
        # NaN and +inf count as the maximum: their rows fail below
        best, tokens = _row_max_known(x, known)
        ok = torch.isfinite(best)
        rand = [i for i, p in enumerate(params) if not p.greedy and not _keyed(seqs[i])]
        for i, s in enumerate(seqs):
            if _keyed(s):
                tokens[i] = _gumbel(x[i : i + 1], s, len(s.token_ids))[0]
        if rand:
            rows = torch.tensor(rand)
            tokens[rows] = _draw(x[rows], [params[i] for i in rand],
                                 [seqs[i].generator for i in rand])
        return tokens.masked_fill_(~ok, FAILED).tolist()

    # --- logit adjustments that depend on the sequence ----------------------------------------

    def verify(self, logits: torch.Tensor, seqs: Sequence[SampledSeq],
               drafts: Sequence[list[int]],
               draft_probs: Sequence[torch.Tensor | None] | None = None,
               known: torch.Tensor | None = None) -> list[list[int]]:
        """A speculative step: sampler i owns 1 + len(drafts[i]) consecutive rows (row j: after
        drafts[i][:j]); returns the tokens each appends (accepted drafts, then a correction or
        bonus token: rejection.py), a list ending at FAILED where a row it reached could not
        be sampled. Row j's penalties count drafts[i][:j] as generated. `draft_probs[i]`: the
        distributions [len(drafts[i]), V] a sampling draft model drew sampler i's drafts from
        (None: point masses). `known`: as __call__'s, per row."""
        row_seqs: list[SampledSeq] = []
        ahead: list[list[int]] = []
        for s, d in zip(seqs, drafts, strict=True):
            for j in range(len(d) + 1):
                row_seqs.append(s)
                ahead.append(d[:j])
        x = self.adjust(logits, row_seqs, ahead)
        best, top = _row_max_known(x, known)
        ok = torch.isfinite(best).tolist()
        top_ids = top.tolist()
        out = []
        r = 0
        for i, (s, d) in enumerate(zip(seqs, drafts, strict=True)):
            n = len(d) + 1
            p = s.request.params
            if p.greedy:
                toks = accept_greedy(top_ids[r : r + n], d)
            elif _keyed(s):
                toks = accept_greedy(_gumbel(x[r : r + n], s, len(s.token_ids)), d)
            else:
                probs = torch.softmax(warp(x[r : r + n], [p] * n), dim=-1).double()
                q = None if draft_probs is None or not d else draft_probs[i]
                toks = accept_sampled(probs, d, s.generator, q)
            for j in range(len(toks)):
                if not ok[r + j]:
                    toks = toks[:j] + [FAILED]
                    break
            out.append(toks)
            r += n
        return out

    def draft_tokens(self, logits: torch.Tensor, seqs: Sequence[SampledSeq],
                     ahead: Sequence[list[int]], depth: int
                     ) -> tuple[list[int], list[torch.Tensor | None]]:
        """A draft model's next token for each sequence from its logits [n, V] (row i: after
        s's tokens and its drafts `ahead[i]`, depth = len(ahead[i])), with the request's
        penalties as if the drafts were generated. Greedy: the argmax (q None: a point mass).
        Seeded sampled (speculating): the Gumbel-max under the noise of the target row at the
        same position (q None: verification compares tokens). Else a draw from the warped
        distribution q, returned (float32 [V]) for rejection sampling."""
        x = self.adjust(logits, seqs, ahead)
        toks = x.argmax(-1).tolist()  # greedy rows keep theirs
        qs: list[torch.Tensor | None] = [None] * len(seqs)
        drawn = []
        for r, s in enumerate(seqs):
            if s.request.params.greedy:
                continue
            if _keyed(s):
                toks[r] = _gumbel(x[r : r + 1], s, len(s.token_ids) + depth)[0]
            else:
                drawn.append(r)
        if drawn:  # one warp, softmax and draw for all of them
            rows = torch.tensor(drawn)
            q = torch.softmax(warp(x[rows], [seqs[r].request.params for r in drawn]), dim=-1)
            cdf = q.double().cumsum(-1)
            u = torch.rand(len(drawn), 1, dtype=torch.float64) * cdf[:, -1:]
            picked = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=x.shape[-1] - 1)
            for j, (r, t) in enumerate(zip(drawn, picked.tolist(), strict=True)):
                toks[r] = t
                qs[r] = q[j]
        return toks, qs

    def adjust(self, logits: torch.Tensor, seqs: Sequence[SampledSeq],
               ahead: Sequence[list[int]] | None = None) -> torch.Tensor:
        """float32 logits after logit_bias, min_tokens and the penalties; a copy where anything
        changes (the caller's logits stay raw). `ahead[i]` (verification rows): tokens row i
        counts as generated after the sequence's own (its drafts so far)."""
        self._forget_finished()
        x = logits.float()
        params = [s.request.params for s in seqs]
        rows = [i for i, (s, p) in enumerate(zip(seqs, params, strict=True))
                if p.logit_bias or p.has_penalties or _before_min_tokens(s, p)]
        masked = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows and not masked:
            return x
        x = x.clone()
        if rows:
            hist = [self._history(seqs[i], x.shape[-1]) for i in rows]
            if ahead is not None:
                hist = [_ahead(h, ahead[i]) if ahead[i] else h for h, i in zip(hist, rows,
                                                                                strict=True)]
            self._bias_and_min_tokens(x, rows, hist, seqs, params)
            pen = [j for j, i in enumerate(rows) if params[i].has_penalties]
            if pen:
                _penalize(x, [rows[j] for j in pen], [hist[j] for j in pen],
                          [params[rows[j]] for j in pen])
        if masked:
            self._mask(x, masked, seqs)
        return x

    def _mask(self, x: torch.Tensor, rows: list[int], seqs: Sequence[SampledSeq]) -> None:
        """-inf for every token the row's grammar does not allow now (a matcher in its error
        state allows none: that row fails alone)."""
        g = self.grammars
        if g is None:
            raise RuntimeError("a sequence has a grammar but the sampler has no GrammarCompiler")
        t0 = time.perf_counter()
        matchers = [seqs[i].grammar for i in rows]
        early = self.settle()  # waited for even when unused: the worker is then off the matchers
        if early is not None and len(early[0]) == len(matchers) and all(
                a is b and n == b.consumed for (a, n), b in zip(early[0], matchers, strict=True)):
            masks = early[1]
            self.mask_early += len(rows)
        else:
            masks = torch.zeros((len(rows), g.words), dtype=torch.int32)
            g.fill_masks(matchers, masks)  # type: ignore[arg-type]
        apply_masks(x, rows, masks)
        for i, m in zip(rows, matchers, strict=True):
            if m.error:  # type: ignore[union-attr]  # (its mask still allows EOS)
                x[i] = _NEG_INF
        self.mask_seconds += time.perf_counter() - t0
        self.mask_rows += len(rows)

    def _bias_and_min_tokens(self, x: torch.Tensor, rows: list[int], hist: list[_History],
                             seqs: Sequence[SampledSeq], params: list[SamplingParams]) -> None:
        r, c, v = [], [], []
        for i, h in zip(rows, hist, strict=True):
            if h.bias_ids.numel():
                r.append(torch.full_like(h.bias_ids, i))
                c.append(h.bias_ids)
                v.append(h.bias_vals)
            if _before_min_tokens(seqs[i], params[i]) and h.banned.numel():
                r.append(torch.full_like(h.banned, i))
                c.append(h.banned)
                v.append(torch.full(h.banned.shape, _NEG_INF))
        if r:  # accumulate: -inf wins over any bias
            x.index_put_((torch.cat(r), torch.cat(c)), torch.cat(v), accumulate=True)

    def _history(self, s: SampledSeq, vocab: int) -> _History:
        h = self._hist.get(id(s))
        if h is None or h.n > len(s.token_ids) or h.seen.numel() != vocab:
            h = self._hist[id(s)] = self._new_history(s, vocab)
        if h.n < len(s.token_ids):
            new = torch.tensor(s.token_ids[h.n:])
            h.seen[new] = True
            out = new[max(s.num_prompt - h.n, 0):]
            h.counts.index_add_(0, out, torch.ones(out.shape))
            h.n = len(s.token_ids)
        return h

    def _new_history(self, s: SampledSeq, vocab: int) -> _History:
        p = s.request.params
        ids = [t for t in p.logit_bias if t < vocab]
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids))
        return _History(
            seq=s,
            seen=torch.zeros(vocab, dtype=torch.bool),
            counts=torch.zeros(vocab),
            n=0,
            bias_ids=torch.tensor(ids, dtype=torch.long),
            bias_vals=torch.tensor([p.logit_bias[t] for t in ids], dtype=torch.float32),
            banned=torch.tensor(sorted(t for t in banned if t < vocab), dtype=torch.long),
        )

    def _forget_finished(self) -> None:
        for key in [key for key, h in self._hist.items() if h.seq.finished]:
            del self._hist[key]


def _ahead(h: _History, tokens: list[int]) -> _History:
    """h with `tokens` generated after it (a verification row's view; h is not changed)."""
    t = torch.tensor(tokens)
    seen = h.seen.clone()
    seen[t] = True
    counts = h.counts.clone().index_add_(0, t, torch.ones(len(tokens)))
    return _History(h.seq, seen, counts, h.n + len(tokens), h.bias_ids, h.bias_vals, h.banned)


# greedy_kind: what a row needs of its raw logits
OTHER, GREEDY_VALUES, ARGMAX_ONLY = 0, 1, 2


def greedy_kind(s: SampledSeq) -> int:
    """ARGMAX_ONLY: s's token is the plain argmax of its raw logits and nothing else reads them
    (greedy; no logprobs, logit_bias, penalties, min_tokens still ahead or grammar); GREEDY_VALUES:
    the same with logprobs (every logit read); OTHER: anything else. A verification row counts
    drafts as generated: with no penalties and min_tokens behind, the same kind."""
    p = s.request.params
    if (not p.greedy or p.logit_bias or p.has_penalties or _before_min_tokens(s, p)
            or s.grammar is not None):
        return OTHER
    return ARGMAX_ONLY if p.logprobs is None else GREEDY_VALUES


def _before_min_tokens(s: SampledSeq, p: SamplingParams) -> bool:
    return len(s.token_ids) - s.num_prompt < p.min_tokens


def _penalize(x: torch.Tensor, rows: list[int], hist: list[_History],
              params: list[SamplingParams]) -> None:
    """Repetition (prompt + output, transformers/vLLM), then frequency and presence (output only,
    OpenAI): x -= frequency * count + presence * (count > 0)."""
    idx = torch.tensor(rows)
    sub = x[idx]
    seen = torch.stack([h.seen for h in hist])
    counts = torch.stack([h.counts for h in hist])
    rep = torch.tensor([[p.repetition_penalty] for p in params])
    freq = torch.tensor([[p.frequency_penalty] for p in params])
    pres = torch.tensor([[p.presence_penalty] for p in params])
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalized, sub)
    sub = sub - freq * counts - pres * (counts > 0)
    x[idx] = sub


# --- the random rows ------------------------------------------------------------------------


def _draw(x: torch.Tensor, params: list[SamplingParams],
          gens: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of adjusted logits x [R, V] by inverting the CDF (float64, in token-id
    order) at one uniform per row; a seeded row's uniform comes from its own generator, so its
    token depends only on its own logits. A row without a finite maximum gives an arbitrary
    in-range token: the caller fails it."""
    cdf = torch.softmax(warp(x, params), dim=-1).double().cumsum_(dim=-1)
    u = torch.rand(x.shape[0], 1, dtype=torch.float64)
    for i, g in enumerate(gens):
        if g is not None:
            u[i] = torch.rand(1, generator=g, dtype=torch.float64)
    # the first token whose CDF exceeds u * total: tokens of probability 0 are never taken
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
    return picked.clamp_(max=x.shape[-1] - 1)


def _truncates(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1


def _scale(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature and min_p: the maximum shifted to 0 first, so dividing by a tiny temperature
    cannot overflow; then p_i < min_p * p_max  <=>  x_i < log(min_p)."""
    temp = torch.tensor([[p.temperature] for p in params])
    x = (x - x.amax(dim=-1, keepdim=True)) / temp
    if any(p.min_p > 0 for p in params):
        log_min_p = torch.tensor([[math.log(p.min_p) if p.min_p > 0 else _NEG_INF]
                                  for p in params])
        x.masked_fill_(x < log_min_p, _NEG_INF)
    return x


def warp(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, min_p, top-k, top-p over whole rows: the logits the sampler draws from
    (maximum 0, dropped tokens -inf). The reference the sampler's tests compare."""
    x = _scale(x, params)
    trunc = [i for i, p in enumerate(params) if _truncates(p, x.shape[-1])]
    for pos, vals, idx in _candidates(x, trunc, params):
        x[torch.tensor(pos)] = torch.full((len(pos), x.shape[-1]), _NEG_INF).scatter_(1, idx, vals)
    return x


TOP_P_WINDOW = 1024  # top-p looks at the most likely this-many tokens first


def _candidates(x: torch.Tensor, rows: list[int], params: list[SamplingParams]
                ) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Top-k (ties with the k-th kept), then top-p over what is left (the most likely token
    always stays), for the given rows: groups of (row positions, logits [n, K] in descending
    order with dropped ones at -inf, their token ids [n, K]). One top-k of width K = max(window,
    largest top_k) serves every row whose kept set provably lies inside it; the rest (top-p only,
    the window's mass below top_p) take one full sort."""
    if not rows:
        return []
    vocab = x.shape[-1]
    ks = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in rows]
    window = [TOP_P_WINDOW] if vocab in ks else []  # rows without top-k: top-p only
    width = min(vocab, max(window + [k for k in ks if k < vocab]))
    sub = x[torch.tensor(rows)]
    vals, idx = sub.topk(width, dim=-1) if width < vocab else sub.sort(dim=-1, descending=True)
    k = torch.tensor(ks)[:, None]
    vals = vals.masked_fill(vals < vals.gather(1, k.clamp(max=width) - 1), _NEG_INF)
    # top-p normalizes over what top-k kept: the window for top-k rows, else the whole row
    norm = torch.where(k < vocab, vals.logsumexp(-1, keepdim=True),
                       sub.logsumexp(-1, keepdim=True))
    top_p = torch.tensor([[params[i].top_p] for i in rows])
    vals, mass = _top_p(vals, norm, top_p)
    covered = ((k < vocab) | (mass >= top_p))[:, 0].tolist()
    if width == vocab or all(covered):
        return [(rows, vals, idx)]
    inside = [j for j, c in enumerate(covered) if c]
    full = [rows[j] for j, c in enumerate(covered) if not c]
    fvals, fidx = x[torch.tensor(full)].sort(dim=-1, descending=True)
    fvals, _ = _top_p(fvals, fvals.logsumexp(-1, keepdim=True), top_p[[not c for c in covered]])
    groups = [(full, fvals, fidx)]
    if inside:
        groups.append(([rows[j] for j in inside], vals[inside], idx[inside]))
    return groups


def _top_p(vals: torch.Tensor, norm: torch.Tensor, top_p: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop each token once the mass before it reaches top_p (the first always stays), on
    descending logits normalized by `norm`; also returns the mass the columns hold [n, 1]."""
    probs = (vals - norm).exp()
    cum = probs.cumsum(dim=-1)
    drop = (cum - probs) >= top_p
    drop[:, 0] = False
    return vals.masked_fill(drop, _NEG_INF), cum[:, -1:]


def top_logprobs(logits_row: torch.Tensor, token: int, k: int) -> dict[int, float]:
    """The sampled token's log-probability and the k most likely ones (raw model distribution)."""
    lp = torch.log_softmax(logits_row.float(), dim=-1)
    out = {}
    if k > 0:
        vals, ids = torch.topk(lp, k)
        out = dict(zip(ids.tolist(), vals.tolist(), strict=True))
    out[token] = float(lp[token])
    return out


def _row_max_known(x: torch.Tensor, known: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """_row_max, taking the rows of `known` >= 0 as decided (their value counted finite)."""
    if known is None:
        return _row_max(x)
    todo = (known < 0).nonzero().flatten()
    best, tokens = torch.zeros(x.shape[0]), known.clone()
    if todo.numel():
        b, t = _row_max(x.index_select(0, todo))
        best[todo], tokens[todo] = b, t
    return best, tokens


def _row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x.max(dim=-1) (first maximum; NaN wins), by the compiled op for float32 CPU rows: torch's
    reduction took ~1 ms for 40 rows of SmolLM2's 49152 logits, a few % of a decode step."""
    op = qkernel.argmax()
    if op is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or not x.shape[1]:
        return x.max(dim=-1)
    x = x.contiguous()
    best, idx = torch.empty(x.shape[0]), torch.empty(x.shape[0], dtype=torch.int64)
    op(x, best, idx)
    return best, idx

