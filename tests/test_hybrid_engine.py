"""The hybrid KV cache through the engine, on tiny random GGUFs (tests/tiny_gguf.py):
Gemma 3-shaped (a 16-token window on five of six layers: six groups of one layer) and
Mistral-style (every layer windowed: one window group; a Phi-3-shaped file, whose GGUF carries
an all-layer window as Phi-3-mini's 2047, since llama.cpp's "llama" files carry none). The reference for each feature is the
same engine with `disable_hybrid_kv_cache_manager=True` (every layer keeps its whole context,
the band mask alone applies the window; the band mask itself is checked against transformers
in test_archs.py and test_gemma3.py): outputs must be token for token the same, while the
window groups give their blocks back.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tiny_gguf import SPECS, write_tiny_gguf

from pagedkv import LLM, SamplingParams
from pagedkv.engine.beam_search import BeamSearchParams
from pagedkv.errors import CacheConfigError, SlidingWindowError

LONG = [(7 * i + 3) % 900 + 10 for i in range(70)]  # 70 tokens: past the 16-token window
PROMPTS = [LONG, LONG[:40] + [5, 6, 7], list(range(40, 69))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
BS = 16


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hybrid")
    mistral = dataclasses.replace(SPECS["phi3"], window=16, layers=2)
    return {"gemma3": write_tiny_gguf(SPECS["gemma3"], folder / "gemma3.gguf", fast=True),
            "mistral": write_tiny_gguf(mistral, folder / "mistral.gguf", fast=True)}


def pair(path: Path, **kw) -> tuple[LLM, LLM]:  # noqa: ANN003
    return (LLM(str(path), **kw),
            LLM(str(path), disable_hybrid_kv_cache_manager=True, **kw))


def tokens(outs) -> list[list[int]]:  # noqa: ANN001
    return [list(o.token_ids) for o in outs]


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_groups_and_outputs_equal_the_full_cache(files: dict[str, Path], arch: str) -> None:
    hybrid, full = pair(files[arch], num_blocks=96, max_num_batched_tokens=32)
    groups = hybrid.engine.cache.groups
    if arch == "gemma3":
        assert groups.windows == (None, 16, 16, 16, 16, 16)
        assert groups.group_layers[0] == (5,) and groups.layers_per_group == 1
    else:
        assert groups.windows == (16,) and groups.group_layers == ((0, 1),)
    assert full.engine.cache.num_groups == 1 and full.engine.cache.groups.windows == (None,)
    # chunks of 32 tokens: later chunks' bands start inside blocks the window groups keep
    assert tokens(hybrid.generate(PROMPTS, GREEDY)) == tokens(full.generate(PROMPTS, GREEDY))
    hybrid.engine.cache.check_invariants()


def test_window_groups_give_blocks_back_while_decoding(files: dict[str, Path]) -> None:
    llm = LLM(str(files["mistral"]), num_blocks=64)
    eng = llm.engine
    eng.add_request("a", LONG, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    held = []
    while not eng.is_idle():
        eng.step()
        for s in eng.scheduler.running:
            c = eng.cache
            held.append(c.held_blocks(s.seq_id))
            # the window (16 tokens) plus the block being filled, never the whole context
            assert c.held_blocks(s.seq_id) <= -(-16 // BS) + 2
            assert c.seq_pos_min(s.seq_id) >= c.num_tokens(s.seq_id) - 16 - 2 * BS
    assert held and max(held) <= 3
    eng.cache.check_invariants()


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_multi_turn_past_the_window_recomputes_only_the_new_turn(files: dict[str, Path],
                                                                 arch: str) -> None:
    """Each turn's prompt is the whole conversation so far: every group serves it from the
    prefix cache, whole blocks (window groups from the blocks they gave back as cached blocks)
    then the last turn's partial block kept when it finished, at ~8x the window."""
    llm = LLM(str(files[arch]), num_blocks=600)
    _, cold = pair(files[arch], num_blocks=600, enable_prefix_caching=False)
    context: list[int] = []
    for turn in range(6):
        prompt = context + [100 + 7 * turn + i for i in range(17)]
        out = llm.generate([prompt], GREEDY)[0]
        # all of it but the last answer token (never fed back, so never written)
        assert out.num_cached_tokens == max(0, len(context) - 1), turn
        assert list(out.token_ids) == list(cold.generate([prompt], GREEDY)[0].token_ids)
        context = prompt + list(out.token_ids)
    assert len(context) > 8 * 16


def test_n_beam_preemption_and_int8_equal_the_full_cache(files: dict[str, Path]) -> None:
    """Forks (n = 3 seeded samples, beam search) share every group's blocks and copy on write;
    a pool too small for all prompts preempts and recomputes; int8 KV per group."""
    kw = dict(max_num_batched_tokens=32, kv_cache_dtype="int8")
    path = str(files["gemma3"])  # blocks of 1 layer: 60 is 10 of the full cache's 6-layer ones
    hybrid = LLM(path, num_blocks=60, **kw)
    full = LLM(path, num_blocks=24, disable_hybrid_kv_cache_manager=True, **kw)
    sampled = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)
    a = [[list(c.token_ids) for c in o.outputs] for o in hybrid.generate(PROMPTS, sampled)]
    b = [[list(c.token_ids) for c in o.outputs] for o in full.generate(PROMPTS, sampled)]
    assert a == b
    assert hybrid.engine.stats().num_preemptions > 0  # recomputed from its cached blocks
    hybrid = LLM(path, num_blocks=6 * 24, **kw)
    beams = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    x = [[s.token_ids for s in o.sequences] for o in hybrid.beam_search(PROMPTS[:2], beams)]
    y = [[s.token_ids for s in o.sequences] for o in full.beam_search(PROMPTS[:2], beams)]
    assert x == y
    hybrid.engine.cache.check_invariants()


def test_disk_tier_and_snapshot_per_group(files: dict[str, Path], tmp_path: Path) -> None:
    """Every group's blocks are written to the tier under their group key; a fresh engine
    loads whole blocks (all groups) from it, and a snapshot restores them as cached blocks."""
    path, kw = str(files["gemma3"]), dict(num_blocks=600)
    cold = tokens(LLM(path, enable_prefix_caching=False, **kw).generate([LONG], GREEDY))
    first = LLM(path, kv_tier=f"disk:{tmp_path / 'tier'}", **kw)
    assert tokens(first.generate([LONG], GREEDY)) == cold
    first.engine.tiers.close()
    second = LLM(path, kv_tier=f"disk:{tmp_path / 'tier'}", **kw)
    out = second.generate([LONG], GREEDY)[0]
    assert list(out.token_ids) == cold[0]
    assert out.num_tier_cached_tokens == (len(LONG) - 1) // BS * BS == out.num_cached_tokens
    assert second.engine.tier_stats()["hit_tokens"] == out.num_tier_cached_tokens
    second.engine.cache.check_invariants()
    snap = LLM(path, kv_snapshot=str(tmp_path / "snap"), **kw)
    snap.generate([LONG], GREEDY)
    assert snap.engine.snapshot() > 0
    restarted = LLM(path, kv_snapshot=str(tmp_path / "snap"), **kw)
    out = restarted.generate([LONG], GREEDY)[0]
    assert list(out.token_ids) == cold[0] and out.num_cached_tokens == (len(LONG) - 1) // BS * BS
    restarted.engine.cache.check_invariants()


def test_what_window_groups_cannot_do_is_refused(files: dict[str, Path]) -> None:
    path = str(files["gemma3"])
    with pytest.raises(CacheConfigError, match="disable-hybrid-kv-cache-manager"):
        LLM(path, num_blocks=64, context_shift=True, max_model_len=256)
    LLM(path, num_blocks=64, context_shift=True, max_model_len=256,
        disable_hybrid_kv_cache_manager=True)
    cache = LLM(path, num_blocks=64).engine.cache
    cache.create("s", LONG)
    assert cache.seq_pos_min("s") == (len(LONG) - 16 + 1) // BS * BS
    for op in (lambda: cache.remove("s", 0, 5), lambda: cache.shift("s", 0, 5, 1),
               lambda: cache.copy("s", "s", 0, 5)):
        with pytest.raises(SlidingWindowError, match="disable-hybrid-kv-cache-manager"):
            op()
    with pytest.raises(SlidingWindowError, match="window of 16"):
        cache.truncate("s", 20)
    cache.truncate("s", len(LONG) - 3)  # within what the window still holds
    cache.check_invariants()


def test_server_reports_cached_tokens_truthfully(files: dict[str, Path]) -> None:
    """Through the real server and the openai client: each turn of a conversation past the
    window reports as cached exactly the tokens no group computed (the engine's count)."""
    import openai

    from pagedkv.engine import LLMEngine
    from pagedkv.server import ServerThread, build_app

    engine = LLMEngine(str(files["gemma3"]), num_blocks=600)
    with ServerThread(build_app(engine, served_model_name="g")) as thread:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0)
        context: list[int] = []
        for turn in range(4):
            prompt = context + [200 + 11 * turn + i for i in range(23)]
            r = client.completions.create(model="g", prompt=prompt, max_tokens=6, temperature=0)
            details = r.usage.prompt_tokens_details
            cached = details.cached_tokens if details is not None else 0
            assert (r.usage.prompt_tokens, cached) == (len(prompt), len(context)), turn
            context = prompt  # the next turn repeats this one's prompt (all of it cached: whole
            # blocks, then the leading part of the block it ended in, kept or filled by the answer)
    assert engine.cache.num_groups == 6


REPEAT = [11, 12, 13, 14, 15, 16, 17, 18, 19] * 8  # 72 tokens: the proposer drafts at once


def test_speculative_decoding_on_window_groups_equals_plain_decoding(files: dict[str, Path]
                                                                     ) -> None:
    """Prompt-lookup drafts verified on Gemma 3's six groups (drafting whenever a match
    exists): the tokens equal the full cache's with speculation, and the greedy ones (with
    penalties too) plain decoding's, with drafts accepted and rejected; a
    pool too small for every sequence preempts (and never for drafts); check_invariants holds
    after every step, and window groups keep giving blocks back while verifying."""
    path = str(files["gemma3"])
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
            "adaptive": False}
    prompts = [REPEAT[:20], LONG[:20], LONG[30:50], REPEAT[5:25], LONG[10:22] + REPEAT[:8]]
    kw = dict(max_tokens=64, ignore_eos=True)
    params = [SamplingParams(temperature=0, **kw),
              SamplingParams(temperature=0, frequency_penalty=0.3, **kw),  # runs that switch
              SamplingParams(temperature=1.0, seed=3, **kw),  # position-keyed draws
              SamplingParams(temperature=0, frequency_penalty=0.3, **kw),
              SamplingParams(temperature=0, **kw)]
    plain = tokens(LLM(path, num_blocks=400).generate(prompts, params))
    full = tokens(LLM(path, num_blocks=400, disable_hybrid_kv_cache_manager=True,
                      speculative_config=spec).generate(prompts, params))
    greedy = [0, 1, 3, 4]  # a seeded sample speculating draws position-keyed: as on the full cache
    assert [full[i] for i in greedy] == [plain[i] for i in greedy]
    llm = LLM(path, num_blocks=40, max_num_batched_tokens=32, speculative_config=spec)
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"r{i}", p, sp)
    got: dict[str, list[int]] = {}
    most = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
        eng.cache.check_invariants()
        for s in eng.scheduler.running:  # a window group holds its window, not the context
            r = eng.cache.seq(s.seq_id).tables[1]
            most = max(most, len(r.blocks) - r.start)
    assert [got[f"r{i}"] for i in range(len(prompts))] == full
    st = eng.stats()
    assert st.spec_decode_num_accepted_tokens > 0
    assert st.spec_decode_num_draft_tokens > st.spec_decode_num_accepted_tokens
    assert st.num_preemptions > 0
    assert most <= -(-16 // BS) + 1 + -(-4 // BS)  # window + the block filling + lookahead
    assert eng.cache.num_free_blocks == eng.cache.num_blocks
