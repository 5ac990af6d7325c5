"""Speculative decoding with a draft model (method "draft_model"): start-up checks, greedy
output unchanged (the default model drafting for itself accepts ~all), a tiny random draft
(low acceptance; the adaptive policy turns it off), the sampled distribution unchanged with a
real draft distribution q, and the draft's own paged KV cache kept in step with the target's
(only accepted tokens cached, preemption, abort, n > 1, prefix hits, context shift)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_spec_decode import PARAMS, PROMPTS, _chi2, assert_same_outputs
from tiny_gguf import TinySpec, write_tiny_gguf

from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.draft_model import check_vocabulary
from pagedkv.engine.rejection import accept_sampled
from pagedkv.engine.sampler import warp
from pagedkv.errors import SpecConfigError
from pagedkv.model import default_model_path, load_model
from pagedkv.options import cli_spelling


def _self(k: int = 4, adaptive: bool = False) -> dict:
    return {"method": "draft_model", "model": str(default_model_path()),
            "num_speculative_tokens": k, "adaptive": adaptive}


def _tiny(vocab: int, seed: int, layers: int = 2) -> TinySpec:
    """A random SmolLM2-tokenizer model far smaller than SmolLM2 (hidden 128, 2 heads)."""
    return TinySpec("llama", f"SmolLM2 draft tiny {seed}", 128, 2, 1, 64, 256, layers=layers,
                    vocab=vocab, seed=seed, chat=vocab >= 49152)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random draft with SmolLM2's whole vocabulary and tokenizer."""
    return write_tiny_gguf(_tiny(49152, 21), tmp_path_factory.mktemp("draft") / "draft.gguf",
                           fast=True)


@pytest.fixture(scope="module")
def base(smollm2):  # noqa: ANN001, ANN201
    return LLM(smollm2, num_blocks=256)


def _check_in_step(llm: LLM) -> None:
    """Both caches consistent; the draft's sequences hold prefixes of their targets' contexts,
    with nothing reserved ahead and only accepted tokens' blocks hashed."""
    eng = llm.engine
    draft = eng.spec.proposer.cache
    eng.cache.check_invariants()
    draft.check_invariants()
    running = {s.seq_id: s for s in eng.scheduler.running}
    for sid, st in draft.seqs.items():
        s = running[sid]  # only running sequences have draft state
        assert st.lookahead == 0 and st.num_written <= st.num_tokens <= s.num_ctx
        assert st.num_hashed <= st.num_tokens // draft.block_size
        if s.chain is not None:
            assert st.block_hashes == s.chain.hashes[: st.num_hashed]


# --- start-up ---------------------------------------------------------------------------------


def test_draft_model_config_and_its_errors(tmp_path: Path) -> None:
    c = EngineConfig(speculative_config=_self()).spec
    assert (c.method, c.num_speculative_tokens, c.model) == ("draft_model", 4,
                                                            str(default_model_path()))
    for bad, says in (({"method": "draft_model"}, "needs the draft model's path"),
                      ({"method": "draft_model", "model": str(tmp_path / "no.gguf")},
                       "no draft model at")):
        with pytest.raises(SpecConfigError, match="speculative_config.model") as e:
            EngineConfig(speculative_config=bad)
        assert says in str(e.value) and e.value.options == ("speculative_config",)
        cli_spelling(e.value, EngineConfig)
        assert str(e.value).startswith("--speculative-config")
    with pytest.raises(SpecConfigError):  # refused before the target loads
        LLM("/nonexistent.gguf", speculative_config={"method": "draft_model", "model": "/no"})


def test_a_bad_or_foreign_draft_is_a_typed_error(smollm2, tmp_path: Path) -> None:  # noqa: ANN001
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(SpecConfigError, match="cannot load the draft model") as e:
        LLM(smollm2, num_blocks=32, speculative_config={"method": "draft_model",
                                                        "model": str(junk)})
    assert e.value.options == ("speculative_config",)
    small = write_tiny_gguf(_tiny(1024, 3, layers=1), tmp_path / "small.gguf", fast=True)
    with pytest.raises(SpecConfigError, match="the draft's vocabulary has 1024 tokens, the "
                                              "target's 49152"):
        LLM(smollm2, num_blocks=32, speculative_config={"method": "draft_model",
                                                        "model": str(small)})


def test_vocabularies_are_compared_token_by_token() -> None:
    class Tok:
        def __init__(self, vocab: dict) -> None:
            self.vocab = vocab

        def get_vocab(self) -> dict:
            return dict(self.vocab)

    class M:
        def __init__(self, vocab: dict) -> None:
            self.tokenizer = Tok(vocab)
            self.config = type("C", (), {"vocab_size": 3})()

    target = M({"a": 0, "b": 1, "c": 2})
    check_vocabulary(M({"c": 2, "a": 0, "b": 1}), target)
    with pytest.raises(SpecConfigError, match="token id 1 is 'b' in the target, 'x' in the draft"):
        check_vocabulary(M({"a": 0, "x": 1, "c": 2}), target)
    with pytest.raises(SpecConfigError, match="1 more tokens"):
        check_vocabulary(M({"a": 0, "b": 1, "c": 2, "d": 3}), target)


# --- greedy output ----------------------------------------------------------------------------


def test_self_draft_keeps_greedy_output_and_accepts_everything(smollm2, base) -> None:  # noqa: ANN001
    """The default model drafting for itself (its weights shared, its own cache): every
    prompt under every params (logprobs, stop strings, penalties, max_tokens, n > 1) gives
    the output of plain decoding, and ~every draft is accepted."""
    spec = LLM(smollm2, num_blocks=256, speculative_config=_self(3))
    assert spec.engine.spec.proposer.draft.shared
    prompts = [p for p in PROMPTS[1:] for _ in PARAMS]
    params = PARAMS * len(PROMPTS[1:])
    want = base.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert_same_outputs(want, got)
    st = spec.engine.stats()
    assert st.spec_decode_num_draft_tokens > 150
    assert st.spec_decode_acceptance_rate > 0.97  # float rounding of batched rows aside: all
    assert sum(g.num_accepted_tokens for g in got) == st.spec_decode_num_accepted_tokens
    assert st.blocks_used == 0 and st.spec_decode_draft_kv_usage == 0.0
    _check_in_step(spec)


def test_tiny_random_draft_low_acceptance_and_the_policy_turns_it_off(
        smollm2, base, tiny_draft) -> None:  # noqa: ANN001
    """A random draft (SmolLM2's tokenizer, 2 tiny layers) is almost never right: output is
    unchanged all the same, and the adaptive policy stops drafting with it."""
    p = SamplingParams(temperature=0, max_tokens=32)
    want = base.generate(PROMPTS[1:3], p)
    cfg = {"method": "draft_model", "model": str(tiny_draft), "num_speculative_tokens": 4}
    always = LLM(smollm2, num_blocks=256, speculative_config={**cfg, "adaptive": False})
    got = always.generate(PROMPTS[1:3], p)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    st = always.engine.stats()
    assert not always.engine.spec.proposer.draft.shared
    assert st.spec_decode_num_draft_tokens > 40 and st.spec_decode_acceptance_rate < 0.2
    adaptive = LLM(smollm2, num_blocks=256, speculative_config=cfg)
    got = adaptive.generate(PROMPTS[1:3], p)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    drafted = adaptive.engine.stats().spec_decode_num_draft_tokens
    generated = sum(len(g.token_ids) for g in got)
    assert 0 < drafted < 0.1 * 4 * generated  # tried, learnt, off
    _check_in_step(adaptive)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path, Path]:
    """A tiny target (loaded; its file) and another tiny draft on a 64-token vocabulary (the
    same tokenizer): fast engines for the bookkeeping tests and the distribution test."""
    d = tmp_path_factory.mktemp("tiny64")
    path = write_tiny_gguf(_tiny(64, 31), d / "target.gguf")
    return load_model(path), path, write_tiny_gguf(_tiny(64, 32), d / "draft.gguf")


def _tiny_prompts(n: int, length: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(17, 64, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def _tiny_self(path: Path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k,
            "adaptive": False}


def test_draft_cache_follows_preemption_abort_and_small_caches(tiny_pair) -> None:  # noqa: ANN001
    """A cache too small for every sequence (the draft's blocks run short too: those
    sequences draft nothing), preemptions and an abort mid-run: after every step the two
    caches agree, and the draft holds nothing at the end."""
    target, path, _ = tiny_pair
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _tiny_prompts(8)
    want = LLM(target, num_blocks=16, block_size=8).generate(prompts, p)
    spec = LLM(target, num_blocks=16, block_size=8, speculative_config=_tiny_self(path))
    eng = spec.engine
    assert eng.spec.proposer.draft.shared
    for i, pr in enumerate(prompts):
        eng.add_request(f"r{i}", pr, p)
    got: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.token_ids
        steps += 1
        if steps in (6, 9):
            eng.scheduler.preempt(eng.scheduler.running[0])  # as when blocks run short
        if steps == 12:
            eng.abort_request("r1")
        _check_in_step(spec)
    assert eng.stats().num_preemptions > 2
    for i, w in enumerate(want):
        if i != 1:
            assert got[f"r{i}"] == w.token_ids
    assert eng.spec.proposer.cache.stats().used_blocks == 0
    assert eng.stats().spec_decode_acceptance_rate > 0.9


def test_draft_prefix_hits_and_only_accepted_blocks_are_cached(tiny_pair) -> None:  # noqa: ANN001
    """The draft's cache serves prefix hits of its own (the same prompt again; n > 1 samples
    share the prompt), and every block it ever hashed names tokens the target accepted."""
    target, path, _ = tiny_pair
    spec = LLM(target, num_blocks=256, block_size=8, speculative_config=_tiny_self(path))
    eng = spec.engine
    draft = eng.spec.proposer.cache
    seen: set[bytes] = set()
    params = SamplingParams(temperature=0, max_tokens=40, n=3, ignore_eos=True)
    prompt = _tiny_prompts(1, 30)[0]
    for rid in ("a", "b"):
        eng.add_request(rid, prompt, params)
        while eng.has_unfinished_requests():
            eng.step()
            for s in eng.scheduler.running:
                seen.update(s.chain.hashes)
            for h, _ in draft.cached_blocks():
                assert h in seen
            _check_in_step(spec)
    st = draft.stats()
    assert st.prefix_hits >= 3 * 24 and st.used_blocks == 0  # the prompt's 3 full blocks
    assert eng.stats().spec_decode_acceptance_rate > 0.9


def test_without_prefix_caching_and_with_context_shift(tiny_pair) -> None:  # noqa: ANN001
    """Bare-count sequences (no prefix caching) accept lookahead too; a context shift drops the
    draft's sequence, which recomputes the shifted context."""
    target, path, _ = tiny_pair
    p = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = _tiny_prompts(3)
    for kw in ({"enable_prefix_caching": False},
               {"context_shift": True, "n_keep": 8, "max_model_len": 48}):
        want = LLM(target, num_blocks=64, **kw).generate(prompts, p)
        for spec_cfg in (_tiny_self(path), {"method": "ngram", "adaptive": False}):
            spec = LLM(target, num_blocks=64, speculative_config=spec_cfg, **kw)
            got = spec.generate(prompts, p)
            assert [g.token_ids for g in got] == [w.token_ids for w in want]
            assert spec.engine.stats().spec_decode_num_accepted_tokens > 0
            if "context_shift" in kw:
                assert spec.engine.stats().context_shifts > 0


def test_a_failing_draft_never_fails_the_step(tiny_pair) -> None:  # noqa: ANN001
    target, path, _ = tiny_pair
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = _tiny_prompts(3)
    spec = LLM(target, num_blocks=64, speculative_config=_tiny_self(path))
    prop = spec.engine.spec.proposer
    real = prop.runner.run
    calls = {"n": 0}

    def flaky(plan):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] % 3 == 2:
            raise RuntimeError("draft broke")
        return real(plan)

    prop.runner.run = flaky
    got = spec.generate(prompts, p)
    want = LLM(target, num_blocks=64).generate(prompts, p)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.engine.stats().spec_decode_draft_failures > 0
    assert prop.cache.stats().used_blocks == 0
    _check_in_step(spec)


# --- sampled output ---------------------------------------------------------------------------


def test_rejection_sampling_with_a_draft_distribution() -> None:
    """Drafts drawn from q (overlapping p's support only in part), accepted with
    min(1, p/q), corrected from max(0, p - q): each position keeps p (chi-square, 5 degrees
    of freedom, 20.5 = the 0.1% tail)."""
    V, n = 6, 12000
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(3, V, generator=g, dtype=torch.float64) * 1.5, -1)
    p[1, 5] = 0.0  # a token the target never emits that the draft likes
    p[2] *= 3.0  # rows need not sum to 1
    q = torch.softmax(torch.randn(2, V, generator=g, dtype=torch.float64), -1)
    q[0, 0] = 0.0  # one the draft never proposes
    q[1, 5] = 0.5
    q = q / q.sum(-1, keepdim=True)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(n):
        d = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)]
        out = accept_sampled(p, d, g, q)
        first[out[0]] += 1
        if out[0] == d[0] and len(out) > 1:  # given the first draft accepted
            second[out[1]] += 1
    assert _chi2(first, p[0]) < 20.5
    assert _chi2(second, p[1] / p[1].sum()) < 20.5


def test_sampled_distribution_unchanged_with_a_sampling_draft(tiny_pair) -> None:  # noqa: ANN001
    """Through the engine: the first verified token after t1 (drafted by a different random
    model from its own top-4 distribution q) follows the target's top-4 distribution
    p(. | prompt, t1) (chi-square, 3 degrees of freedom; 16.3 = the 0.1% tail)."""
    target, _, draft = tiny_pair
    prompt = [25, 39, 44, 33, 52]
    p = SamplingParams(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True)
    llm = LLM(target, num_blocks=2048, max_num_seqs=256, speculative_config={
        "method": "draft_model", "model": str(draft), "num_speculative_tokens": 2,
        "adaptive": False})
    torch.manual_seed(0)
    outs = llm.generate([prompt] * 1200, p)
    st = llm.engine.stats()
    assert st.spec_decode_num_accepted_tokens > 20 and st.spec_decode_acceptance_rate < 0.9
    firsts = torch.tensor([o.token_ids[0] for o in outs])
    t1 = int(firsts.mode().values)
    counts = torch.zeros(64)
    for o in outs:
        if o.token_ids[0] == t1:
            counts[o.token_ids[1]] += 1
    ref = LLM(target, num_blocks=64).engine
    ref.add_request("ref", prompt + [t1], SamplingParams(max_tokens=1))
    logits = ref.forward().logits[0:1]
    want = torch.softmax(warp(logits.clone(), [p]), -1)[0].double()
    assert counts.sum() > 250
    assert _chi2(counts, want) < 16.3


def test_seeded_sampling_is_the_same_whatever_drafts(tiny_pair) -> None:  # noqa: ANN001
    """A seed gives the same tokens with the draft model as with prompt lookup: every
    emitted token is the target's position-keyed Gumbel-max; the self-draft, drawing under
    the same noise, is accepted ~always."""
    target, path, _ = tiny_pair
    p = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=11, n=2, ignore_eos=True)
    prompts = _tiny_prompts(2)
    a = LLM(target, num_blocks=128, speculative_config=_tiny_self(path)).generate(prompts, p)
    spec = LLM(target, num_blocks=128, speculative_config={"method": "ngram"})
    b = spec.generate(prompts, p)
    assert [[o.token_ids for o in r.outputs] for r in a] == [[o.token_ids for o in r.outputs]
                                                              for r in b]
    assert sum(r.num_draft_tokens for r in a) > 0
    assert sum(r.num_accepted_tokens for r in a) > 0.9 * sum(r.num_draft_tokens for r in a)
