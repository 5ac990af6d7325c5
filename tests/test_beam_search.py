"""Beam search over shared blocks against transformers' `generate(num_beams=k, do_sample=False)`
on the same weights; block sharing, pruned beams' blocks returned, parameter checks."""

from __future__ import annotations

import pytest
import torch

from pagedkv import BeamSearchParams as TopLevelBeamSearchParams
from pagedkv.engine import LLM, BeamSearchParams
from pagedkv.errors import InvalidParamsError, PagedKVError

PROMPTS = [
    "What is the capital of Japan? Answer briefly.",
    "Write a short poem about a lighthouse.",
    "Explain how a hash table works.",
    "Give me three tips for learning a new language.",
    "What is 12 times 13?",
    "Describe the water cycle.",
    "Why do cats purr?",
    "Say hi.",
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llm(smollm2) -> LLM:  # noqa: ANN001
    return LLM(smollm2, num_blocks=256, block_size=4)


@pytest.fixture(scope="module")
def chat_ids(smollm2) -> list[list[int]]:  # noqa: ANN001
    tok = smollm2.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in PROMPTS]
    return [list(tok(t, add_special_tokens=False).input_ids) for t in texts]


def _hf_beams(hf, ids: list[int], k: int, penalty: float, eos: list[int]) -> list[int]:  # noqa: ANN001
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=MAX_TOKENS, do_sample=False, num_beams=k,
                          length_penalty=penalty, early_stopping=False, eos_token_id=eos,
                          pad_token_id=eos[0])
    toks = out[0, len(ids):].tolist()
    while len(toks) > 1 and toks[-1] == eos[0] and toks[-2] in eos:  # padding after an EOS
        toks.pop()
    return toks


@pytest.mark.slow
@pytest.mark.parametrize("k, penalty", [(2, 1.0), (4, 0.5)])
def test_beams_match_transformers(llm, hf_smollm2, chat_ids, k, penalty) -> None:  # noqa: ANN001
    eos = sorted(llm.engine.eos_ids)
    outs = llm.beam_search(chat_ids, BeamSearchParams(k, MAX_TOKENS, length_penalty=penalty))
    mismatches = []
    for ids, out in zip(chat_ids, outs, strict=True):
        assert 1 <= len(out.sequences) <= k
        scores = [b.score for b in out.sequences]
        assert scores == sorted(scores, reverse=True)
        ref = _hf_beams(hf_smollm2, ids, k, penalty, eos)
        if out.token_ids != ref:
            mismatches.append((out.token_ids, ref))
    assert not mismatches
    assert llm.engine.cache.num_free_blocks == llm.engine.cache.num_blocks  # nothing leaked


def test_beams_share_blocks_and_pruned_beams_give_them_back(llm, chat_ids) -> None:  # noqa: ANN001
    steps = []
    outs = llm.beam_search(chat_ids[:2], BeamSearchParams(4, 6), on_step=steps.append)
    assert len(outs) == 2 and all(o.sequences for o in outs)
    assert all(s.shared_blocks <= s.copied_blocks for s in steps)
    assert any(s.shared_blocks < s.copied_blocks for s in steps)  # the prompt is shared
    cache = llm.engine.cache
    held = sum(1 for b in cache._pool.blocks if b.ref_cnt > 0)
    assert held == 0 and not cache.seqs  # every beam's blocks went back
    cache.check_invariants()


def test_beam_outputs_have_text_and_accept_every_prompt_form(llm) -> None:  # noqa: ANN001
    (out,) = llm.beam_search("The sky is", BeamSearchParams(2, 3, ignore_eos=True))
    assert len(out.sequences) == 2
    for b in out.sequences:
        assert len(b.token_ids) == 3 and b.finish_reason == "length"
        assert b.text == llm.tokenizer.decode(b.token_ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "hi"}]
    assert len(llm.beam_search([chat, [1, 2, 3]], BeamSearchParams(2, 2))) == 2


@pytest.mark.parametrize("kw", [
    {"beam_width": 0, "max_tokens": 4}, {"beam_width": 2, "max_tokens": 0},
    {"beam_width": 1000, "max_tokens": 4}, {"beam_width": 2.0, "max_tokens": 4},
    {"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")},
    {"beam_width": 2, "max_tokens": 4, "temperature": -1.0},
])
def test_bad_params_are_typed(kw) -> None:  # noqa: ANN001
    with pytest.raises(InvalidParamsError):
        BeamSearchParams(**kw)
    assert TopLevelBeamSearchParams is BeamSearchParams


def test_too_long_or_too_wide_is_refused_and_changes_nothing(llm) -> None:  # noqa: ANN001
    with pytest.raises(PagedKVError):
        llm.beam_search([[1] * 2000], BeamSearchParams(2, 4))
    with pytest.raises(PagedKVError):
        llm.beam_search([[1, 2]], BeamSearchParams(64, 1000))
    assert not llm.engine.cache.seqs and not llm.engine.scheduler.running
    assert not llm.engine.scheduler.waiting


def test_beam_search_steps_through_the_engines_step_primitive(smollm2, chat_ids, tmp_path) -> None:  # noqa: ANN001
    """Beam search runs LLMEngine.forward, as step() does: its full blocks reach the KV tier and
    its forward passes count in the engine's timing."""
    llm = LLM(smollm2, num_blocks=256, block_size=4, kv_tier=f"disk:{tmp_path}")
    try:
        before = llm.engine.stats()
        llm.beam_search(chat_ids[:1], BeamSearchParams(2, 4))
        llm.engine.tiers.connector.writer.flush()
        after = llm.engine.stats()
        assert llm.engine.tier_stats()["blocks_written"] >= len(chat_ids[0]) // 4
        assert after.forward_seconds > before.forward_seconds
        assert after.step_seconds >= after.forward_seconds
        assert llm.engine.is_idle()
    finally:
        llm.engine.close()
