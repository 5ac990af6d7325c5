"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 / 3, SmolLM2 / 3, Granite)
over the paged KV cache.

One forward serves a whole engine step: the new tokens of every sequence, prefills and decodes,
flattened into one [T] dimension with no padding. Attention is `paged_attention`, which writes
each layer's new K/V into the cache and reads the context through block tables.

Written for small models on few CPU cores, where per-op overhead is a real share of a decode
step: Q/K/V and gate/up are each one fused matmul, RoPE is three elementwise ops on q and k
together, the RoPE tables are gathered once per step for all layers, each residual add is fused
with the RMSNorm after it (fused_ops.cpp; torch ops without the kernel), and the LM head runs
only on the rows whose logits are wanted. Weights are float tensors or, for a GGUF loaded with
weights="quantized", the file's blocks (quant.py).

Gemma 3 is the same decoder with four norms per layer (the attention and MLP outputs are normed
before their residual adds), embeddings scaled by sqrt(hidden), GeGLU (tanh gelu), the attention
scale from query_pre_attn_scalar, and sliding-window layers with their own RoPE base: each layer
reads one of up to three RoPE tables (global, local base, none: SmolLM3's NoPE layers), each
gathered once per step, and passes its window (and Gemma 2's soft-cap) to attention. Partial
rotary (Phi-4-mini) is the same RoPE over reordered q/k rows (partial_rotary_order).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.paged import attention_plan, paged_attention
from pagedkv.cache.storage import KVStorage, LayerKV
from pagedkv.errors import ModelLoadError, StorageMismatchError
from pagedkv.model import qkernel, quant
from pagedkv.model.config import ModelConfig
from pagedkv.model.greedy_head import GreedyHead
from pagedkv.model.packed import linear as packed_linear
from pagedkv.model.packed import pack
from pagedkv.model.quant import QPart, QWeight

# whether a pure-decode step runs its layers in one op (decode_loop.cpp; the same ops and bits
# as the Python loop, which runs every other step and where this is False)
DECODE_LOOP = True
# LlamaModel._logits_out: the LM head's logits go to a buffer kept from step to step from this
# many bytes (below, a fresh tensor costs nothing: glibc reuses its heap) up to the most kept
LOGITS_KEEP_MIN = 16 << 20
LOGITS_KEEP_MAX = 256 << 20
# HF checkpoint entries that carry no weights we need
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# the tensors partial rotary reorders (LlamaModel._rotary_rows): q and k rows, QK-norm weights
_ROTARY_PROJ = ("q_proj", "k_proj", "qkv_proj", "q_norm", "k_norm")


class Linear(nn.Module):
    """y = x W^T (+ b) on uninitialized storage: every weight is loaded afterwards, and a random
    init of 135M parameters would cost about a second (nn.Linear on "meta" imports sympy, ~1 s).

    A quantized model keeps the weight in `q` (a QWeight of GGUF blocks) and `weight` empty."""

    def __init__(self, n_in: int, n_out: int, bias: bool, dtype: torch.dtype, quantized: bool = False) -> None:
        super().__init__()
        self.n_in, self.n_out = n_in, n_out
        rows = 0 if quantized else n_out
        self.weight = nn.Parameter(torch.empty(rows, n_in, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(n_out, dtype=dtype), requires_grad=False) if bias else None
        )
        self.packed: torch.Tensor | None = None  # see packed.py; set by LlamaModel.pack_weights
        self.q: QWeight | None = None

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: scratch a quantized weight's kernel may write into; use the result."""
        if self.q is not None:
            y = self.q.linear(x, out)
            return y if self.bias is None else y.add_(self.bias)
        return packed_linear(x, self.weight, self.packed, self.bias)

    def fast(self):  # noqa: ANN201
        """A plain callable computing forward(x) without nn.Module.__call__ (hook machinery):
        the QWeight's own `linear` when there is no bias. Valid until `q` is replaced."""
        return self.q.linear if self.q is not None and self.bias is None else self.forward


def _rms_weight(n: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.ones(n, dtype=dtype), requires_grad=False)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of the HF "rotate_half" RoPE layout, gathered by position once per step.

    Applying rotate_half(x) * sin as flip_halves(x) * sin_signed (sin_signed = [-sin, sin]) makes
    RoPE three ops: x * cos, a flip of the two halves, and one addcmul.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, theta: float | None = None,
                 identity: bool = False) -> None:
        """`theta`: a local base (never scaled); `identity`: no rotation at all (the tables of
        SmolLM3's NoPE layers: cos 1, sin 0)."""
        super().__init__()
        self.head_dim, self.rotary = cfg.head_dim, cfg.rotary
        # [D/2] float32 (0 on pass-through pairs)
        self.inv_freq = torch.zeros(cfg.head_dim // 2) if identity else _inv_freq(cfg, theta)
        self.scale = cfg.rope_attention_factor if theta is None and not identity else 1.0  # on cos and sin
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin_signed", torch.empty(0), persistent=False)
        # start small (a 128k-context model would need 134 MB of tables); lookup() grows them
        self._build(min(cfg.max_position_embeddings, 4096), dtype)

    def _build(self, num_positions: int, dtype: torch.dtype) -> None:
        # float32 angles, cast afterwards, as transformers does (so bf16 tables round alike)
        dev = self.cos.device if hasattr(self, "cos") else torch.device("cpu")
        t = torch.arange(num_positions, dtype=torch.float32, device=dev)
        freqs = torch.outer(t, self.inv_freq.to(dev))  # [P, D/2]
        cos, sin = freqs.cos(), freqs.sin()  # pass-through dims (inv_freq 0): exactly 1 and 0
        if self.scale != 1.0:  # LongRoPE: q and k's rotated dims scaled by the attention factor
            r = self.rotary // 2
            cos[:, :r], sin[:, :r] = cos[:, :r] * self.scale, sin[:, :r] * self.scale
        self.cos = torch.cat([cos, cos], dim=-1).to(dtype)  # [P, D]
        self.sin_signed = torch.cat([-sin, sin], dim=-1).to(dtype)  # [P, D]

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed for `positions` [T]: each [T, 1, D], broadcast over heads."""
        if positions.is_cpu and positions.numel():  # (device positions: see reserve())
            self.reserve(int(positions.max()))
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        return cos, self.sin_signed.index_select(0, positions).unsqueeze(1)

    def reserve(self, max_position: int) -> None:
        """Tables covering `max_position` (grown to the next power of two, so a long generation
        rebuilds only a few times). A runner with positions on a device calls this with the
        host's maximum, so lookup() never syncs."""
        if max_position >= self.cos.shape[0]:
            self._build(1 << int(max_position).bit_length(), self.cos.dtype)

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


def _inv_freq(cfg: ModelConfig, theta: float | None = None) -> torch.Tensor:
    """[D/2] float32 rotary frequencies of base `theta` (None: cfg.rope_theta, with Llama-3
    frequency scaling or a GGUF file's frequency factors when configured; a local base is never
    scaled). Partial rotary (cfg.rotary < D): the R/2 frequencies of an R-dim RoPE, then zeros,
    which rotate the pass-through pairs by nothing (see partial_rotary_order)."""
    inv = _rotary_inv_freq(cfg, theta)
    return F.pad(inv, (0, cfg.head_dim // 2 - inv.numel()))


def _rotary_inv_freq(cfg: ModelConfig, theta: float | None) -> torch.Tensor:
    d = cfg.rotary
    base = cfg.rope_theta if theta is None else theta
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if theta is not None:
        return inv
    if cfg.rope_freq_factors is not None:  # llama.cpp: theta / factor, in float32
        return inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
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


def partial_rotary_order(d: int, r: int) -> torch.Tensor:
    """[D] transformers' head dim of each dim RoPE runs over, for RoPE over the first r of d.

    transformers rotates the pairs (i, i + r/2) of the first r dims and passes the rest through;
    the RoPE here pairs (j, j + d/2) over the whole head. So the rotated halves go to the front
    of each half of the head and the pass-through dims fill the rest, and their frequencies are
    0 (cos 1, sin 0: unchanged). q and k get the same order (the projection rows are reordered
    at load), so every q.k is the same sum; v and the attention output keep theirs."""
    rot, rest = torch.arange(r), torch.arange(r, d)
    return torch.cat([rot[: r // 2], rest[: (d - r) // 2], rot[r // 2 :], rest[(d - r) // 2 :]])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quantized: bool = False, index: int = 0) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.attention_scale
        # attention window in tokens (0: the whole context)
        self.window = cfg.layer_window(index) or 0
        # which of the model's RoPE tables it reads: 0 the global, 1 the local base's (Gemma 3's
        # windowed layers), 2 none (SmolLM3's NoPE layers)
        local = cfg.rope_local_theta is not None and self.window > 0
        self.rope_table = 2 if index in (cfg.nope_layers or ()) else int(local)
        self.gelu = cfg.hidden_act == "gelu_tanh"
        self.softcap = cfg.attn_logit_softcapping or 0.0  # Gemma 2: scores soft-capped (0: not)
        self.input_norm = _rms_weight(h, dtype)
        q = quantized
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, cfg.attention_bias, dtype, q)
        self.o_proj = Linear(self.q_size, h, False, dtype, q)
        self.post_attention_norm = _rms_weight(h, dtype)
        self.gate_up_proj = Linear(h, 2 * cfg.intermediate_size, False, dtype, q)
        self.down_proj = Linear(cfg.intermediate_size, h, False, dtype, q)
        # Qwen3: RMSNorm over every q and k head (weights [D]) before RoPE
        self.q_norm = _rms_weight(d, dtype) if cfg.qk_norm else None
        self.k_norm = _rms_weight(d, dtype) if cfg.qk_norm else None
        # Gemma: the attention output and the MLP output are normed before their residual adds
        self.attn_out_norm = _rms_weight(h, dtype) if cfg.sandwich_norms else None
        self.mlp_out_norm = _rms_weight(h, dtype) if cfg.sandwich_norms else None
        self.bind()

    def bind(self) -> None:
        """Prebind the four matmuls as plain callables (Linear.fast), called once per layer
        per step without the nn.Module call machinery; again whenever a Linear's `q` changes."""
        quant.changed()  # (a cached decode plan holds the old weights)
        fns = (self.qkv_proj.fast(), self.o_proj.fast(), self.gate_up_proj.fast(), self.down_proj.fast())
        self._qkv, self._o, self._gate_up, self._down = fns
        # plain references (nn.Module attribute lookup of a Parameter is a slow path); the
        # Parameter objects stay the same when weights load (they are copied into .data)
        self.norms = (self.input_norm, self.post_attention_norm)
        # q_norm repeated for the Hq heads, then k_norm for the Hkv heads: [Hq + Hkv, D], one
        # multiply for the whole q|k block (a copy: rebuilt here after every load_weights)
        self._qk_norm_w = None if self.q_norm is None else torch.cat([
            self.q_norm.detach().expand(self.num_heads, -1),
            self.k_norm.detach().expand(self.num_kv_heads, -1),
        ])

    def _norm_qk(self, qk_in: torch.Tensor) -> torch.Tensor:
        """Qwen3's per-head RMSNorm of q|k [T, Hq + Hkv, D] (a view of qkv) -> new contiguous
        [T, Hq + Hkv, D]; without qk_norm, `qk_in` itself."""
        if self._qk_norm_w is None:
            return qk_in
        return F.rms_norm(qk_in, qk_in.shape[-1:], None, self.eps).mul_(self._qk_norm_w)

    def _rope_fused(self, fused: tuple, qk_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    out: torch.Tensor) -> None:
        """RoPE of q|k into `out` by the fused ops; with QK-norm, the norm and RoPE in one pass."""
        if self._qk_norm_w is None:
            fused[0](qk_in, cos, sin, out)
        else:
            fused[5](qk_in, self._qk_norm_w, self.eps, cos, sin, out)

    def attention(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKV,
        meta: AttentionMetadata,
        fused: tuple | None = None,
        bufs: tuple | None = None,
    ) -> torch.Tensor:
        """h = input_norm(x) [T, H] -> the attention block's output [T, H]. `fused`: the
        compiled elementwise ops, qkernel.fused() (float32 only); None: torch ops. `bufs`:
        LlamaModel._step_buffers (with `fused`), scratch reused by every layer of the step."""
        t = h.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self._qkv(h, None if bufs is None else bufs[4])  # [T, (Hq + 2 Hkv) D]
        if bufs is not None and qkv is bufs[4]:  # the step's views of the scratch, made once
            qk_in, q, k, v, o2 = bufs[8]
            self._rope_fused(fused, qk_in, cos, sin, bufs[0])
            paged_attention(q, k, v, cache, meta, self.scale, bufs[1], self.window, self.softcap)
            return self._o(o2, bufs[5])
        # q and k are rotated together: one set of RoPE ops instead of two (one op when fused)
        qk_in = qkv[:, : self.q_size + self.kv_size].view(t, hq + hkv, d)
        if fused is not None:
            qk = torch.empty(t, hq + hkv, d) if bufs is None else bufs[0]
            self._rope_fused(fused, qk_in, cos, sin, qk)
        else:
            qk = RotaryEmbedding.rotate(self._norm_qk(qk_in), cos, sin)
        q, k = qk[:, :hq], qk[:, hq:]  # [T, Hq, D], [T, Hkv, D]
        v = qkv[:, self.q_size + self.kv_size :].view(t, hkv, d)  # [T, Hkv, D]
        o = paged_attention(q, k, v, cache, meta, self.scale, None if bufs is None else bufs[1], self.window,
                            self.softcap)
        return self._o(o.reshape(t, self.q_size), None if bufs is None else bufs[5])

    def mlp(self, h: torch.Tensor, fused: tuple | None = None, bufs: tuple | None = None) -> torch.Tensor:
        """h = post_attention_norm(x) [T, H] -> the MLP's output [T, H]."""
        gu = self._gate_up(h, None if bufs is None else bufs[6])  # [T, 2I]
        if fused is not None:  # SwiGLU or GeGLU in one pass
            act = torch.empty(gu.shape[0], gu.shape[1] // 2) if bufs is None else bufs[2]
            fused[3 if self.gelu else 1](gu, act)
            return self._down(act, None if bufs is None else bufs[7])
        gate, up = gu.chunk(2, dim=-1)  # [T, I] each
        if self.gelu:  # GeGLU: transformers' gelu_pytorch_tanh
            return self._down(F.gelu(gate, approximate="tanh").mul_(up))
        return self._down(F.silu(gate).mul_(up))  # SwiGLU


def _add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float, fused: tuple | None,
    out: torch.Tensor | None = None, w_delta: torch.Tensor | None = None,
) -> torch.Tensor:
    """x += delta (in place); returns rms_norm(x) * w, in `out` when given (fused only).
    `w_delta` (Gemma's output norms): x += rms_norm(delta) * w_delta instead."""
    if w_delta is not None:
        if fused is not None:
            out = torch.empty_like(x) if out is None else out
            fused[4](x, delta.contiguous(), w_delta, w, eps, out)
            return out
        delta = F.rms_norm(delta, delta.shape[-1:], w_delta, eps)
    if fused is not None:
        out = torch.empty_like(x) if out is None else out
        fused[2](x, delta.contiguous(), w, eps, out)
        return out
    x.add_(delta)
    return F.rms_norm(x, x.shape[-1:], w, eps)


class LlamaModel(nn.Module):
    """Decoder + LM head. Build with `LlamaModel(cfg, dtype)`, then `load_weights(...)`.

    `quantized=True` (float32 only): every matmul weight and the token embeddings arrive as
    GGUF blocks (QPart) and stay so (quant.py); the float parameters of those are left empty.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, quantized: bool = False) -> None:
        super().__init__()
        if quantized and dtype != torch.float32:
            raise ModelLoadError("quantized weights compute in float32; use dtype float32")
        self.config = cfg
        self.quantized = quantized
        v, h = cfg.vocab_size, cfg.hidden_size
        vq = 0 if quantized else v
        # The LM head is stored transposed, [H, V]: at batch 1 a [1, H] @ [H, V] product runs
        # ~2x faster on CPU than F.linear over the [V, H] matrix (113 MB for SmolLM2, the largest
        # read of a decode step). Tied embeddings read their rows from the same storage.
        self.lm_head_t = nn.Parameter(torch.empty(h, vq, dtype=dtype), requires_grad=False)
        self.embed_tokens = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(vq, h, dtype=dtype), requires_grad=False)
        )
        self.embed_q: QWeight | None = None  # quantized token embeddings [V, H]
        self.lm_head_q: QWeight | None = None  # quantized LM head [V, H] (the same one when tied)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, quantized, i) for i in range(cfg.num_layers))
        self.norm = _rms_weight(h, dtype)
        self.rope = RotaryEmbedding(cfg, dtype)  # the full-attention layers' (all, without a local base)
        used = {layer.rope_table for layer in self.layers}
        self.rope_local = RotaryEmbedding(cfg, dtype, cfg.rope_local_theta) if 1 in used else None
        self.rope_none = RotaryEmbedding(cfg, dtype, identity=True) if 2 in used else None
        # Gemma: embeddings times sqrt(hidden), rounded to the compute dtype as transformers does
        self._embed_scale = (
            None if cfg.embedding_scale is None else torch.tensor(cfg.embedding_scale).to(dtype)
        )
        self._lm_head_packed: torch.Tensor | None = None
        self._logits_buf: torch.Tensor | None = None  # _logits_out
        self._greedy: GreedyHead | None = None  # greedy_head.py's, for lm_head_q (_greedy_head)
        # the last forward's greedy rows' tokens (GreedyHead.logits; None: not decided there),
        # read with its logits, before the next forward
        self.greedy_tokens: torch.Tensor | None = None
        self._plans: dict[int, tuple] = {}  # row count -> ((route key, KV layer groups), _static_plan)

    def pack_weights(self) -> bool:
        """Pre-pack every matmul weight for the CPU (packed.py); True if packing applies.
        Costs a second copy of the weights; call again after changing them."""
        if self.quantized:
            return False
        for m in self.modules():
            if isinstance(m, Linear):
                m.packed = pack(m.weight)
        self._lm_head_packed = pack(self.lm_head_t.t())
        return self._lm_head_packed is not None

    def set_activations(self, mode: str) -> None:
        """"float32" (exact) or "int8": quantize each quantized matmul's input to int8 blocks
        (quant.py; approximate, opt-in). Raises UnsupportedModelError on another mode."""
        for q in self.qweights():
            q.set_activations(mode)

    def set_batch_weights(self, mode: str) -> None:
        """"quantized" (tiles, the default), "float32": keep a pre-packed float32 copy of every
        quantized matmul weight for the calls above the kernels' row counts, or "panel": keep the
        int8 panels of the K-quant ones (quant.py, QWeight.set_batch_weights).
        Raises UnsupportedModelError on another mode. All or nothing: if building a copy fails
        (out of memory), the copies built so far are dropped again."""
        qws = self.qweights()
        had = [q for q in qws if q.batch_bytes]
        try:
            for q in qws:
                q.set_batch_weights(mode)
        except BaseException:
            for q in qws:
                if q not in had:
                    q.set_batch_weights("quantized")
            raise

    def batch_weight_bytes(self) -> int:
        """Bytes of the batch copies: float32, or the kept int8 panels (0 under "quantized")."""
        return sum(q.batch_bytes for q in self.qweights())

    def expanded_weights(self) -> dict[str, int]:
        """Types no kernel reads -> the float32 bytes their tensors became at load (QWeight)."""
        out: dict[str, int] = {}
        for q in self.qweights():
            for name, n in q.expanded.items():
                out[name] = out.get(name, 0) + n
        return out

    def qweights(self) -> list[QWeight]:
        """Every quantized matrix once (the LM head included; a tied table counted once)."""
        qws = [m.q for m in self.modules() if isinstance(m, Linear) and m.q is not None]
        return [q for q in dict.fromkeys([*qws, self.lm_head_q]) if q is not None]

    def unpack_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, Linear):
                m.packed = None
        self._lm_head_packed = None

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head_t.dtype

    def shift_keys(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Every layer's keys k [L, T, H, D], stored after RoPE at positions p -> as if rotated at
        p + delta, each layer by its own RoPE table (the cache's `shift` callback)."""
        tables = self.ropes()
        if tables[1] is None and tables[2] is None:
            return self.rope.shift_keys(k, delta)
        ropes = [tables[layer.rope_table] for layer in self.layers]
        return torch.stack([r.shift_keys(k[i], delta) for i, r in enumerate(ropes)])

    def ropes(self) -> tuple[RotaryEmbedding | None, ...]:
        """The RoPE tables a layer's rope_table picks from: global, local base, none."""
        return (self.rope, self.rope_local, self.rope_none)

    def to_device(self, device: torch.device | str) -> LlamaModel:
        """Move every weight and table to `device` (float weights only: the quantized blocks
        are read by CPU kernels); the CPU pre-packed copies are dropped."""
        if self.quantized:
            raise ModelLoadError("quantized weights run on the CPU kernels; load float weights")
        device = torch.device(device)
        self.unpack_weights()
        self.to(device)
        for rope in self.ropes():
            if rope is not None:
                rope.inv_freq = rope.inv_freq.to(device)
        if self._embed_scale is not None:
            self._embed_scale = self._embed_scale.to(device)
        for layer in self.layers:
            layer.bind()  # the prebound callables and q|k norm weights of the moved tensors
        return self

    def reserve_positions(self, max_position: int) -> None:
        """RoPE tables covering `max_position` (see RotaryEmbedding.reserve)."""
        for rope in self.ropes():
            if rope is not None:
                rope.reserve(max_position)

    def weight_bytes(self) -> int:
        """Bytes held by the weights (quantized blocks are parameters too; a tied table once)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def embedding_weight(self) -> torch.Tensor:
        """[V, H] input embeddings (a transposed view of the LM head when tied)."""
        return self.lm_head_t.t() if self.embed_tokens is None else self.embed_tokens

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVStorage,
        meta: AttentionMetadata | tuple[AttentionMetadata, ...],
        logits_indices: torch.Tensor | None = None,
        greedy: tuple[torch.Tensor, bool] | None = None,
    ) -> torch.Tensor:
        """input_ids/positions [T] int64 -> logits [B, vocab] float32 for rows `logits_indices`
        ([B] int64; None: all T rows). `meta`: one AttentionMetadata per KV group of `kv`
        (a single one for a storage of one group); layer i attends through group
        `kv.layer_group[i]`'s and reads `kv.model_layers[i]`. `greedy`: (rows of the B, approx)
        where those rows' tokens are the plain argmax of their logits (greedy_head.py: their
        candidates are recomputed in float64; approx: every row is such a row and needs no other
        logit exactly); their tokens are then left in `greedy_tokens`."""
        metas = (meta,) if isinstance(meta, AttentionMetadata) else tuple(meta)
        groups = kv.layer_group
        if len(metas) <= max(groups, default=0):
            raise StorageMismatchError(f"{len(metas)} attention metadata for a KV storage of "
                                       f"{max(groups) + 1} groups")
        if any(m.group_window for m in metas):  # window groups: a few ints per step
            for layer, g in zip(self.layers, groups, strict=False):
                w = metas[g].group_window
                if w and layer.window != w:
                    raise StorageMismatchError(f"a layer with window {layer.window or 'none'} "
                                               f"reads a KV group that keeps only {w} tokens")
        if self.embed_q is not None:
            x = self.embed_q.rows(input_ids)  # [T, H]: only the looked-up rows are dequantized
        else:
            x = F.embedding(input_ids, self.embedding_weight())  # [T, H], fresh: safe to add_ into
        if self._embed_scale is not None:
            x.mul_(self._embed_scale)
        # ([T, 1, D] cos, sin) of each RoPE table the layers read, shared by them
        tables = [None if r is None else r.lookup(positions) for r in self.ropes()]
        eps, layers = self.config.rms_norm_eps, list(self.layers)  # list: no ModuleList indexing per layer
        fused = qkernel.fused() if x.dtype == torch.float32 and x.is_cpu else None  # once per step
        # each residual add is fused with the RMSNorm that follows it (fused_ops.cpp)
        h = F.rms_norm(x, x.shape[-1:], layers[0].input_norm, eps)
        last = len(layers) - 1
        bufs = None if fused is None else self._step_buffers(x)
        hb = None if bufs is None else bufs[3]
        res = self.config.residual_scale  # Granite: block outputs scaled before their adds
        loop = None if bufs is None or not DECODE_LOOP else self._decode_plan(kv, metas, tables, bufs)
        if loop is not None:  # the layers in one op (decode_loop.cpp): the same ops, no Python
            qkernel.decode_layers()(x, h, *loop)
            layers = []
        for i, (layer, cache) in enumerate(zip(layers, kv.model_layers, strict=False)):
            cos, sin = tables[layer.rope_table]
            a = layer.attention(h, cos, sin, cache, metas[groups[i]], fused, bufs)
            if res is not None:
                a = a.mul_(res)
            # Gemma: each output normed before its residual add (attn_out_norm, mlp_out_norm)
            h = _add_rms_norm(x, a, layer.norms[1], eps, fused, hb, layer.attn_out_norm)
            m = layer.mlp(h, fused, bufs)
            if res is not None:
                m = m.mul_(res)
            if i < last:
                h = _add_rms_norm(x, m, layers[i + 1].norms[0], eps, fused, hb, layer.mlp_out_norm)
            elif layer.mlp_out_norm is not None:
                x.add_(F.rms_norm(m, m.shape[-1:], layer.mlp_out_norm, eps))
            else:
                x.add_(m)
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)  # [B, H]: norm + LM head only where needed
        x = F.rms_norm(x, x.shape[-1:], self.norm, self.config.rms_norm_eps)
        return self._final_logits(self._lm_head(x, greedy))

    def _decode_plan(self, kv: KVStorage, metas: tuple[AttentionMetadata, ...], tables: list,
                     bufs: tuple[torch.Tensor, ...]) -> tuple | None:
        """decode_loop.cpp's arguments after (x, h) for this step's layers, or None where one of
        them would take another way than the op's: Granite's residual scale, a NoPE layer, a
        matmul QWeight.step_call does not take, an
        attention step other than the fused write + decode (prefill, a quantized or strided
        cache, the triton backend). The weights' part is cached per row count and the storage's
        layer groups (quant.route_key: any change of a weight's routes drops it); the caches are
        passed each step, so no plan keeps a KV storage alive."""
        t, views = bufs[4].shape[0], bufs[8]
        q, k = views[1], views[2]
        meta: list[torch.Tensor] = []
        for g, m in enumerate(metas):
            if g not in kv.layer_group:
                meta += [m.slot_mapping] * 3  # (a group no layer reads: never indexed)
                continue
            cache = kv.model_layers[kv.layer_group.index(g)]
            plan = m.plan
            if plan is None or not plan.fits(q, cache):
                plan = m.plan = attention_plan(q, k, cache, m)
            if plan.write_op is None or plan.triton is not None or plan.num_tokens != t:
                return None
            meta += [m.slot_mapping, plan.block_tables, plan.seq_lens]
        caches = [kv_t for c in kv.model_layers for kv_t in (c.k, c.v)]
        if not all(c.is_contiguous() for c in caches):
            return None
        key = (quant.route_key(), kv.layer_group)
        hit = self._plans.get(t)
        if hit is None or hit[0] != key:
            if len(self._plans) > 64:
                self._plans.clear()
            hit = self._plans[t] = (key, self._static_plan(t, kv.layer_group))
        static = hit[1]
        if static is None:
            return None
        w, ints, floats, tabs = static
        if any(tables[i] is None for i in tabs):
            return None
        rope = [c for pair in tables for c in (pair or (views[0], views[0]))]  # (a stand-in for a table no layer reads)
        bufs = [bufs[0], bufs[1], bufs[2], bufs[4], bufs[5], bufs[6], bufs[7], *views]
        return bufs, rope, meta, caches, w, ints, floats

    def _static_plan(self, t: int, layer_group: tuple[int, ...]) -> tuple | None:
        """The step-independent part of _decode_plan for t rows (None: the Python loop). It holds
        the model's own tensors only (never a KV storage's)."""
        c = self.config
        layers = list(self.layers)
        if (self.dtype != torch.float32 or c.residual_scale is not None or qkernel.decode_layers() is None
                or len({(ly.scale, ly.softcap, ly.gelu) for ly in layers}) != 1):
            return None
        w: list[torch.Tensor] = []
        ints = [len(layers), int(layers[0].gelu)]
        for i, ly in enumerate(layers):
            if ly.rope_table == 2:
                return None
            bias, qk_w = ly.qkv_proj.bias, ly._qk_norm_w
            outs = [] if ly.attn_out_norm is None else [ly.attn_out_norm, ly.mlp_out_norm]
            ints += [layer_group[i], ly.rope_table, ly.window, int(bias is not None), int(qk_w is not None),
                     int(bool(outs))]
            w += [ly.norms[1], *([layers[i + 1].norms[0]] if i + 1 < len(layers) else []),
                  *([bias] if bias is not None else []), *([qk_w] if qk_w is not None else []), *outs]
            for lin in (ly.qkv_proj, ly.o_proj, ly.gate_up_proj, ly.down_proj):
                if lin.q is None or lin.bias is not None and lin is not ly.qkv_proj:
                    return None
                call = lin.q.step_call(t)
                if call is None:
                    return None
                kind, ts, vs = call
                ints += [kind, len(ts), len(vs), *vs]
                w += ts
        floats = [float(c.rms_norm_eps), float(layers[0].scale), float(layers[0].softcap)]
        return w, ints, floats, {ly.rope_table for ly in layers}

    def _lm_head(self, x: torch.Tensor, greedy: tuple[torch.Tensor, bool] | None = None) -> torch.Tensor:
        """Normed hidden states [B, H] -> logits [B, V] float32: a new tensor, or rows of the
        kept logits buffer (`_logits_out`), overwritten by the next forward."""
        self.greedy_tokens = None
        head = None if greedy is None or not greedy[0].numel() else self._greedy_head()
        if head is not None:
            logits, self.greedy_tokens = head.logits(x, greedy[0], greedy[1],
                                                     self._logits_out(x.shape[0], head.q.n))
            return logits
        if self.lm_head_q is not None:
            return self.lm_head_q.linear(x, self._logits_out(x.shape[0], self.lm_head_q.n))
        if self._lm_head_packed is not None:
            return packed_linear(x, self.lm_head_t.t(), self._lm_head_packed).float()
        return torch.mm(x, self.lm_head_t).float()

    def prepare_greedy_head(self) -> bool:
        """Build the greedy head and its row norms now (one pass over the LM head, at engine
        start: 0.06-0.15 s for the 0.5B, Gemma 3 270M and 1.5B heads on the Zen 2), not at the
        first greedy step; False where there is none."""
        head = self._greedy_head()
        return head is not None and head.norms() is not None

    def _greedy_head(self) -> GreedyHead | None:
        """lm_head_q's GreedyHead (kept while lm_head_q is the same), or None: no quantized
        head, or one greedy_head.py does not take. Only where the final logits keep the raw
        ones' order strictly: no softcap (Gemma 2's tanh can round two logits to one float32
        value), a divisor (Granite) only when positive."""
        q, c = self.lm_head_q, self.config
        div = c.logit_divisor
        if (q is None or c.final_logit_softcapping is not None or (div is not None and not div > 0)
                or not GreedyHead.able(q)):
            return None
        if self._greedy is None or self._greedy.q is not q:
            self._greedy = GreedyHead(q)
        return self._greedy

    def _logits_out(self, rows: int, vocab: int) -> torch.Tensor | None:
        """Where the quantized LM head writes [rows, vocab] logits: rows of one buffer kept from
        step to step when they take LOGITS_KEEP_MIN bytes or more (up to LOGITS_KEEP_MAX), else
        None (a new tensor). An allocation that big is mapped fresh and zeroed page by page every
        step, and unmapped again (glibc maps any block over 32 MiB): Gemma 3 270M's 40 rows of
        262,144 logits (40 MiB) cost 11.2 ms of system time a step; kept, its int8 40-row step
        went 65.7 -> 56.8 ms (exact 145.7 -> 138.7; alternated, Zen 4). Invariant: the logits a forward
        returns are read before the next forward starts (the sampler, logprobs and forks of
        LLMEngine; beam search), as with the CUDA graphs' static logits."""
        need = rows * vocab * 4
        if not LOGITS_KEEP_MIN <= need <= LOGITS_KEEP_MAX:
            return None
        buf = self._logits_buf
        if buf is None or buf.shape[1] != vocab or buf.shape[0] < rows:
            buf = self._logits_buf = None  # (the old one freed first)
            buf = self._logits_buf = torch.empty(rows, vocab, dtype=torch.float32)
        return buf[:rows]

    def _final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """In place: Gemma 2's logits c * tanh(logits / c), Granite's divided by logits_scaling;
        other models' as they are."""
        c, div = self.config.final_logit_softcapping, self.config.logit_divisor
        if div is not None:
            logits.div_(div)
        return logits if c is None else logits.div_(c).tanh_().mul_(c)

    def _step_buffers(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Scratch for one step, shared by every layer (each layer is done with it before the
        next starts): RoPE'd q|k [T, Hq + Hkv, D], attention output [T, Hq, D], SwiGLU
        activation [T, I], normed hidden state [T, H], then the outputs of qkv [T, (Hq + 2 Hkv) D],
        o [T, H], gate_up [T, 2I] and down [T, H] (quantized kernels write there); last, the
        views DecoderLayer.attention takes of them: (q|k of qkv, q, k, v, attention out 2-D)."""
        c, t = self.config, x.shape[0]
        hq, hkv, d, n = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        qk, att, qkv = torch.empty(t, hq + hkv, d), torch.empty(t, hq, d), torch.empty(t, (hq + 2 * hkv) * d)
        views = (
            qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d),
            qk[:, :hq],
            qk[:, hq:],
            qkv[:, (hq + hkv) * d :].view(t, hkv, d),
            att.view(t, hq * d),
        )
        return (qk, att, torch.empty(t, n), torch.empty_like(x), qkv, torch.empty_like(x),
                torch.empty(t, 2 * n), torch.empty_like(x), views)

    def make_kv_storage(
        self, num_blocks: int, block_size: int, kv_cache_dtype: str | torch.dtype = "auto"
    ) -> KVStorage:
        """A KVStorage shaped for this model, in `kv_cache_dtype` ("auto": the model's dtype)."""
        c = self.config
        dt = self.dtype if kv_cache_dtype == "auto" else kv_cache_dtype
        return KVStorage(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, dt,
                         self.lm_head_t.device)

    # --- weights ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors ("model.layers.0.self_attn.q_proj.weight", ...) into the fused
        parameters, converting dtype. Streams: each tensor can be freed once copied.

        Raises ModelLoadError on a missing tensor, a shape mismatch, or an unknown name.
        """
        self.unpack_weights()  # packed copies would go stale
        targets = self._weight_targets()
        slots = self._quant_slots() if self.quantized else {}
        pending: dict[int, tuple[Any, dict[int, QPart]]] = {}
        seen: set[str] = set()
        for name, tensor in weights:
            tensor = self._rotary_rows(name, tensor)
            if isinstance(tensor, QPart):
                if name not in slots:
                    raise ModelLoadError(f"weight {name!r} cannot stay quantized here")
                owner, idx, rows, k = slots[name]
                if tensor.shape != (rows, k):
                    raise ModelLoadError(f"weight {name}: shape {tensor.shape}, expected {(rows, k)}")
                pending.setdefault(id(owner), (owner, {}))[1][idx] = tensor
                seen.add(name)
                continue
            if name in slots:
                raise ModelLoadError(f"weight {name!r} must arrive quantized (QPart) in a quantized model")
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
            if self.config.sandwich_norms and name.endswith("norm.weight"):
                tensor = 1.0 + tensor.float()  # Gemma norms scale by 1 + w (as transformers)
            dest.copy_(tensor)
            seen.add(name)
        self._attach_quantized(pending)
        for layer in self.layers:
            layer.bind()  # a Linear's `q` may have changed
        missing = sorted((set(targets) | set(slots)) - seen)
        if missing:
            raise ModelLoadError(f"missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    def _rotary_rows(self, name: str, w: torch.Tensor | QPart) -> torch.Tensor | QPart:
        """Partial rotary: q/k projection rows (and QK-norm weights) from transformers' order
        into the one RoPE runs in (partial_rotary_order); any other tensor as it is."""
        c = self.config
        proj = name.rsplit(".", 2)[-2] if ".self_attn." in name and name.endswith((".weight", ".bias")) else None
        if c.rotary == c.head_dim or proj not in _ROTARY_PROJ:
            return w
        rows, idx = (w.data if isinstance(w, QPart) else w), self._rotary_index(proj)
        if rows.shape[0] != idx.numel():  # load_weights names the shape mismatch
            return w
        rows = rows.index_select(0, idx)
        return QPart(w.qtype, rows, w.k) if isinstance(w, QPart) else rows

    def _rotary_index(self, proj: str) -> torch.Tensor:
        """The rows of `proj` (one of _ROTARY_PROJ) in the order RoPE runs in: each head's
        partial_rotary_order; a fused qkv's v rows as they are."""
        c, d = self.config, self.config.head_dim
        per = partial_rotary_order(d, c.rotary)
        if proj in ("q_norm", "k_norm"):
            return per

        def heads(n: int, first: int = 0) -> torch.Tensor:
            return (first + torch.arange(n)[:, None] * d + per).flatten()

        if proj != "qkv_proj":
            return heads(c.num_heads if proj == "q_proj" else c.num_kv_heads)
        q, kv = c.num_heads * d, c.num_kv_heads * d
        return torch.cat([heads(c.num_heads), heads(c.num_kv_heads, q), torch.arange(q + kv, q + 2 * kv)])

    def _attach_quantized(self, pending: dict[int, tuple[Any, dict[int, QPart]]]) -> None:
        """Build each QWeight from its parts (all present, in row order). Its blocks are also
        registered as uint8 parameters (`qpart0`, ...), so that everything that walks the
        parameters (weight digests, byte counts, state_dict) sees the quantized weights."""
        for owner, parts in pending.values():
            k = next(iter(parts.values())).shape[1]
            qw = QWeight(k, [(parts[i].qtype, parts[i].data) for i in sorted(parts)])
            module, prefix = (self, f"{owner}_") if isinstance(owner, str) else (owner, "")
            for i, (_, data) in enumerate(qw.parts):
                module.register_parameter(f"{prefix}qpart{i}", nn.Parameter(data, requires_grad=False))
            if owner == "embed":
                self.embed_q = qw
                if self.config.tie_word_embeddings:
                    self.lm_head_q = qw
            elif owner == "lm_head":
                self.lm_head_q = qw
            else:
                owner.q = qw

    def _quant_slots(self) -> dict[str, tuple[Any, int, int, int]]:
        """HF name -> (owner: a Linear, "embed" or "lm_head"; part index; rows; K)."""
        c = self.config
        s: dict[str, tuple[Any, int, int, int]] = {
            "model.embed_tokens.weight": ("embed", 0, c.vocab_size, c.hidden_size)
        }
        if not c.tie_word_embeddings:
            s["lm_head.weight"] = ("lm_head", 0, c.vocab_size, c.hidden_size)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            q, kv, n = layer.q_size, layer.kv_size, c.intermediate_size
            qkv, gu = layer.qkv_proj, layer.gate_up_proj
            if c.fused_projections:  # Phi-3: one stored matrix each
                s[p + "self_attn.qkv_proj.weight"] = (qkv, 0, q + 2 * kv, qkv.n_in)
                s[p + "mlp.gate_up_proj.weight"] = (gu, 0, 2 * n, gu.n_in)
            else:
                s[p + "self_attn.q_proj.weight"] = (qkv, 0, q, qkv.n_in)
                s[p + "self_attn.k_proj.weight"] = (qkv, 1, kv, qkv.n_in)
                s[p + "self_attn.v_proj.weight"] = (qkv, 2, kv, qkv.n_in)
                s[p + "mlp.gate_proj.weight"] = (gu, 0, n, gu.n_in)
                s[p + "mlp.up_proj.weight"] = (gu, 1, n, gu.n_in)
            s[p + "self_attn.o_proj.weight"] = (layer.o_proj, 0, layer.o_proj.n_out, layer.o_proj.n_in)
            s[p + "mlp.down_proj.weight"] = (layer.down_proj, 0, layer.down_proj.n_out, layer.down_proj.n_in)
        return s

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        """HF weight name -> the (view of the) parameter it fills (float weights only)."""
        t: dict[str, torch.Tensor] = {"model.norm.weight": self.norm.data}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            t[p + "input_layernorm.weight"] = layer.input_norm.data
            if layer.attn_out_norm is not None:  # Gemma's names: post_attention = after attention
                t[p + "post_attention_layernorm.weight"] = layer.attn_out_norm.data
                t[p + "pre_feedforward_layernorm.weight"] = layer.post_attention_norm.data
                t[p + "post_feedforward_layernorm.weight"] = layer.mlp_out_norm.data
            else:
                t[p + "post_attention_layernorm.weight"] = layer.post_attention_norm.data
            if layer.q_norm is not None:
                t[p + "self_attn.q_norm.weight"] = layer.q_norm.data
                t[p + "self_attn.k_norm.weight"] = layer.k_norm.data
            if layer.qkv_proj.bias is not None:
                q, kv = layer.q_size, layer.kv_size
                for proj, (a, b) in {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}.items():
                    t[p + f"self_attn.{proj}.bias"] = layer.qkv_proj.bias.data[a:b]
        if self.quantized:
            return t
        t["model.embed_tokens.weight"] = self.embedding_weight().data
        if not self.config.tie_word_embeddings:
            t["lm_head.weight"] = self.lm_head_t.data.t()
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            q, kv = layer.q_size, layer.kv_size
            t[p + "self_attn.o_proj.weight"] = layer.o_proj.weight.data
            t[p + "mlp.down_proj.weight"] = layer.down_proj.weight.data
            if self.config.fused_projections:  # Phi-3: the stored matrices are ours as is
                t[p + "self_attn.qkv_proj.weight"] = layer.qkv_proj.weight.data
                t[p + "mlp.gate_up_proj.weight"] = layer.gate_up_proj.weight.data
                continue
            parts = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
            for proj, (a, b) in parts.items():
                t[p + f"self_attn.{proj}.weight"] = layer.qkv_proj.weight.data[a:b]
            n = self.config.intermediate_size
            t[p + "mlp.gate_proj.weight"] = layer.gate_up_proj.weight.data[:n]
            t[p + "mlp.up_proj.weight"] = layer.gate_up_proj.weight.data[n:]
        return t
