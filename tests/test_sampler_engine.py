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


def test_a_row_that_cannot_be_sampled_fails_only_its_request(smollm2) -> None:  # noqa: ANN001
    """NaN logits in one row (here injected into the forward's output) end that request with
    finish_reason 'error'; the others in the same steps finish exactly as they would alone."""
    prompts = [PROMPT, "Hello there", "One two three"]
    params = [SamplingParams(temperature=0, max_tokens=8),
              SamplingParams(temperature=0.7, max_tokens=8, seed=3),
              SamplingParams(temperature=0.9, top_p=0.8, max_tokens=8, seed=4)]
    want = [o.token_ids for o in LLM(smollm2, num_blocks=64).generate(prompts, params)]
    llm = LLM(smollm2, num_blocks=64)
    eng = llm.engine
    run = eng.runner.run

    def poisoned(plan):  # noqa: ANN001, ANN202
        logits = run(plan)
        for row, s in enumerate(plan.samplers):
            if s.request.request_id == "bad" and len(s.output_ids) == 2:
                logits = logits.clone()
                logits[row] = float("nan")
        return logits

    eng.runner.run = poisoned
    eng.add_request("bad", "Tell me a story", SamplingParams(temperature=0.8, max_tokens=8, seed=5))
    for i, (pr, p) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(str(i), pr, p)
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert done["bad"].finish_reason == "error" and len(done["bad"].token_ids) == 2
    assert [done[str(i)].token_ids for i in range(3)] == want
    eng.cache.check_invariants()
    assert eng.stats().blocks_used == 0


def test_penalties_bias_min_tokens_match_transformers(smollm2, hf_smollm2) -> None:  # noqa: ANN001
    """Greedy with repetition_penalty, logit_bias and min_tokens against transformers' generate
    with the same processors (repetition counts prompt + output in both)."""
    import torch

    tok = smollm2.tokenizer
    eos = tok.eos_token_id
    chats = ["Name a colour.", "Say yes.", "Count to five."]
    ids = [list(tok(tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                            add_generation_prompt=True),
                    add_special_tokens=False).input_ids) for c in chats]
    bias = {tok.encode(" the")[0]: 3.0, tok.encode("Yes")[0]: -100.0}
    p = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, min_tokens=12,
                       logit_bias=bias)
    ours = [o.token_ids for o in LLM(smollm2, num_blocks=128).generate(ids, p)]
    for i, prompt in enumerate(ids):
        with torch.inference_mode():
            out = hf_smollm2.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=20, do_sample=False, repetition_penalty=1.3, min_new_tokens=12,
                sequence_bias={(t,): b for t, b in bias.items()}, pad_token_id=eos,
                eos_token_id=eos)
        ref = out[0, len(prompt):].tolist()
        assert len(ours[i]) >= 12
        assert ours[i] == ref, (i, tok.decode(ours[i]), tok.decode(ref))
