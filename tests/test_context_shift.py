"""Context shift (llama.cpp's): a sequence that fills max_model_len keeps n_keep tokens, drops
n_discard, shifts the rest down with K re-rotated, and goes on generating."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedkv.engine import LLM, LLMEngine, SamplingParams
from pagedkv.errors import CacheConfigError

CTX = 40


def _fresh_layer0_keys(fresh: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Layer 0's K of a fresh prefill of `ids` at positions 0..len-1 ([T, Hkv, D])."""
    fresh.add_request("fresh", ids, SamplingParams(max_tokens=2, ignore_eos=True))
    fresh.step()
    (seq,) = fresh.scheduler.running
    k = fresh.storage.gather(0, fresh.cache.block_ids(seq.seq_id), len(ids))[0].clone()
    fresh.abort_request("fresh")
    return k


def _run(engine: LLMEngine, rid: str, prompt: Any, params: SamplingParams,
         watch: Any = None) -> Any:
    engine.add_request(rid, prompt, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        if watch is not None:
            watch()
    return out


@pytest.fixture(scope="module")
def shifting(smollm2: Any) -> LLMEngine:  # noqa: ANN001
    return LLMEngine(smollm2, num_blocks=64, block_size=4, max_model_len=CTX,
                     context_shift=True, n_keep=6)


def test_shifted_keys_equal_rope_at_the_new_positions(shifting: LLMEngine, smollm2: Any) -> None:
    """After each shift, layer 0's cached K of every kept token (stored with RoPE at its old
    position, then re-rotated) equals the K a fresh prefill of the kept tokens computes with RoPE
    at their new positions (layer 0's K depends on the token and position alone)."""
    engine, checked = shifting, []
    fresh = LLMEngine(smollm2, num_blocks=16, block_size=4, max_model_len=CTX,
                      enable_prefix_caching=False)
    start = engine.scheduler.num_context_shifts

    def watch() -> None:
        for s in engine.scheduler.running:
            if s.n_dropped and s.num_scheduled == engine.cache.num_tokens(s.seq_id):
                n = s.num_scheduled
                want = _fresh_layer0_keys(fresh, s.ctx_ids(0, n))
                got = engine.storage.gather(0, engine.cache.block_ids(s.seq_id), n)[0]
                torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
                # the check has teeth: K at the old positions would not pass
                old = smollm2.model.rope.shift_keys(want[s.n_keep :], s.n_dropped)
                assert not torch.allclose(old, want[s.n_keep :], atol=1e-2)
                checked.append(n)

    out = _run(engine, "k", "Count from one to one hundred:",
               SamplingParams(max_tokens=90, ignore_eos=True), watch)
    assert engine.scheduler.num_context_shifts - start >= 2 and checked
    assert len(out.outputs[0].token_ids) == 90


def test_long_generation_in_a_tiny_context_keeps_going_and_leaks_nothing(
        shifting: LLMEngine) -> None:
    engine, lens = shifting, []

    def watch() -> None:
        lens.extend(engine.cache.num_tokens(s.seq_id) for s in engine.scheduler.running)

    out = _run(engine, "long", "Tell me a long story about a dragon.",
               SamplingParams(max_tokens=150, ignore_eos=True), watch)
    assert len(out.outputs[0].token_ids) == 150 and out.finished
    assert out.outputs[0].finish_reason == "length"
    assert max(lens) <= CTX  # positions stay within the context
    assert not engine.cache.seqs and engine.cache.num_free_blocks == engine.cache.num_blocks
    engine.cache.check_invariants()


def test_without_context_shift_the_sequence_finishes_at_the_context(smollm2: Any) -> None:
    llm = LLM(smollm2, num_blocks=64, block_size=4, max_model_len=CTX)
    (out,) = llm.generate(["Tell me a long story."], SamplingParams(max_tokens=150, ignore_eos=True))
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == CTX


def test_a_prompt_longer_than_the_context_is_cut_and_answered(shifting: LLMEngine) -> None:
    prompt = list(range(100, 100 + 3 * CTX))
    out = _run(shifting, "cut", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    assert out.prompt_token_ids == prompt and len(out.outputs[0].token_ids) == 5
    assert not shifting.cache.seqs


def test_parallel_samples_shift_without_touching_each_other(shifting: LLMEngine) -> None:
    out = _run(shifting, "n", "Once upon a time",
               SamplingParams(max_tokens=60, n=3, temperature=1.0, seed=1, ignore_eos=True))
    assert [len(o.token_ids) for o in out.outputs] == [60, 60, 60]
    assert not shifting.cache.seqs and shifting.cache.num_free_blocks == shifting.cache.num_blocks


@pytest.mark.parametrize("kw", [{"n_keep": -1}, {"n_keep": CTX}, {"n_keep": 1.5},
                                {"n_discard": 0}, {"max_model_len": 10_000}])
def test_bad_shift_config_is_typed(smollm2: Any, kw: dict) -> None:  # noqa: ANN001
    args = {"num_blocks": 64, "block_size": 4, "max_model_len": CTX, "context_shift": True} | kw
    with pytest.raises(CacheConfigError):
        LLMEngine(smollm2, **args)


def test_chat_of_many_turns_through_the_server_keeps_answering(smollm2: Any) -> None:
    import openai

    from pagedkv.server.app import ServerThread, build_app

    engine = LLMEngine(smollm2, num_blocks=64, block_size=16, max_model_len=96,
                       context_shift=True, n_keep=8)
    with ServerThread(build_app(engine, served_model_name="smollm2")) as thread:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="x", max_retries=0,
                               timeout=120)
        chat = [{"role": "system", "content": "You are brief."}]
        for turn in range(6):
            chat.append({"role": "user", "content": f"Turn {turn}: name an animal and a colour."})
            r = client.chat.completions.create(model="smollm2", messages=chat, max_tokens=24,
                                               temperature=0.0)
            reply = r.choices[0].message.content
            assert reply and r.choices[0].finish_reason in ("stop", "length")
            chat.append({"role": "assistant", "content": reply})
        assert r.usage.prompt_tokens > 96  # the history outgrew the context long ago
        shifts = _shifts_on_metrics(thread.url)
        count = "Count: " + ", ".join(str(i) for i in range(1, 22))
        r = client.completions.create(model="smollm2", prompt=count, max_tokens=24,
                                      temperature=0.0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 24
        assert r.usage.prompt_tokens < 96 < r.usage.prompt_tokens + 24  # generation shifts
        assert _shifts_on_metrics(thread.url) > shifts
        assert _shifts_on_metrics(thread.url) == engine.scheduler.num_context_shifts
    assert engine.scheduler.num_context_shifts >= 1 or not engine.cache.seqs


def _shifts_on_metrics(url: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("pagedkv:context_shifts_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("pagedkv:context_shifts_total is not on /metrics")
