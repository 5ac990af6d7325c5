"""Qwen2, Qwen3 (QK-norm), Mistral, Phi-3 (fused qkv / gate_up), Gemma 3 (sandwich norms, a
16-token window on five of six layers), Gemma 2 (soft-caps, a window on every other layer) and
Llama at real models' shapes; Phi-4-mini's partial rotary.

Each architecture is a tiny random GGUF (tests/tiny_gguf.py: a few layers, the hidden and head
sizes of a real model, Q8_0/Q4_0/F16 matrices, a byte-level tokenizer) loaded by pagedkv and by
transformers' own GGUF loader; pagedkv's greedy tokens, batched, must equal transformers'
float32 greedy tokens one by one.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from tiny_gguf import SPECS, TinySpec, longrope_factors, rope_freqs, write_tiny_gguf

from pagedkv import LLM, SamplingParams
from pagedkv.errors import CacheConfigError, ModelLoadError, UnsupportedModelError
from pagedkv.model.config import ModelConfig

PROMPTS = [[5, 77, 300, 12, 900, 45, 33, 1000, 17, 8, 250, 600, 3], list(range(40, 69))]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=sorted(SPECS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One architecture: its GGUF, pagedkv's LLM over it, transformers' model from the same file."""
    from transformers import AutoModelForCausalLM

    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    path = write_tiny_gguf(SPECS[arch], folder / f"{arch}.gguf")
    hf = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=path.name, dtype=torch.float32)
    return {"arch": arch, "path": path, "llm": LLM(str(path), num_blocks=64), "hf": hf.eval()}


def hf_greedy(hf: Any, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """transformers' float32 greedy continuation, EOS not stopping it (as ignore_eos)."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def test_greedy_matches_transformers(tiny: dict[str, Any]) -> None:
    ours = greedy(tiny["llm"])  # both prompts in one batch: prefill, then 2-row decode steps
    assert ours == [hf_greedy(tiny["hf"], p) for p in PROMPTS]


def test_config_weights_and_tokenizer(tiny: dict[str, Any]) -> None:
    spec, loaded = SPECS[tiny["arch"]], tiny["llm"].engine.loaded
    cfg, hf_cfg = loaded.config, tiny["hf"].config
    assert cfg.architecture == tiny["arch"]  # "mistral": a "llama" file named so
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (
        hf_cfg.hidden_size, hf_cfg.num_hidden_layers, hf_cfg.num_attention_heads,
        hf_cfg.num_key_value_heads, hf_cfg.intermediate_size)
    assert cfg.head_dim == spec.head_dim
    assert (cfg.qk_norm, cfg.attention_bias, cfg.tie_word_embeddings) == (spec.qk_norm, spec.bias, spec.tied)
    assert cfg.sliding_window == spec.window == getattr(hf_cfg, "sliding_window", None)
    assert loaded.weights == "quantized"  # every matrix stays in the file's blocks
    assert loaded.weight_bytes <= tiny["path"].stat().st_size
    text = "Hello world, paged attention!"
    assert loaded.tokenizer is not None
    assert loaded.tokenizer.decode(loaded.tokenizer(text).input_ids) == text


@pytest.mark.parametrize("tiny", ["qwen3", "phi3"], indirect=True)
def test_float32_weights_same_greedy(tiny: dict[str, Any]) -> None:
    """The dequantized-at-load path fills the same QK-norm / fused parameters."""
    llm = LLM(str(tiny["path"]), num_blocks=64, weights="float32")
    assert llm.engine.loaded.weights == "float32"
    assert greedy(llm) == greedy(tiny["llm"])


def _hf_checkpoint(tiny: dict[str, Any]) -> Any:
    """transformers' model re-made as a plain (not GGUF-quantized, hence savable) model with the
    same weights. The Mistral file loads in transformers as Llama (its GGUF loader has no
    "mistral" tensor map), so its weights go into a MistralForCausalLM of the same shape."""
    import transformers as tf

    hf, c = tiny["hf"], tiny["hf"].config
    if tiny["arch"] == "mistral":
        cfg = tf.MistralConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
            rope_theta=c.rope_parameters["rope_theta"], max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=c.tie_word_embeddings, sliding_window=None,
        )
        model = tf.MistralForCausalLM(cfg)
    else:
        d = {k: v for k, v in c.to_dict().items() if k != "quantization_config"}
        model = type(hf)(type(c).from_dict(d))
    model.load_state_dict(hf.state_dict())
    return model.eval()


@pytest.mark.parametrize("tiny", ["qwen3", "phi3", "mistral", "gemma2"], indirect=True)
def test_hf_checkpoint_folder(tiny: dict[str, Any], tmp_path: Path) -> None:
    """config.json + safetensors of the same model (Phi-3: qkv_proj / gate_up_proj names)."""
    arch = tiny["arch"]
    hf = _hf_checkpoint(tiny)
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), num_blocks=64)
    assert llm.engine.loaded.config.architecture == arch
    assert greedy(llm) == [hf_greedy(hf, p) for p in PROMPTS]


# Llama 3.2-like heads (64 wide, RoPE base 500,000, scaling factor 32) with an original context of
# 64 tokens instead of 8,192, so that the prompts' positions reach the scaled frequencies; and
# DeepSeek-Coder's linear scaling (factor 4, in the file's metadata)
Q8, Q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0
SCALED = {
    "llama3": TinySpec("llama", "Llama 3.2 tiny", 512, 8, 2, 64, 1376, rope_theta=5e5,
                       llama3=(32.0, 1.0, 4.0, 64), seed=7, qtypes={"attn": Q8, "ffn": Q4}),
    "linear": TinySpec("llama", "DeepSeek-Coder tiny", 512, 4, 4, 128, 1376, rope_theta=1e5,
                       linear=4.0, seed=8, qtypes={"attn": Q8, "ffn": Q4}),
    # Gemma 3 4B+: the global layers' RoPE (base 1e6) scaled by 8, the local ones (1e4) not
    "gemma3": dataclasses.replace(SPECS["gemma3"], name="Gemma 3 4B tiny", linear=8.0, seed=9),
    # Phi-3.5-mini's LongRoPE (original context 4,096 of 131,072; here 64 of 2,048)
    "longrope": dataclasses.replace(SPECS["phi3"], name="Phi3.5 tiny", longrope=64, seed=10),
    # Qwen3 with YaRN (factor 4 over an original context of 64 tokens instead of 32,768)
    "yarn": dataclasses.replace(SPECS["qwen3"], name="Qwen3 yarn tiny", yarn=(4.0, 64), seed=16),
    # Phi-4-mini: RoPE over 96 of each head's 128 dims, LongRoPE, GQA 3:1, tied embeddings
    "partial": TinySpec("phi3", "Phi4 mini tiny", 768, 6, 2, 128, 1600, fused=True, tied=True, seed=11,
                        rope_theta=1e4, longrope=64, rotary=96, qtypes={"attn": Q4, "ffn": Q8, "embd": Q8}),
}


def _rope_parameters(spec: TinySpec, hf: dict[str, Any]) -> dict[str, Any]:
    if spec.arch == "gemma3":  # per layer type
        return {**hf, "full_attention": {**hf["full_attention"], "rope_type": "linear", "factor": spec.linear}}
    if spec.longrope:
        short, long = longrope_factors(spec)
        return {"rope_type": "longrope", "rope_theta": spec.rope_theta, "short_factor": short.tolist(),
                "long_factor": long.tolist(), "original_max_position_embeddings": spec.longrope}
    if spec.linear:
        return {"rope_type": "linear", "rope_theta": spec.rope_theta, "factor": spec.linear}
    if spec.yarn:
        return {"rope_type": "yarn", "rope_theta": spec.rope_theta, "factor": spec.yarn[0],
                "original_max_position_embeddings": spec.yarn[1]}
    factor, low, high, ctx = spec.llama3
    return {"rope_type": "llama3", "rope_theta": spec.rope_theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": ctx}


def test_hf_partial_rotary_folder(tmp_path: Path) -> None:
    """A Phi-3 checkpoint with RoPE over half of each head (plain RoPE, GQA): greedy equals
    transformers'; the q/k rows are reordered at load, v and o are not."""
    import transformers as tf

    torch.manual_seed(12)
    cfg = tf.Phi3Config(vocab_size=1024, hidden_size=256, intermediate_size=640, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        pad_token_id=0, initializer_range=0.1,  # (0.02: RoPE barely matters)
                        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    hf = tf.Phi3ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), num_blocks=64)
    assert llm.engine.loaded.config.rotary_dim == 32
    assert greedy(llm) == [hf_greedy(hf, p) for p in PROMPTS]


def _scaled_pair(spec: TinySpec, path: Path) -> tuple[Path, Any, Any]:
    """`spec` written at `path`; transformers' model from its GGUF loader (plain RoPE) and the
    same weights with the model's own rope_parameters (eval mode both)."""
    from transformers import AutoModelForCausalLM

    write_tiny_gguf(spec, path)
    plain = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    d = {k: v for k, v in plain.config.to_dict().items() if k != "quantization_config"}
    d["rope_parameters"] = _rope_parameters(spec, d["rope_parameters"])
    if spec.rotary:
        d["rope_parameters"]["partial_rotary_factor"] = spec.rotary / spec.head_dim
    if spec.longrope:  # as Phi-3.5's config.json has it too (the GGUF config: Phi3Config's 4,096)
        d["original_max_position_embeddings"] = spec.longrope
    scaled = type(plain)(type(plain.config).from_dict(d))
    scaled.load_state_dict(plain.state_dict())
    return path, plain, scaled.eval()


@pytest.mark.parametrize("kind", sorted(SCALED))
def test_gguf_rope_scaling(kind: str, tmp_path: Path) -> None:
    """A Llama 3.1+ file's rope_freqs (its "llama3" RoPE scaling, as per-frequency divisors), a
    file's linear rope scaling and Phi-3's LongRoPE (its short factors and attention factor) are
    applied as llama.cpp applies them: greedy equals transformers' with the model's own
    rope_parameters. (transformers' GGUF loader drops them all and runs plain RoPE, which parts
    from it here.)"""
    spec = SCALED[kind]
    path, plain, scaled = _scaled_pair(spec, tmp_path / f"{kind}.gguf")
    llm = LLM(str(path), num_blocks=64)
    want = (rope_freqs(spec).tolist() if spec.llama3 else longrope_factors(spec)[0].tolist() if spec.longrope
            else [spec.linear] * (spec.head_dim // 2) if spec.linear else None)
    if want is not None:  # (yarn's divisors: checked through transformers' output below)
        assert llm.engine.loaded.config.rope_freq_factors == pytest.approx(want)
    if spec.longrope:  # the short factors' context (transformers switches to the long ones past it)
        assert llm.engine.max_model_len == spec.longrope
    assert greedy(llm) == [hf_greedy(scaled, p) for p in PROMPTS]
    # the next token's top logprobs after the longer prompt: transformers' with the scaling,
    # clearly not its plain RoPE's (the tiny Gemma repeats its last token either way)
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    ours = out.outputs[0].logprobs[0]
    with torch.no_grad():
        want, other = (torch.log_softmax(m(torch.tensor([PROMPTS[1]])).logits[0, -1], -1) for m in (scaled, plain))
    assert max(abs(lp - float(want[t])) for t, lp in ours.items()) < 1e-3
    assert max(abs(lp - float(other[t])) for t, lp in ours.items()) > 1e-2


@pytest.mark.parametrize("kind", ["longrope", "partial"])
def test_longrope_past_the_original_context(kind: str, tmp_path: Path) -> None:
    """A max_model_len past LongRoPE's original context (64 here) takes the file's long factors
    for every position, as llama.cpp does for such a context: a prompt past the original, where
    transformers turns every position by the long factors too, continues as transformers'."""
    spec = SCALED[kind]
    path, _, scaled = _scaled_pair(spec, tmp_path / f"{kind}.gguf")
    llm = LLM(str(path), num_blocks=64, max_model_len=256)
    cfg = llm.engine.loaded.config
    assert cfg.rope_freq_factors == pytest.approx(longrope_factors(spec)[1].tolist())
    assert llm.engine.max_model_len == 256 and cfg.max_position_embeddings == 32 * spec.longrope
    long_prompt = [(7 * i + 3) % 1000 for i in range(90)]  # 90 tokens: past the original 64
    assert greedy(llm, [long_prompt]) == [hf_greedy(scaled, long_prompt)]
    with pytest.raises(CacheConfigError, match="max_model_len"):  # past the file's whole context
        LLM(str(path), num_blocks=64, max_model_len=32 * spec.longrope + 1)


def _llama_variant(spec: TinySpec, tmp_path: Path, arch: str, extra: dict[str, Any], name: str) -> tuple[Path, Any, Any]:
    """`spec` (a Llama layout) written as `arch`, and transformers' <name>ForCausalLM of the same
    weights (config `extra` on top of the file's shapes): transformers' GGUF loader does not
    read `arch`, so it loads the same tensors filed as Llama (its q/k rows un-permuted) and
    hands their state to the other class. Returns (the `arch` file, the Llama model, the other)."""
    import transformers as tf

    (tmp_path / "as_llama").mkdir()
    llama = write_tiny_gguf(dataclasses.replace(spec, scales=None), tmp_path / "as_llama" / "m.gguf")
    path = write_tiny_gguf(dataclasses.replace(spec, arch=arch), tmp_path / f"{arch}.gguf")
    plain = tf.AutoModelForCausalLM.from_pretrained(str(llama.parent), gguf_file=llama.name, dtype=torch.float32)
    c = plain.config
    cfg = getattr(tf, f"{name}Config")(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps, rope_theta=spec.rope_theta,
        max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        **extra)
    ref = getattr(tf, f"{name}ForCausalLM")(cfg)
    assert ref.load_state_dict(plain.state_dict()).missing_keys == []
    return path, plain.eval(), ref.eval()


def test_smollm3_nope_layers(tmp_path: Path) -> None:
    """SmolLM3: every 4th layer attends without RoPE. A GGUF file (llama's permuted q/k rows,
    the NoPE step llama.cpp fixes) and an HF folder (`no_rope_layers`) both continue as
    transformers' SmolLM3; context shift leaves the NoPE layers' keys as they are."""
    spec = TinySpec("llama", "SmolLM3 tiny", 512, 8, 2, 64, 1376, layers=8, rope_theta=2e6, seed=17,
                    qtypes={"attn": Q8, "ffn": Q4, "embd": Q8})
    path, plain, ref = _llama_variant(spec, tmp_path, "smollm3", {}, "SmolLM3")
    assert ref.config.no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0]
    want = [hf_greedy(ref, p) for p in PROMPTS]
    llm = LLM(str(path), num_blocks=64)
    assert llm.engine.loaded.config.nope_layers == (3, 7)
    assert greedy(llm) == want
    assert want != [hf_greedy(plain, p) for p in PROMPTS]  # (RoPE on every layer parts from it)
    ref.save_pretrained(tmp_path / "hf")
    assert greedy(LLM(str(tmp_path / "hf"), num_blocks=64)) == want
    model = llm.engine.loaded.model
    k = torch.randn(8, 5, 2, 64, generator=torch.Generator().manual_seed(0))
    shifted = model.shift_keys(k, 7)
    assert torch.equal(shifted[3], k[3]) and not torch.allclose(shifted[0], k[0])


def test_granite_scales(tmp_path: Path) -> None:
    """Granite: embeddings, residual branches, attention scale and logits scaled by the file's
    four keys (llama's permuted q/k rows): greedy and logprobs equal transformers' Granite with
    the same multipliers, from a GGUF file and an HF folder."""
    keys = {"embedding_scale": 12.0, "residual_scale": 0.22, "attention.scale": 0.0078125, "logit_scale": 8.0}
    spec = TinySpec("llama", "Granite tiny", 512, 8, 2, 64, 1376, layers=3, tied=True, rope_theta=1e4, seed=18,
                    qtypes={"attn": Q8, "ffn": Q4, "embd": Q8})
    path, plain, ref = _llama_variant(
        dataclasses.replace(spec, scales=keys), tmp_path, "granite", {
            "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
            "logits_scaling": 8.0}, "Granite")
    want = [hf_greedy(ref, p) for p in PROMPTS]
    llm = LLM(str(path), num_blocks=64)
    assert llm.engine.loaded.config.attention_scale == 0.0078125
    assert greedy(llm) == want
    assert want != [hf_greedy(plain, p) for p in PROMPTS]  # (Llama's scales part from it)
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    with torch.no_grad():
        lp = torch.log_softmax(ref(torch.tensor([PROMPTS[1]])).logits[0, -1], -1)
    assert max(abs(v - float(lp[t])) for t, v in out.outputs[0].logprobs[0].items()) < 1e-3
    ref.save_pretrained(tmp_path / "hf")
    assert greedy(LLM(str(tmp_path / "hf"), num_blocks=64)) == want
    with pytest.raises(ModelLoadError, match="granite.residual_scale"):
        ModelConfig.from_gguf({"general.architecture": "granite", "granite.embedding_length": 64,
                               "granite.attention.head_count": 2, "granite.block_count": 1,
                               "granite.feed_forward_length": 64, "granite.residual_scale": -1.0}, [])


def test_gemma2_softcaps_default_and_checked() -> None:
    """Without the keys Gemma 2 caps at 50 / 30 (llama.cpp's and transformers' defaults); a
    checkpoint's null turns a cap off; a bad value is a typed error."""
    meta = {"general.architecture": "gemma2", "gemma2.embedding_length": 256, "gemma2.attention.head_count": 2,
            "gemma2.block_count": 2, "gemma2.feed_forward_length": 512, "gemma2.vocab_size": 100}
    cfg = ModelConfig.from_gguf(meta, [])
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.layer_types) == (50.0, 30.0, None)
    hf = {"model_type": "gemma2", "vocab_size": 100, "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 128, "sliding_window": 16}
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    assert cfg.layer_types == ["sliding", "full"] and cfg.rope_local_theta is None and not cfg.qk_norm
    assert ModelConfig.from_hf({**hf, "final_logit_softcapping": None}).final_logit_softcapping is None
    for bad in (0.0, -50.0, float("nan"), float("inf"), "abc"):
        with pytest.raises(ModelLoadError, match="softcapping"):
            ModelConfig.from_gguf({**meta, "gemma2.attn_logit_softcapping": bad}, [])
    with pytest.raises(UnsupportedModelError, match="gemma2: rope scaling 'linear'"):
        ModelConfig.from_hf({**hf, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})


def test_gemma2_softcaps_from_the_file(tmp_path: Path) -> None:
    """Gemma 2's soft-caps come from the file (here 2 on the scores and 3 on the logits, where
    they bite): greedy and logprobs equal transformers' with those caps, not its defaults'
    (50 / 30, all its GGUF loader gives), in prefill and decode."""
    from transformers import AutoModelForCausalLM

    spec = dataclasses.replace(SPECS["gemma2"], name="Gemma 2 capped", softcaps=(2.0, 3.0), seed=15)
    path = write_tiny_gguf(spec, tmp_path / "gemma2.gguf")
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    d = {k: v for k, v in plain.config.to_dict().items() if k != "quantization_config"}
    capped = type(plain)(type(plain.config).from_dict(
        {**d, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}))
    capped.load_state_dict(plain.state_dict())
    capped.eval()
    llm = LLM(str(path), num_blocks=64)
    cfg = llm.engine.loaded.config
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.qk_norm) == (2.0, 3.0, False)
    assert cfg.layer_types == ["sliding", "full", "sliding", "full"]
    assert greedy(llm) == [hf_greedy(capped, p) for p in PROMPTS]
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=3, logprobs=5))[0]
    ids = PROMPTS[1] + list(out.outputs[0].token_ids)
    with torch.no_grad():
        want, other = (torch.log_softmax(m(torch.tensor([ids])).logits[0], -1) for m in (capped, plain))
    for j, ours in enumerate(out.outputs[0].logprobs):  # the prefill's token, then two decodes
        row = len(PROMPTS[1]) - 1 + j
        assert max(abs(lp - float(want[row, t])) for t, lp in ours.items()) < 1e-3
        assert max(abs(lp - float(other[row, t])) for t, lp in ours.items()) > 1e-2


_LLAMA_META = {
    "general.architecture": "llama", "llama.embedding_length": 256, "llama.attention.head_count": 4,
    "llama.block_count": 2, "llama.feed_forward_length": 512, "llama.vocab_size": 100,
}


@pytest.mark.parametrize("values", [[1.0] * 31, [1.0] * 33, [1.0] * 31 + [0.0], [1.0] * 31 + [float("nan")],
                                    [1.0] * 31 + [-2.0], [1.0] * 31 + [float("inf")]])
def test_bad_rope_freqs_refused(values: list[float]) -> None:
    """head_dim 64: 32 divisors, each finite and positive, or a typed error."""
    with pytest.raises(ModelLoadError, match="rope_freq_factors"):
        ModelConfig.from_gguf(_LLAMA_META, ["rope_freqs.weight"], rope_freqs=values)


def test_rope_freqs_values_and_name_go_together() -> None:
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        ModelConfig.from_gguf(_LLAMA_META, ["rope_freqs.weight"])
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        ModelConfig.from_gguf(_LLAMA_META, [], rope_freqs=[1.0] * 32)
    cfg = ModelConfig.from_gguf(_LLAMA_META, ["rope_freqs.weight"], rope_freqs=[2.0] * 32)
    assert cfg.rope_freq_factors == (2.0,) * 32 and cfg.rope_scaling is None
    linear = {**_LLAMA_META, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    cfg = ModelConfig.from_gguf(linear, ["rope_freqs.weight"], rope_freqs=[2.0] * 32)
    assert cfg.rope_freq_factors == (8.0,) * 32  # both, as llama.cpp: freq_scale and the divisors
    for bad in (0.0, -1.0, float("nan"), "four", None):
        with pytest.raises(ModelLoadError, match="rope.scaling.factor"):
            ModelConfig.from_gguf({**linear, "llama.rope.scaling.factor": bad}, [])
    with pytest.raises(UnsupportedModelError, match="longrope"):  # (LongRoPE comes as its tensors)
        ModelConfig.from_gguf({**_LLAMA_META, "llama.rope.scaling.type": "longrope"}, [])


# --- what is refused ---------------------------------------------------------------------------

_META = {
    "general.architecture": "phi3", "phi3.embedding_length": 3072, "phi3.attention.head_count": 32,
    "phi3.block_count": 2, "phi3.feed_forward_length": 8192, "phi3.vocab_size": 100,
}


def test_gguf_partial_rotary_and_longrope_config() -> None:
    cfg = ModelConfig.from_gguf({**_META, "phi3.rope.dimension_count": 72}, [])  # as Phi-4-mini's 96 of 128
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rotary) == (96, 72, 72)
    assert ModelConfig.from_gguf({**_META, "phi3.rope.dimension_count": 96}, []).rotary_dim is None
    for bad in (71, 0, 98, "72", True, 72.0):
        with pytest.raises(ModelLoadError, match="rotary_dim|dimension_count"):
            ModelConfig.from_gguf({**_META, "phi3.rope.dimension_count": bad}, [])
    longrope = ["rope_factors_long.weight", "rope_factors_short.weight"]
    partial = {**_META, "phi3.rope.dimension_count": 72, "phi3.context_length": 8192,
               "phi3.rope.scaling.original_context_length": 4096}
    assert ModelConfig.from_gguf(partial, longrope, rope_freqs=[1.5] * 36).rope_freq_factors == (1.5,) * 36
    with pytest.raises(ModelLoadError, match="36 frequencies"):  # one factor per rotated pair
        ModelConfig.from_gguf(partial, longrope, rope_freqs=[1.5] * 48)
    # llama's q/k rows are permuted for a RoPE over the whole head; transformers' Llama has none
    for arch in ("llama", "qwen2"):
        meta = {k.replace("phi3", arch): v for k, v in _META.items()}
        with pytest.raises(UnsupportedModelError, match="partial rotary"):
            ModelConfig.from_gguf({**meta, "general.architecture": arch, f"{arch}.rope.dimension_count": 64}, [])
    names = ["rope_factors_long.weight", "rope_factors_short.weight"]  # Phi-3.5, Phi-3 128k
    meta = {**_META, "phi3.context_length": 131072, "phi3.rope.scaling.original_context_length": 4096}
    cfg = ModelConfig.from_gguf(meta, names, rope_freqs=[1.5] * 48)
    assert (cfg.rope_freq_factors, cfg.max_position_embeddings) == ((1.5,) * 48, 4096)
    assert cfg.rope_attention_factor == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
    cfg = ModelConfig.from_gguf({**meta, "phi3.rope.scaling.attn_factor": 1.25}, names, rope_freqs=[1.0] * 48)
    assert cfg.rope_attention_factor == 1.25
    for bad_meta, bad_names in (({**meta, "phi3.rope.scaling.attn_factor": -1.0}, names),
                                (_META, names),  # no original context
                                ({**meta, "phi3.rope.scaling.original_context_length": 1}, names),
                                ({**meta, "phi3.rope.scaling.original_context_length": 4096.5}, names),
                                (meta, names[:1]),  # long factors only
                                (meta, [*names, "rope_freqs.weight"])):
        with pytest.raises(ModelLoadError):
            ModelConfig.from_gguf(bad_meta, bad_names, rope_freqs=[1.0] * 48)
    cfg = ModelConfig.from_gguf({**_META, "phi3.attention.sliding_window": 2047}, ["output.weight"])
    assert (cfg.architecture, cfg.head_dim, cfg.sliding_window, cfg.fused_projections) == ("phi3", 96, 2047, True)
    with pytest.raises(UnsupportedModelError, match="supported: "):
        ModelConfig.from_gguf({**_META, "general.architecture": "gemma4"}, [])


def test_hf_partial_rotary_config() -> None:
    d = {"model_type": "phi3", "vocab_size": 100, "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 1, "num_attention_heads": 4, "partial_rotary_factor": 0.75}
    assert ModelConfig.from_hf(d).rotary_dim == 48
    assert ModelConfig.from_hf({**d, "rope_parameters": {"partial_rotary_factor": 0.5}}).rotary_dim == 32
    for bad in (0, 0.3, 1.5, -1, "x", float("nan")):  # 0.3: 19 dims, not pairs
        with pytest.raises(ModelLoadError):
            ModelConfig.from_hf({**d, "partial_rotary_factor": bad})
    with pytest.raises(UnsupportedModelError, match="partial rotary"):
        ModelConfig.from_hf({**d, "model_type": "qwen3", "head_dim": 128})
    d = {**d, "model_type": "qwen3", "partial_rotary_factor": 1.0, "head_dim": 128}
    cfg = ModelConfig.from_hf(d)
    assert (cfg.qk_norm, cfg.head_dim, cfg.fused_projections) == (True, 128, False)



@pytest.mark.parametrize("tiny", ["gemma3"], indirect=True)
def test_multi_turn_chat_past_the_window_recomputes_only_the_new_turn(tiny: dict[str, Any]) -> None:
    """Six turns whose context grows to ~10x the 16-token window: each turn's prompt (the whole
    conversation so far) is served from the prefix cache up to the new turn's tokens (whole
    blocks, then the partial block the last turn left); greedy output equals a cold engine's."""
    llm, cold = tiny["llm"], LLM(str(tiny["path"]), num_blocks=64, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    context: list[int] = []
    for turn in range(6):
        prompt = context + [100 + 7 * turn + i for i in range(17)]
        out = llm.generate([prompt], params)[0]
        # all of it but the last answer token (never fed back, so never written)
        assert out.num_cached_tokens == max(0, len(context) - 1), turn
        assert list(out.token_ids) == list(cold.generate([prompt], params)[0].token_ids)
        context = prompt + list(out.token_ids)
    assert len(context) > 8 * 16


def test_gemma3_hf_rope_scaling() -> None:
    """Gemma 3 4B+ checkpoints scale the global layers' RoPE linearly (transformers 5:
    rope_parameters per layer type; 4: one rope_scaling); the local layers' never."""
    base = {"model_type": "gemma3_text", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
            "sliding_window": 16}
    v5 = {**base, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    v4 = {**base, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 1e6}
    for d in (v5, v4):
        cfg = ModelConfig.from_hf(d)
        assert cfg.rope_freq_factors == (8.0,) * 16 and cfg.rope_local_theta == 1e4
    local = {**v5, "rope_parameters": {**v5["rope_parameters"], "sliding_attention": {"rope_type": "linear"}}}
    with pytest.raises(UnsupportedModelError, match="linear"):
        ModelConfig.from_hf(local)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf({**v4, "rope_scaling": {"rope_type": "yarn", "factor": 8.0}})
    with pytest.raises(ModelLoadError, match="factor"):
        ModelConfig.from_hf({**v4, "rope_scaling": {"rope_type": "linear", "factor": 0}})


def test_hf_linear_and_longrope_configs() -> None:
    """A checkpoint's linear scaling and Phi-3.5's LongRoPE (transformers 4's rope_scaling with a
    top-level original context, or 5's rope_parameters) become the same divisors as the files'."""
    base = {"model_type": "phi3", "vocab_size": 100, "hidden_size": 96, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 131072}
    long = {"short_factor": [1.0 + i / 24 for i in range(24)], "long_factor": [8.0] * 24}
    v4 = {**base, "original_max_position_embeddings": 4096, "rope_scaling": {"type": "longrope", **long}}
    v5 = {**base, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, **long,
                                      "original_max_position_embeddings": 4096}}
    for d in (v4, v5):
        cfg = ModelConfig.from_hf(d)
        assert cfg.rope_freq_factors == tuple(long["short_factor"]) and cfg.max_position_embeddings == 4096
        assert cfg.rope_attention_factor == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
        assert cfg.rope_scaling is None
    cfg = ModelConfig.from_hf({**v4, "rope_scaling": {"type": "longrope", **long, "attention_factor": 1.1}})
    assert cfg.rope_attention_factor == 1.1
    with pytest.raises(ModelLoadError, match="rope_freq_factors"):  # 24 divisors for heads of 48
        ModelConfig.from_hf({**v4, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 23}})
    with pytest.raises(ModelLoadError, match="original_max_position_embeddings"):
        ModelConfig.from_hf({**base, "rope_scaling": {"type": "longrope", **long}})
    for bad in ({"short_factor": 3.0}, {"short_factor": [1.0] * 23 + [float("nan")]}):
        with pytest.raises(ModelLoadError, match="short_factor"):
            ModelConfig.from_hf({**v4, "rope_scaling": {"type": "longrope", **long, **bad}})
    # a context past the original takes the long factors (and the whole context); within, the short
    for d in (v4, v5):
        cfg = ModelConfig.from_hf(d, context=8192)
        assert (cfg.rope_freq_factors, cfg.max_position_embeddings) == ((8.0,) * 24, 131072)
        assert ModelConfig.from_hf(d, context=4096).rope_freq_factors == tuple(long["short_factor"])
    for bad in ({"long_factor": [8.0] * 23}, {"long_factor": [8.0] * 23 + [-1.0]}, {"long_factor": "x"}):
        with pytest.raises(ModelLoadError, match="long_factor|rope_freq_factors"):
            ModelConfig.from_hf({**v4, "rope_scaling": {"type": "longrope", **long, **bad}}, context=8192)
    names = ["rope_factors_long.weight", "rope_factors_short.weight"]
    meta = {**_META, "phi3.context_length": 131072, "phi3.rope.scaling.original_context_length": 4096}
    cfg = ModelConfig.from_gguf(meta, names, rope_freqs=[1.5] * 48, rope_long=[9.0] * 48, context=4097)
    assert (cfg.rope_freq_factors, cfg.max_position_embeddings) == ((9.0,) * 48, 131072)
    with pytest.raises(ModelLoadError, match="rope_factors_long"):
        ModelConfig.from_gguf(meta, names[1:], rope_freqs=[1.5] * 48, rope_long=[9.0] * 48, context=4097)
    with pytest.raises(ModelLoadError, match="rope_factors_long"):
        ModelConfig.from_gguf(meta, names, rope_freqs=[1.5] * 48, rope_long=[9.0] * 47 + [0.0], context=4097)
    llama = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 2, "rope_scaling": {"type": "linear", "factor": 4.0}}
    assert ModelConfig.from_hf(llama).rope_freq_factors == (4.0,) * 16
    # YaRN: the fastest frequencies kept, the slowest divided by the factor; cos / sin scaled
    yarn = {**llama, "model_type": "qwen2", "rope_theta": 1e6, "max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    cfg = ModelConfig.from_hf(yarn)
    f = cfg.rope_freq_factors
    assert f[0] == 1.0 and f[-1] == pytest.approx(4.0) and all(a <= b for a, b in zip(f, f[1:], strict=False))
    assert cfg.rope_attention_factor == pytest.approx(1 + 0.1 * math.log(4.0))
    assert cfg.max_position_embeddings == 131072
    assert ModelConfig.from_hf({**yarn, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}).rope_freq_factors is None
    for bad in ({"mscale": 1.0, "mscale_all_dim": 1.0}, {"factor": -1.0}, {"original_max_position_embeddings": None}):
        with pytest.raises((UnsupportedModelError, ModelLoadError)):
            ModelConfig.from_hf({**yarn, "rope_scaling": {**yarn["rope_scaling"], **bad}})
    meta = {**_LLAMA_META, "general.architecture": "llama", "llama.rope.scaling.type": "yarn",
            "llama.rope.scaling.factor": 4.0, "llama.rope.scaling.original_context_length": 32768}
    assert ModelConfig.from_gguf(meta, []).rope_attention_factor == pytest.approx(1 + 0.1 * math.log(4.0))
    assert ModelConfig.from_gguf({**meta, "llama.rope.scaling.yarn_ext_factor": -1.0}, []).rope_freq_factors
    for key, v in (("attn_factor", 2.0), ("yarn_log_multiplier", 0.1), ("yarn_ext_factor", 0.5)):
        with pytest.raises(UnsupportedModelError, match=key):
            ModelConfig.from_gguf({**meta, f"llama.rope.scaling.{key}": v}, [])
    with pytest.raises(ModelLoadError, match="original_context_length"):
        ModelConfig.from_gguf({**meta, "llama.rope.scaling.original_context_length": 0}, [])
