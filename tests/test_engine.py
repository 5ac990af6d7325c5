"""The engine on the real SmolLM2 weights: batching, preemption, prefix caching, sampling."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine import LLM, LLMEngine, SamplingParams, parse_size
from pagedkv.errors import CacheConfigError, InvalidParamsError, RequestTooLongError

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain what a block table is in a paged KV cache."}],
    "The quick brown fox",
    [{"role": "user", "content": "List three prime numbers and say why they are prime."}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "What colour is grass?"}],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def _llm(model, **kw) -> LLM:  # noqa: ANN001
    kw.setdefault("num_blocks", 256)
    return LLM(model, **kw)


@pytest.fixture(scope="module")
def reference(smollm2) -> list[list[int]]:  # noqa: ANN001
    """Greedy outputs with ample memory, one request at a time."""
    llm = _llm(smollm2, max_num_seqs=1)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_batched_equals_one_at_a_time(smollm2, reference) -> None:  # noqa: ANN001
    llm = _llm(smollm2)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert all(o.text for o in outs)
    llm.engine.cache.check_invariants()
    assert llm.engine.stats().blocks_used == 0


def test_preemption_keeps_outputs(smollm2, reference) -> None:  # noqa: ANN001
    # 12 blocks of 16: the six requests need ~25; decodes must preempt one another
    llm = _llm(smollm2, num_blocks=12, max_num_seqs=8)
    outs = llm.generate(PROMPTS, GREEDY)
    eng = llm.engine
    assert eng.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    eng.cache.check_invariants()
    st = eng.cache.stats()
    assert st.used_blocks == 0 and st.free_blocks == st.num_blocks  # nothing leaked


def test_chunked_prefill_keeps_outputs(smollm2, reference) -> None:  # noqa: ANN001
    llm = _llm(smollm2, max_num_batched_tokens=8, max_num_seqs=4)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_prefix_caching_on_off_identical(smollm2) -> None:  # noqa: ANN001
    system = {"role": "system", "content": "You are a careful assistant. " * 12}
    prompts = [[system, {"role": "user", "content": q}]
               for q in ("Name a river.", "Name a mountain.", "Name a city.")]
    on = _llm(smollm2)
    off = _llm(smollm2, enable_prefix_caching=False)
    first = on.generate(prompts[:1], GREEDY)  # fills the cache
    rest_on = on.generate(prompts[1:], GREEDY)
    rest_off = off.generate(prompts[1:], GREEDY)
    assert [o.token_ids for o in rest_on] == [o.token_ids for o in rest_off]
    assert all(o.num_cached_tokens >= 16 for o in rest_on)
    assert first[0].num_cached_tokens == 0
    assert on.engine.stats().prefix_hit_rate > 0
    assert off.engine.stats().prefix_cache_hits == 0
    on.engine.cache.check_invariants()


def test_a_prompt_sent_again_computes_only_its_last_token(smollm2, reference) -> None:  # noqa: ANN001
    """Partial prefix hits: the first answer's tokens filled each prompt's tail block, so the
    same prompts again are served from the cache but for their last token (whole blocks, then
    the tail block's leading tokens copied); greedy output is unchanged."""
    llm = _llm(smollm2)
    first = llm.generate(PROMPTS, GREEDY)
    again = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in again] == reference
    filled = 0
    for o, f in zip(again, first, strict=True):
        n = len(o.prompt_token_ids)
        whole = (n - 1) // 16 * 16
        if n + len(f.token_ids) - 1 >= whole + 16:  # the tail block filled up: registered
            assert o.num_cached_tokens == n - 1
            filled += 1
        else:  # only whole blocks, or a partial hit from another prompt's block
            assert whole <= o.num_cached_tokens < n
    assert filled >= 4
    assert llm.engine.cache.stats().partial_hits == llm.engine.stats().prefix_cache_partial_hits > 0
    llm.engine.cache.check_invariants()


def test_parallel_sampling_seeded_and_shared(smollm2) -> None:  # noqa: ANN001
    params = SamplingParams(n=4, temperature=1.0, top_p=0.9, seed=7, max_tokens=12)
    a = _llm(smollm2).generate(PROMPTS[2], params)[0]
    llm = _llm(smollm2)
    b = llm.generate(PROMPTS[2], params)[0]
    assert len(a.outputs) == 4
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # samples differ
    assert llm.engine.cache.cow_copies > 0  # forks shared the prompt, then copied on write
    st = llm.engine.stats()
    assert st.fork_shared_blocks >= 3  # three children, each sharing the prompt's blocks
    assert st.fork_saved_bytes == st.fork_shared_blocks * llm.engine.storage.bytes_per_block
    llm.engine.cache.check_invariants()
    assert llm.engine.stats().blocks_used == 0


def test_abort_frees_blocks(smollm2) -> None:  # noqa: ANN001
    eng = LLMEngine(smollm2, num_blocks=64)
    eng.add_request("a", PROMPTS[2], SamplingParams(max_tokens=50, temperature=0))
    eng.add_request("b", PROMPTS[0], SamplingParams(max_tokens=50, temperature=0))
    eng.step()
    eng.step()
    assert eng.cache.stats().used_blocks > 0
    eng.abort_request("a")
    eng.abort_request("b")
    eng.abort_request("unknown")  # no-op
    assert eng.cache.stats().used_blocks == 0
    assert not eng.has_unfinished_requests()
    eng.cache.check_invariants()


def test_stop_strings_and_tokens(smollm2, reference) -> None:  # noqa: ANN001
    llm = _llm(smollm2)
    full = llm.generate(PROMPTS[2], GREEDY)[0]
    word = full.text.split()[2]
    cut = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, stop=[word]))[0]
    assert cut.finish_reason == "stop"
    assert word not in cut.text and full.text.startswith(cut.text)
    tok = full.token_ids[3]
    st = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24,
                                                 stop_token_ids=[tok]))[0]
    assert st.finish_reason == "stop" and st.token_ids[-1] == tok
    ign = llm.generate(PROMPTS[5], SamplingParams(temperature=0, max_tokens=20,
                                                  ignore_eos=True))[0]
    assert len(ign.token_ids) == 20 and ign.finish_reason == "length"


def test_logprobs(smollm2) -> None:  # noqa: ANN001
    out = _llm(smollm2).generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5,
                                                             logprobs=3))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, lps, strict=True):
        assert tok in lp and len(lp) == 3  # greedy token is among the top 3
        assert lp[tok] == max(lp.values()) and lp[tok] <= 0


def test_invalid_requests(smollm2) -> None:  # noqa: ANN001
    eng = LLMEngine(smollm2, num_blocks=8, max_model_len=100)
    for bad in (dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(n=0),
                dict(top_k=-5), dict(logprobs=99), dict(max_tokens="3"), dict(stop=[""])):
        with pytest.raises(InvalidParamsError):
            SamplingParams(**bad)
    with pytest.raises(RequestTooLongError):
        eng.add_request("long", list(range(1, 120)), SamplingParams(max_tokens=4))
    with pytest.raises(RequestTooLongError):  # fits the context, never the 128-token cache
        LLMEngine(smollm2, num_blocks=8).add_request("x", [1] * 100, SamplingParams(max_tokens=60))
    with pytest.raises(InvalidParamsError):
        eng.add_request("neg", [-1, 5], SamplingParams())
    with pytest.raises(InvalidParamsError):
        eng.add_request("empty", [], SamplingParams())
    eng.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidParamsError):
        eng.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=2))
    assert len(eng.requests) == 1  # failed adds left nothing behind


def test_parse_size() -> None:
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("512MB") == 512 * 1000**2
    assert parse_size(1234) == 1234
    with pytest.raises(CacheConfigError):
        parse_size("lots")


def test_kv_budget_sizing(smollm2) -> None:  # noqa: ANN001
    eng = LLMEngine(smollm2, kv_cache_memory="64MiB")
    per_block = 2 * 30 * 16 * 3 * 64 * 4
    assert eng.cache.num_blocks == 64 * 1024**2 // per_block
    assert eng.storage.memory_bytes <= 64 * 1024**2
    assert eng.storage.kv.dtype == torch.float32


class _FailingModel:
    """The real model, except that call number `fail_at` (0-based) raises: an injected fault."""

    def __init__(self, model, fail_at: int) -> None:  # noqa: ANN001
        self.model, self.fail_at, self.calls = model, fail_at, 0

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise RuntimeError("injected forward failure")
        return self.model(*args, **kwargs)


@pytest.mark.parametrize("fail_at", [0, 3])  # in the prefill step, in a decode step
def test_failed_forward_registers_no_prefix_hash(smollm2, reference, fail_at) -> None:  # noqa: ANN001
    eng = LLMEngine(smollm2, num_blocks=256)
    real = eng.runner.model
    eng.runner.model = _FailingModel(real, fail_at)
    eng.add_request("a", PROMPTS[2], GREEDY)
    eng.add_request("b", PROMPTS[4], GREEDY)
    for _ in range(fail_at):
        eng.step()
    hashed = dict(eng.cache._pool.hash_to_block)
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    # nothing of the failed step is findable: only blocks written by earlier steps keep hashes
    # (the preempted sequences' partial last blocks are kept up to what earlier steps wrote:
    # the recomputation below reuses them, and its outputs equal the reference)
    after = eng.cache._pool.hash_to_block
    assert {h: b for h, b in after.items() if not b.partial} == hashed
    assert eng.cache.stats().used_blocks == 0  # the step's sequences wait to be recomputed
    eng.cache.check_invariants()
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert [done["a"], done["b"]] == [reference[2], reference[4]]
    eng.cache.check_invariants()


def test_inflight_prefix_dedup_keeps_outputs(smollm2) -> None:  # noqa: ANN001
    system = {"role": "system", "content": "You answer questions about rivers, briefly. " * 8}
    prompts = [[system, {"role": "user", "content": q}]
               for q in ("Name a river.", "How long is the Nile?", "Where is the Rhine?",
                         "What is a delta?")]
    on = _llm(smollm2)
    off = _llm(smollm2, dedup_inflight_prefixes=False)
    outs_on = on.generate(prompts, GREEDY)
    outs_off = off.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs_on] == [o.token_ids for o in outs_off]
    st = on.engine.stats()
    assert st.dedup_requests_held == 3 and st.dedup_tokens_saved >= 3 * 64
    assert [o.num_cached_tokens >= 64 for o in outs_on] == [False, True, True, True]
    assert off.engine.stats().dedup_requests_held == 0
    assert all(o.num_cached_tokens == 0 for o in outs_off)
    on.engine.cache.check_invariants()
