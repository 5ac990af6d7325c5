"""Token sampling for one step: greedy rows in one argmax, random rows with their own generator."""

from __future__ import annotations

import hashlib

import torch

from pagedkv.engine.sampling_params import SamplingParams


def generator_for(seed: int, index: int) -> torch.Generator:
    """The generator of sample `index` of a request seeded with `seed` (any int64): its seed is a
    63-bit hash of both, so every int64 is valid and samples of one request differ."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def sample(
    logits: torch.Tensor,  # [B, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One token per row. Seeded rows draw from their own generator so results do not depend on
    what else is in the batch."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = _sample_row(logits[i], p, generators[i])
    return out


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    x = row / p.temperature
    if p.top_k > 0 and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop tokens once the mass before them already reaches top_p (the first always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        drop[0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(0, idx, sorted_x)
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def top_logprobs(logits_row: torch.Tensor, token: int, k: int) -> dict[int, float]:
    """The sampled token's log-probability and the k most likely ones (raw model distribution)."""
    lp = torch.log_softmax(logits_row.float(), dim=-1)
    out = {}
    if k > 0:
        vals, ids = torch.topk(lp, k)
        out = dict(zip(ids.tolist(), vals.tolist(), strict=True))
    out[token] = float(lp[token])
    return out
