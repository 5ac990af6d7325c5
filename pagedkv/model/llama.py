"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over the paged KV cache.

One forward serves a whole engine step: the new tokens of every sequence, prefills and decodes,
flattened into one [T] dimension with no padding. Attention is `paged_attention`, which writes
each layer's new K/V into the cache and reads the context through block tables.

Written for small models on few CPU cores, where per-op overhead is a real share of a decode
step: Q/K/V and gate/up are each one fused matmul, RoPE is three elementwise ops on q and k
together, the RoPE tables are gathered once per step for all layers, the residual adds are in
place, and the LM head runs only on the rows whose logits are wanted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.paged import paged_attention
from pagedkv.cache.storage import KVStorage
from pagedkv.errors import ModelLoadError
from pagedkv.model.config import ModelConfig
from pagedkv.model.packed import linear as packed_linear
from pagedkv.model.packed import pack

# HF checkpoint entries that carry no weights we need
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Linear(nn.Module):
    """y = x W^T (+ b) on uninitialized storage: every weight is loaded afterwards, and a random
    init of 135M parameters would cost about a second (nn.Linear on "meta" imports sympy, ~1 s)."""

    def __init__(self, n_in: int, n_out: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(n_out, dtype=dtype), requires_grad=False) if bias else None
        )
        self.packed: torch.Tensor | None = None  # see packed.py; set by LlamaModel.pack_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.packed, self.bias)


def _rms_weight(n: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.ones(n, dtype=dtype), requires_grad=False)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of the HF "rotate_half" RoPE layout, gathered by position once per step.

    Applying rotate_half(x) * sin as flip_halves(x) * sin_signed (sin_signed = [-sin, sin]) makes
    RoPE three ops: x * cos, a flip of the two halves, and one addcmul.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.inv_freq = _inv_freq(cfg)  # [D/2] float32
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin_signed", torch.empty(0), persistent=False)
        # start small (a 128k-context model would need 134 MB of tables); lookup() grows them
        self._build(min(cfg.max_position_embeddings, 4096), dtype)

    def _build(self, num_positions: int, dtype: torch.dtype) -> None:
        # float32 angles, cast afterwards, as transformers does (so bf16 tables round alike)
        t = torch.arange(num_positions, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)  # [P, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        self.cos = torch.cat([cos, cos], dim=-1).to(dtype)  # [P, D]
        self.sin_signed = torch.cat([-sin, sin], dim=-1).to(dtype)  # [P, D]

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed for `positions` [T]: each [T, 1, D], broadcast over heads."""
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            # grow to the next power of two so a long generation rebuilds only a few times
            self._build(1 << int(positions.max()).bit_length(), self.cos.dtype)
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        return cos, self.sin_signed.index_select(0, positions).unsqueeze(1)

    def shift_keys(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys k [..., D] stored after RoPE at positions p -> as if rotated at p + delta.

        RoPE rotates each frequency pair by position * inv_freq, so rotating again by
        delta * inv_freq gives position p + delta (exact in real arithmetic, Llama-3 scaling
        included: it only changes inv_freq). The cache's `shift` calls this (context shift).
        """
        ang = (float(delta) * self.inv_freq.double()).to(k.device)  # [D/2], float64 angle
        cos, sin = ang.cos().float(), ang.sin().float()
        cos2, sin_signed = torch.cat([cos, cos]), torch.cat([-sin, sin])
        d = k.shape[-1]
        swapped = k.reshape(*k.shape[:-1], 2, d // 2).flip(-2).reshape(k.shape)
        return (k.float() * cos2 + swapped.float() * sin_signed).to(k.dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] -> rotated [T, H, D] (new contiguous tensor)."""
        t, h, d = x.shape
        swapped = x.reshape(t, h, 2, d // 2).flip(2).reshape(t, h, d)  # [x2, x1]
        return torch.addcmul(x * cos, swapped, sin_signed)


def _inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[D/2] float32 rotary frequencies, with Llama-3 frequency scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv
    # Llama 3: long wavelengths (low frequencies) are slowed down by `factor`, short ones are
    # kept, and the band between is interpolated linearly in 1/wavelength.
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen = old_ctx / s["low_freq_factor"]
    high_wavelen = old_ctx / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    mixed = (1 - smooth) * inv / s["factor"] + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / s["factor"], mixed)
    return torch.where(wavelen < high_wavelen, inv, out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.eps = cfg.rms_norm_eps
        self.scale = d**-0.5
        self.input_norm = _rms_weight(h, dtype)
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, cfg.attention_bias, dtype)
        self.o_proj = Linear(self.q_size, h, False, dtype)
        self.post_attention_norm = _rms_weight(h, dtype)
        self.gate_up_proj = Linear(h, 2 * cfg.intermediate_size, False, dtype)
        self.down_proj = Linear(cfg.intermediate_size, h, False, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x [T, H] (updated in place and returned)."""
        x.add_(self._attention(x, cos, sin, k_cache, v_cache, meta))
        x.add_(self._mlp(x))
        return x

    def _attention(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        h = F.rms_norm(x, x.shape[-1:], self.input_norm, self.eps)
        qkv = self.qkv_proj(h)  # [T, (Hq + 2 Hkv) D]
        # q and k are rotated together: one set of RoPE ops instead of two
        qk = RotaryEmbedding.rotate(qkv[:, : self.q_size + self.kv_size].view(t, hq + hkv, d), cos, sin)
        q, k = qk[:, :hq], qk[:, hq:]  # [T, Hq, D], [T, Hkv, D]
        v = qkv[:, self.q_size + self.kv_size :].view(t, hkv, d)  # [T, Hkv, D]
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.q_size))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x, x.shape[-1:], self.post_attention_norm, self.eps)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate).mul_(up))  # SwiGLU


class LlamaModel(nn.Module):
    """Decoder + LM head. Build with `LlamaModel(cfg, dtype)`, then `load_weights(...)`."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = cfg
        v, h = cfg.vocab_size, cfg.hidden_size
        # The LM head is stored transposed, [H, V]: at batch 1 a [1, H] @ [H, V] product runs
        # ~2x faster on CPU than F.linear over the [V, H] matrix (113 MB for SmolLM2, the largest
        # read of a decode step). Tied embeddings read their rows from the same storage.
        self.lm_head_t = nn.Parameter(torch.empty(h, v, dtype=dtype), requires_grad=False)
        self.embed_tokens = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(v, h, dtype=dtype), requires_grad=False)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = _rms_weight(h, dtype)
        self.rope = RotaryEmbedding(cfg, dtype)
        self._lm_head_packed: torch.Tensor | None = None

    def pack_weights(self) -> bool:
        """Pre-pack every matmul weight for the CPU (packed.py); True if packing applies.
        Costs a second copy of the weights; call again after changing them."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.packed = pack(m.weight)
        self._lm_head_packed = pack(self.lm_head_t.t())
        return self._lm_head_packed is not None

    def unpack_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, Linear):
                m.packed = None
        self._lm_head_packed = None

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head_t.dtype

    def embedding_weight(self) -> torch.Tensor:
        """[V, H] input embeddings (a transposed view of the LM head when tied)."""
        return self.lm_head_t.t() if self.embed_tokens is None else self.embed_tokens

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVStorage,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids/positions [T] int64 -> logits [B, vocab] float32 for rows `logits_indices`
        ([B] int64; None: all T rows)."""
        x = F.embedding(input_ids, self.embedding_weight())  # [T, H], fresh: safe to add_ into
        cos, sin = self.rope.lookup(positions)  # [T, 1, D] each, shared by every layer
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv.k_cache(i), kv.v_cache(i), meta)
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)  # [B, H]: norm + LM head only where needed
        x = F.rms_norm(x, x.shape[-1:], self.norm, self.config.rms_norm_eps)
        if self._lm_head_packed is not None:
            return packed_linear(x, self.lm_head_t.t(), self._lm_head_packed).float()  # [B, V]
        return torch.mm(x, self.lm_head_t).float()  # [B, vocab]

    def make_kv_storage(self, num_blocks: int, block_size: int) -> KVStorage:
        """A KVStorage shaped for this model, in the model's dtype."""
        c = self.config
        return KVStorage(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, self.dtype)

    # --- weights ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors ("model.layers.0.self_attn.q_proj.weight", ...) into the fused
        parameters, converting dtype. Streams: each tensor can be freed once copied.

        Raises ModelLoadError on a missing tensor, a shape mismatch, or an unknown name.
        """
        self.unpack_weights()  # packed copies would go stale
        targets = self._weight_targets()
        seen: set[str] = set()
        for name, tensor in weights:
            if name not in targets:
                if name.endswith(_IGNORED_SUFFIXES) or (
                    name == "lm_head.weight" and self.config.tie_word_embeddings
                ):
                    continue
                raise ModelLoadError(f"unexpected weight {name!r} for {self.config.architecture}")
            dest = targets[name]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ModelLoadError(
                    f"weight {name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            seen.add(name)
        missing = sorted(set(targets) - seen)
        if missing:
            raise ModelLoadError(f"missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        """HF weight name -> the (view of the) parameter it fills."""
        t: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embedding_weight().data,
            "model.norm.weight": self.norm.data,
        }
        if not self.config.tie_word_embeddings:
            t["lm_head.weight"] = self.lm_head_t.data.t()
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            q, kv = layer.q_size, layer.kv_size
            t[p + "input_layernorm.weight"] = layer.input_norm.data
            t[p + "post_attention_layernorm.weight"] = layer.post_attention_norm.data
            t[p + "self_attn.o_proj.weight"] = layer.o_proj.weight.data
            t[p + "mlp.down_proj.weight"] = layer.down_proj.weight.data
            parts = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
            for proj, (a, b) in parts.items():
                t[p + f"self_attn.{proj}.weight"] = layer.qkv_proj.weight.data[a:b]
                if layer.qkv_proj.bias is not None:
                    t[p + f"self_attn.{proj}.bias"] = layer.qkv_proj.bias.data[a:b]
            n = self.config.intermediate_size
            t[p + "mlp.gate_proj.weight"] = layer.gate_up_proj.weight.data[:n]
            t[p + "mlp.up_proj.weight"] = layer.gate_up_proj.weight.data[n:]
        return t
