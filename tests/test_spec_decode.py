"""Speculative decoding: the n-gram proposer, lookahead slots, verification (greedy and
rejection sampling), the policy, and the engine on the real SmolLM2 (outputs unchanged)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_sampler import seq as fake_seq

from pagedkv.cache import PagedKVCache
from pagedkv.cache.hashing import HashChain
from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.ngram import NgramIndex
from pagedkv.engine.rejection import accept_greedy, accept_sampled, gumbel_tokens
from pagedkv.engine.sampler import Sampler, position_generator, warp
from pagedkv.engine.spec_config import SpeculativeConfig
from pagedkv.engine.spec_decode import SpecDecoder, StepCost
from pagedkv.errors import PositionError, SpecConfigError, UnknownOptionError
from pagedkv.options import cli_spelling

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}

# --- the proposer ----------------------------------------------------------------------------


def _brute(toks: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The latest earlier occurrence of the longest suffix of lo..hi tokens, scanned."""
    L = len(toks)
    for n in range(min(hi, L - 1), lo - 1, -1):
        suffix = toks[L - n :]
        for e in range(L - 1, n - 1, -1):
            if toks[e - n : e] == suffix:
                return toks[e : e + k]
    return []


@given(st.lists(st.integers(0, 3), min_size=1, max_size=60),
       st.lists(st.integers(1, 6), min_size=1, max_size=8),
       st.integers(1, 3), st.integers(0, 3), st.integers(1, 6))
def test_ngram_index_matches_a_scan(prompt, steps, lo, span, k) -> None:  # noqa: ANN001
    """Incremental: the index, extended step by step, proposes what a full scan finds."""
    hi = lo + span
    idx = NgramIndex(lo, hi)
    toks = list(prompt)
    for i, grow in enumerate(steps):
        assert idx.propose(toks, k) == _brute(toks, k, lo, hi)
        toks.extend((toks[j % len(toks)] + i) % 4 for j in range(grow))


def test_ngram_index_copies_what_followed() -> None:
    idx = NgramIndex(1, 4)
    toks = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert idx.propose(toks, 3) == [8, 9, 1]
    assert idx.propose(toks + [3], 3) == []  # 3 never appeared before


# --- the configuration -----------------------------------------------------------------------


def test_speculative_config_parses_vllm_spellings() -> None:
    c = SpeculativeConfig.parse(json.dumps(NGRAM))
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (
        "ngram", 5, 4, 1)
    assert SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_min": 6}).prompt_lookup_max == 6
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    assert SpeculativeConfig.parse(c) is c
    assert EngineConfig(speculative_config=NGRAM).spec == c


@pytest.mark.parametrize(("value", "says"), [
    ("{bad", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ({"method": "eagle"}, "method must be one of ngram, draft_model"),
    ({"method": "draft_model", "model": "/nonexistent/x.gguf"}, "no draft model at"),
    ({"num_speculative_tokens": 3}, "method is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 16}, "[1, 15]"),
    ({"method": "ngram", "num_speculative_tokens": "5"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "model": "x.gguf"}, "model only goes with"),
    ({"method": "ngram", "adaptive": 1}, "adaptive"),
    ({"method": "ngram", "num_spec_tokens": 3}, "unknown key 'num_spec_tokens'"),
])
def test_bad_speculative_configs_are_typed_errors(value, says) -> None:  # noqa: ANN001
    with pytest.raises(SpecConfigError, match="speculative_config") as e:
        EngineConfig(speculative_config=value)
    assert says in str(e.value)
    assert e.value.options == ("speculative_config",)
    cli_spelling(e.value, EngineConfig)
    assert str(e.value).startswith("--speculative-config")


def test_llm_refuses_a_bad_config_before_loading() -> None:
    with pytest.raises(SpecConfigError):
        LLM("/nonexistent.gguf", speculative_config='{"method": "ngram", "x": 1}')
    with pytest.raises(UnknownOptionError):
        LLM("/nonexistent.gguf", speculative=NGRAM)


# --- lookahead slots -------------------------------------------------------------------------


def _cache_with(ids: list[int], blocks: int = 8, bs: int = 4) -> tuple[PagedKVCache, HashChain]:
    cache = PagedKVCache(blocks, bs)
    chain = HashChain(bs, list(ids))
    cache.create("s", chain)
    return cache, chain


def test_lookahead_slots_are_reserved_then_accepted_or_given_back() -> None:
    cache, chain = _cache_with([1, 2, 3, 4, 5])  # 2 blocks of 4
    assert cache.try_lookahead("s", 6)  # positions 5..10: 1 more block... 3 in all
    assert len(cache.block_ids("s")) == 3
    cache.check_invariants()
    slots, tables, lens = cache.decode_tensors(["s"], drafts=[6])
    assert lens.tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert slots.tolist() == [cache.table.slots(cache.seq("s").row, torch.arange(4, 11).numpy())
                              .tolist()][0]
    assert tables.shape == (7, 3)
    _, hashed = cache.block_states()
    assert hashed.sum() == 1  # only the prompt's full block: drafts are never hashed
    chain.extend([6, 7, 8])  # the owner appended the accepted drafts (+ the bonus token)
    cache.accept_lookahead("s", 2)  # tokens 5, 6 accepted -> 7 tokens, the third block goes
    assert cache.num_tokens("s") == 7 and len(cache.block_ids("s")) == 2
    cache.check_invariants()
    chain.extend([9])
    cache.append("s", 2)  # the next decode: position 8 fills block 2 -> hashed when computed
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8


def test_lookahead_that_does_not_fit_changes_nothing() -> None:
    cache, _ = _cache_with([1, 2, 3, 4, 5], blocks=3)
    before = cache.block_ids("s")
    assert not cache.try_lookahead("s", 8)  # would need 2 more blocks, 1 free
    assert cache.block_ids("s") == before and cache.seq("s").lookahead == 0
    cache.check_invariants()
    assert cache.try_lookahead("s", 3)
    with pytest.raises(PositionError):
        cache.accept_lookahead("s", 4)
    with pytest.raises(PositionError):  # the chain holds no accepted ids yet
        cache.accept_lookahead("s", 1)
    cache.accept_lookahead("s", 0)
    assert cache.block_ids("s") == before
    cache.check_invariants()


@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), min_size=1, max_size=25))
def test_lookahead_steps_keep_the_cache_a_prefill_of_the_accepted(steps) -> None:  # noqa: ANN001
    """Shadow model: after any run of (draft k, accept m) steps the cache holds exactly the
    accepted tokens, its full blocks findable by a fresh lookup, nothing else hashed."""
    bs = 4
    cache = PagedKVCache(64, bs)
    chain = HashChain(bs, [7, 8, 9])
    cache.create("s", chain)
    chain.extend([10])  # as after a prefill: the sampled token is one id ahead of the cache
    ids = [7, 8, 9, 10]
    for i, (k, m) in enumerate(steps):
        m = min(m, k)
        cache.append_one_each(["s"], computed=True)  # the decode's token (the last sampled)
        assert cache.try_lookahead("s", k)
        cache.check_invariants()
        new = [200 + 10 * i + j for j in range(m + 1)]  # m accepted drafts + one more
        chain.extend(new)
        cache.accept_lookahead("s", m)
        ids += new
        cache.check_invariants()
        assert cache.num_tokens("s") == len(ids) - 1 and cache.seq("s").token_ids == ids[:-1]
        full = (len(ids) - 1) // bs
        assert cache.lookup(ids) == full * bs
        _, hashed = cache.block_states()
        assert hashed.sum() == full


# --- verification ----------------------------------------------------------------------------


def test_greedy_verification_takes_the_agreeing_prefix_and_one_more() -> None:
    assert accept_greedy([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert accept_greedy([5, 6, 9, 8], [5, 6, 9]) == [5, 6, 9, 8]  # + the bonus token
    assert accept_greedy([4, 6, 9, 8], [5, 6, 9]) == [4]
    assert accept_greedy([3], []) == [3]


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0  # a token of probability 0 is never emitted
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Each emitted position has the target's distribution, whatever the draft: chi-square
    over 6 tokens (5 degrees of freedom; 20.5 is the 0.1% tail) with a fixed seed."""
    V, n = 6, 12000
    g = torch.Generator().manual_seed(0)
    rows = torch.softmax(torch.randn(3, V, generator=g, dtype=torch.float64) * 1.5, -1)
    rows[2, 4] = 0.0  # a token the target never emits, drafted at position 2
    for draft in ([1, 4], [0, 0], [3, 2]):
        first = torch.zeros(V)
        second = torch.zeros(V)
        for _ in range(n):
            out = accept_sampled(rows, draft, g)
            first[out[0]] += 1
            if out[0] == draft[0] and len(out) > 1:  # given the first draft accepted
                second[out[1]] += 1
        assert _chi2(first, rows[0]) < 20.5
        assert _chi2(second, rows[1]) < 20.5


def test_gumbel_rows_keep_the_target_distribution() -> None:
    V, n = 6, 8000
    x = torch.randn(1, V, generator=torch.Generator().manual_seed(2)) * 2
    x[0, 3] = float("-inf")
    counts = torch.zeros(V)
    for t in gumbel_tokens(x.expand(n, V), [position_generator(5, 0, i) for i in range(n)]):
        counts[t] += 1
    assert _chi2(counts, torch.softmax(x[0].double(), -1)) < 20.5


def test_sampler_verify_draws_from_the_warped_rows() -> None:
    """Through the Sampler: temperature and top-k apply to each verification row; greedy
    rows agree with argmax; the emitted first token follows softmax(warp(row))."""
    V = 6
    x = torch.randn(3, V, generator=torch.Generator().manual_seed(1)) * 2
    p = SamplingParams(temperature=0.7, top_k=4, seed=3)
    s = fake_seq(p, [1, 2])
    counts = torch.zeros(V)
    sampler = Sampler()
    for _ in range(3000):
        counts[sampler.verify(x, [s], [[2, 3]])[0][0]] += 1
    target = torch.softmax(warp(x[:1].clone(), [p]), -1)[0].double()
    assert _chi2(counts, target) < 20.5
    greedy = fake_seq(SamplingParams(temperature=0), [1, 2])
    top = x.argmax(-1).tolist()
    assert sampler.verify(x, [greedy], [[top[0], top[1]]]) == [top]


def test_verify_rows_count_the_drafts_as_generated_for_penalties() -> None:
    V = 8
    x = torch.zeros(2, V)
    x[:, 5] = 1.0
    x[:, 6] = 0.9
    p = SamplingParams(temperature=0, presence_penalty=0.5)
    s = fake_seq(p, [1, 2])
    # row 0 picks 5; with 5 drafted, row 1 sees 5 penalized (0.5 < 0.9) and picks 6
    assert Sampler().verify(x, [s], [[5]]) == [[5, 6]]


# --- the policy ------------------------------------------------------------------------------


class _Seq:
    """What the policy reads of a Sequence."""

    def __init__(self, toks: list[int], max_tokens: int = 1000) -> None:
        self.token_ids = list(toks)
        self.num_prompt = 2
        self.num_ctx = len(toks)
        self.grammar = None
        self.spec = None
        self.request = type("R", (), {"speculate": True, "params": SamplingParams(
            max_tokens=max_tokens), "num_draft_tokens": 0, "num_accepted_tokens": 0})()

    def append(self, tok: int) -> None:
        self.token_ids.append(tok)
        self.num_ctx += 1


PATTERN = [1, 2, 3, 4, 5, 6, 7]


def _cost(a: float, b: float, c: float) -> StepCost:
    """A StepCost fitted on exact steps t = a + b * plain rows + c * verify rows."""
    cost = StepCost()
    for rows, drafts in [(1, 0), (4, 0), (9, 3), (16, 0), (20, 10), (7, 7), (30, 2), (2, 1)] * 3:
        cost.observe(rows + drafts, a + b * rows + c * drafts, drafts)
    return cost


def _policy(cost: StepCost) -> SpecDecoder:
    spec = SpecDecoder(SpeculativeConfig.parse(NGRAM))
    spec.cost = cost
    return spec


def test_step_cost_measures_plain_and_verify_rows_apart() -> None:
    a, b, c = _cost(0.010, 0.002, 0.003).coef()
    assert math.isclose(a, 0.010, rel_tol=1e-3) and math.isclose(b, 0.002, rel_tol=1e-3)
    assert math.isclose(c, 0.003, rel_tol=1e-3)
    one = StepCost()  # one stream: rows never vary, so a + b is measured and split by the prior
    for k in (0, 3, 5, 0, 2, 5, 1):
        one.observe(1 + k, 0.030 + 0.008 * k, k)
    a, b, c = one.coef()
    assert math.isclose(a + b, 0.030, rel_tol=1e-3) and math.isclose(c, 0.008, rel_tol=1e-2)
    plain = StepCost()  # never verified: a verify row is priced as a decode row
    for r in (10, 20, 30, 40):
        plain.observe(r, 0.01 + 0.002 * r)
    a, b, c = plain.coef()
    assert math.isclose(b, 0.002, rel_tol=1e-2) and math.isclose(c, b, rel_tol=1e-2)
    flat = StepCost()  # a noisy fit falls back to positive coefficients
    for r, t in [(10, 0.05), (20, 0.01), (30, 0.001)]:
        flat.observe(r, t)
    assert min(flat.coef()) > 0


def test_policy_drafts_when_rows_are_cheap_and_not_in_a_compute_bound_batch() -> None:
    toks = PATTERN * 2 + PATTERN[:3]  # the proposal: 4 5 6 7 1
    cheap = _policy(_cost(0.010, 0.001, 0.001))
    # one stream, a row 9% of a step (no margin): the prior 0.6 pays for three drafts
    assert cheap.drafts([_Seq(toks)], 1, 100) == [[4, 5, 6]]
    sure = _Seq(toks)
    cheap.state(sure).accepted = cheap.state(sure).tried = 50.0
    assert cheap.drafts([sure], 1, 100) == [[4, 5, 6, 7, 1]]  # always accepted: all five
    assert cheap.drafts([sure], 1, 3) == [[4, 5, 6]]  # the token budget caps them
    dear_verify = _policy(_cost(0.010, 0.001, 0.020))  # a verify row costs 2 steps: none
    assert dear_verify.drafts([sure], 1, 100) == [[]]
    # rows at 2 ms each beside a 26 ms fixed cost (SmolLM2 on 2 cores), 80% acceptance: a
    # few drafts each in a batch of 8, none in a batch of 40 (not even sure ones: the margin)
    big = _policy(_cost(0.026, 0.002, 0.002))
    batch = [_Seq(toks) for _ in range(40)]
    for s in batch:
        big.state(s).accepted, big.state(s).tried = 40.0, 50.0
    got = big.drafts(batch[:8], 8, 1000)
    assert all(1 <= len(d) <= 3 for d in got)
    assert big.drafts(batch, 40, 1000) == [[]] * 40
    for s in batch:
        big.state(s).accepted = big.state(s).tried = 500.0
    assert big.drafts(batch, 40, 1000) == [[]] * 40


rates = st.tuples(st.floats(0, 60), st.floats(0, 60)).map(lambda t: (min(t), max(t)))


@given(a=st.floats(1e-3, 0.1), b=st.floats(1e-5, 0.01), c=st.floats(1e-5, 0.02),
       seqs=st.lists(rates, min_size=1, max_size=48), extra=st.integers(0, 64),
       budget=st.integers(0, 300))
def test_policy_drafts_only_what_raises_predicted_tokens_per_second(a, b, c, seqs, extra,
                                                                    budget) -> None:  # noqa: ANN001
    """On any measured cost and acceptance: the step's predicted tokens per second with the
    kept drafts beat it without them, drafts stay within the budget, each sequence's are a prefix of its proposal, and a dearer verify row never buys
    more drafts."""
    toks = PATTERN * 2 + PATTERN[:3]
    batch = [_Seq(toks) for _ in seqs]
    spec = _policy(_cost(a, b, c))
    for s, (acc, tried) in zip(batch, seqs, strict=True):
        spec.state(s).accepted, spec.state(s).tried = acc, tried
    rows = len(batch) + extra
    got = spec.drafts(batch, rows, budget)
    assert sum(map(len, got)) <= budget
    assert all(d == [4, 5, 6, 7, 1][: len(d)] for d in got)
    fa, fb, fc = spec.cost.coef()
    gain = sum(s.spec.rate(spec.by_match[s.spec.index.matched].value) ** (j + 1)
               for s, d in zip(batch, got, strict=True) for j in range(len(d)))
    n = sum(map(len, got))
    t0 = fa + fb * rows
    if n:
        assert (len(batch) + gain) / (t0 + fc * n) > len(batch) / t0
    dearer = _policy(_cost(a, b, c * 2))
    for s, (acc, tried) in zip(batch, seqs, strict=True):
        s.spec = None
        dearer.state(s).accepted, dearer.state(s).tried = acc, tried
    assert sum(map(len, dearer.drafts(batch, rows, budget))) <= n


def test_a_sequence_not_drafting_is_still_scored_and_starts_again() -> None:
    """In a batch where an average proposal does not pay, each proposal left unverified is
    scored against the token that came: sequences whose proposals keep coming true start
    verifying again, those whose proposals fail stay off; no probe counts as a draft."""
    spec = _policy(_cost(0.026, 0.004, 0.004))  # 8 rows: a draft pays above ~0.8 acceptance
    right = [_Seq(PATTERN * 2 + PATTERN[:3]) for _ in range(4)]
    wrong = [_Seq(PATTERN * 2 + PATTERN[:3]) for _ in range(4)]
    batch = right + wrong
    first = spec.drafts(batch, 8, 1000)
    assert first == [[]] * 8  # the prior (0.6) does not pay
    for step in range(40):
        got = spec.drafts(batch, 8, 1000) if step else first
        for s, d in zip(batch, got, strict=True):
            if s in right:  # the pattern goes on: its proposals are right
                n = len(s.token_ids)
                truth = [PATTERN[(n + j) % 7] for j in range(len(d) + 1)]
            else:  # a token never seen (so never proposed), then a suffix that matches again
                truth = [1000 + step, *PATTERN[:3]]
            m = 0
            while m < len(d) and d[m] == truth[m]:
                m += 1
            if d:
                spec.observe(s, len(d), m)
            for t in truth[: m + 1] if s in right else truth:
                s.append(t)
    assert all(spec.drafts(batch, 8, 1000)[:4])
    assert all(s.spec.rate(0.6) < 0.2 for s in wrong)
    assert spec.drafts(batch, 8, 1000)[4:] == [[]] * 4
    drafted_by_wrong = sum(s.request.num_draft_tokens for s in wrong)
    assert drafted_by_wrong == 0 and spec.num_draft_tokens == sum(
        s.request.num_draft_tokens for s in right)


# --- the engine on the real model -------------------------------------------------------------

CODE = '''def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''
PROMPTS = [
    [{"role": "user", "content": "Repeat this code exactly, renaming `total` to `acc`:\n\n"
                                 + CODE}],
    [{"role": "user", "content": "Copy this sentence three times: the cat sat on the mat."}],
    [{"role": "user", "content": "What is the capital of France?"}],
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fib",
]


def _pair(smollm2, **kw):  # noqa: ANN001, ANN202
    base = LLM(smollm2, num_blocks=256, **kw)
    spec = LLM(smollm2, num_blocks=256, speculative_config=NGRAM, **kw)
    return base, spec


@pytest.fixture(scope="module")
def engines(smollm2):  # noqa: ANN001, ANN201
    return _pair(smollm2)


PARAMS = [
    SamplingParams(temperature=0, max_tokens=64),
    SamplingParams(temperature=0, max_tokens=40, logprobs=2),
    SamplingParams(temperature=0, max_tokens=48, stop=["acc", "mat"]),
    SamplingParams(temperature=0, max_tokens=48, repetition_penalty=1.2, frequency_penalty=0.3,
                   presence_penalty=0.2),
    SamplingParams(temperature=0, max_tokens=7),
    SamplingParams(temperature=0, max_tokens=32, n=2, min_tokens=5),
]  # greedy; logprobs; stop strings; penalties; max_tokens; n > 1 with min_tokens


def assert_same_outputs(want, got, logprob_abs: float | None = None) -> None:  # noqa: ANN001
    """Request by request: the same tokens, text, finish reasons and logprob tokens; with
    `logprob_abs`, logprob values within it."""
    for w, g in zip(want, got, strict=True):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
        assert [o.text for o in g.outputs] == [o.text for o in w.outputs]
        assert [o.finish_reason for o in g.outputs] == [o.finish_reason for o in w.outputs]
        for ow, og in zip(w.outputs, g.outputs, strict=True):
            if ow.logprobs is None:
                continue
            assert [list(d) for d in og.logprobs] == [list(d) for d in ow.logprobs]
            if logprob_abs is not None:
                for dw, dg in zip(ow.logprobs, og.logprobs, strict=True):
                    for t in dw:
                        assert dg[t] == pytest.approx(dw[t], abs=logprob_abs)


def test_greedy_output_is_unchanged(engines) -> None:  # noqa: ANN001
    """Every prompt under every params, in one batch each way: tokens, text, finish reasons
    and logprobs as without speculation."""
    base, spec = engines
    prompts = [p for p in PROMPTS for _ in PARAMS]
    params = PARAMS * len(PROMPTS)
    want = base.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert_same_outputs(want, got, logprob_abs=1e-4)
    for g in got:
        assert g.num_draft_tokens >= g.num_accepted_tokens
    stats = spec.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0  # it did speculate
    assert stats.num_running == 0 and stats.blocks_used == 0
    spec.engine.cache.check_invariants()


def test_one_stream_is_unchanged_and_accepts_drafts(engines) -> None:  # noqa: ANN001
    """One stream (the case speculation is for): copying code, drafts are accepted."""
    base, spec = engines
    p = SamplingParams(temperature=0, max_tokens=96)
    before = spec.engine.stats()
    want, got = base.generate(PROMPTS[0], p)[0], spec.generate(PROMPTS[0], p)[0]
    assert got.token_ids == want.token_ids
    after = spec.engine.stats()
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert (got.num_draft_tokens, got.num_accepted_tokens) == (drafted, accepted)
    assert accepted > 0.25 * drafted


def test_streaming_and_abort_see_only_accepted_tokens(engines) -> None:  # noqa: ANN001
    base, spec = engines
    params = SamplingParams(temperature=0, max_tokens=60)
    want = base.generate(PROMPTS[:2], params)
    eng = spec.engine
    eng.add_request("a", PROMPTS[0], params)
    eng.add_request("b", PROMPTS[1], params)
    texts: dict[str, str] = {"a": "", "b": ""}
    ids: dict[str, list[int]] = {"a": [], "b": []}
    while eng.has_unfinished_requests():
        for out in eng.step():
            rid = out.request_id
            assert out.text.startswith(texts[rid]) and out.token_ids[: len(ids[rid])] == ids[rid]
            texts[rid], ids[rid] = out.text, out.token_ids
            if rid == "b" and len(out.token_ids) >= 20 and not out.finished:
                eng.abort_request("b")
            eng.cache.check_invariants()
    assert ids["a"] == want[0].token_ids
    assert ids["b"] == want[1].token_ids[: len(ids["b"])]
    assert eng.stats().blocks_used == 0


def test_a_seed_gives_the_same_output_whatever_the_drafts(smollm2, engines) -> None:  # noqa: ANN001
    """Seeded rows are position-keyed Gumbel-max draws: the adaptive policy (timing-driven)
    and always-draft give the same tokens, run after run."""
    _, spec = engines
    always = LLM(smollm2, num_blocks=256, speculative_config={**NGRAM, "adaptive": False})
    p = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, seed=7, n=2)
    a = spec.generate(PROMPTS[:2], p)
    b = always.generate(PROMPTS[:2], p)
    ids = [[o.token_ids for o in r.outputs] for r in a]
    assert ids == [[o.token_ids for o in r.outputs] for r in b]
    assert ids[0][0] != ids[0][1]  # the samples differ
    assert always.engine.stats().spec_decode_num_draft_tokens > 0


def test_small_cache_and_context_end_keep_outputs(smollm2) -> None:  # noqa: ANN001
    """Lookahead slots that do not fit are skipped (no preemption for drafts); the context's
    end is never crossed mid-step."""
    params = SamplingParams(temperature=0, max_tokens=64)
    base, spec = (LLM(smollm2, num_blocks=40, max_model_len=330, **kw) for kw in (
        {}, {"speculative_config": NGRAM}))
    want = base.generate(PROMPTS, params)
    got = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    spec.engine.cache.check_invariants()
