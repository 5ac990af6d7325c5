"""Paged attention vs torch SDPA over the same K/V stored contiguously.

Every case scatters each sequence's blocks over a shuffled pool whose other slots hold random
garbage, so reading a wrong block or slot shows up as a wrong answer. Both decode backends are
checked: the compiled kernel and the pure-torch fallback (PAGEDKV_NO_KERNEL=1). Sliding-window
cases (a band mask: a token at p sees p - window < j <= p) put -1 in the table entries of blocks
wholly before the window, so reading one is an error, not a quiet wrong answer.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.attention import kernel as attn_kernel
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.paged import (
    decode_backend,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
)
from pagedkv.cache.storage import LayerKV, write_layer
from pagedkv.errors import StorageMismatchError

BACKENDS = ("kernel", "torch")
HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None


@contextlib.contextmanager
def backend(name: str):
    """Select the decode backend (hypothesis-friendly, no fixture)."""
    if name == "kernel" and not HAS_COMPILER:
        pytest.skip("no C++ compiler: the compiled kernel cannot be built here")
    old = attn_kernel.CONFIG.use_kernel
    attn_kernel.set_use_kernel(name == "kernel")
    try:
        # a machine with a compiler must build the kernel: a silent fallback would hide bugs
        assert decode_backend("cpu") == name, attn_kernel.kernel_info()
        yield
    finally:
        attn_kernel.set_use_kernel(old)


# --- case construction ------------------------------------------------------------------------


@dataclass
class Spec:
    hkv: int
    group: int  # Hq // Hkv
    head_dim: int
    block_size: int
    prefills: list[tuple[int, int]]  # (new tokens, cached context)
    decodes: list[int]  # seq_len incl. the new token
    seed: int
    scale: float
    window: int = 0  # sliding window in tokens (0: none)
    softcap: float = 0.0  # scores soft-capped, c * tanh(s / c) (Gemma 2; 0: none)


@st.composite
def specs(draw, max_prefill: int = 40, max_context: int = 70) -> Spec:
    d = draw(st.sampled_from([8, 16, 64]))
    prefills = draw(
        st.lists(st.tuples(st.integers(1, max_prefill), st.integers(0, max_context)), max_size=3)
    )
    # long decodes (>= 128) with a small batch exercise the kernel's split-sequence path
    decodes = draw(st.lists(st.one_of(st.integers(1, 40), st.integers(100, 300)), max_size=4))
    if not prefills and not decodes:
        decodes = [draw(st.integers(1, 50))]
    return Spec(
        hkv=draw(st.sampled_from([1, 2, 3])),
        group=draw(st.integers(1, 4)),
        head_dim=d,
        block_size=draw(st.sampled_from([1, 4, 16, 32])),
        prefills=prefills,
        decodes=decodes,
        seed=draw(st.integers(0, 2**31 - 1)),
        scale=draw(st.sampled_from([1.0 / math.sqrt(d), 0.3])),
        window=draw(st.sampled_from([0, 0, 1, 5, 17, 64])),
        softcap=draw(st.sampled_from([0.0, 0.0, 0.7, 5.0, 1e6])),  # 1e6: tanh's small-argument side
    )


@dataclass
class Case:
    q: torch.Tensor  # [T, Hq, D] (a strided view, like a slice of a fused qkv projection)
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    k_cache: torch.Tensor  # [N, bs, Hkv, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    ref: torch.Tensor  # [T, Hq, D] float32

    @property
    def layer(self) -> LayerKV:
        return LayerKV(self.k_cache, self.v_cache)


def _blocks_to_slots(ids: torch.Tensor, positions: torch.Tensor, bs: int) -> torch.Tensor:
    return ids[positions // bs] * bs + positions % bs


def build_case(spec: Spec, dtype: torch.dtype) -> Case:
    g = torch.Generator().manual_seed(spec.seed)
    hkv, d, bs = spec.hkv, spec.head_dim, spec.block_size
    hq = hkv * spec.group
    # (cached context, new tokens) per sequence: prefills first, then decodes
    seqs = list(((c, n) for n, c in spec.prefills)) + [(s - 1, 1) for s in spec.decodes]
    nblocks = [-(-(c + n) // bs) for c, n in seqs]
    num_blocks = sum(nblocks) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=g)  # scattered, unordered block ids
    # garbage everywhere: a wrong read cannot accidentally match
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    max_blocks = max(nblocks)

    t = sum(n for _, n in seqs)
    # q as a strided view of a wider projection output, like the model will pass it
    fused = torch.randn(t, (hq + 1) * d, generator=g).to(dtype)
    q = fused[:, : hq * d].view(t, hq, d)
    k = torch.empty(t, hkv, d, dtype=dtype)
    v = torch.empty(t, hkv, d, dtype=dtype)
    slots = torch.empty(t, dtype=torch.int64)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    ref = torch.empty(t, hq, d)
    row, used = 0, 0
    for i, ((c, n), nb) in enumerate(zip(seqs, nblocks, strict=True)):
        ids = perm[used : used + nb]
        used += nb
        tables[i, :nb] = ids.to(torch.int32)
        full_k = torch.randn(c + n, hkv, d, generator=g).to(dtype)
        full_v = torch.randn(c + n, hkv, d, generator=g).to(dtype)
        ctx_slots = _blocks_to_slots(ids, torch.arange(c), bs)
        k_cache.view(-1, hkv, d)[ctx_slots] = full_k[:c]
        v_cache.view(-1, hkv, d)[ctx_slots] = full_v[:c]
        k[row : row + n], v[row : row + n] = full_k[c:], full_v[c:]
        slots[row : row + n] = _blocks_to_slots(ids, torch.arange(c, c + n), bs)
        # reference: SDPA over the contiguous sequence, kv heads expanded (h -> h // group)
        qs = q[row : row + n].float().transpose(0, 1)  # [Hq, n, D]
        ks = full_k.float().repeat_interleave(spec.group, dim=1).transpose(0, 1)
        vs = full_v.float().repeat_interleave(spec.group, dim=1).transpose(0, 1)
        qpos, kpos = torch.arange(n)[:, None] + c, torch.arange(c + n)[None, :]
        mask = kpos <= qpos
        if spec.window:
            mask &= kpos > qpos - spec.window
            # blocks wholly before the first query's window are never read: poison their ids
            tables[i, : max(0, c - spec.window + 1) // bs] = -1
        if spec.softcap:  # as transformers' eager Gemma 2: scale, cap, mask, softmax
            sc = (qs @ ks.transpose(1, 2) * spec.scale / spec.softcap).tanh() * spec.softcap
            o = sc.masked_fill(~mask, -math.inf).softmax(-1) @ vs
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=spec.scale)
        ref[row : row + n] = o.transpose(0, 1)
        row += n

    npf = len(spec.prefills)
    dec_lens = torch.tensor(spec.decodes, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slots,
        prefill_query_lens=[n for n, _ in spec.prefills],
        prefill_context_lens=[c for _, c in spec.prefills],
        prefill_block_tables=tables[:npf].contiguous(),
        decode_block_tables=tables[npf:].contiguous(),
        decode_seq_lens=dec_lens,
        max_decode_seq_len=int(dec_lens.max()) if len(spec.decodes) else 0,
    )
    return Case(q, k, v, k_cache, v_cache, meta, ref)


def run_and_check(case: Case, scale: float, atol: float, rtol: float, window: int = 0,
                  softcap: float = 0.0) -> None:
    out = paged_attention(case.q, case.k, case.v, case.layer, case.meta, scale, window=window, softcap=softcap)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    torch.testing.assert_close(out.float(), case.ref, atol=atol, rtol=rtol)
    # every new token's K/V landed at its slot
    h, d = case.k.shape[1:]
    torch.testing.assert_close(case.k_cache.view(-1, h, d)[case.meta.slot_mapping], case.k)
    torch.testing.assert_close(case.v_cache.view(-1, h, d)[case.meta.slot_mapping], case.v)


# --- property tests ---------------------------------------------------------------------------

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", BACKENDS)
@FAST
@given(spec=specs())
def test_mixed_batch_float32(name: str, spec: Spec) -> None:
    with backend(name):
        run_and_check(build_case(spec, torch.float32), spec.scale, atol=1e-5, rtol=1e-5, window=spec.window, softcap=spec.softcap)


@pytest.mark.parametrize("name", BACKENDS)
@settings(FAST, max_examples=15)
@given(spec=specs())
def test_mixed_batch_bfloat16(name: str, spec: Spec) -> None:
    # reference sees the same bf16-rounded inputs; the gap is the bf16 rounding of the output
    with backend(name):
        run_and_check(build_case(spec, torch.bfloat16), spec.scale, atol=2e-2, rtol=2e-2,
                      window=spec.window, softcap=spec.softcap)


@pytest.mark.parametrize("name", BACKENDS)
@settings(FAST, max_examples=8)
@given(spec=specs())
def test_mixed_batch_float16(name: str, spec: Spec) -> None:
    with backend(name):
        run_and_check(build_case(spec, torch.float16), spec.scale, atol=2e-3, rtol=2e-3,
                      window=spec.window, softcap=spec.softcap)


# --- decode -----------------------------------------------------------------------------------


def _decode_problem(batch: int, lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, bs = 6, 2, 32, 16
    nb = [-(-n // bs) for n in lens]
    num_blocks = sum(nb) + 1
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(batch, max(nb), dtype=torch.int32)
    used = 0
    for i, n in enumerate(nb):
        tables[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g)
    q = torch.randn(batch, hq, d, generator=g)
    ref = torch.empty(batch, hq, d)
    for i, n in enumerate(lens):
        ids = tables[i, : nb[i]].long()
        ks = kc[ids].reshape(-1, hkv, d)[:n].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        vs = vc[ids].reshape(-1, hkv, d)[:n].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        ref[i] = F.scaled_dot_product_attention(q[i][:, None], ks, vs, scale=0.2)[:, 0]
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), ref


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens", [[1000], [3, 700, 129], [5] * 9 + [400]])
def test_decode_long_contexts(name: str, threads: int, lens: list[int]) -> None:
    # batch smaller than the thread pool -> sequences split along their length and merged
    q, kc, vc, tables, seq_lens, ref = _decode_problem(len(lens), lens)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with backend(name):
            out = paged_decode_attention(q, kc, vc, tables, seq_lens, 0.2)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [1, 100, 512])
def test_decode_window_long_contexts(name: str, threads: int, window: int) -> None:
    """The band over long sequences (split along their length when the batch is small): only
    the last `window` positions count, and blocks wholly before them are never read."""
    lens = [1000, 3, 700, 129]
    q, kc, vc, tables, seq_lens, _ = _decode_problem(len(lens), lens, seed=3)
    hq, hkv, d, bs = q.shape[1], kc.shape[2], kc.shape[3], kc.shape[1]
    ref = torch.empty_like(q)
    for i, n in enumerate(lens):
        first = max(0, n - window)
        ids = tables[i, : -(-n // bs)].long()
        ks = kc[ids].reshape(-1, hkv, d)[first:n].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        vs = vc[ids].reshape(-1, hkv, d)[first:n].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        ref[i] = F.scaled_dot_product_attention(q[i][:, None], ks, vs, scale=0.2)[:, 0]
        tables[i, : first // bs] = -1
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with backend(name):
            out = paged_decode_attention(q, kc, vc, tables, seq_lens, 0.2, window=window)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
def test_decode_zero_length_gives_zeros(name: str) -> None:
    q, kc, vc, tables, _, ref = _decode_problem(2, [0, 20])
    with backend(name):
        out = paged_decode_attention(
            q, kc, vc, tables, torch.tensor([0, 20], dtype=torch.int32), 0.2
        )
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1], ref[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
def test_decode_int64_tables_and_bf16_query_on_float_cache(name: str) -> None:
    q, kc, vc, tables, lens, ref = _decode_problem(3, [17, 64, 5])
    with backend(name):
        out = paged_decode_attention(q.bfloat16(), kc, vc, tables.long(), lens.long(), 0.2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_decode_non_contiguous_cache_uses_fallback() -> None:
    # a cache view that is not contiguous must not be copied whole: the fallback handles it
    q, kc, vc, tables, lens, ref = _decode_problem(2, [40, 9])
    kc2 = torch.randn(2, *kc.shape).select(0, 1).copy_(kc)
    wide = torch.zeros(*vc.shape[:-1], vc.shape[-1] * 2)
    vc2 = wide[..., : vc.shape[-1]]
    vc2.copy_(vc)
    assert not vc2.is_contiguous()
    out = paged_decode_attention(q, kc2, vc2, tables, lens, 0.2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
def test_kernel_rejects_bad_block_ids() -> None:
    q, kc, vc, tables, lens, _ = _decode_problem(1, [20])
    tables[0, 1] = kc.shape[0]  # one past the last block
    with backend("kernel"), pytest.raises(RuntimeError, match="block id"):
        paged_decode_attention(q, kc, vc, tables, lens, 0.2)


# --- writes -----------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
@FAST
@given(spec=specs(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), data=st.data())
def test_a_decode_step_writes_and_attends_in_one_op_with_the_same_bits(
        spec: Spec, dtype: torch.dtype, data: st.DataObject) -> None:
    """A pure-decode step over a float cache goes through write_decode (one op: the new K/V
    copied to their slots, then the decode kernel): the same output bits and the same cache as
    write_layer's copies followed by the decode op, with k/v strided views of a wider tensor
    (as the model passes them) and skipped (-1) slots."""
    spec.prefills, spec.decodes = [], spec.decodes or [7]
    case = build_case(spec, dtype)
    t, h, d = case.k.shape
    wide = torch.randn(t, h + 1, d).to(dtype)  # k as a view with a token stride of (h + 1) d
    wide[:, :h] = case.k
    k = wide[:, :h]
    skip = data.draw(st.lists(st.integers(0, t - 1), max_size=2))
    case.meta.slot_mapping[skip] = -1
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    with backend("kernel"):
        out = paged_attention(case.q, k, case.v, case.layer, case.meta, spec.scale, window=spec.window,
                              softcap=spec.softcap)
        assert case.meta.plan.write_op is not None
        write_layer(LayerKV(kc, vc), case.meta.slot_mapping, k, case.v)
        ref = paged_decode_attention(case.q, kc, vc, case.meta.decode_block_tables, case.meta.decode_seq_lens,
                                     spec.scale, window=spec.window, softcap=spec.softcap)
    assert torch.equal(out, ref)
    assert torch.equal(case.k_cache, kc) and torch.equal(case.v_cache, vc)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
@FAST
@given(spec=specs(), dtype=st.sampled_from([torch.float16, torch.bfloat16]), data=st.data())
def test_float32_rows_into_a_16_bit_cache_in_one_op_with_the_same_bits(
        spec: Spec, dtype: torch.dtype, data: st.DataObject) -> None:
    """A float32 model over a float16 / bfloat16 cache (--kv-cache-dtype): write_decode rounds its
    float32 K/V into the cache's type as write_layer's indexed copy does, then attends, all in one
    op: the same output and cache bits as write_layer followed by the decode op."""
    spec.prefills, spec.decodes = [], spec.decodes or [7]
    case = build_case(spec, dtype)
    t, h, d = case.k.shape
    g = torch.Generator().manual_seed(spec.seed + 7)
    wide = torch.randn(t, h + 1, d, generator=g) * 3  # float32 K as the model's strided view
    k, v = wide[:, :h], torch.randn(t, h, d, generator=g)
    q = case.q.float()
    skip = data.draw(st.lists(st.integers(0, t - 1), max_size=2))
    case.meta.slot_mapping[skip] = -1
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    with backend("kernel"):
        out = paged_attention(q, k, v, case.layer, case.meta, spec.scale, window=spec.window, softcap=spec.softcap)
        assert case.meta.plan.write_op is not None
        write_layer(LayerKV(kc, vc), case.meta.slot_mapping, k, v)
        ref = paged_decode_attention(q, kc, vc, case.meta.decode_block_tables, case.meta.decode_seq_lens,
                                     spec.scale, window=spec.window, softcap=spec.softcap)
    assert torch.equal(out, ref)
    assert torch.equal(case.k_cache, kc) and torch.equal(case.v_cache, vc)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
def test_mixed_k_and_v_dtypes_into_a_16_bit_cache_write_nothing() -> None:
    """write_decode rounds float32 K and V into a 16-bit cache only together: float32 K with a
    float16 V (or the reverse) is refused before any row of the cache changes."""
    from pagedkv.attention import kernel as attn_kernel

    spec = Spec(hkv=2, group=2, head_dim=16, block_size=4, prefills=[], decodes=[9, 5], seed=3, scale=0.25)
    case = build_case(spec, torch.float16)
    assert attn_kernel.load_kernel()
    op = attn_kernel.write_decode_op()
    before_k, before_v = case.k_cache.clone(), case.v_cache.clone()
    out = torch.empty(case.q.shape)
    for k, v in ((case.k.float(), case.v), (case.k, case.v.float())):
        with pytest.raises(RuntimeError, match="cache's dtype"):
            op(case.q.float(), k, v, case.meta.slot_mapping, case.k_cache, case.v_cache,
               case.meta.decode_block_tables.int(), case.meta.decode_seq_lens.int(), 0.25, out, 0, 0.0)
        assert torch.equal(case.k_cache, before_k) and torch.equal(case.v_cache, before_v)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 40, 320])
def test_16_bit_rows_read_in_place_give_the_float32_caches_bits(dtype: torch.dtype, d: int) -> None:
    """A float16 / bfloat16 cache is read in place, 8 values a register (the vector code), and
    attends with the bits of the same values in a float32 cache: GQA, lengths that end inside a
    tile and a block, a head size with a tail past the 8-lane groups (40) and one past 256."""
    g = torch.Generator().manual_seed(d)
    bs, hkv, hq, lens = 16, 2, 6, [1, 7, 33, 85]
    nb = sum(-(-n // bs) for n in lens) + 2
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    perm, tables, used = torch.randperm(nb, generator=g), torch.zeros(len(lens), 6, dtype=torch.int32), 0
    for i, n in enumerate(lens):
        k = -(-n // bs)
        tables[i, :k] = perm[used : used + k].to(torch.int32)
        used += k
    q = torch.randn(len(lens), hq, d, generator=g)
    seq = torch.tensor(lens, dtype=torch.int32)
    with backend("kernel"):
        half = paged_decode_attention(q, kc, vc, tables, seq, 0.125)
        full = paged_decode_attention(q, kc.float(), vc.float(), tables, seq, 0.125)
    assert torch.equal(half, full)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
def test_a_slot_outside_the_cache_writes_nothing() -> None:
    """write_decode checks every slot before its first copy: one past the cache's last row is
    an error and no row of the cache changes (the first sequence's slot included)."""
    spec = Spec(hkv=2, group=2, head_dim=16, block_size=4, prefills=[], decodes=[9, 5], seed=1, scale=0.25)
    case = build_case(spec, torch.float32)
    rows = case.k_cache.shape[0] * case.k_cache.shape[1]
    case.meta.slot_mapping[1] = rows
    before_k, before_v = case.k_cache.clone(), case.v_cache.clone()
    with backend("kernel"), pytest.raises(RuntimeError, match="outside the cache"):
        paged_attention(case.q, case.k, case.v, case.layer, case.meta, spec.scale)
    assert torch.equal(case.k_cache, before_k) and torch.equal(case.v_cache, before_v)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
def test_a_bad_block_table_fails_the_decode_step_before_any_write() -> None:
    """write_decode checks the block tables and lengths too before its first copy: a block id
    outside the pool, or a length past the table, fails with no row of the cache changed."""
    spec = Spec(hkv=2, group=2, head_dim=16, block_size=4, prefills=[], decodes=[9, 5], seed=2, scale=0.25)
    for field, value, match in (("decode_block_tables", 10_000, "block id"), ("decode_seq_lens", 999, "seq_lens")):
        case = build_case(spec, torch.float32)
        getattr(case.meta, field)[0] = value
        before_k, before_v = case.k_cache.clone(), case.v_cache.clone()
        with backend("kernel"), pytest.raises(RuntimeError, match=match):
            paged_attention(case.q, case.k, case.v, case.layer, case.meta, spec.scale)
        assert torch.equal(case.k_cache, before_k) and torch.equal(case.v_cache, before_v)


@pytest.mark.parametrize("name", BACKENDS)
def test_slots_minus_one_are_not_written(name: str) -> None:
    spec = Spec(
        hkv=2,
        group=2,
        head_dim=16,
        block_size=4,
        prefills=[(7, 5), (6, 0)],
        decodes=[9, 30],
        seed=3,
        scale=0.25,
    )
    case = build_case(spec, torch.float32)
    slots = case.meta.slot_mapping.clone()
    skip = torch.tensor([1, 4, 8])  # prefill tokens: their K/V come from k/v, not the cache
    before_k = case.k_cache.clone()
    before_v = case.v_cache.clone()
    case.meta.slot_mapping[skip] = -1
    with backend(name):
        out = paged_attention(
            case.q, case.k, case.v, case.layer, case.meta, spec.scale
        )
    torch.testing.assert_close(out, case.ref, atol=1e-5, rtol=1e-5)
    h, d = case.k.shape[1:]
    kflat, vflat = case.k_cache.view(-1, h, d), case.v_cache.view(-1, h, d)
    # skipped slots keep their old contents, the others got the new K/V
    assert torch.equal(kflat[slots[skip]], before_k.view(-1, h, d)[slots[skip]])
    assert torch.equal(vflat[slots[skip]], before_v.view(-1, h, d)[slots[skip]])
    keep = torch.ones(len(slots), dtype=torch.bool)
    keep[skip] = False
    assert torch.equal(kflat[slots[keep]], case.k[keep])
    # nothing else in the cache moved
    changed = (case.k_cache != before_k).flatten(0, 1).any(-1).any(-1).nonzero().flatten()
    assert set(changed.tolist()) <= set(slots[keep].tolist())


# --- prefill ----------------------------------------------------------------------------------


def test_prefill_chunks_match_one_shot() -> None:
    # a prompt prefilled in three chunks (context grows) equals the same prompt in one go
    spec_one = Spec(
        hkv=3,
        group=3,
        head_dim=64,
        block_size=16,
        prefills=[(50, 0)],
        decodes=[],
        seed=11,
        scale=0.125,
    )
    one = build_case(spec_one, torch.float32)
    full = paged_attention(one.q, one.k, one.v, one.layer, one.meta, 0.125)
    tables = one.meta.prefill_block_tables
    outs = []
    for start, stop in [(0, 20), (20, 21), (21, 50)]:
        outs.append(
            paged_prefill_attention(
                one.q[start:stop],
                one.k[start:stop],
                one.v[start:stop],
                one.k_cache,
                one.v_cache,
                [stop - start],
                [start],
                tables,
                0.125,
            )
        )
    torch.testing.assert_close(torch.cat(outs), full, atol=1e-5, rtol=1e-5)


def test_metadata_mismatch_raises() -> None:
    spec = Spec(
        hkv=1, group=1, head_dim=8, block_size=4, prefills=[(3, 0)], decodes=[5], seed=0, scale=0.3
    )
    case = build_case(spec, torch.float32)
    with pytest.raises(StorageMismatchError):
        paged_attention(
            case.q[:-1], case.k[:-1], case.v[:-1], case.layer, case.meta, 0.3
        )


# --- kernel build -----------------------------------------------------------------------------


def test_build_failure_falls_back_and_warns_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(attn_kernel.DECODE, "state", attn_kernel.KernelState())

    def broken(op) -> None:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(attn_kernel, "_load_op", broken)
    monkeypatch.setattr(attn_kernel.CONFIG, "use_kernel", True)
    q, kc, vc, tables, lens, ref = _decode_problem(2, [30, 3])
    with caplog.at_level(logging.WARNING, logger=attn_kernel.__name__):
        out1 = paged_decode_attention(q, kc, vc, tables, lens, 0.2)
        out2 = paged_decode_attention(q, kc, vc, tables, lens, 0.2)
    assert decode_backend("cpu") == "torch"
    assert sum("fallback" in r.getMessage() for r in caplog.records) == 1
    torch.testing.assert_close(out1, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out1, out2)


def test_env_var_is_read_once_and_forces_fallback(monkeypatch) -> None:
    monkeypatch.setenv("PAGEDKV_NO_KERNEL", "1")
    assert attn_kernel.AttentionConfig.from_env().use_kernel is False
    monkeypatch.setenv("PAGEDKV_NO_KERNEL", "0")
    assert attn_kernel.AttentionConfig.from_env().use_kernel is True
    monkeypatch.setattr(attn_kernel.CONFIG, "use_kernel", False)
    monkeypatch.setenv("PAGEDKV_NO_KERNEL", "0")  # changing the env later changes nothing
    assert decode_backend("cpu") == "torch"
    monkeypatch.setattr(attn_kernel.CONFIG, "use_kernel", True)
    assert decode_backend("meta") == "torch"  # other devices always use the fallback


def test_env_var_read_at_start_in_a_fresh_process() -> None:
    import subprocess
    import sys

    code = "from pagedkv.attention import decode_backend; print(decode_backend('cpu'))"
    env = {**os.environ, "PAGEDKV_NO_KERNEL": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "torch", out.stderr


def test_build_name_depends_on_flags() -> None:
    a = attn_kernel._build_name("src", ["-O3", "-mavx2", "-mfma"])
    b = attn_kernel._build_name("src", ["-O3"])
    assert a != b and "avx2" in a and a.isidentifier() and b.isidentifier()
    assert attn_kernel._build_name("src2", ["-O3"]) != b
