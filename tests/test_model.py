"""The paged model computes the same logits as transformers on the same weights.

Reference logits come from one full (cache-free) transformers forward per sequence; ours come
from running the sequence through the paged cache step by step (prefill, chunks, decodes, mixed
batches), with each sequence's blocks scattered through the storage.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from step_layout import SeqStep, assign_blocks, build_step

from pagedkv.errors import ModelLoadError, UnsupportedModelError
from pagedkv.model import LlamaModel, ModelConfig, load_model

F32_TOL = 1e-3  # max abs logit difference allowed in float32

TEXT = (
    "The paged KV cache stores keys and values in fixed-size blocks, so sequences of very "
    "different lengths can share one memory pool without fragmentation. A block table maps "
    "each sequence's logical blocks to physical ones, and copy-on-write lets beams share "
    "their prompt."
)


# --- helpers ------------------------------------------------------------------------------------


@dataclass
class Schedule:
    """Steps of a run: each step lists prefill chunks (seq, num_new) and decodes (seq)."""

    steps: list[tuple[list[tuple[int, int]], list[int]]] = field(default_factory=list)

    def add(self, prefills: Sequence[tuple[int, int]] = (), decodes: Sequence[int] = ()) -> Schedule:
        self.steps.append((list(prefills), list(decodes)))
        return self


def run_paged(
    model: LlamaModel,
    seqs: list[torch.Tensor],
    schedule: Schedule,
    block_size: int,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Feed `seqs` ([L_i] token ids) through the paged cache; logits [fed_i, V] per sequence."""
    blocks = assign_blocks([len(s) for s in seqs], block_size, 1024 // block_size + 64, seed)
    kv = model.make_kv_storage(1024 // block_size + 64, block_size)
    done = [0] * len(seqs)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    for prefills, decodes in schedule.steps:
        entries = [*prefills, *((i, 1) for i in decodes)]
        specs = [SeqStep(blocks[i], done[i], n) for i, n in entries]
        positions, meta = build_step(specs, block_size, num_decodes=len(decodes))
        ids = torch.cat([seqs[i][done[i] : done[i] + n] for i, n in entries])
        with torch.inference_mode():
            logits = model(ids, positions, kv, meta)  # [T, V]
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), model.config.vocab_size)
        for (i, n), rows in zip(entries, logits.split([n for _, n in entries]), strict=True):
            out[i].append(rows)
            done[i] += n
    return [torch.cat(o) if o else torch.zeros(0) for o in out]


def hf_logits(hf_model: Any, ids: torch.Tensor) -> torch.Tensor:
    """[L, V] float32 logits of a full cache-free transformers forward."""
    with torch.inference_mode():
        return hf_model(ids[None], use_cache=False).logits[0].float()


def max_diff(ours: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    return max(float((o - r[: len(o)]).abs().max()) for o, r in zip(ours, refs, strict=True))


def prefill_then_decode(prompt_len: int, total: int) -> Schedule:
    s = Schedule().add(prefills=[(0, prompt_len)])
    for _ in range(total - prompt_len):
        s.add(decodes=[0])
    return s


def mixed_schedule() -> Schedule:
    """Four sequences; step 2 mixes a fresh prefill, a second chunk (context > 0) and decodes."""
    return (
        Schedule()
        .add(prefills=[(0, 13), (1, 10), (2, 5)])  # seq 1: first chunk of its prompt
        .add(prefills=[(3, 19), (1, 9)], decodes=[0, 2])  # fresh prefill + 2nd chunk + decodes
        .add(decodes=[0, 1, 2, 3])
        .add(decodes=[3, 1])
    )


# --- tiny random models built with transformers --------------------------------------------------

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _tiny(kind: str) -> Any:
    import transformers as tf

    torch.manual_seed({"llama": 0, "qwen2": 1, "mistral": 2, "mistral_window": 3, "gemma3": 4,
                       "qwen2_window": 5}[kind])
    if kind == "llama":  # untied, Llama-3 rope scaling over a short original context
        cfg = tf.LlamaConfig(
            **TINY,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2":  # q/k/v bias, tied embeddings
        cfg = tf.Qwen2Config(**TINY, tie_word_embeddings=True, rope_theta=1e6)
        model = tf.Qwen2ForCausalLM(cfg)
    elif kind == "qwen2_window":  # use_sliding_window: layers from max_window_layers on (1 of 2)
        cfg = tf.Qwen2Config(**TINY, tie_word_embeddings=True, rope_theta=1e6, use_sliding_window=True,
                             sliding_window=8, max_window_layers=1)
        model = tf.Qwen2ForCausalLM(cfg)
    elif kind == "gemma3":  # sandwich norms, GeGLU, two RoPE bases, a window of 8 on 2 of 3 layers
        cfg = tf.Gemma3TextConfig(
            **{**TINY, "num_hidden_layers": 3}, head_dim=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24, rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        )
        model = tf.Gemma3ForCausalLM(cfg)
    else:  # Mistral; "mistral_window": every layer's window is 8 tokens
        window = 8 if kind == "mistral_window" else None
        cfg = tf.MistralConfig(**TINY, head_dim=16, tie_word_embeddings=False, sliding_window=window)
        model = tf.MistralForCausalLM(cfg)
    with torch.no_grad():  # the default init (zero biases, unit norms) would hide bugs
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2 if name.endswith("bias") else 0.08)
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral", "mistral_window", "gemma3",
                                                 "qwen2_window"])
def tiny_pair(request: pytest.FixtureRequest) -> tuple[LlamaModel, Any]:
    hf = _tiny(request.param)
    return load_model(hf).model, hf


def _tokens(n: int, seed: int, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_tiny_prefill_decode_chunked_mixed(tiny_pair: tuple[LlamaModel, Any], block_size: int) -> None:
    model, hf = tiny_pair
    seqs = [_tokens(n, seed=s) for s, n in enumerate([20, 25, 9, 23])]
    refs = [hf_logits(hf, s) for s in seqs]
    # one long prompt (several blocks) then decodes; a prompt exactly filling 2 blocks of 16
    assert max_diff(run_paged(model, seqs[:1], prefill_then_decode(17, 20), block_size), refs[:1]) < F32_TOL
    exact = [_tokens(32, seed=9)]
    out = run_paged(model, exact, prefill_then_decode(32, 32), block_size, seed=1)
    assert max_diff(out, [hf_logits(hf, exact[0])]) < F32_TOL
    assert max_diff(run_paged(model, seqs, mixed_schedule(), block_size, seed=2), refs) < F32_TOL


def test_tiny_rope_table_grows_past_max_positions() -> None:
    import transformers as tf

    torch.manual_seed(3)
    hf = tf.LlamaForCausalLM(tf.LlamaConfig(**{**TINY, "max_position_embeddings": 8})).eval()
    model = load_model(hf).model
    seq = _tokens(40, seed=4)
    out = run_paged(model, [seq], prefill_then_decode(30, 40), block_size=16)
    assert max_diff(out, [hf_logits(hf, seq)]) < F32_TOL
    assert model.rope.cos.shape[0] >= 40


def test_logits_indices_select_rows(tiny_pair: tuple[LlamaModel, Any]) -> None:
    model, _ = tiny_pair
    seqs = [_tokens(11, seed=5), _tokens(7, seed=6)]
    specs = [SeqStep(b, 0, len(s)) for b, s in zip(assign_blocks([11, 7], 4, 8), seqs, strict=True)]
    positions, meta = build_step(specs, 4)
    kv = model.make_kv_storage(8, 4)
    with torch.inference_mode():
        full = model(torch.cat(seqs), positions, kv, meta)  # [18, V]
        kv2 = model.make_kv_storage(8, 4)
        picked = model(torch.cat(seqs), positions, kv2, meta, torch.tensor([10, 17]))  # [2, V]
    assert picked.shape == (2, model.config.vocab_size)
    torch.testing.assert_close(picked, full[[10, 17]], atol=1e-5, rtol=1e-5)


def test_tiny_bfloat16_runs_close() -> None:
    hf = _tiny("llama")
    model = load_model(hf, dtype=torch.bfloat16).model
    assert model.dtype == torch.bfloat16
    seq = _tokens(24, seed=7)
    out = run_paged(model, [seq], prefill_then_decode(18, 24), block_size=16)[0]
    ref = hf_logits(hf, seq)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert float((out - ref).abs().max()) < 0.1 * float(ref.abs().max())


def test_hf_directory_roundtrip(tmp_path: Path) -> None:
    hf = _tiny("qwen2")
    hf.save_pretrained(tmp_path)  # config.json + model.safetensors
    loaded = load_model(tmp_path)
    assert loaded.tokenizer is None and loaded.config.attention_bias
    seq = _tokens(21, seed=8)
    out = run_paged(loaded.model, [seq], prefill_then_decode(17, 21), block_size=16)
    assert max_diff(out, [hf_logits(hf, seq)]) < F32_TOL


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _interleave_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to llama q/k rows: pair i with i + D/2 within each head."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _write_tiny_gguf(hf: Any, path: Path, arch: str) -> None:
    """A float32 GGUF of a tiny transformers model, laid out as llama.cpp would write it."""
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            gname = "output.weight"
        elif name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, i, *mid, kind = name.split(".")
            gname = f"blk.{i}.{_GGUF_LAYER_NAMES['.'.join(mid)]}.{kind}"
            if arch == "llama" and ("q_proj" in name or "k_proj" in name):
                heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
                t = _interleave_rope_rows(t, heads)
        w.add_tensor(gname, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_matches_transformers_gguf(tmp_path: Path, arch: str) -> None:
    """llama files carry llama.cpp's q/k row interleave (undone on load); qwen2 files do not."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if arch == "llama":
        torch.manual_seed(5)
        hf = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False)).eval()
    else:
        hf = _tiny("qwen2")
    _write_tiny_gguf(hf, tmp_path / "tiny.gguf", arch)
    loaded = load_model(tmp_path / "tiny.gguf")
    assert loaded.config.architecture == arch and loaded.tokenizer is None
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32)
    seq = _tokens(21, seed=8)
    out = run_paged(loaded.model, [seq], prefill_then_decode(17, 21), block_size=16)
    assert max_diff(out, [hf_logits(ref.eval(), seq)]) < F32_TOL
    assert max_diff(out, [hf_logits(hf, seq)]) < F32_TOL


# --- SmolLM2 (the real default model) ------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_text(smollm2: Any, hf_smollm2: Any) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(smollm2.tokenizer(TEXT).input_ids, dtype=torch.int64)
    assert len(ids) >= 40
    return ids, hf_logits(hf_smollm2, ids)


def test_smollm2_config_matches_transformers(smollm2: Any, hf_smollm2: Any) -> None:
    ours, theirs = smollm2.config, ModelConfig.from_hf(hf_smollm2.config)
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
              "attention_bias", "max_position_embeddings", "bos_token_id"):
        assert getattr(ours, f) == getattr(theirs, f), f
    assert ours.eos_token_ids == [2] and smollm2.tokenizer.eos_token_id == 2


@pytest.mark.parametrize(
    ("block_size", "prompt_len"),
    [(1, 9), (16, 21), (16, 32), (32, 37)],  # 16/32: exactly two full blocks of 16
)
def test_smollm2_prefill_then_decode(
    smollm2: Any, smol_text: tuple[torch.Tensor, torch.Tensor], block_size: int, prompt_len: int
) -> None:
    ids, ref = smol_text
    total = prompt_len + 4
    out = run_paged(smollm2.model, [ids[:total]], prefill_then_decode(prompt_len, total), block_size)
    diff = max_diff(out, [ref])
    assert diff < F32_TOL, diff


def test_smollm2_mixed_batch_and_chunked_prefill(
    smollm2: Any, hf_smollm2: Any, smol_text: tuple[torch.Tensor, torch.Tensor]
) -> None:
    ids, ref = smol_text
    # four different sequences: shifted windows of the text
    seqs = [ids[o : o + n] for o, n in [(0, 20), (3, 25), (7, 9), (11, 23)]]
    refs = [ref[:20]] + [hf_logits(hf_smollm2, s) for s in seqs[1:]]
    diff = max_diff(run_paged(smollm2.model, seqs, mixed_schedule(), 16, seed=3), refs)
    assert diff < F32_TOL, diff


def test_smollm2_bfloat16_runs_close(hf_smollm2: Any, smol_text: tuple[torch.Tensor, torch.Tensor]) -> None:
    ids, ref = smol_text
    model = load_model(hf_smollm2, dtype=torch.bfloat16).model  # weights copied from memory
    out = run_paged(model, [ids[:27]], prefill_then_decode(24, 27), block_size=16)[0]
    ref = ref[:27]
    assert torch.isfinite(out).all()
    # bf16 keeps ~3 significant digits: compare the predictions, not the exact values
    agree = (out.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree >= 0.8, agree  # measured: 1.0
    assert float((out - ref).abs().mean()) < 0.3  # measured: ~0.08


# --- errors ------------------------------------------------------------------------------------


def test_missing_file_and_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        load_model(junk)
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(ModelLoadError):
        load_model(tmp_path / "weights.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(empty)
    with pytest.raises(ModelLoadError):
        load_model(object())


def test_unsupported_architecture_and_rope(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(tmp_path)
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(UnsupportedModelError, match="mrope"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "mrope", "mrope_section": [1]}})
    with pytest.raises(UnsupportedModelError, match="silu"):
        ModelConfig.from_hf({**base, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError):
        ModelConfig.from_gguf({"general.architecture": "gpt2"}, [])
    assert ModelConfig.from_hf({**base, "rope_scaling": {"type": "default"}}).rope_scaling is None


def test_wrong_shapes_and_missing_weights(tmp_path: Path) -> None:
    hf = _tiny("mistral")
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    model = LlamaModel(ModelConfig.from_hf(hf.config))
    bad = dict(sd)
    bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(95, 64)
    with pytest.raises(ModelLoadError, match="up_proj.*shape"):
        model.load_weights(bad.items())
    missing = {k: v for k, v in sd.items() if "layers.0.self_attn.v_proj" not in k}
    with pytest.raises(ModelLoadError, match="missing.*v_proj"):
        model.load_weights(missing.items())
    with pytest.raises(ModelLoadError, match="unexpected"):
        model.load_weights([*sd.items(), ("model.layers.0.mlp.gate_proj.bias", torch.zeros(96))])
    # a checkpoint whose config disagrees with its tensors
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 80}))
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(tmp_path)


def test_gemma3_shift_keys_use_each_layers_rope() -> None:
    """Context shift re-rotates K per layer: the sliding layers by the local base (10,000), the
    full one by the global base."""
    model = load_model(_tiny("gemma3")).model
    assert [layer.rope_table for layer in model.layers] == [1, 0, 1]
    pos, delta = torch.arange(5, 12), -4
    raw = torch.randn(len(pos), 2, 16, generator=torch.Generator().manual_seed(0))

    def at(p: torch.Tensor) -> torch.Tensor:  # [L, T, H, D]: each layer's K at positions p
        ropes = [model.ropes()[layer.rope_table] for layer in model.layers]
        return torch.stack([r.rotate(raw, *r.lookup(p)) for r in ropes])

    torch.testing.assert_close(model.shift_keys(at(pos), delta), at(pos + delta), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(at(pos)[0], at(pos)[1])  # the two bases differ


def test_partial_rotary_tables_order_and_shift() -> None:
    """RoPE over 48 of 64 dims (a LongRoPE attention factor on them): in the order load_weights
    gives q/k, the rotated dims turn as transformers' rotate_half over the first 48, the other 16
    come out unchanged (not scaled), and shift_keys moves the rotated ones only."""
    from pagedkv.model.llama import RotaryEmbedding, partial_rotary_order

    cfg = ModelConfig(architecture="phi3", vocab_size=8, hidden_size=128, intermediate_size=8, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=64, rotary_dim=48, rope_attention_factor=1.2)
    rope, order = RotaryEmbedding(cfg, torch.float32), partial_rotary_order(64, 48)
    assert sorted(order.tolist()) == list(range(64))
    x = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(1))  # transformers' order
    pos = torch.arange(3, 8)
    ours = rope.rotate(x[..., order], *rope.lookup(pos))
    inv = 1.0 / (1e4 ** (torch.arange(0, 48, 2).float() / 48))
    ang = torch.outer(pos.float(), inv)[:, None]  # [T, 1, 24]
    cos, sin = torch.cat([ang.cos()] * 2, -1) * 1.2, torch.cat([ang.sin()] * 2, -1) * 1.2
    r = x[..., :48]
    want = torch.cat([r * cos + torch.cat([-r[..., 24:], r[..., :24]], -1) * sin, x[..., 48:]], -1)
    torch.testing.assert_close(ours, want[..., order])
    moved = rope.rotate(x[..., order], *rope.lookup(pos + 6))
    torch.testing.assert_close(rope.shift_keys(ours, 6), moved, atol=1e-5, rtol=1e-5)
