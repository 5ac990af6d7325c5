"""Sampling through the real engine: degenerate values, 64-bit seeds, one bad row failing alone."""

from __future__ import annotations

import pytest

from pagedkv.engine import LLM, SamplingParams

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(smollm2) -> LLM:  # noqa: ANN001
    return LLM(smollm2, num_blocks=128)


def test_underflowing_values_sample_exactly(llm: LLM) -> None:
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6))[0].token_ids
    for params in (SamplingParams(temperature=1e-40, max_tokens=6),
                   SamplingParams(top_p=1e-300, max_tokens=6, seed=1),
                   SamplingParams(temperature=1e-40, top_p=1e-300, max_tokens=6)):
        out = llm.generate(PROMPT, params)[0]
        assert out.finish_reason == "length"
        assert out.token_ids == greedy  # both are exactly "the most likely token"


@pytest.mark.parametrize("seed", [0, 2**62, 2**63 - 1, -(2**63), -1])
def test_int64_seeds_reproduce(llm: LLM, seed: int) -> None:
    p = SamplingParams(temperature=1.0, max_tokens=8, seed=seed)
    a = llm.generate(PROMPT, p)[0].token_ids
    # the same seed in a different batch gives the same tokens
    b = llm.generate([PROMPT, "Hello"], [p, SamplingParams(temperature=1.0, max_tokens=8)])[0]
    assert b.token_ids == a


def test_different_seeds_differ(llm: LLM) -> None:
    outs = {tuple(llm.generate(PROMPT, SamplingParams(temperature=1.5, max_tokens=8,
                                                      seed=s))[0].token_ids)
            for s in (2**63 - 1, -(2**63), 1, 2)}
    assert len(outs) > 1
