"""Sampler benchmark: one decode step's sampling for a batch, on random logits (no model).

Batch 64 over SmolLM2's vocabulary (49,152). For each mix of sampling parameters, measured in one
run, side by side: `batched_ms` (median time of one `Sampler` call for the whole batch) and
`per_row_ms` (the same rows sampled one at a time the way the pre-batching sampler did: a loop
over rows, a full sort per row for top-p), with `speedup`. The `penalties_*` mixes carry
repetition/frequency/presence penalties with 128 and 1,024 generated tokens per sequence: the
batched time must not grow with output length (`penalty_growth` = time at 1,024 / time at 128).

`pagedkv bench sampler` prints one JSON object.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from pagedkv.engine.sampler import Sampler, generator_for
from pagedkv.engine.sampling_params import SamplingParams

VOCAB = 49_152
BATCH = 64
MIXES = {
    "greedy": lambda i: SamplingParams(temperature=0),
    "temperature": lambda i: SamplingParams(temperature=0.8),
    "top_p": lambda i: SamplingParams(temperature=0.8, top_p=0.95),
    "top_k_top_p": lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "mixed_seeded": lambda i: [SamplingParams(temperature=0),
                               SamplingParams(temperature=0.7, top_p=0.9, seed=i),
                               SamplingParams(temperature=1.0, top_k=40, seed=i),
                               SamplingParams(temperature=0.9, min_p=0.05)][i % 4],
}
PENALTY = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1,
                         frequency_penalty=0.5, presence_penalty=0.3)


@dataclass
class _Req:
    params: SamplingParams


@dataclass(eq=False)
class _Seq:
    token_ids: list[int]
    request: _Req
    num_prompt: int
    generator: torch.Generator | None
    finished: bool = False
    grammar: None = None  # structured outputs: none here


def add_args(ap) -> None:  # noqa: ANN001
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per mix")


def _seqs(params: list[SamplingParams], out_len: int, g: torch.Generator) -> list[_Seq]:
    seqs = []
    for p in params:
        ids = torch.randint(0, VOCAB, (64 + out_len,), generator=g).tolist()
        gen = None if p.seed is None else generator_for(p.seed, 0)
        seqs.append(_Seq(ids, _Req(p), 64, gen))
    return seqs


def _time_batched(seqs: list[_Seq], logits: torch.Tensor, steps: int) -> float:
    sampler = Sampler([2])
    sampler(logits, seqs)  # builds any penalty history once
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        toks = sampler(logits, seqs)
        times.append(time.perf_counter() - t0)
        for s, t in zip(seqs, toks, strict=True):  # the engine appends the sampled token
            s.token_ids.append(t)
    return statistics.median(times) * 1e3


def _per_row(logits: torch.Tensor, params: list[SamplingParams],
             gens: list[torch.Generator | None]) -> list[int]:
    """The pre-batching algorithm (reference for the ratio): one row at a time."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        x = logits[i] / p.temperature
        if 0 < p.top_k < x.numel():
            x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
        if p.top_p < 1.0:
            sx, idx = torch.sort(x, descending=True)
            pr = torch.softmax(sx, dim=-1)
            drop = (torch.cumsum(pr, dim=-1) - pr) >= p.top_p
            drop[0] = False
            x = torch.empty_like(x).scatter_(0, idx, sx.masked_fill(drop, float("-inf")))
        out[i] = int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=gens[i]))
    return out


def _time_per_row(seqs: list[_Seq], logits: torch.Tensor, steps: int) -> float:
    params = [s.request.params for s in seqs]
    gens = [s.generator for s in seqs]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _per_row(logits, params, gens)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(args) -> dict:  # noqa: ANN001
    batch = args.batch if not args.quick else 8
    steps = args.steps if not args.quick else 3
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, VOCAB, generator=g) * 4
    result: dict = {"batch": batch, "vocab": VOCAB, "steps": steps,
                    "threads": torch.get_num_threads(), "mixes": {}}
    for name, make in MIXES.items():
        seqs = _seqs([make(i) for i in range(batch)], 0, g)
        batched = _time_batched(seqs, logits, steps)
        per_row = _time_per_row(seqs, logits, steps)
        result["mixes"][name] = {"batched_ms": round(batched, 3), "per_row_ms": round(per_row, 3),
                                 "speedup": round(per_row / batched, 2)}
    for out_len in (128, 1024):
        seqs = _seqs([PENALTY] * batch, out_len, g)
        result["mixes"][f"penalties_{out_len}"] = {
            "batched_ms": round(_time_batched(seqs, logits, steps), 3)}
    p = result["mixes"]
    result["penalty_growth"] = round(p["penalties_1024"]["batched_ms"]
                                     / p["penalties_128"]["batched_ms"], 2)
    return result
