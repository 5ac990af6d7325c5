"""Verifying draft tokens against the target's rows (speculative decoding).

A sequence that verified d drafts has d + 1 rows: row j is the target's distribution for the
token after the context plus drafts[:j]. Both rules return the tokens to append: the accepted
drafts, then one more token from the first row not consumed (the correction after a
rejection, or the bonus token when every draft was accepted), so 1..d+1 tokens.

- Greedy: draft j is accepted while it equals row j's argmax; the extra token is that row's
  argmax. Token for token what decoding one token per step gives.
- Sampled (rejection sampling, Leviathan et al. / Chen et al.; vLLM's rejection sampler): a
  draft from a proposer with distribution q is accepted with probability min(1, p(x)/q(x));
  after a rejection the token is drawn from the residual max(0, p - q), normalized. Prompt
  lookup and greedy draft models propose one token for certain (q is a point mass), so draft
  x is accepted with probability p(x), and the residual is p without x; a sampling draft model
  passes its rows q (the distributions it drew each draft from). Each emitted token then has
  exactly the target's distribution p (tests: a chi-square over many draws, both ways).
- Seeded (a request with a seed, while speculative decoding is on): every token, drafted or
  not, is the Gumbel-max of its row, argmax(log p + G) with G drawn from a generator keyed by
  (seed, sample index, position), and a draft is accepted while it equals that token. The
  distribution is exactly p again, and the output no longer depends on how many drafts each
  step verified (which the adaptive policy decides from timings): a seed stays reproducible.
"""

from __future__ import annotations

import torch


def accept_greedy(argmax: list[int], draft: list[int]) -> list[int]:
    """Greedy verification: `argmax` holds the d + 1 rows' argmax tokens."""
    out = []
    for j, t in enumerate(draft):
        out.append(argmax[j])
        if argmax[j] != t:
            return out
    out.append(argmax[len(draft)])
    return out


def accept_sampled(probs: torch.Tensor, draft: list[int],
                   generator: torch.Generator | None, q: torch.Tensor | None = None) -> list[int]:
    """Rejection sampling: probs [d + 1, V] float64, the target's (warped) distribution per
    row, rows summing to 1 (or more precisely: to anything > 0); q [d, V] (summing to 1) the
    draft's distribution of each draft, None for point masses."""
    out = []
    for j, t in enumerate(draft):
        row = probs[j]
        total = float(row.sum())
        qt = 1.0 if q is None else float(q[j, t])
        if _uniform(generator) * total * qt < float(row[t]):  # u < p(x) / q(x)
            out.append(t)
            continue
        if q is None:
            residual = row.clone()
            residual[t] = 0.0
        else:
            residual = (row / total - q[j].double()).clamp_(min=0.0)
            if not float(residual.sum()) > 0:  # p == q up to rounding: never rejects, in theory
                residual = row
        out.append(draw(residual, generator))
        return out
    out.append(draw(probs[len(draft)], generator))
    return out


def gumbel_tokens(warped: torch.Tensor, gens: list[torch.Generator]) -> list[int]:
    """Row i's Gumbel-max token under generator i: argmax(x - log(-log u)), x [n, V] the
    warped logits (dropped tokens -inf, never taken)."""
    u = torch.stack([torch.rand(warped.shape[-1], generator=g, dtype=torch.float64)
                     for g in gens])
    noise = -torch.log(-torch.log(u.clamp_(min=1e-300)))
    return (warped.double() + noise).argmax(-1).tolist()


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand(1, generator=generator, dtype=torch.float64))


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn in proportion to `weights` (float64 [V], not all zero): the CDF
    inverted at one uniform; a token of weight 0 is never taken."""
    cdf = weights.cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp_(max=weights.shape[0] - 1))


__all__ = ["accept_greedy", "accept_sampled", "draw", "gumbel_tokens"]
