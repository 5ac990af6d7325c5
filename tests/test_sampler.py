"""The batched sampler on synthetic logits, against transformers' logits processors."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pagedkv.engine.sampler import FAILED, Sampler, generator_for, warp
from pagedkv.engine.sampling_params import SamplingParams

V = 64
EOS = 2


@dataclass
class Req:
    params: SamplingParams


@dataclass(eq=False)
class Seq:
    """The part of engine/sequence.py's Sequence the sampler reads."""

    token_ids: list[int]
    request: Req
    num_prompt: int
    generator: torch.Generator | None = None
    finished: bool = False
    extra: dict = field(default_factory=dict)
    grammar: None = None  # structured outputs: none here


def seq(params: SamplingParams, prompt: list[int], out: list[int] = (), index: int = 0) -> Seq:
    gen = None if params.seed is None else generator_for(params.seed, index)
    return Seq(list(prompt) + list(out), Req(params), len(prompt), gen)


def logits(rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax() -> None:
    x = logits(5)
    seqs = [seq(SamplingParams(temperature=t, top_k=k), [1]) for t, k in
            [(0, -1), (1e-40, -1), (1.0, 1), (0, 5), (0.0, 0)]]
    assert Sampler([EOS])(x, seqs) == x.argmax(-1).tolist()


def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    x = logits(6)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(6)]
    alone = [Sampler()(x[i:i + 1], [seq(p, [1])])[0] for i, p in enumerate(params)]
    bad = x.clone()
    bad[1, 3] = float("nan")
    bad[2, 7] = float("inf")
    bad[3] = float("-inf")
    got = Sampler()(bad, [seq(p, [1]) for p in params])
    assert got[1:4] == [FAILED] * 3
    assert [got[i] for i in (0, 4, 5)] == [alone[i] for i in (0, 4, 5)]
    greedy = [SamplingParams(temperature=0)] * 6
    got = Sampler()(bad, [seq(p, [1]) for p in greedy])
    assert got == [int(x[0].argmax()), FAILED, FAILED, FAILED, int(x[4].argmax()),
                   int(x[5].argmax())]


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    x = logits(1)
    p = SamplingParams(temperature=1.0, seed=-(2**63))
    alone = [Sampler()(x, [seq(p, [1])])[0] for _ in range(3)]
    assert len(set(alone)) == 1
    crowd = torch.cat([logits(3, seed=9), x, logits(2, seed=8)])
    others = [SamplingParams(temperature=1.0)] * 3 + [p] + [SamplingParams(top_k=3)] * 2
    assert Sampler()(crowd, [seq(q, [1]) for q in others])[3] == alone[0]


def _hf_chain(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers, in the sampler's order: temperature, min_p, top-k, top-p."""
    ids = torch.zeros(x.shape[0], 1, dtype=torch.long)
    procs = [TemperatureLogitsWarper(p.temperature)]
    if p.min_p > 0:
        procs.append(MinPLogitsWarper(p.min_p))
    if p.top_k > 0:
        procs.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        procs.append(TopPLogitsWarper(p.top_p))
    for proc in procs:
        x = proc(ids, x)
    return torch.softmax(x, dim=-1)


@pytest.mark.parametrize("kw", [
    dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(top_p=0.8),
    dict(temperature=0.5, top_k=20, top_p=0.6), dict(min_p=0.1), dict(min_p=0.3, top_p=0.9),
    dict(temperature=2.0, min_p=0.05, top_k=10, top_p=0.95),
])
def test_warpers_match_transformers(kw: dict) -> None:
    x = logits(8, seed=3)
    p = SamplingParams(**kw)
    ours = torch.softmax(warp(x, [p] * 8), dim=-1)
    torch.testing.assert_close(ours, _hf_chain(x, p), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scale", [8.0, 0.3])  # peaked: the top-p window covers; flat: full sort
def test_wide_vocabulary_top_p_window_and_fallback(scale: float) -> None:
    x = logits(6, seed=12, vocab=5000) / 3 * scale
    ps = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5, temperature=1.5),
          SamplingParams(top_k=2000, top_p=0.95), SamplingParams(top_k=7),
          SamplingParams(top_p=0.99, min_p=0.01), SamplingParams(top_p=0.3)]
    ours = torch.softmax(warp(x, ps), dim=-1)
    for i, p in enumerate(ps):
        torch.testing.assert_close(ours[i:i + 1], _hf_chain(x[i:i + 1], p), atol=1e-6,
                                   rtol=1e-4)


def test_seeded_token_does_not_depend_on_the_candidate_window() -> None:
    x = logits(1, seed=13, vocab=5000)
    p = SamplingParams(top_p=0.9, seed=5)
    alone = Sampler()(x, [seq(p, [1])])[0]
    flat = logits(1, seed=14, vocab=5000) * 0.01  # forces a full sort for its row
    wide = [SamplingParams(top_k=3000), SamplingParams(top_p=0.99)]
    for other in wide:
        got = Sampler()(torch.cat([flat, x]), [seq(other, [1]), seq(p, [1])])
        assert got[1] == alone
    assert Sampler()(x, [seq(SamplingParams(top_p=0.9, top_k=4000, seed=5), [1])])[0] == alone


def test_mixed_rows_warp_like_each_alone() -> None:
    x = logits(4, seed=5)
    ps = [SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams(temperature=0.3),
          SamplingParams(min_p=0.2, top_k=40)]
    torch.testing.assert_close(warp(x, ps), torch.cat([warp(x[i:i + 1], [p])
                                                       for i, p in enumerate(ps)]))


def test_draws_follow_the_distribution() -> None:
    """20,000 rows of the same logits in one call: frequencies match the warped softmax."""
    x = logits(1, seed=11, vocab=8).expand(20_000, 8).contiguous()
    p = SamplingParams(temperature=0.9, top_k=6, top_p=0.9)
    want = _hf_chain(x[:1], p)[0]
    got = torch.bincount(torch.tensor(Sampler()(x, [seq(p, [1])] * 20_000)), minlength=8)
    freq = got.float() / 20_000
    assert ((freq - want).abs() <= 4 * (want * (1 - want) / 20_000).sqrt() + 1e-9).all()
    assert (got[want == 0] == 0).all()


def test_repetition_penalty_matches_transformers() -> None:
    x = logits(3, seed=4)
    prompts, outs = [[5, 6, 7], [1, 1], [9]], [[7, 8], [], [10, 11, 9]]
    for rp in (0.5, 1.3, 2.0):
        p = SamplingParams(repetition_penalty=rp, temperature=0)
        seqs = [seq(p, pr, o) for pr, o in zip(prompts, outs, strict=True)]
        ours = Sampler().adjust(x, seqs)
        proc = RepetitionPenaltyLogitsProcessor(rp)
        ref = torch.cat([proc(torch.tensor([s.token_ids]), x[i:i + 1].clone())
                         for i, s in enumerate(seqs)])
        torch.testing.assert_close(ours, ref)


def test_presence_frequency_count_generated_tokens_only() -> None:
    x = logits(2, seed=6)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=-1.5)
    seqs = [seq(p, [3, 3, 4], [4, 4, 5]), seq(p, [6], [])]
    ref = x.clone()
    for tok, n in ((4, 2), (5, 1)):  # OpenAI: logit -= count * freq + (count > 0) * presence
        ref[0, tok] -= n * -1.5 + 0.5
    torch.testing.assert_close(Sampler().adjust(x, seqs), ref)


def test_logit_bias_matches_transformers() -> None:
    x = logits(2, seed=7)
    bias = {3: -100.0, 10: 5.5, V - 1: 100.0}
    p = SamplingParams(logit_bias=bias)
    ours = Sampler().adjust(x, [seq(p, [1]), seq(SamplingParams(), [1])])
    proc = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    ref = proc(torch.tensor([[1]]), x[:1].clone())
    torch.testing.assert_close(ours[0], ref[0])
    torch.testing.assert_close(ours[1], x[1])  # the other row is untouched


@pytest.mark.parametrize("n_out", [0, 2, 3, 5])
def test_min_tokens_matches_transformers(n_out: int) -> None:
    x = logits(1, seed=8)
    x[0, EOS] = 50.0  # EOS is the argmax
    p = SamplingParams(min_tokens=3, temperature=0)
    s = seq(p, [1, 4], list(range(10, 10 + n_out)))
    ours = Sampler([EOS]).adjust(x, [s])
    proc = MinNewTokensLengthLogitsProcessor(2, 3, EOS)
    torch.testing.assert_close(ours, proc(torch.tensor([s.token_ids]), x.clone()))
    assert (Sampler([EOS])(x, [s])[0] == EOS) == (n_out >= 3)


def test_min_tokens_masks_stop_token_ids_and_respects_ignore_eos() -> None:
    x = logits(1, seed=9)
    s = seq(SamplingParams(min_tokens=2, stop_token_ids=[5], ignore_eos=True), [1])
    ours = Sampler([EOS]).adjust(x, [s])
    assert ours[0, 5] == float("-inf") and ours[0, EOS] == x[0, EOS]


def test_history_is_incremental_and_forgotten() -> None:
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.2,
                       temperature=0)
    live = Sampler()
    s = seq(p, [1, 2, 3])
    for step in range(12):
        x = logits(1, seed=step)
        got = live.adjust(x, [s])
        torch.testing.assert_close(got, Sampler().adjust(x, [seq(p, s.token_ids[:3],
                                                                 s.token_ids[3:])]))
        s.token_ids.append(int(got.argmax()) if step % 3 else 2)
    assert len(live._hist) == 1
    s.finished = True
    live.adjust(logits(1), [seq(SamplingParams(), [1])])
    assert not live._hist


def _reference_adjust(x: torch.Tensor, s: Seq, eos: list[int]) -> torch.Tensor:
    """Shadow model: the adjustments computed from scratch with plain Python counting."""
    p = s.request.params
    out = x.clone()
    prompt, gen = s.token_ids[:s.num_prompt], s.token_ids[s.num_prompt:]
    for t, b in p.logit_bias.items():
        out[0, t] += b
    if len(gen) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            out[0, t] = float("-inf")
    for t in set(prompt) | set(gen):
        v = out[0, t]
        out[0, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    for t in set(gen):
        out[0, t] -= p.frequency_penalty * gen.count(t) + p.presence_penalty
    return out


@given(
    rep=st.sampled_from([1.0, 0.5, 1.7]), freq=st.sampled_from([0.0, -1.0, 1.5]),
    pres=st.sampled_from([0.0, 0.4, -2.0]), min_tokens=st.integers(0, 4),
    bias=st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100), max_size=4),
    prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=6),
    chunks=st.lists(st.lists(st.integers(0, V - 1), max_size=3), min_size=1, max_size=6),
)
@settings(max_examples=60, deadline=None)
def test_incremental_history_matches_a_shadow_model(rep, freq, pres, min_tokens, bias, prompt,
                                                    chunks) -> None:  # noqa: ANN001
    p = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                       min_tokens=min_tokens, logit_bias=bias, stop_token_ids=[7],
                       max_tokens=16)
    sampler = Sampler([EOS])
    s = seq(p, prompt)
    other = seq(SamplingParams(presence_penalty=1.0), [1, 2])
    for step, chunk in enumerate(chunks):
        x = logits(2, seed=step)
        got = sampler.adjust(x, [s, other])
        torch.testing.assert_close(got[:1], _reference_adjust(x[:1], s, [EOS]))
        torch.testing.assert_close(got[1:], _reference_adjust(x[1:], other, [EOS]))
        s.token_ids.extend(chunk)  # one token per step, or several (e.g. after a fork)
        other.token_ids.append(step % V)
