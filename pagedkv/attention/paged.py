"""Attention over the paged KV cache: write the step's new K/V, then prefill + decode attention.

Shapes (T new tokens this step, prefills first, then one token per decode sequence):
    q [T, Hq, D], k/v [T, Hkv, D], k_cache/v_cache [num_blocks, block_size, Hkv, D]
Hq is a multiple of Hkv; query head h reads kv head h // (Hq // Hkv) (GQA/MQA).
Quantized caches (int8, fp8_e4m3) come with k_scale/v_scale [num_blocks, block_size, Hkv] float32
(one scale per token and kv head, see cache/quant.py); every reader dequantizes only what it
reads: the kernel row by row in registers, prefill the gathered blocks, the fallback one chunk.

Prefill uses torch's scaled_dot_product_attention per sequence (a few per step). Decode, the hot
path (every layer, every step), uses the compiled CPU kernel in paged_decode.cpp, which reads the
cache block by block; on other devices, or when the kernel cannot be built, a pure-torch
fallback runs instead. Softmax is computed in float32 for every input dtype.

Sliding-window layers (`window` > 0 tokens) use the same paths with a band mask: a token at
position p attends to positions p - window < j <= p (transformers' and vLLM's convention). Prefill
gathers only the blocks the band reaches, decode starts at the window's first position, so
blocks wholly before it are never read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedkv.attention import kernel as _kernel
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.cache.quant import QUANT_DTYPES, is_quantized
from pagedkv.cache.storage import LayerKV, gather_blocks, write_layer
from pagedkv.errors import StorageMismatchError

__all__ = [
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "decode_backend",
]

# enable_gqa arrived in torch 2.5; before that the kv heads are expanded explicitly.
_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")

# Tokens per step of the pure-torch decode fallback: bounds the per-chunk gather to
# B * CHUNK * Hkv * D elements while keeping the number of python-level steps small.
_FALLBACK_CHUNK_TOKENS = 512


@dataclass(slots=True)
class AttentionPlan:
    """What paged_attention decides once per step, from the metadata and the first layer's
    inputs: token counts (checked against q/k), the slot check, the scales check and the decode
    backend. Valid for every layer whose q and cache have the dtypes it was built for (all the
    layers of one KVStorage); a call with other dtypes, or after set_use_kernel, rebuilds it."""

    num_tokens: int
    num_prefill: int  # prefill tokens
    num_decodes: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    use_kernel: bool  # CONFIG.use_kernel when built
    kernel: bool  # decode through the compiled op (cache contiguity is still checked per layer)
    block_tables: torch.Tensor  # decode block tables, int32 contiguous when `kernel`
    seq_lens: torch.Tensor  # decode seq lens, int32 contiguous when `kernel`
    op: object | None  # the decode op's builtin when `kernel`
    triton: object | None = None  # triton_backend.TritonStep when the triton backend runs the step
    # a pure-decode step over a float cache (`kernel`, no prefill, int64 slots): the op that
    # writes the new K/V and attends in one call (write_decode), else None
    write_op: object | None = None

    def fits(self, q: torch.Tensor, cache: LayerKV) -> bool:
        return (
            q.dtype == self.q_dtype
            and cache.k.dtype == self.kv_dtype
            and _kernel.CONFIG.use_kernel == self.use_kernel
        )


def attention_plan(q: torch.Tensor, k: torch.Tensor, cache: LayerKV, meta: AttentionMetadata) -> AttentionPlan:
    """What a step's attention does, decided once from its first layer's q, k and cache (meta.plan:
    paged_attention, and LlamaModel._decode_plan before the layers run in one op).
    StorageMismatchError where the metadata does not describe q and k."""
    num_tokens = q.shape[0]
    num_prefill = meta.num_prefill_tokens
    if num_prefill + meta.num_decodes != num_tokens or k.shape[0] != num_tokens:
        raise StorageMismatchError(
            f"metadata describes {num_prefill} prefill + {meta.num_decodes} decode tokens, "
            f"but q has {num_tokens} and k {k.shape[0]}"
        )
    if num_tokens:
        _check_scales(cache.k, cache.v, cache.k_scale, cache.v_scale)
    if use_triton(meta.backend, q.device):  # (the write kernel skips -1 slots itself)
        from pagedkv.attention.triton_backend import TritonStep

        step = TritonStep.build(meta, q, cache.k.shape[2])
        return AttentionPlan(num_tokens, num_prefill, meta.num_decodes, q.dtype, cache.k.dtype,
                             _kernel.CONFIG.use_kernel, False, step.decode_tables,
                             step.decode_lens, None, step)
    if num_tokens and meta.has_skips is None:  # one device sync per step, not one per layer
        meta.has_skips = bool((meta.slot_mapping < 0).any())
    out = q[:0]  # dtype/device/contiguity stand-in for the fresh output
    kernel = meta.num_decodes > 0 and _use_kernel(q, cache.k, cache.v, out, cache.k_scale)
    tables, lens, op = meta.decode_block_tables, meta.decode_seq_lens, None
    if kernel:
        op = _kernel.decode_op()
        op = getattr(op, "_op", op)  # the builtin OpOverload.__call__ forwards to
        if tables.dtype != torch.int32 or not tables.is_contiguous():
            tables = tables.to(torch.int32).contiguous()
        if lens.dtype != torch.int32 or not lens.is_contiguous():
            lens = lens.to(torch.int32).contiguous()
    # (float32 K/V into a 16-bit cache: write_decode rounds them as the indexed copy does)
    same = k.dtype == cache.k.dtype or (k.dtype == torch.float32 and cache.k.dtype in (torch.float16, torch.bfloat16))
    fused = (kernel and not num_prefill and cache.k_scale is None and same
             and meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.is_contiguous())
    return AttentionPlan(num_tokens, num_prefill, meta.num_decodes, q.dtype, cache.k.dtype,
                         _kernel.CONFIG.use_kernel, kernel, tables, lens, op,
                         write_op=_kernel.write_decode_op() if fused else None)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerKV,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Write k/v at meta.slot_mapping, then attend; returns [T, Hq, D] in q's dtype.

    q [T, Hq, D]; k, v [T, Hkv, D]; `cache` one layer's views (KVStorage.layer(i)). The
    metadata's checks and the decode backend are decided by the first layer (meta.plan).
    `out`: a contiguous [T, Hq, D] tensor of q's dtype to write into (the model reuses one per
    step across its layers); None: a new one. `window`: the layer's sliding window in tokens
    (0: the whole context). `softcap` > 0: every score s (q.k times scale) becomes
    softcap * tanh(s / softcap) before the softmax (Gemma 2); 0: none.
    """
    plan = meta.plan
    if plan is None or not plan.fits(q, cache):
        plan = meta.plan = attention_plan(q, k, cache, meta)
    num_tokens, num_prefill = plan.num_tokens, plan.num_prefill
    if q.shape[0] != num_tokens or k.shape[0] != num_tokens:
        raise StorageMismatchError(
            f"metadata describes {num_tokens} tokens, but q has {q.shape[0]} and k {k.shape[0]}"
        )
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D], contiguous
    if plan.triton is not None:
        return _triton_attention(q, k, v, cache, plan, scale, out, window, softcap)
    if plan.write_op is not None and cache.k.is_contiguous() and cache.v.is_contiguous():
        plan.write_op(q if q.stride(-1) == 1 else q.contiguous(), k, v, meta.slot_mapping, cache.k,
                      cache.v, plan.block_tables, plan.seq_lens, float(scale), out, window, softcap)
        return out
    if num_tokens:
        write_layer(cache, meta.slot_mapping, k, v, skips=meta.has_skips)
    if num_prefill:
        paged_prefill_attention(
            q[:num_prefill],
            k[:num_prefill],
            v[:num_prefill],
            cache.k,
            cache.v,
            meta.prefill_query_lens,
            meta.prefill_context_lens,
            meta.prefill_block_tables,
            scale,
            out=out[:num_prefill],
            k_scale=cache.k_scale,
            v_scale=cache.v_scale,
            window=window,
            softcap=softcap,
        )
    if plan.num_decodes:
        qd = q[num_prefill:] if num_prefill else q  # no view op on a pure-decode step
        od = out[num_prefill:] if num_prefill else out
        if plan.kernel and cache.k.is_contiguous() and cache.v.is_contiguous():
            if qd.stride(-1) != 1:
                qd = qd.contiguous()
            plan.op(qd, cache.k, cache.v, plan.block_tables, plan.seq_lens, float(scale),
                    od, cache.k_scale, cache.v_scale, window, softcap)
        else:
            paged_decode_attention(
                qd,
                cache.k,
                cache.v,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                scale,
                max_seq_len=meta.max_decode_seq_len or None,
                out=od,
                k_scale=cache.k_scale,
                v_scale=cache.v_scale,
                window=window,
                softcap=softcap,
            )
    return out


def use_triton(backend: str, device: torch.device) -> bool:
    """Whether a step on `device` with metadata backend `backend` runs the triton kernels."""
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    from pagedkv.attention import triton_backend

    return device.type == "cuda" and triton_backend.available()


def _triton_attention(q, k, v, cache: LayerKV, plan: AttentionPlan, scale: float,
                      out: torch.Tensor, window: int, softcap: float) -> torch.Tensor:
    """One layer through the triton kernels: the KV write (one launch), prefill, decode."""
    from pagedkv.attention import triton_backend as tb

    step, p = plan.triton, plan.num_prefill
    if plan.num_tokens:
        tb.write_kv(cache.k, cache.v, step.slot_mapping, k, v, cache.k_scale, cache.v_scale)
    if p:
        tb.prefill(q[:p], k[:p], v[:p], cache.k, cache.v, step.prefill_tables, step.q_starts,
                   step.q_lens, step.ctx_lens, step.max_q_len, scale, out=out[:p],
                   k_scale=cache.k_scale, v_scale=cache.v_scale, window=window, softcap=softcap)
    if plan.num_decodes:
        tb.decode(q[p:], cache.k, cache.v, step.decode_tables, step.decode_lens, scale,
                  out=out[p:], splits=step.splits, k_scale=cache.k_scale, v_scale=cache.v_scale,
                  window=window, softcap=softcap, scratch=step.scratch)
    return out


# --- prefill ----------------------------------------------------------------------------------


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    softcap: float = 0.0,
) -> torch.Tensor:
    """SDPA on [n, Hq, D] / [L, Hkv, D] token-major tensors; returns [n, Hq, D] float32-softmaxed.
    `softcap` > 0: soft-capped scores (_softcapped, which SDPA has no option for)."""
    if softcap:
        return _softcapped(q, k, v, scale, softcap, mask, causal)
    out_dtype = q.dtype
    if q.device.type == "cpu" and q.dtype != torch.float32:
        # CPU kernels do not all keep the softmax in float32 for half types; upcasting the
        # prefill operands is O(L * D), small next to the O(n * L * D) attention.
        q, k, v = q.float(), k.float(), v.float()
    hq, hkv = q.shape[1], k.shape[1]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # head-major views
    kwargs: dict[str, object] = {}
    if hq != hkv:
        if _SDPA_HAS_GQA:
            kwargs["enable_gqa"] = True
        else:
            kh = kh.repeat_interleave(hq // hkv, dim=0)
            vh = vh.repeat_interleave(hq // hkv, dim=0)
    o = F.scaled_dot_product_attention(
        qh.unsqueeze(0),
        kh.unsqueeze(0),
        vh.unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        **kwargs,
    )  # [1, Hq, n, D]
    return o[0].transpose(0, 1).to(out_dtype)


_SOFTCAP_ROWS = 256  # query rows per pass: [Hq, 256, L] float32 scores at a time


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cap: float,
                mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """Attention with soft-capped scores, cap * tanh(scale * q.k / cap), in float32, as
    transformers' eager Gemma 2 computes it; [n, Hq, D] / [L, Hkv, D] -> [n, Hq, D]. Queries go
    _SOFTCAP_ROWS at a time, so the scores never take [Hq, n, L] at once. `causal`: query j
    sees keys <= j + L - n."""
    n, hq, d = q.shape
    kh, vh = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [Hkv, L, D]
    g, L = hq // kh.shape[0], kh.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for a in range(0, n, _SOFTCAP_ROWS):
        b = min(n, a + _SOFTCAP_ROWS)
        qh = q[a:b].float().transpose(0, 1).reshape(kh.shape[0], g * (b - a), d)  # [Hkv, G*r, D]
        s = torch.bmm(qh, kh.transpose(1, 2)).mul_(scale / cap).tanh_().mul_(cap)  # [Hkv, G*r, L]
        s = s.view(kh.shape[0], g, b - a, L)
        if causal:
            keep = torch.arange(L, device=q.device) <= torch.arange(a, b, device=q.device)[:, None] + L - n
        else:
            keep = mask[a:b]
        s = s.masked_fill(~keep, -math.inf).softmax(-1).view(kh.shape[0], g * (b - a), L)
        o = torch.bmm(s, vh).view(hq, b - a, d)  # [Hq, r, D]
        out[a:b] = o.transpose(0, 1).to(q.dtype)
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention for prefill sequences whose new tokens are concatenated in q/k/v.

    q [P, Hq, D], k/v [P, Hkv, D] with P = sum(query_lens); block_tables [S, max_blocks] int32.
    New token j of sequence i sees the sequence's context_lens[i] cached tokens (read from
    k_cache/v_cache [N, bs, Hkv, D] through block_tables[i]) and new tokens 0..j. The new tokens'
    K/V are taken from k/v, not from the cache, so this does not depend on them being written.
    Quantized caches (k_scale/v_scale [N, bs, Hkv] given) are dequantized block by gathered block.
    `window` > 0: a band mask (query at p sees keys p - window < j <= p), and only the blocks
    the band reaches are gathered. `softcap` > 0: soft-capped scores (see paged_attention).
    Returns [P, Hq, D] (written into `out` when given).
    """
    _check_scales(k_cache, v_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    bs = k_cache.shape[1]
    start = 0
    for i, (n, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        n, ctx = int(n), int(ctx)
        if n == 0:
            continue
        qi, ki, vi = q[start : start + n], k[start : start + n], v[start : start + n]
        # the first cached block the band reaches (query 0, at ctx, sees keys > ctx - window)
        b0 = max(0, ctx - window + 1) // bs if window else 0
        if ctx == 0 and (not window or n <= window):
            # fresh prompt within the window: its K/V are exactly the new contiguous slices
            out[start : start + n] = _sdpa(qi, ki, vi, scale, causal=True, softcap=softcap)
        elif ctx <= b0 * bs:
            # no cached token is in reach: the new tokens alone, under the band
            out[start : start + n] = _sdpa(qi, ki, vi, scale, mask=_band(n, ctx, ctx, window, q.device),
                                           softcap=softcap)
        else:
            # prefix-cache hit or a later chunk: gather the cached context by whole blocks
            nb = -(-ctx // bs)
            ids = block_tables[i, b0:nb].to(device=k_cache.device, dtype=torch.int64)
            first = b0 * bs
            kc = gather_blocks(k_cache, k_scale, ids, ctx - first, q.dtype)  # [ctx - first, Hkv, D]
            vc = gather_blocks(v_cache, v_scale, ids, ctx - first, q.dtype)
            # the chunk's own K/V join at full precision (they are not read back from the cache)
            kk = torch.cat([kc.to(ki.dtype), ki])  # [ctx - first + n, Hkv, D]
            vv = torch.cat([vc.to(vi.dtype), vi])
            out[start : start + n] = _sdpa(qi, kk, vv, scale, mask=_band(n, ctx, first, window, q.device),
                                           softcap=softcap)
        start += n
    return out


def _band(n: int, ctx: int, first: int, window: int, device: torch.device) -> torch.Tensor:
    """[n, ctx - first + n] bool: query j (position ctx + j) sees key i (position first + i)
    when it is not in the future and, with a window, within the last `window` positions."""
    qpos = torch.arange(n, device=device).unsqueeze(1) + ctx
    kpos = torch.arange(first, ctx + n, device=device).unsqueeze(0)
    mask = kpos <= qpos
    return mask & (kpos > qpos - window) if window else mask


# --- decode -----------------------------------------------------------------------------------


def decode_backend(device: torch.device | str = "cpu") -> str:
    """Which decode implementation a call on `device` uses now: "kernel" or "torch"."""
    if torch.device(device).type != "cpu" or not _kernel.CONFIG.use_kernel:
        return "torch"
    return "kernel" if _kernel.load_kernel() else "torch"


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query token per sequence over its paged K/V; returns [B, Hq, D] in q's dtype.

    q [B, Hq, D]; k_cache/v_cache [N, bs, Hkv, D]; block_tables [B, max_blocks] int32;
    seq_lens [B] int32 (tokens to attend, the new one included, already written).
    `max_seq_len` (optional, >= max(seq_lens)) spares the fallback a device sync.
    Quantized caches (int8/fp8) need k_scale/v_scale [N, bs, Hkv] float32. `window` > 0: only
    the last `window` positions are attended (and read). `softcap` > 0: soft-capped scores.

    On CPU this runs the compiled kernel, which reads K/V in place through the block table.
    The pure-torch fallback (other devices, PAGEDKV_NO_KERNEL=1, or no compiler) gathers the
    blocks of a chunk of ~512 positions for the whole batch at a time and merges chunks with an
    online softmax, so it never materializes a full sequence either.
    """
    _check_scales(k_cache, v_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    if _use_kernel(q, k_cache, v_cache, out, k_scale):
        if block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
            block_tables = block_tables.to(torch.int32).contiguous()
        if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
            seq_lens = seq_lens.to(torch.int32).contiguous()
        if q.stride(-1) != 1:
            q = q.contiguous()
        _kernel.decode_op()(
            q, k_cache, v_cache, block_tables, seq_lens, float(scale), out, k_scale, v_scale, window,
            float(softcap),
        )
        return out
    out.copy_(
        _decode_torch(
            q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, k_scale, v_scale,
            window, softcap,
        )
    )
    return out


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KERNEL_DTYPES = (*_FLOAT_DTYPES, *QUANT_DTYPES.values())


def _check_scales(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    quant = is_quantized(k_cache.dtype)
    if quant != (k_scale is not None) or quant != (v_scale is not None):
        raise StorageMismatchError(
            f"a {k_cache.dtype} cache needs {'both' if quant else 'no'} k_scale/v_scale"
        )
    if v_cache.dtype != k_cache.dtype:
        raise StorageMismatchError(f"k_cache {k_cache.dtype} != v_cache {v_cache.dtype}")
    if quant and (
        k_scale.shape != k_cache.shape[:-1]
        or v_scale.shape != v_cache.shape[:-1]
        or k_scale.dtype != torch.float32
        or v_scale.dtype != torch.float32
    ):
        raise StorageMismatchError("k_scale/v_scale must be float32 [N, block_size, Hkv]")


def _use_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    k_scale: torch.Tensor | None,
) -> bool:
    # Cheapest tests first: this runs for every layer of every decode step.
    if not (q.is_cpu and k_cache.is_cpu and _kernel.CONFIG.use_kernel):
        return False
    return (
        q.dtype in _FLOAT_DTYPES
        and k_cache.dtype in _KERNEL_DTYPES
        and (k_scale is None or k_scale.is_contiguous())
        # a non-contiguous cache would need a full copy first, defeating the point
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and out.is_contiguous()
        and _kernel.load_kernel()
    )


def _decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Pure-torch paged decode: per-chunk block gather + float32 online softmax (any device).
    Quantized chunks are dequantized right after their gather. With a window, chunks start at
    the earliest window start of the batch and positions before a row's start are masked."""
    b, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    g = hq // hkv
    dev = k_cache.device
    lens = seq_lens.to(device=dev, dtype=torch.int64).view(b, 1)  # [B, 1]
    max_len = int(lens.max()) if max_seq_len is None else int(max_seq_len)
    tables = block_tables.to(device=dev, dtype=torch.int64)
    qf = q.to(device=dev, dtype=torch.float32).reshape(b, hkv, g, d) * scale  # [B, Hkv, G, D]
    m = torch.full((b, hkv, g, 1), -math.inf, device=dev)  # running max
    l_sum = torch.zeros((b, hkv, g, 1), device=dev)  # running softmax denominator
    acc = torch.zeros((b, hkv, g, d), device=dev)  # running un-normalized output
    step = max(1, _FALLBACK_CHUNK_TOKENS // bs)  # blocks per chunk
    starts = (lens - window).clamp_min(0) if window else None  # [B, 1] first attended position
    first_block = int(starts.min()) // bs if window else 0
    for j0 in range(first_block, -(-max_len // bs), step):
        ids = tables[:, j0 : j0 + step].clamp_min(0)  # [B, c] (entries before a window: any id)
        c = ids.shape[1]
        # gather only this chunk's blocks: [B, c, bs, Hkv, D] -> [B, Hkv, c*bs, D]
        kc = k_cache[ids].reshape(b, c * bs, hkv, d).float()
        vc = v_cache[ids].reshape(b, c * bs, hkv, d).float()
        if k_scale is not None:
            kc = kc * k_scale[ids].reshape(b, c * bs, hkv, 1)
            vc = vc * v_scale[ids].reshape(b, c * bs, hkv, 1)
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
        s = torch.matmul(qf, kc.transpose(-1, -2))  # [B, Hkv, G, c*bs]
        if softcap:
            s = s.div_(softcap).tanh_().mul_(softcap)
        pos = torch.arange(j0 * bs, (j0 + c) * bs, device=dev)
        hidden = pos.unsqueeze(0) >= lens
        if starts is not None:
            hidden |= pos.unsqueeze(0) < starts
        s = s.masked_fill(hidden[:, None, None, :], -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        # rows with nothing visible yet keep m = -inf; subtract 0 there to avoid inf - inf
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe)
        l_sum = l_sum * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, vc)
        m = m_new
    out = torch.where(l_sum > 0, acc / l_sum.clamp_min(1e-30), torch.zeros_like(acc))
    return out.reshape(b, hq, d).to(device=q.device, dtype=q.dtype)
