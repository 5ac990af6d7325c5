"""The Triton attention backend: launches triton_kernels.py over one layer's paged cache.

Importing this module never imports triton: `available()` says whether it can run, and the
kernels module is imported on first use. On CUDA tensors the kernels are compiled; on CPU tensors
they run under Triton's interpreter (slow, exact: what CI tests against the torch path).

Per step, `TritonStep.build(meta, ...)` makes once what every layer shares (the prefill
sequences' start/length/context tensors, the decode split count and its scratch), so a layer's
attention is three launches (write, prefill, decode + reduce) and no host-device sync.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch

from pagedkv.cache.quant import QMAX, is_quantized
from pagedkv.errors import StorageMismatchError

__all__ = ["available", "TritonStep", "Tiles", "write_kv", "decode", "prefill", "decode_splits"]

BLOCK_T = 16  # tokens per program of the KV write
MAX_SPLITS = 32


@dataclass(frozen=True, slots=True)
class Tiles:
    """Tile sizes of one launch. The interpreter's time goes by tiles and programs, so on the
    CPU they are small; on a GPU, decode streams 64 positions a tile (32 for heads over 128)
    and prefill takes 64 query rows x 32 keys (32 x 32 for heads over 128: the float32
    accumulator is rows x D registers); a prefill program's rows are 64 / G tokens x the G
    query heads of one kv head (G over 64: one token x G)."""

    decode_n: int  # key positions per decode tile
    prefill_m: int  # query rows (tokens x the kv head's G query heads) per prefill program
    prefill_n: int  # key positions per prefill tile


CPU_TILES = Tiles(16, 16, 16)


def tiles_for(device: torch.device, head_dim: int) -> Tiles:
    if device.type == "cpu":
        return CPU_TILES
    return Tiles(64, 64, 32) if head_dim <= 128 else Tiles(32, 32, 32)


def _block_d(d: int) -> int:
    return max(16, _pow2(d))  # tl.dot needs K >= 16


@functools.cache
def available() -> bool:
    """Whether triton is installed (the kernels can be launched on CPU tensors through the
    interpreter, and on CUDA tensors when a GPU is present); never imports it."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: a module entry without a spec (blocked)
        return False


@functools.cache
def _k():
    from pagedkv.attention import triton_kernels

    return triton_kernels


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _f32_dot(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """tl.dot in float32 (IEEE) unless q and the cache are the same 16-bit dtype (bfloat16
    only compiled: the interpreter's tl.dot misreads bfloat16 operands, so it gets float32)."""
    if q.dtype != cache.dtype:
        return True
    return not (q.dtype == torch.float16 or q.dtype == torch.bfloat16 and q.device.type != "cpu")


def write_kv(k_cache, v_cache, slot_mapping, k, v, k_scale=None, v_scale=None) -> None:
    """k/v [T, H, D] at slot_mapping [T] (-1 skipped) into [N, bs, H, D] caches, one launch;
    int8/fp8 caches quantize per (token, head) into k_scale/v_scale [N, bs, H]."""
    t, h, d = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    quant = is_quantized(k_cache.dtype)
    qmax = QMAX.get(k_cache.dtype, 1.0)
    _k().write_kv_kernel.launch(
        (triton_cdiv(t, BLOCK_T), h), k.device.type == "cpu",
        k, v, slot_mapping, k_cache, v_cache,
        k_scale if quant else k_cache, v_scale if quant else v_cache,
        t, h, d, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        QUANT=quant, IS_INT8=k_cache.dtype == torch.int8, QMAX=float(qmax),
        BLOCK_T=BLOCK_T, BLOCK_D=_pow2(d),
    )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_splits(batch: int, num_kv_heads: int, max_len: int, programs: int,
                  tile: int = 64) -> int:
    """Splits of each sequence's positions: enough programs to fill `programs` (the GPU's
    streaming multiprocessors x 2), never a split shorter than 4 tiles, at most MAX_SPLITS."""
    want = triton_cdiv(programs, max(1, batch * num_kv_heads))
    most = max(1, triton_cdiv(max_len, 4 * tile))
    return max(1, min(want, most, MAX_SPLITS))


def _scratch(b: int, hq: int, d: int, splits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partials (mid_o [B, Hq, S, D], mid_lse [B, Hq, S]) float32; one split needs none
    (the decode kernel writes the output): 1-element stand-ins."""
    if splits == 1:
        one = torch.empty(1, dtype=torch.float32, device=device)
        return one, one
    return (torch.empty((b, hq, splits, d), dtype=torch.float32, device=device),
            torch.empty((b, hq, splits), dtype=torch.float32, device=device))


def decode(q, k_cache, v_cache, block_tables, seq_lens, scale, *, out, splits=1,
           k_scale=None, v_scale=None, window=0, softcap=0.0, scratch=None, tiles=None) -> torch.Tensor:
    """One query per sequence: q [B, Hq, D] over [N, bs, Hkv, D] caches; out [B, Hq, D].
    `splits` partitions each sequence's positions (split-K); `scratch`: (mid_o [B, Hq, S, D],
    mid_lse [B, Hq, S]) float32, reused across layers."""
    b, hq, d = q.shape
    if b == 0:
        return out
    _, bs, hkv, _ = k_cache.shape
    g = hq // hkv
    if hq != g * hkv:
        raise StorageMismatchError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    tiles = tiles or tiles_for(q.device, d)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if scratch is None:
        scratch = _scratch(b, hq, d, splits, q.device)
    mid_o, mid_lse = scratch
    quant = is_quantized(k_cache.dtype)
    cpu = q.device.type == "cpu"
    kern = _k()
    kern.decode_kernel.launch(
        (b, hkv, splits), cpu,
        q, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache,
        block_tables, seq_lens, mid_o, mid_lse, out,
        float(scale), int(window), float(softcap), q.stride(0), q.stride(1), block_tables.stride(0),
        block_tables.shape[1], out.stride(0), out.stride(1), g, d, splits, BS=bs, HKV=hkv,
        ONE_SPLIT=splits == 1, QUANT=quant,
        F32_DOT=quant or _f32_dot(q, k_cache),
        BLOCK_G=max(16, _pow2(g)), BLOCK_N=tiles.decode_n, BLOCK_D=_block_d(d),
    )
    if splits == 1:
        return out  # the decode kernel wrote it
    kern.decode_reduce_kernel.launch(
        (b, hq), cpu, mid_o, mid_lse, out, out.stride(0), out.stride(1), hq, d,
        splits, BLOCK_S=_pow2(splits), BLOCK_D=_block_d(d),
    )
    return out


def prefill(q, k, v, k_cache, v_cache, block_tables, q_starts, q_lens, ctx_lens, max_q_len,
            scale, *, out, k_scale=None, v_scale=None, window=0, softcap=0.0, tiles=None) -> torch.Tensor:
    """Causal prefill of S sequences concatenated in q [P, Hq, D] / k, v [P, Hkv, D]: sequence
    i's tokens q_starts[i] .. + q_lens[i] see its ctx_lens[i] cached tokens (block_tables[i])
    and the chunk's own tokens up to themselves (int32 device tensors [S]); out [P, Hq, D]."""
    s = int(q_lens.shape[0])
    if s == 0 or max_q_len == 0:
        return out
    _, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    quant = is_quantized(k_cache.dtype)
    tiles = tiles or tiles_for(q.device, d)
    g = hq // hkv
    if hq != g * hkv:
        raise StorageMismatchError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    block_g = _pow2(g)
    block_m = max(1, tiles.prefill_m // block_g)  # rows = tokens x heads: prefill_m (or G)
    _k().prefill_kernel.launch(
        (triton_cdiv(max_q_len, block_m), hkv, s), q.device.type == "cpu",
        q, k, v, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache,
        out, block_tables, q_starts, q_lens, ctx_lens, float(scale), int(window), float(softcap),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), g, d,
        BS=bs, HKV=hkv, QUANT=quant, F32_DOT=_f32_dot(q, q),
        BLOCK_M=block_m, BLOCK_G=block_g, BLOCK_N=tiles.prefill_n, BLOCK_D=_block_d(d),
    )
    return out


@dataclass(slots=True)
class TritonStep:
    """What every layer of one step shares: prefill index tensors and the decode split-K plan."""

    slot_mapping: torch.Tensor  # [T] on the device (-1: skipped by the write kernel)
    q_starts: torch.Tensor  # [S] int32
    q_lens: torch.Tensor  # [S] int32
    ctx_lens: torch.Tensor  # [S] int32
    max_q_len: int
    prefill_tables: torch.Tensor  # [S, max_blocks] int32 (a [S, 1] zero table when no context)
    decode_tables: torch.Tensor  # [B, max_blocks] int32
    decode_lens: torch.Tensor  # [B] int32
    splits: int
    scratch: tuple[torch.Tensor, torch.Tensor] | None

    @classmethod
    def build(cls, meta, q: torch.Tensor, num_kv_heads: int) -> TritonStep:
        dev = q.device
        qlens = list(meta.prefill_query_lens)
        starts = [0]
        for n in qlens[:-1]:
            starts.append(starts[-1] + n)
        i32 = functools.partial(torch.tensor, dtype=torch.int32, device=dev)
        s = len(qlens)
        ptab = meta.prefill_block_tables
        if ptab.shape[0] != s:  # no prefill has context: a zero table no program reads
            ptab = torch.zeros((s, 1), dtype=torch.int32)
        ptab = ptab.to(device=dev, dtype=torch.int32).contiguous()
        dtab = meta.decode_block_tables.to(device=dev, dtype=torch.int32).contiguous()
        dlens = meta.decode_seq_lens.to(device=dev, dtype=torch.int32).contiguous()
        b, hq, d = meta.num_decodes, q.shape[1], q.shape[2]
        splits, scratch = 1, None
        if b:
            sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
            splits = decode_splits(b, num_kv_heads, meta.max_decode_seq_len or 1, 2 * sms,
                                   tiles_for(dev, d).decode_n)
            scratch = _scratch(b, hq, d, splits, dev)
        slots = meta.slot_mapping.to(dev)
        return cls(slots, i32(starts) if s else i32([]), i32(qlens), i32(list(meta.prefill_context_lens)),
                   max(qlens, default=0), ptab, dtab, dlens, splits, scratch)
