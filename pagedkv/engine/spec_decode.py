"""Speculative decoding's policy: which decoding sequences verify how many draft tokens.

Each step the scheduler asks `SpecDecoder.drafts(decodes, rows, budget)`: for every decoding
sequence that may speculate, the proposer (prompt lookup, `ngram.py`) offers up to k tokens
(k = num_speculative_tokens, less near max_tokens or the context's end); the policy keeps a
prefix of each. Adaptive (the default) decides from two measured things:
- cost (`StepCost`): a decode-only step's seconds, fitted online as a + b * rows + c * drafts
  (decayed least squares over whole steps, sampling included), so c is the measured price of
  one verify row at the current batch and b that of one plain decode row;
- acceptance (`SeqSpec`): each sequence's decayed rate, pulled toward the engine's rate for
  proposals of the same match length (a 1-token suffix match is a much weaker proposal than a
  4-token one). A proposal not verified is still scored when the next token arrives (was it
  the token the target chose?), so acceptance stays measured while a sequence does not draft:
  it starts again by itself when its proposals would now pay (a free probe).
The j-th draft of a sequence with acceptance a is worth a**j expected tokens and costs c
seconds; drafts are taken best first while each one's tokens per second (a**j / c) beat the
step's own tokens per second (tokens / T) by a margin, none for one stream and toward MARGIN
as the batch grows (see MARGIN). A large batch makes tokens / T high and a row no cheaper, so
only near-certain drafts pass there (or none); one stream copying its prompt takes many; a
sequence whose drafts are rejected takes none. Counters use vLLM's names.

Method "draft_model": `proposer` (draft_proposer.py) decides the drafts with the same cost
fit, the draft model's forward passes added to the step's seconds, and proposes them; the
scheduler's hooks below (`accepted`, `unverified`, `forget`, `fork`, `reset`) keep its cache
in step with the target's. Without a proposer they do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedkv.engine.ngram import NgramIndex
from pagedkv.engine.spec_config import SpeculativeConfig

PRIOR_RATE = 0.6  # acceptance assumed before a sequence has drafted
PRIOR_WEIGHT = 2.0  # in drafts
DECAY = 0.9  # per verification or scored proposal
PRIOR_SLOPE = 0.3  # one more row costs this share of a one-row step until measured
MARGIN = 0.5  # with B sequences decoding, a draft must beat the step's tokens per second by
#               MARGIN * (1 - 1/B): one stream's every saved token shortens it by a whole step,
#               but in a batch a token saved off a sequence that does not finish last saves
#               only its row, and the sequences that copy (draft well) tend to finish first


@dataclass(slots=True)
class SeqSpec:
    """A sequence's speculation state (Sequence.spec): its n-gram index (None with a draft
    model) and acceptance, and the proposal it did not verify (`probe_at`: the token position
    it guessed, or -1)."""

    index: NgramIndex | None
    accepted: float = 0.0  # decayed
    tried: float = 0.0  # decayed: drafts whose fate was seen (accepted + the first rejected)
    probe_at: int = -1
    probe_token: int = 0
    probe_match: int = 0  # the probe's suffix match length

    def rate(self, prior: float) -> float:
        return (self.accepted + prior * PRIOR_WEIGHT) / (self.tried + PRIOR_WEIGHT)

    def observe(self, drafted: int, accepted: int) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + accepted + (accepted < drafted)


@dataclass(slots=True)
class _Rate:
    """The engine's decayed acceptance of drafts proposed after an n-token match."""

    accepted: float = 0.0
    tried: float = 0.0

    @property
    def value(self) -> float:
        return (self.accepted + PRIOR_RATE * PRIOR_WEIGHT) / (self.tried + PRIOR_WEIGHT)

    def observe(self, drafted: int, accepted: int) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + accepted + (accepted < drafted)


# weak priors of the fit, in pseudo-steps: b = PRIOR_SLOPE * a (decides a and b while the row
# count never varies, one stream) and c = b (a verify row costs a decode row until measured)
_PRIOR_B = 0.01
_PRIOR_C = 0.01


@dataclass(slots=True)
class StepCost:
    """Seconds of a decode-only step with `rows` token rows of which `drafts` verify drafts:
    t = a + b * (rows - drafts) + c * drafts, a decayed least-squares fit of whole steps
    (`decay` per step) with the weak priors above. Invariant: `coef()` is (a, b, c), all > 0;
    before any step it is (1, PRIOR_SLOPE, PRIOR_SLOPE) (units of a one-row step)."""

    decay: float = 0.98
    # sums of w * x_i * x_j (x = 1, plain rows, drafts) and w * x_i * t
    xx: list[float] = field(default_factory=lambda: [0.0] * 9)
    xt: list[float] = field(default_factory=lambda: [0.0] * 3)

    def observe(self, rows: int, seconds: float, drafts: int = 0) -> None:
        d = self.decay
        x = (1.0, float(rows - drafts), float(drafts))
        for i in range(3):
            self.xt[i] = d * self.xt[i] + x[i] * seconds
            for j in range(3):
                self.xx[3 * i + j] = d * self.xx[3 * i + j] + x[i] * x[j]

    def coef(self) -> tuple[float, float, float]:
        if self.xx[0] <= 1e-9:
            return 1.0, PRIOR_SLOPE, PRIOR_SLOPE
        m = list(self.xx)
        s = PRIOR_SLOPE  # + _PRIOR_B * (b - s a)^2 + _PRIOR_C * (c - b)^2
        for (i, j), v in {(0, 0): s * s * _PRIOR_B, (0, 1): -s * _PRIOR_B,
                          (1, 1): _PRIOR_B + _PRIOR_C, (1, 2): -_PRIOR_C,
                          (2, 2): _PRIOR_C}.items():
            m[3 * i + j] += v
            if i != j:
                m[3 * j + i] += v
        sol = _solve3(m, self.xt)
        if sol is not None and min(sol) > 0:
            return sol
        # a noisy fit (a non-positive coefficient): a one-row step of the mean seconds' size
        w = self.xx[0]
        a = self.xt[0] / w / (1 + PRIOR_SLOPE * max((self.xx[1] + self.xx[2]) / w - 1, 0))
        return a, PRIOR_SLOPE * a, PRIOR_SLOPE * a

    def line(self) -> tuple[float, float]:
        """(a, b): a plain decode step's fixed seconds and seconds per row."""
        a, b, _ = self.coef()
        return a, b

    def predict(self, rows: int, drafts: int = 0) -> float:
        a, b, c = self.coef()
        return a + b * (rows - drafts) + c * drafts


def _solve3(m: list[float], v: list[float]) -> tuple[float, float, float] | None:
    """The solution of the 3x3 system m (row-major) x = v by Cramer's rule; None if singular."""
    def det(a: list[float]) -> float:
        return (a[0] * (a[4] * a[8] - a[5] * a[7]) - a[1] * (a[3] * a[8] - a[5] * a[6])
                + a[2] * (a[3] * a[7] - a[4] * a[6]))

    d = det(m)
    if abs(d) < 1e-300:
        return None
    out = []
    for k in range(3):
        a = list(m)
        for i in range(3):
            a[3 * i + k] = v[i]
        out.append(det(a) / d)
    return out[0], out[1], out[2]


class SpecDecoder:
    """The proposer and the policy of one engine, with vLLM's counters: prompt lookup, or
    `proposer` (a DraftProposer, method "draft_model")."""

    def __init__(self, config: SpeculativeConfig, proposer: Any = None) -> None:
        self.config = config
        self.proposer = proposer
        self.k = config.num_speculative_tokens
        self.cost = StepCost()
        self.by_match = [_Rate() for _ in range(config.prompt_lookup_max + 1)]
        self.num_drafts = 0  # sequences that verified drafts (vLLM: spec_decode_num_drafts)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def state(self, s) -> SeqSpec:  # noqa: ANN001
        st = s.spec
        if st is None:
            c = self.config
            index = (None if self.proposer is not None
                     else NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max))
            st = s.spec = SeqSpec(index)
        return st

    def limit(self, s, max_model_len: int | None) -> int:  # noqa: ANN001
        """The most drafts s may verify now: none for requests that do not speculate (beam
        search, structured outputs) or before min_tokens; never past max_tokens (the bonus
        token included) nor to the context's end (no context shift mid-step)."""
        req = s.request
        p = req.params
        generated = len(s.token_ids) - s.num_prompt
        if not req.speculate or s.grammar is not None or generated < p.min_tokens:
            return 0
        k = min(self.k, p.max_tokens - generated - 1)
        if max_model_len is not None:
            k = min(k, max_model_len - s.num_ctx - 2)
        return max(k, 0)

    def drafts(self, decodes: list, rows: int, budget: int,
               max_model_len: int | None = None) -> list[list[int]]:
        """Draft tokens for each decoding sequence (parallel to `decodes`), for a step that
        already has `rows` token rows; at most `budget` drafts in all."""
        out: list[list[int]] = [[] for _ in decodes]
        if budget <= 0 or not decodes:
            return out
        if self.proposer is not None:
            return self.proposer.drafts(self, decodes, rows, budget, max_model_len)
        adaptive = self.config.adaptive
        tokens = float(len(decodes))
        coef = self.cost.coef() if adaptive else (1.0, 0.0, 0.0)
        bar = 1 + MARGIN * (1 - 1 / len(decodes))
        if adaptive and not _worth(coef, bar, tokens, rows, 0, 1.0):
            return out  # not even a sure draft would pay: do not propose at all
        cands = []
        for i, s in enumerate(decodes):
            k = self.limit(s, max_model_len)
            if k <= 0:
                continue
            st = self.state(s)
            if adaptive:
                self._score_probe(st, s.token_ids)
            d = st.index.propose(s.token_ids, k)
            if not d:
                continue
            out[i] = d
            if adaptive:
                a = st.rate(self.by_match[st.index.matched].value)
                cands.extend((a ** (j + 1), j, i) for j in range(len(d)))
        if not adaptive:
            return _within(out, budget)
        cands.sort(key=lambda c: (-c[0], c[1]))
        keep = [0] * len(decodes)
        taken = 0
        for g, j, i in cands:
            if taken >= budget or j != keep[i] or not _worth(coef, bar, tokens, rows, taken, g):
                continue
            keep[i] += 1
            tokens += g
            taken += 1
        for i, d in enumerate(out):
            if d and not keep[i]:  # not verified: scored when the next token comes
                st = decodes[i].spec
                st.probe_at, st.probe_token = len(decodes[i].token_ids), d[0]
                st.probe_match = st.index.matched
            out[i] = d[: keep[i]]
        return out

    def _score_probe(self, st: SeqSpec, toks: list[int]) -> None:
        """The proposal s did not verify meets the token the target chose at its position."""
        at = st.probe_at
        if 0 <= at < len(toks):
            hit = int(toks[at] == st.probe_token)
            st.observe(1, hit)
            self.by_match[st.probe_match].observe(1, hit)
            st.probe_at = -1

    def observe(self, s, drafted: int, accepted: int) -> None:  # noqa: ANN001
        """s verified `drafted` drafts and the target agreed with the first `accepted`."""
        st = self.state(s)
        st.observe(drafted, accepted)
        rate = self.proposer.rate if st.index is None else self.by_match[st.index.matched]
        rate.observe(drafted, accepted)
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        req = s.request
        req.num_draft_tokens += drafted
        req.num_accepted_tokens += accepted

    def observe_step(self, plan, seconds: float) -> None:  # noqa: ANN001
        """A decode-only step's whole seconds (schedule to outputs) for the cost fit."""
        drafts = sum(len(d) for d in plan.drafts)
        if self.proposer is not None:  # the target's cost, without the draft's passes
            seconds -= self.proposer.take_step_seconds()
        self.cost.observe(len(plan.decodes) + drafts, seconds, drafts)

    def stats(self) -> dict[str, float]:
        n = self.num_draft_tokens
        out = {"spec_decode_num_drafts": self.num_drafts,
               "spec_decode_num_draft_tokens": n,
               "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
               "spec_decode_acceptance_rate": self.num_accepted_tokens / n if n else 0.0}
        if self.proposer is not None:
            out.update(self.proposer.stats())
        return out

    # --- the scheduler's hooks (a draft model's cache follows the target's) ----------------------

    def accepted(self, s, m: int) -> None:  # noqa: ANN001
        """s verified its drafts, m accepted, and still runs."""
        if self.proposer is not None:
            self.proposer.accepted(s, m)

    def unverified(self, s) -> None:  # noqa: ANN001
        """s's drafts were proposed but will not be verified (no lookahead slots)."""
        if self.proposer is not None:
            self.proposer.accepted(s, 0)

    def forget(self, s) -> None:  # noqa: ANN001
        """s's blocks went back (preempted, finished, aborted) or its context was edited."""
        if self.proposer is not None:
            self.proposer.forget(s)

    def fork(self, parent, child) -> None:  # noqa: ANN001
        if self.proposer is not None:
            self.proposer.fork(parent, child)

    def reset(self) -> None:
        """The target's prefix cache was emptied."""
        if self.proposer is not None:
            self.proposer.reset()

    def draft_probs(self, seqs: list, drafts: list[list[int]]) -> list | None:
        """The q rows of each sampler's drafts (None without a sampling draft model)."""
        if self.proposer is None:
            return None
        return [self.proposer.q_rows(s, len(d)) for s, d in zip(seqs, drafts, strict=True)]


def _worth(coef: tuple[float, float, float], bar: float, tokens: float, rows: int,
           drafts: int, gain: float) -> bool:
    """One more verify row with `gain` expected tokens, in a step of `rows` plain rows and
    `drafts` verify rows expected to yield `tokens`, beats the step's tokens per second by
    the factor `bar`: gain / c > bar * tokens / T (coef: StepCost's a, b, c)."""
    a, b, c = coef
    return gain * (a + b * rows + c * drafts) > bar * tokens * c


def _within(drafts: list[list[int]], budget: int) -> list[list[int]]:
    out = []
    for d in drafts:
        d = d[: max(budget, 0)]
        budget -= len(d)
        out.append(d)
    return out


__all__ = ["MARGIN", "SeqSpec", "SpecDecoder", "StepCost"]
