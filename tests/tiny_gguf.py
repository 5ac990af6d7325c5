"""Tiny random GGUF files at real models' shapes, laid out as llama.cpp writes them.

`write_tiny_gguf(spec, path)` writes a few decoder layers of random weights with the hidden,
head and intermediate sizes of a real model (rows not a multiple of 256, as in the small
Qwen/SmolLM files, so K-quants cannot appear), matrices in the spec's ggml types (quantized by
`gguf.quants`), 1-D tensors in F32, the metadata transformers' GGUF loader reads, and a
byte-level BPE tokenizer cut from SmolLM2's (the first `vocab` tokens and the merges among them),
so the file loads with `from_pretrained(dir, gguf_file=name)` and in pagedkv alike.

The random weights are written in the file's own row order: llama.cpp's q/k interleave for the
"llama" architecture is whatever these rows mean, and both loaders undo it the same way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from pagedkv.model.gguf_file import GGUFFile
from pagedkv.model.loader import default_model_path

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class TinySpec:
    """One architecture at one shape. `qtypes`: ggml type per tensor kind ("attn", "ffn",
    "embd", "output"); 1-D tensors are always F32."""

    arch: str  # general.architecture
    name: str  # general.name ("mistral" in it: Mistral, filed under "llama")
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int = 2
    vocab: int = 1024
    tied: bool = True
    bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # attn_q_norm / attn_k_norm (Qwen3)
    fused: bool = False  # attn_qkv and ffn_up = gate|up (Phi-3)
    window: int | None = None  # attention.sliding_window (Gemma 3: every 6th layer is global)
    rope_theta: float = 1e6
    # Llama 3.1+ RoPE scaling (factor, low_freq_factor, high_freq_factor, original context), written
    # as llama.cpp's converter writes it: a rope_freqs tensor of per-frequency divisors
    llama3: tuple[float, float, float, int] | None = None
    linear: float | None = None  # rope.scaling.type linear with this factor (DeepSeek-Coder: 4)
    longrope: int | None = None  # Phi-3 LongRoPE from this original context (the file's: 32x it)
    rotary: int | None = None  # rope.dimension_count when RoPE turns fewer dims than a head's (Phi-4-mini)
    softcaps: tuple[float, float] | None = None  # Gemma 2's attention and final logit soft-caps
    yarn: tuple[float, int] | None = None  # rope.scaling.type yarn: (factor, original context)
    scales: dict[str, float] | None = None  # Granite's keys under the arch (embedding_scale, ...)
    seed: int = 0
    qtypes: dict[str, Q] = field(default_factory=dict)
    chat: bool = False  # write SmolLM2's chat template (the whole-model specs, for `bench serve`)

    def qtype(self, kind: str) -> Q:
        """kind: attn, ffn, embd, output, or a tensor's own (attn_v, ffn_down, ffn_down_odd: the
        odd layers'), which falls back to its family's."""
        if kind in self.qtypes:
            return self.qtypes[kind]
        family = {"attn_v": "attn", "ffn_down": "ffn", "ffn_down_odd": "ffn_down"}.get(kind)
        return self.qtype(family) if family else Q.Q8_0


@functools.cache
def smollm2_vocab(n: int) -> tuple[list[str], list[int], list[str]]:
    """SmolLM2's first `n` tokens, their types, and the merges whose parts and result they hold."""
    meta = GGUFFile(default_model_path()).metadata
    tokens = list(meta["tokenizer.ggml.tokens"][:n])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"][:n]]
    have = set(tokens)
    merges = [m for m in meta["tokenizer.ggml.merges"]
              if (parts := m.split(" ")) and len(parts) == 2 and parts[0] + parts[1] in have
              and parts[0] in have and parts[1] in have]
    return tokens, types, merges


# byte offsets of each block's fp16 scales (d, then dmin where the type has one)
F16_AT = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.IQ4_NL: (0,),
          Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
          Q.IQ4_XS: (0,)}


def _random_blocks(rng: np.random.Generator, rows: int, k: int, qtype: Q, scale: float) -> np.ndarray:
    """Valid blocks of any F16_AT type drawn directly (random quants and sub-block scales, fp16
    scales giving values of roughly `scale` / sqrt(k)): a 0.5 GB file in seconds, no quantizer."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    out = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    top = {Q.Q8_0: 127, Q.Q6_K: 32 * 64, Q.Q5_K: 31 * 32, Q.Q4_K: 15 * 32, Q.Q3_K: 4 * 16,
           Q.Q2_K: 3 * 8, Q.IQ4_XS: 127 * 16, Q.IQ4_NL: 127, Q.Q5_0: 16, Q.Q5_1: 31}.get(qtype, 8)
    d = np.frombuffer(np.float16(scale / np.sqrt(k) / (top / 2)).tobytes(), dtype=np.uint8)
    for at in F16_AT[qtype]:
        out[:, :, at : at + 2] = d
    return out.reshape(rows, -1)


def _tensors(spec: TinySpec, fast: bool = False) -> dict[str, tuple[np.ndarray, Q]]:
    """name -> (values in the file's shape [rows, K] or [n], ggml type to store): float32
    values, or with `fast` the Q8_0/Q4_0 matrices as ready blocks (uint8)."""
    rng = np.random.default_rng(spec.seed)
    h, d, n = spec.hidden, spec.head_dim, spec.intermediate
    q, kv = spec.heads * d, spec.kv_heads * d

    def mat(rows: int, k: int, kind: str, scale: float = 1.0) -> tuple[np.ndarray, Q]:
        qtype = spec.qtype(kind)
        if fast and qtype in F16_AT:
            return _random_blocks(rng, rows, k, qtype, scale), qtype
        return (rng.standard_normal((rows, k), dtype=np.float32) * (scale / np.sqrt(k)), qtype)

    def norm(size: int) -> tuple[np.ndarray, Q]:
        return (1.0 + 0.2 * rng.standard_normal(size, dtype=np.float32), Q.F32)

    out = {"token_embd.weight": mat(spec.vocab, h, "embd")}
    for i in range(spec.layers):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = norm(h)
        if spec.fused:
            out[p + "attn_qkv.weight"] = mat(q + 2 * kv, h, "attn")
        else:
            out[p + "attn_q.weight"] = mat(q, h, "attn")
            out[p + "attn_k.weight"] = mat(kv, h, "attn")
            out[p + "attn_v.weight"] = mat(kv, h, "attn_v")
        if spec.bias:
            for part, rows in (("q", q), ("k", kv), ("v", kv)):
                out[p + f"attn_{part}.bias"] = (0.1 * rng.standard_normal(rows, dtype=np.float32), Q.F32)
        if spec.qk_norm:
            out[p + "attn_q_norm.weight"] = norm(d)
            out[p + "attn_k_norm.weight"] = norm(d)
        out[p + "attn_output.weight"] = mat(h, q, "attn")
        if spec.arch in ("gemma2", "gemma3"):  # the norms of the attention and MLP outputs
            out[p + "post_attention_norm.weight"] = norm(h)
            out[p + "post_ffw_norm.weight"] = norm(h)
        out[p + "ffn_norm.weight"] = norm(h)
        if spec.fused:
            out[p + "ffn_up.weight"] = mat(2 * n, h, "ffn")
        else:
            out[p + "ffn_gate.weight"] = mat(n, h, "ffn")
            out[p + "ffn_up.weight"] = mat(n, h, "ffn")
        out[p + "ffn_down.weight"] = mat(h, n, "ffn_down_odd" if i % 2 else "ffn_down")
    out["output_norm.weight"] = norm(h)
    if spec.llama3 is not None:
        out["rope_freqs.weight"] = (rope_freqs(spec), Q.F32)
    if spec.longrope:
        short, long = longrope_factors(spec)
        out["rope_factors_long.weight"] = (long, Q.F32)
        out["rope_factors_short.weight"] = (short, Q.F32)
    if not spec.tied:
        out["output.weight"] = mat(spec.vocab, h, "output", 3.0)
    return out


def rope_freqs(spec: TinySpec) -> np.ndarray:
    """The divisor of each rotary frequency under spec.llama3 (1 for short wavelengths, the
    factor for long ones, the reciprocal of the linear blend of 1 / factor and 1 between)."""
    assert spec.llama3 is not None
    factor, low, high, ctx = spec.llama3
    freqs = spec.rope_theta ** -(np.arange(0, spec.head_dim, 2, dtype=np.float64) / spec.head_dim)
    out = []
    for wavelen in 2 * np.pi / freqs:
        if wavelen < ctx / high:
            out.append(1.0)
        elif wavelen > ctx / low:
            out.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def longrope_factors(spec: TinySpec) -> tuple[np.ndarray, np.ndarray]:
    """LongRoPE's short and long factors, one per rotary frequency (fixed random values)."""
    rng = np.random.default_rng(spec.seed + 100)
    n = (spec.rotary or spec.head_dim) // 2
    return (1 + 2 * rng.random(n)).astype(np.float32), (1 + 30 * rng.random(n)).astype(np.float32)


def _encode(values: np.ndarray, qtype: Q) -> np.ndarray:
    if values.dtype == np.uint8:  # already blocks
        return values
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


def write_tiny_gguf(spec: TinySpec, path: str | Path, fast: bool = False) -> Path:
    """Write `spec` as a GGUF file at `path`; returns the path. `fast`: random Q8_0/Q4_0
    blocks instead of quantized random values (for load-time and speed benchmarks)."""
    path = Path(path)
    w = gguf.GGUFWriter(str(path), spec.arch)
    w.add_name(spec.name)
    w.add_context_length(32 * spec.longrope if spec.longrope else 4096)
    w.add_block_count(spec.layers)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.intermediate)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.rotary or spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(spec.vocab)
    if spec.window:
        w.add_sliding_window(spec.window)
    for key, v in (spec.scales or {}).items():
        w.add_float32(f"{spec.arch}.{key}", v)
    if spec.softcaps:
        w.add_attn_logit_softcapping(spec.softcaps[0])
        w.add_final_logit_softcapping(spec.softcaps[1])
    if spec.linear:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec.linear)
    if spec.yarn:  # as llama.cpp's converter writes a Qwen config's yarn rope_scaling
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(spec.yarn[0])
        w.add_rope_scaling_orig_ctx_len(spec.yarn[1])
    if spec.longrope:  # as llama.cpp's converter: the original context and the attention factor
        w.add_rope_scaling_orig_ctx_len(spec.longrope)
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(32) / np.log(spec.longrope))))
    tokens, types, merges = smollm2_vocab(min(spec.vocab, 49152))  # SmolLM2's 49,152 at most
    if spec.vocab > len(tokens):  # padded to the embedding's rows (llama.cpp checks), with plain
        pad = spec.vocab - len(tokens)  # text tokens: a random model that samples one still streams text
        tokens = [*tokens, *(f"pad{i}" for i in range(pad))]
        types = [*types, *([1] * pad)]  # gguf.TokenType.NORMAL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    if spec.chat:  # SmolLM2's template (its vocabulary holds the <|im_start|> / <|im_end|> tokens)
        w.add_chat_template(GGUFFile(default_model_path()).metadata["tokenizer.chat_template"])
    for name, (values, qtype) in _tensors(spec, fast).items():
        data = _encode(values, qtype)
        w.add_tensor(name, data, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Real models' shapes (a few of their layers): hidden sizes 896 / 640 / 1536 / 960, heads of 64,
# 96 or 128, intermediate sizes that are not a multiple of 256.
SPECS = {
    # Qwen2.5-0.5B: 14 heads / 2 KV heads of 64, q/k/v biases, tied embeddings
    "qwen2": TinySpec("qwen2", "Qwen2.5 tiny", 896, 14, 2, 64, 1216, bias=True, seed=1,
                      qtypes={"attn": Q.Q8_0, "ffn": Q.Q4_0, "embd": Q.Q8_0}),
    # Qwen3-0.6B-like: heads of 128 wider than hidden / heads, QK-norm, untied output
    "qwen3": TinySpec("qwen3", "Qwen3 tiny", 640, 8, 2, 128, 1088, qk_norm=True, tied=False, seed=2,
                      qtypes={"attn": Q.Q4_0, "ffn": Q.Q8_0, "embd": Q.Q4_0, "output": Q.Q8_0}),
    # Mistral: filed as "llama" (q/k rows interleaved), named so; heads of 128, GQA 3:1
    "mistral": TinySpec("llama", "Mistral tiny", 1536, 12, 4, 128, 1600, tied=False, seed=3,
                        rope_theta=1e6, qtypes={"attn": Q.Q8_0, "ffn": Q.F16, "embd": Q.Q8_0, "output": Q.Q4_0}),
    # Phi-3-mini-like: heads of 96, no GQA, fused qkv and gate|up
    "phi3": TinySpec("phi3", "Phi3 tiny", 1536, 16, 16, 96, 1600, fused=True, tied=False, seed=4,
                     rope_theta=1e4, qtypes={"attn": Q.Q4_0, "ffn": Q.Q8_0, "embd": Q.F16, "output": Q.Q8_0}),
    # Gemma 3 270M: 4 heads / 1 KV head of 256 wider than hidden / heads, QK-norm, sandwich
    # norms, six layers (the sixth global) with a window of 16 tokens the prompts cross
    "gemma3": TinySpec("gemma3", "Gemma 3 tiny", 640, 4, 1, 256, 1184, layers=6, qk_norm=True,
                       window=16, seed=6, qtypes={"attn": Q.Q8_0, "ffn": Q.Q4_0, "embd": Q.Q8_0}),
    # Gemma 2 2B: 8 heads / 4 KV heads of 256 (hidden 2304 here 576), sandwich norms, soft-caps
    # (transformers' defaults: its GGUF loader does not read them), every 2nd layer global and
    # a window of 16 tokens the prompts cross
    "gemma2": TinySpec("gemma2", "Gemma 2 tiny", 576, 8, 4, 256, 1152, layers=4, window=16, seed=14,
                       rope_theta=1e4, softcaps=(50.0, 30.0),
                       qtypes={"attn": Q.Q8_0, "ffn": Q.Q4_0, "embd": Q.Q8_0}),
    # SmolLM2-360M: 15 heads / 5 KV heads of 64
    "llama": TinySpec("llama", "SmolLM2 tiny", 960, 15, 5, 64, 2560 - 32, seed=5,
                      qtypes={"attn": Q.Q4_0, "ffn": Q.Q4_0, "embd": Q.Q8_0}),
}

# Whole models' shapes, for `python tests/tiny_gguf.py NAME OUT.gguf` (random blocks; benchmarks)
FULL_SPECS = {
    # Qwen2.5-0.5B-Instruct's shapes, all Q8_0: 0.53 GB
    "qwen2.5-0.5b-q8_0": TinySpec("qwen2", "Qwen2.5 0.5B synthetic", 896, 14, 2, 64, 4864, layers=24,
                                  vocab=151936, bias=True, seed=10,
                                  qtypes={"attn": Q.Q8_0, "ffn": Q.Q8_0, "embd": Q.Q8_0}),
    # the same in Q4_0 (Q8_0 embeddings, as llama.cpp's Q4_0 files keep): 0.34 GB
    "qwen2.5-0.5b-q4_0": TinySpec("qwen2", "Qwen2.5 0.5B synthetic", 896, 14, 2, 64, 4864, layers=24,
                                  vocab=151936, bias=True, seed=11,
                                  qtypes={"attn": Q.Q4_0, "ffn": Q.Q4_0, "embd": Q.Q8_0}),
    # a real Q4_K_M file's mix for these shapes (rows of 896 are not whole 256-blocks, so
    # llama.cpp's quantizer falls back: Q4_K -> Q5_0, Q6_K -> Q8_0): Q5_0 x133, Q8_0 x13,
    # Q4_K x12, Q6_K x12 (ffn_down, 4864 wide, alternating): 0.40 GB
    "qwen2.5-0.5b-q4_k_m": TinySpec("qwen2", "Qwen2.5 0.5B synthetic", 896, 14, 2, 64, 4864, layers=24,
                                    vocab=151936, bias=True, seed=12, chat=True,
                                    qtypes={"attn": Q.Q5_0, "attn_v": Q.Q8_0, "ffn": Q.Q5_0,
                                            "ffn_down": Q.Q4_K, "ffn_down_odd": Q.Q6_K, "embd": Q.Q8_0}),
    # Qwen2.5-1.5B's shapes (rows of 1536 / 8960: whole 256-blocks, so the K-quants stay): the
    # Q4_K_M mix, Q4_K with Q6_K for attn_v, the embeddings / output and every other ffn_down: 1.0 GB
    "qwen2.5-1.5b-q4_k_m": TinySpec("qwen2", "Qwen2.5 1.5B synthetic", 1536, 12, 2, 128, 8960, layers=28,
                                    vocab=151936, bias=True, seed=13, chat=True,
                                    qtypes={"attn": Q.Q4_K, "attn_v": Q.Q6_K, "ffn": Q.Q4_K,
                                            "ffn_down": Q.Q4_K, "ffn_down_odd": Q.Q6_K, "embd": Q.Q6_K}),
    # the same shapes in a Q3_K_M-like mix (llama.cpp's: Q3_K, Q4_K for attn_v and part of
    # ffn_down, Q6_K for the tied embeddings / output): 0.8 GB
    "qwen2.5-1.5b-q3_k_m": TinySpec("qwen2", "Qwen2.5 1.5B synthetic", 1536, 12, 2, 128, 8960, layers=28,
                                    vocab=151936, bias=True, seed=15, chat=True,
                                    qtypes={"attn": Q.Q3_K, "attn_v": Q.Q4_K, "ffn": Q.Q3_K,
                                            "ffn_down": Q.Q3_K, "ffn_down_odd": Q.Q4_K, "embd": Q.Q6_K}),
    # and a Q2_K-like one (Q2_K, Q3_K for attn_v and ffn_down, Q6_K embeddings / output): 0.7 GB
    "qwen2.5-1.5b-q2_k": TinySpec("qwen2", "Qwen2.5 1.5B synthetic", 1536, 12, 2, 128, 8960, layers=28,
                                  vocab=151936, bias=True, seed=16, chat=True,
                                  qtypes={"attn": Q.Q2_K, "attn_v": Q.Q3_K, "ffn": Q.Q2_K,
                                          "ffn_down": Q.Q3_K, "ffn_down_odd": Q.Q3_K, "embd": Q.Q6_K}),
    # Gemma 2 2B's shapes and Q4_K_M mix (rows of 2304 / 9216: whole 256-blocks): Q4_K, Q6_K for
    # attn_v, every other ffn_down and the tied 256,000 x 2304 embeddings / LM head; soft-caps 50 /
    # 30, a 4,096 window on every other layer: 1.6 GB
    "gemma2-2b-q4_k_m": TinySpec("gemma2", "Gemma 2 2B synthetic", 2304, 8, 4, 256, 9216, layers=26,
                                 vocab=256000, window=4096, rope_theta=1e4, softcaps=(50.0, 30.0), seed=14,
                                 chat=True, qtypes={"attn": Q.Q4_K, "attn_v": Q.Q6_K, "ffn": Q.Q4_K,
                                                    "ffn_down": Q.Q4_K, "ffn_down_odd": Q.Q6_K, "embd": Q.Q6_K}),
    # Llama-3.2-1B's shapes (16 layers, hidden 2048, 32 / 8 heads of 64, intermediate 8192, the
    # tied 128,256-row embeddings, Llama 3 RoPE scaling) in its Q4_K_M mix: Q4_K, Q6_K for attn_v,
    # every other ffn_down and the embeddings / LM head: 0.8 GB
    # Qwen3-0.6B's shapes (28 layers, hidden 1,024, 16 / 8 heads of 128 with QK-norm, the tied
    # 151,936-row embeddings) in its Q4_K_M mix (rows of 1,024 and 3,072: whole super-blocks): 0.5 GB
    "qwen3-0.6b-q4_k_m": TinySpec("qwen3", "Qwen3 0.6B synthetic", 1024, 16, 8, 128, 3072, layers=28,
                                  vocab=151936, qk_norm=True, seed=22, chat=True,
                                  qtypes={"attn": Q.Q4_K, "attn_v": Q.Q6_K, "ffn": Q.Q4_K,
                                          "ffn_down": Q.Q4_K, "ffn_down_odd": Q.Q6_K, "embd": Q.Q6_K}),
    "llama3.2-1b-q4_k_m": TinySpec("llama", "Llama 3.2 1B synthetic", 2048, 32, 8, 64, 8192, layers=16,
                                   vocab=128256, llama3=(32.0, 1.0, 4.0, 8192), rope_theta=500000.0, seed=21,
                                   chat=True, qtypes={"attn": Q.Q4_K, "attn_v": Q.Q6_K, "ffn": Q.Q4_K,
                                                      "ffn_down": Q.Q4_K, "ffn_down_odd": Q.Q6_K, "embd": Q.Q6_K}),
    # Phi-4-mini's shapes (3.8B: 32 layers, hidden 3072, 24 / 8 heads of 128, RoPE over 96 of them,
    # LongRoPE from 4,096, tied 200,064-row embeddings) in a Q4_K_M-like mix: Q5_K fused qkv, Q4_K
    # gate|up, Q6_K every other ffn_down and the embeddings / LM head: 2.4 GB
    "phi4-mini-q4_k_m": TinySpec("phi3", "Phi 4 mini synthetic", 3072, 24, 8, 128, 8192, layers=32,
                                 vocab=200064, fused=True, tied=True, rope_theta=1e4, longrope=4096, rotary=96,
                                 seed=19, chat=True,
                                 qtypes={"attn": Q.Q5_K, "ffn": Q.Q4_K, "ffn_down": Q.Q4_K, "ffn_down_odd": Q.Q6_K,
                                         "embd": Q.Q6_K}),
}


if __name__ == "__main__":
    import sys

    name, out = sys.argv[1], sys.argv[2]
    print(write_tiny_gguf(FULL_SPECS[name], out, fast=True).stat().st_size)
