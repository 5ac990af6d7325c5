"""Speculative decoding's policy: which decoding sequences verify how many draft tokens.

Each step the scheduler asks `SpecDecoder.drafts(decodes, rows, budget)`: for every decoding
sequence that may speculate, the proposer (prompt lookup, `ngram.py`) offers up to k tokens
(k = num_speculative_tokens, less near max_tokens or the context's end); the policy keeps a
prefix of each. Adaptive (the default): the j-th draft of a sequence whose drafts are accepted
at rate a is worth a**j expected tokens, and it costs one more row in the step; drafts are
taken, best first, while the step's expected tokens per predicted second still rise. The cost
of a step by its rows is measured (`StepCost`: a decayed least-squares line over the decode-only
steps' forward seconds), so speculation backs off by itself where rows are not cheap: a large
batch (compute-bound) or low acceptance gets no drafts, one stream copying its prompt gets many.

Acceptance per sequence is a decayed count (`SeqSpec`), pulled toward the engine's decayed
acceptance for drafts of the same match length (a 1-token suffix match is a much weaker
proposal than a 4-token one), so a sequence that stopped drafting is tried again after a
while. Counters use vLLM's names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.engine.ngram import NgramIndex
from pagedkv.engine.spec_config import SpeculativeConfig

PRIOR_RATE = 0.6  # acceptance assumed before a sequence has drafted
PRIOR_WEIGHT = 2.0  # in drafts
DECAY = 0.9  # per verification (and per step a sequence with a match does not draft)
PRIOR_SLOPE = 0.3  # one more row costs this share of a one-row step until measured


@dataclass(slots=True)
class SeqSpec:
    """A sequence's speculation state (Sequence.spec): its n-gram index and acceptance."""

    index: NgramIndex
    accepted: float = 0.0  # decayed
    tried: float = 0.0  # decayed: drafts whose fate was seen (accepted + the first rejected)

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


@dataclass(slots=True)
class StepCost:
    """Forward seconds of a step by its token rows: t = a + b * rows, fitted over decode-only
    steps with exponential decay; until two row counts were seen, b = PRIOR_SLOPE * a."""

    decay: float = 0.98
    s: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, wr, wrr, wt, wrt

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        for i, v in enumerate((1.0, rows, rows * rows, seconds, rows * seconds)):
            self.s[i] = d * self.s[i] + v

    def line(self) -> tuple[float, float]:
        w, wr, wrr, wt, wrt = self.s
        if w <= 0:
            return 1.0, PRIOR_SLOPE
        mr, mt = wr / w, wt / w
        var = wrr / w - mr * mr
        if var > 0.25:
            b = (wrt / w - mr * mt) / var
            a = mt - b * mr
            if b > 0 and a > 0:
                return a, b
        a = mt / (1 + PRIOR_SLOPE * (mr - 1)) if mr >= 1 else mt
        return a, PRIOR_SLOPE * a

    def predict(self, rows: int) -> float:
        a, b = self.line()
        return a + b * rows


class SpecDecoder:
    """The proposer and the policy of one engine (method "ngram"), with vLLM's counters."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
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
            st = s.spec = SeqSpec(NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max))
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
        adaptive = self.config.adaptive
        tokens = float(len(decodes))
        if adaptive and not self._worth(tokens, rows, 1.0):
            return out  # not even a sure draft would pay: do not propose at all
        cands = []
        for i, s in enumerate(decodes):
            k = self.limit(s, max_model_len)
            if k <= 0:
                continue
            st = self.state(s)
            d = st.index.propose(s.token_ids, k)
            if not d:
                continue
            if not adaptive:
                out[i] = d
                continue
            a = st.rate(self.by_match[st.index.matched].value)
            cands.extend((a ** (j + 1), j, i) for j in range(len(d)))
            out[i] = d
        if not adaptive:
            return _within(out, budget)
        cands.sort(key=lambda c: (-c[0], c[1]))
        keep = [0] * len(decodes)
        taken = 0
        for g, j, i in cands:
            if taken >= budget or j != keep[i] or not self._worth(tokens, rows, g):
                continue
            keep[i] += 1
            tokens += g
            rows += 1
            taken += 1
        for i, d in enumerate(out):
            if d and not keep[i]:
                st = decodes[i].spec
                st.accepted *= DECAY  # skipped: drift back toward the prior, to try again later
                st.tried *= DECAY
            out[i] = d[: keep[i]]
        return out

    def _worth(self, tokens: float, rows: int, gain: float) -> bool:
        """One more row with `gain` expected tokens raises tokens per predicted second."""
        predict = self.cost.predict
        return (tokens + gain) * predict(rows) > tokens * predict(rows + 1)

    def observe(self, s, drafted: int, accepted: int) -> None:  # noqa: ANN001
        """s verified `drafted` drafts and the target agreed with the first `accepted`."""
        st = self.state(s)
        st.observe(drafted, accepted)
        r = self.by_match[st.index.matched]
        r.accepted = DECAY * r.accepted + accepted
        r.tried = DECAY * r.tried + accepted + (accepted < drafted)
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        req = s.request
        req.num_draft_tokens += drafted
        req.num_accepted_tokens += accepted

    def stats(self) -> dict[str, float]:
        n = self.num_draft_tokens
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": n,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_acceptance_rate": self.num_accepted_tokens / n if n else 0.0}


def _within(drafts: list[list[int]], budget: int) -> list[list[int]]:
    out = []
    for d in drafts:
        d = d[: max(budget, 0)]
        budget -= len(d)
        out.append(d)
    return out


__all__ = ["SeqSpec", "SpecDecoder", "StepCost"]
