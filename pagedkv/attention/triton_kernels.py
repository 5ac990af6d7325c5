"""Triton kernels over the paged KV layout of cache/storage.py (imports triton: see triton_backend).

Layout (one layer): k/v cache [N, bs, Hkv, D] contiguous, slot = block * bs + offset; int8 /
fp8_e4m3 caches add k/v scales [N, bs, Hkv] float32, one per (token, kv head), value = q * s.
Every kernel reads a position p of a sequence through its block table: block table[p // bs],
row p % bs. Softmax and accumulation are float32 for every dtype.

- `write_kv_kernel`: the step's new K/V at the slot mapping (-1: skipped), quantizing per
  (token, head) exactly as cache/quant.py does (amax / QMAX, round half to even / fp8 cast).
- `decode_kernel` + `decode_reduce_kernel`: one query token per sequence, split-K: program
  (b, kv head, split) handles one contiguous range of the sequence's positions for all the
  query heads of that kv head (GQA grouped, padded to 16 rows for tl.dot) and writes a partial
  output and its log-sum-exp; the reduce merges the splits.
- `prefill_kernel`: a tile of BLOCK_M new tokens of one prefill sequence and all the query
  heads of one kv head (GQA grouped, as decode: BLOCK_M x BLOCK_G rows, one K/V load per tile
  for the group); first the cached context (positions < ctx, through the block table;
  dequantized in registers), then the chunk's own K/V from the k/v inputs (full precision, as
  the torch path), causal, and with a sliding window the band p - window < j <= p (tiles
  wholly outside it are skipped). Both loops run the one online-softmax step `_attend_tile`.

Each function is plain Python decorated by `kernel`, which gives a compiled `JITFunction` for
device tensors and Triton's interpreter for CPU tensors (tests run the same source on the CPU).
"""

from __future__ import annotations

import sys
import threading

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


class _Interpreted:
    """While interpreting: triton.language's own jit helpers (tl.max, tl.sum, tl.zeros...)
    and this module's device functions (_attend_tile) as interpreted functions, as TRITON_INTERPRET=1 at import would have made them, without
    making every kernel of the process interpreted (CUDA tensors keep the compiled path)."""

    _swaps: list[tuple[object, str, object, object]] | None = None
    _lock = threading.Lock()

    @classmethod
    def swaps(cls) -> list[tuple[object, str, object, object]]:
        if cls._swaps is None:
            import triton.experimental.gluon  # noqa: F401  (imported lazily by the launcher;
            # it checks the helpers are JITFunctions, so it must come before any swap)

            wrapped: dict[int, InterpretedFunction] = {}
            out = []
            for mod in (tl, tl.standard, tl.math, tl.core, sys.modules[__name__]):
                for name, value in list(vars(mod).items()):
                    if isinstance(value, JITFunction):
                        w = wrapped.setdefault(id(value), InterpretedFunction(value.fn))
                        out.append((mod, name, value, w))
            cls._swaps = out
        return cls._swaps

    def __enter__(self) -> None:
        self._lock.acquire()
        for mod, name, _, w in self.swaps():
            setattr(mod, name, w)

    def __exit__(self, *exc: object) -> None:
        for mod, name, orig, _ in self.swaps():
            setattr(mod, name, orig)
        self._lock.release()


class Kernel:
    """One kernel source, launched compiled on a GPU or interpreted on the CPU."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.gpu = triton.jit(fn)  # compiled lazily, at its first launch
        self.cpu = InterpretedFunction(fn)

    def launch(self, grid: tuple[int, ...], on_cpu: bool, *args, **kwargs) -> None:
        if on_cpu:
            with _Interpreted():
                self.cpu[grid](*args, **kwargs)
        else:
            self.gpu[grid](*args, **kwargs)


def kernel(fn) -> Kernel:
    return Kernel(fn)


@kernel
def write_kv_kernel(
    k_ptr, v_ptr, slot_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
    T, H, D, stride_kt, stride_kh, stride_vt, stride_vh,
    QUANT: tl.constexpr, IS_INT8: tl.constexpr, QMAX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_T), H): tokens [BLOCK_T] x head dim [BLOCK_D] of one kv head."""
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + t, mask=t < T, other=-1).to(tl.int64)
    row = slot >= 0
    m2 = row[:, None] & (d[None, :] < D)
    dst = (slot * H + h)[:, None] * D + d[None, :]  # cache rows are [slot, H, D] contiguous
    for which in tl.static_range(2):
        if which == 0:
            x = tl.load(k_ptr + t[:, None] * stride_kt + h * stride_kh + d[None, :], mask=m2, other=0.0)
            out_ptr = kc_ptr
            scale_ptr = ks_ptr
        else:
            x = tl.load(v_ptr + t[:, None] * stride_vt + h * stride_vh + d[None, :], mask=m2, other=0.0)
            out_ptr = vc_ptr
            scale_ptr = vs_ptr
        if QUANT:
            xf = x.to(tl.float32)
            amax = tl.max(tl.abs(xf), axis=1)  # [BLOCK_T]
            scale = amax / QMAX
            safe = tl.where(amax > 0, amax, 1.0)
            # QMAX * (1 / amax), as torch's vectorized QMAX / amax computes it (its scalar
            # tail divides exactly: a last-bit difference that can move a q by one step)
            one = tl.full(amax.shape, 1.0, tl.float32)
            inv = tl.where(amax > 0, QMAX * tl.math.div_rn(one, safe), 0.0)
            y = tl.minimum(tl.maximum(xf * inv[:, None], -QMAX), QMAX)
            unit = tl.full(y.shape, 1.0, tl.float32)
            if not IS_INT8:
                # e4m3's spacing at y: 2^(e - 3) for exponent e >= -6 (subnormals below), so
                # rounding y / unit to an integer is the cast's round-half-even, done exactly
                # here (the interpreter's float8 cast mis-rounds across a binade)
                e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
                e = tl.maximum(e, -6) - 3
                unit = ((e + 127) << 23).to(tl.float32, bitcast=True)
            z = y / unit  # exact: unit is a power of two
            r = tl.floor(z + 0.5)  # round half to even, as torch.round and the fp8 cast
            half = r * 0.5
            odd = (half - tl.floor(half)) != 0.0
            r = tl.where(((r - z) == 0.5) & odd, r - 1.0, r) * unit
            tl.store(out_ptr + dst, r.to(out_ptr.dtype.element_ty), mask=m2)
            tl.store(scale_ptr + slot * H + h, scale, mask=row)
        else:
            tl.store(out_ptr + dst, x.to(out_ptr.dtype.element_ty), mask=m2)


@kernel
def decode_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr, mid_o_ptr, mid_lse_ptr, out_ptr,
    scale, window, softcap, stride_qb, stride_qh, stride_table, max_blocks, stride_ob, stride_oh,
    G, D, SPLITS, BS: tl.constexpr, HKV: tl.constexpr,
    ONE_SPLIT: tl.constexpr, QUANT: tl.constexpr, F32_DOT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (B, Hkv, SPLITS) (a run-time count: a new split count compiles nothing). Query heads hkv * G .. + G of row b over one split of its
    positions [start, len); partial (un-normalized / l) outputs to mid_o [B, Hq, SPLITS, D],
    log-sum-exp to mid_lse [B, Hq, SPLITS] (-inf: the split saw nothing). One split: the
    output itself, straight to out [B, Hq, D] (no reduce launch)."""
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # (one type on both
    # paths: the compiler refuses a variable that is a literal on one branch, a tensor on one)
    span = seq_len - start
    per = ((span + SPLITS - 1) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # (no tl.cdiv: the
    # interpreter runs only builtins, and tl.cdiv is a jit function)
    lo = start + split * per
    hi = tl.minimum(lo + per, seq_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    gmask = g < G
    dmask = d < D
    heads = hkv * G + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if F32_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    for p0 in range(lo, hi, BLOCK_N):
        pos = p0 + n
        pmask = pos < hi
        blk = tl.load(table_ptr + b * stride_table + pos // BS, mask=pmask & (pos // BS < max_blocks), other=0)
        rows = (blk.to(tl.int64) * BS + pos % BS) * HKV + hkv  # [BLOCK_N] (slot, head) rows
        kvmask = pmask[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + rows[:, None] * D + d[None, :], mask=kvmask, other=0.0)
        v = tl.load(vc_ptr + rows[:, None] * D + d[None, :], mask=kvmask, other=0.0)
        if QUANT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif F32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if F32_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q.to(k.dtype), tl.trans(k))
        s = s * scale
        if QUANT:
            ksc = tl.load(ks_ptr + rows, mask=pmask, other=0.0)
            s = s * ksc[None, :]
        if softcap > 0:
            s = _softcap(s, softcap)
        s = tl.where(pmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT:
            vsc = tl.load(vs_ptr + rows, mask=pmask, other=0.0)
            pv = p * vsc[None, :]
            acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")
        elif F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    if ONE_SPLIT:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
        return
    hq = HKV * G
    base = (b * hq + heads) * SPLITS + split  # [BLOCK_G]
    tl.store(mid_o_ptr + base[:, None] * D + d[None, :], o, mask=gmask[:, None] & dmask[None, :])
    tl.store(mid_lse_ptr + base, lse, mask=gmask)


@kernel
def decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, stride_ob, stride_oh, HQ, D, SPLITS,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (B, Hq): out[b, h] = sum over splits of exp(lse_s - LSE) * o_s (0 if none saw any)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    base = (b * HQ + h) * SPLITS
    lse = tl.load(mid_lse_ptr + base + s, mask=s < SPLITS, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # 0 for the empty splits
    tot = tl.sum(w, axis=0)
    o = tl.load(mid_o_ptr + (base + s)[:, None] * D + d[None, :],
                mask=(s[:, None] < SPLITS) & (d[None, :] < D), other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(tot > 0, tot, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d < D)


def _softcap_fn(s, cap):
    """cap * tanh(s / cap) (Gemma 2's soft-capped scores) to float32's relative accuracy at any
    cap, as the CPU kernel's softcap_tile: tanh's odd series to y^11 below |y| = 0.4, above
    (1 - e) / (1 + e) with e = exp(-2 |y|)."""
    y = s / cap
    ay = tl.abs(y)
    e = tl.exp(-2.0 * ay)
    big = (1.0 - e) / (1.0 + e)
    y2 = y * y
    p = -1382.0 / 155925.0
    p = p * y2 + 62.0 / 2835.0
    p = p * y2 - 17.0 / 315.0
    p = p * y2 + 2.0 / 15.0
    p = p * y2 - 1.0 / 3.0
    return cap * tl.where(ay < 0.4, y + y * y2 * p, tl.where(y < 0, -big, big))


_softcap = triton.jit(_softcap_fn)


def _attend_tile_fn(q, k, v, vis, scale, softcap, m_i, l_i, acc, F32_DOT: tl.constexpr):
    """One online-softmax step of `q` [R, D] over a key/value tile k, v [N, D] where `vis`
    [R, N]: the running max m_i [R], sum l_i [R] and un-normalized output acc [R, D] float32,
    updated. A row that has seen nothing keeps m_i = -inf, l_i = 0, acc = 0 (no inf - inf).
    `softcap` > 0: scores soft-capped (_softcap) before the softmax."""
    if F32_DOT:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    s = s * scale
    if softcap > 0:
        s = _softcap(s, softcap)
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if F32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc


_attend_tile = triton.jit(_attend_tile_fn)  # a device function: inlined into the kernels that
# call it when compiled; swapped for its interpreted twin during a CPU launch (_Interpreted)


@kernel
def prefill_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, out_ptr, table_ptr,
    q_start_ptr, q_len_ptr, ctx_ptr, scale, window, softcap,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_table, G, D, BS: tl.constexpr, HKV: tl.constexpr,
    QUANT: tl.constexpr, F32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (cdiv(max query len, BLOCK_M), Hkv, S): query tokens [BLOCK_M] of sequence i and
    the G query heads of kv head hkv, as BLOCK_M * BLOCK_G rows (row r: token r // BLOCK_G,
    head r % BLOCK_G), so each K/V tile is loaded once for the whole group (GQA grouped)."""
    tile = tl.program_id(0)
    hkv = tl.program_id(1)
    i = tl.program_id(2)
    n_q = tl.load(q_len_ptr + i)
    if tile * BLOCK_M >= n_q:
        return
    q0 = tl.load(q_start_ptr + i)
    ctx = tl.load(ctx_ptr + i)
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    m = tile * BLOCK_M + r // BLOCK_G  # query index within the chunk, per row
    heads = hkv * G + r % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    rmask = (m < n_q) & (r % BLOCK_G < G)
    dmask = d < D
    qpos = ctx + m  # absolute positions of the query rows
    q = tl.load(q_ptr + (q0 + m)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    if F32_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M * BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_M * BLOCK_G, BLOCK_D], 0.0, tl.float32)
    # 1. the cached context, positions [lo, ctx): lo is where the tile's first query's band starts
    # Positions before `first` are in no row's band, and their table entries may be holes: they
    # are never loaded (a masked score would not be enough: 0 x a NaN of garbage V is NaN)
    first = tl.where(window > 0, tl.maximum(ctx + tile * BLOCK_M - window + 1, 0), 0)
    for p0 in range((first // BLOCK_N) * BLOCK_N, ctx, BLOCK_N):
        pos = p0 + n
        pmask = (pos < ctx) & (pos >= first)
        blk = tl.load(table_ptr + i * stride_table + pos // BS, mask=pmask, other=0)
        rows = (blk.to(tl.int64) * BS + pos % BS) * HKV + hkv
        kvmask = pmask[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + rows[:, None] * D + d[None, :], mask=kvmask, other=0.0)
        v = tl.load(vc_ptr + rows[:, None] * D + d[None, :], mask=kvmask, other=0.0)
        if QUANT:
            k = k.to(tl.float32) * tl.load(ks_ptr + rows, mask=pmask, other=0.0)[:, None]
            v = v.to(tl.float32) * tl.load(vs_ptr + rows, mask=pmask, other=0.0)[:, None]
        vis = pmask[None, :] & rmask[:, None]
        if window > 0:
            vis = vis & (pos[None, :] > qpos[:, None] - window)
        m_i, l_i, acc = _attend_tile(q, k, v, vis, scale, softcap, m_i, l_i, acc, F32_DOT)
    # 2. the chunk's own tokens j <= m (and within the window), at full precision
    lo2 = tl.where(window > 0, tl.maximum(tile * BLOCK_M - window + 1, 0), 0)
    lo2 = (lo2 // BLOCK_N) * BLOCK_N
    hi2 = tl.minimum((tile + 1) * BLOCK_M, n_q)
    for j0 in range(lo2, hi2, BLOCK_N):
        j = j0 + n
        jmask = j < n_q
        kvmask = jmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + (q0 + j)[:, None] * stride_kt + hkv * stride_kh + d[None, :],
                    mask=kvmask, other=0.0)
        v = tl.load(v_ptr + (q0 + j)[:, None] * stride_vt + hkv * stride_vh + d[None, :],
                    mask=kvmask, other=0.0)
        vis = jmask[None, :] & rmask[:, None] & (j[None, :] <= m[:, None])
        if window > 0:
            vis = vis & (j[None, :] > m[:, None] - window)
        m_i, l_i, acc = _attend_tile(q, k, v, vis, scale, softcap, m_i, l_i, acc, F32_DOT)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q0 + m)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
