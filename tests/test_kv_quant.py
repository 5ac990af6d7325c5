"""Quantized KV cache (int8, fp8_e4m3): quantization bounds, storage sizing and block moves,
every attention reader against the same data stored in float32, engine plumbing, fidelity."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_attention import Spec, backend, build_case, specs

from pagedkv.attention.paged import paged_attention, paged_decode_attention, paged_prefill_attention
from pagedkv.cache import KVStorage, PagedKVCache, bytes_per_block, num_blocks_for_budget
from pagedkv.cache.quant import (
    QUANT_DTYPES,
    dequantize,
    quantize,
    resolve_kv_cache_dtype,
    supported_kv_cache_dtypes,
)
from pagedkv.cache.storage import LayerKV
from pagedkv.errors import CacheConfigError, InvalidBlockError, StorageMismatchError

QDTYPES = list(QUANT_DTYPES.values())
L, N, BS, H, D = 2, 6, 4, 3, 16
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def quant_bound(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Largest |x - dequant(quant(x))| the scheme allows, per element."""
    amax = x.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:
        return amax / 127 / 2 * 1.0001 + 1e-30
    # e4m3: 3 mantissa bits (half an ulp = 2^-4 relative); subnormal step 2^-9 of the scale
    return torch.maximum(x.abs() * 2**-4, amax / 448 * 2**-10) * 1.0001 + 1e-30


# --- quantization -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", QDTYPES)
@FAST
@given(seed=st.integers(0, 2**31 - 1), mag=st.sampled_from([1e-3, 1.0, 30.0, 1e4]))
def test_quantize_error_is_bounded(dtype, seed, mag):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 3, 64, generator=g) * mag
    x[0, 1] = 0.0  # an all-zero row
    x[2, 0, 5] = 50 * mag  # an outlier
    q, s = quantize(x, dtype)
    assert q.dtype == dtype and s.shape == (7, 3) and s.dtype == torch.float32
    y = dequantize(q, s)
    assert bool(((y - x).abs() <= quant_bound(x, dtype)).all())
    assert bool((y[0, 1] == 0).all()) and float(s[0, 1]) == 0.0
    # the row's largest magnitude is represented exactly up to float rounding
    torch.testing.assert_close(y.abs().amax(-1), x.abs().amax(-1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_accepts_half_inputs(dtype):
    x = torch.randn(4, 2, 8).to(dtype)
    q, s = quantize(x, torch.int8)
    assert bool(((dequantize(q, s) - x.float()).abs() <= quant_bound(x.float(), torch.int8)).all())


def test_dtype_names_and_typed_errors():
    assert resolve_kv_cache_dtype("auto") is None
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_cache_dtype("INT8") is torch.int8
    assert resolve_kv_cache_dtype("fp8_e4m3") is torch.float8_e4m3fn
    for bad in ("int4", "q4_0", "float64", "", torch.float64, 8):
        with pytest.raises(CacheConfigError) as e:
            resolve_kv_cache_dtype(bad)
        if not isinstance(bad, int):
            assert "int8" in str(e.value) and "fp8_e4m3" in str(e.value)
    assert {"auto", "float32", "float16", "bfloat16", "int8", "fp8_e4m3"} <= set(
        supported_kv_cache_dtypes()
    )


# --- storage ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_layout_memory_and_budget_count_the_scales(name):
    s = KVStorage(L, N, BS, H, D, name)
    assert s.quantized and s.kv.element_size() == 1
    assert s.scales.shape == (L, 2, N, BS, H) and s.scales.dtype == torch.float32
    assert s.memory_bytes == s.kv.numel() + 4 * s.scales.numel()
    assert s.bytes_per_block == bytes_per_block(L, BS, H, D, name) == 2 * L * BS * H * (D + 4)
    assert s.memory_bytes == N * s.bytes_per_block
    # a budget of exactly k blocks (plus a byte short of one more) sizes to k blocks
    per = s.bytes_per_block
    assert num_blocks_for_budget(5 * per + per - 1, L, BS, H, D, name) == 5
    assert KVStorage.from_budget(5 * per, L, BS, H, D, name).memory_bytes == 5 * per
    # views are built once, the layer's scales alongside its K/V
    c = s.layer(1)
    assert c is s.layers[1] and c.k_scale.data_ptr() == s.scales[1, 0].data_ptr()
    assert c.v.data_ptr() == s.kv[1, 1].data_ptr()


def test_smollm2_tokens_per_gib_ratio():
    # SmolLM2-135M: 30 layers, 3 kv heads of 64
    per_token = {d: bytes_per_block(30, 16, 3, 64, d) / 16 for d in ("float32", "int8", "fp8_e4m3")}
    assert per_token["float32"] / per_token["int8"] >= 3.5
    assert per_token["int8"] == per_token["fp8_e4m3"] == 30 * 2 * 3 * (64 + 4)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_write_quantizes_through_the_slot_mapping(dtype):
    s = KVStorage(L, N, BS, H, D, dtype)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(5, H, D, generator=g), torch.randn(5, H, D, generator=g) * 3
    slots = torch.tensor([7, -1, 0, 22, 13])
    s.write(1, slots, k, v)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        rk, rv = s.read(1, slot)
        assert bool(((rk - k[i]).abs() <= quant_bound(k[i], dtype)).all())
        assert bool(((rv - v[i]).abs() <= quant_bound(v[i], dtype)).all())
    assert bool((s.kv[0].view(torch.uint8) == 0).all()) and bool((s.scales[0] == 0).all())
    written = int((s.scales[1] != 0).sum())
    assert written == 2 * 4 * H  # K and V scales of the 4 real slots, nothing else
    k_all, v_all = s.gather(1, [1, 5, 0, 3], 14)  # slot 7 = block 1, offset 3 -> row 3
    assert k_all.dtype == torch.float32
    assert torch.equal(k_all[3], s.read(1, 7)[0]) and torch.equal(v_all[8], s.read(1, 0)[1])


def test_write_rejects_integer_input_and_changes_nothing():
    s = KVStorage(1, N, BS, H, D, "int8")
    bad = torch.ones(2, H, D, dtype=torch.int8)
    with pytest.raises(StorageMismatchError):
        s.write(0, torch.tensor([0, 1]), bad, bad)
    assert bool((s.kv == 0).all()) and bool((s.scales == 0).all())


@pytest.mark.parametrize("dtype", QDTYPES)
def test_copy_blocks_moves_scales_with_their_blocks(dtype):
    s = KVStorage(L, N, BS, H, D, dtype)
    for layer in range(L):
        k = torch.randn(N * BS, H, D) * (layer + 1)
        s.write(layer, torch.arange(N * BS), k, -2 * k)
    before = [[s.read(layer, slot) for slot in range(N * BS)] for layer in range(L)]
    s.copy_blocks([0, 4, 2], [4, 2, 0])  # a cycle: sources read before any write
    perm = {4: 0, 2: 4, 0: 2}
    for layer in range(L):
        for slot in range(N * BS):
            b, o = divmod(slot, BS)
            src = perm.get(b, b) * BS + o
            got = s.read(layer, slot)
            assert torch.equal(got[0], before[layer][src][0])
            assert torch.equal(got[1], before[layer][src][1])


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int8", "fp8_e4m3"])
def test_block_export_import_round_trip(name):
    a = KVStorage(L, N, BS, H, D, name)
    b = KVStorage(L, N, BS, H, D, name)
    for layer in range(L):
        k = torch.randn(N * BS, H, D).to(a.dtype if not a.quantized else torch.float32)
        a.write(layer, torch.arange(N * BS), k, k * 0.5)
    raw = a.block_bytes(3)
    assert isinstance(raw, bytes) and len(raw) == a.bytes_per_block
    b.write_block_bytes(1, raw)
    parts = a.export_blocks([2, 4])
    assert set(parts) == set(a.block_layout()) == ({"kv", "scales"} if a.quantized else {"kv"})
    b.import_blocks([5, 0], parts)
    assert a.layout == b.layout and name in a.layout
    for layer in range(L):
        for o in range(BS):
            for src, dst in ((3, 1), (2, 5), (4, 0)):
                x, y = a.read(layer, src * BS + o), b.read(layer, dst * BS + o)
                assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
    # every other block of b is untouched
    assert bool((b.kv[:, :, [2, 3, 4]].view(torch.uint8) == 0).all())
    # wrong sizes / layouts are typed errors and change nothing
    snap = b.kv.clone().view(torch.uint8)
    with pytest.raises(StorageMismatchError):
        b.write_block_bytes(0, raw[:-1])
    other = KVStorage(L, N, BS, H, D, "float16" if name != "float16" else "float32")
    with pytest.raises(StorageMismatchError):
        b.import_blocks([0], other.export_blocks([0]))
    if a.quantized:
        with pytest.raises(StorageMismatchError):  # K/V without their scales
            b.import_blocks([0], {"kv": parts["kv"][:1]})
    with pytest.raises(InvalidBlockError):
        b.import_blocks([N], a.export_blocks([0]))
    assert torch.equal(b.kv.view(torch.uint8), snap)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_move_slots_and_key_rewrites_keep_scales(dtype):
    s = KVStorage(L, N, BS, H, D, dtype)
    for layer in range(L):
        k = torch.randn(N * BS, H, D) * (layer + 2)
        s.write(layer, torch.arange(N * BS), k, k + 1)
    before = [s.read(1, slot) for slot in (3, 9)]
    s.move_slots([3, 9], [9, 20])
    assert torch.equal(s.read(1, 9)[0], before[0][0]) and torch.equal(s.read(1, 20)[1], before[1][1])
    rot = s.rotated_keys(torch.tensor([5]), lambda k, delta: -k * delta, 2)
    assert rot.dtype == torch.float32
    torch.testing.assert_close(rot[1, 0], -2 * s.read(1, 5)[0])
    v_before = s.read(0, 5)[1]
    s.write_keys(torch.tensor([5]), rot)
    got = s.read(1, 5)[0]
    assert bool(((got - rot[1, 0]).abs() <= quant_bound(rot[1, 0], dtype)).all())
    assert torch.equal(s.read(0, 5)[1], v_before)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_fork_cow_and_defragment_keep_quantized_data_exact(dtype):
    st_ = KVStorage(L, 12, 4, H, D, dtype)
    c = PagedKVCache(12, 4, storage=st_)

    def fill(seq, start):
        n = c.num_tokens(seq)
        slots = c.slot_mapping([seq], n - start)
        for layer in range(L):
            k = torch.randn(n - start, H, D)
            st_.write(layer, slots, k, k.flip(-1))

    def values(seq):
        return [[st_.read(layer, c.slot(seq, p)) for p in range(c.num_tokens(seq))]
                for layer in range(L)]

    for name, n in (("a", 6), ("b", 9), ("c", 5)):
        c.create(name, list(range(100, 100 + n)))
        fill(name, 0)
    c.fork("c", "e")
    shared_before = values("c")
    c.append("e", [1])  # copy-on-write of the shared partial block
    fill("e", 5)
    assert c.cow_copies >= 1
    e_vals = values("e")
    for layer in range(L):
        for p in range(5):  # the copied block carried K/V and scales exactly
            assert torch.equal(e_vals[layer][p][0], shared_before[layer][p][0])
    c.free("a")
    expect = {s: values(s) for s in c.seqs}
    assert c.defragment() > 0
    for s, vals in expect.items():
        got = values(s)
        for layer in range(L):
            for x, y in zip(got[layer], vals[layer], strict=True):
                assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


# --- attention readers ------------------------------------------------------------------------


def _dequantized_twin(case, dtype):  # noqa: ANN001, ANN202
    """The case's caches quantized to `dtype`, and float32 caches holding exactly the values
    the quantized ones decode to."""
    qk, sk = quantize(case.k_cache, dtype)
    qv, sv = quantize(case.v_cache, dtype)
    return LayerKV(qk, qv, sk, sv), LayerKV(dequantize(qk, sk), dequantize(qv, sv))


@pytest.mark.parametrize("name", ["kernel", "torch"])
@pytest.mark.parametrize("dtype", QDTYPES)
@FAST
@given(spec=specs())
def test_decode_reads_quantized_blocks_like_their_float_twin(name, dtype, spec: Spec):
    case = build_case(spec, torch.float32)
    if not len(spec.decodes):
        return
    quant, twin = _dequantized_twin(case, dtype)
    m = case.meta
    q = case.q[m.num_prefill_tokens :]
    with backend(name):
        got = paged_decode_attention(q, quant.k, quant.v, m.decode_block_tables,
                                     m.decode_seq_lens, spec.scale, window=spec.window,
                                     k_scale=quant.k_scale, v_scale=quant.v_scale)
        want = paged_decode_attention(q, twin.k, twin.v, m.decode_block_tables,
                                      m.decode_seq_lens, spec.scale, window=spec.window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_prefill_with_context_dequantizes_the_gathered_blocks(dtype):
    spec = Spec(hkv=3, group=3, head_dim=64, block_size=16, prefills=[(20, 37), (9, 0), (5, 64)],
                decodes=[], seed=5, scale=0.125)
    case = build_case(spec, torch.float32)
    quant, twin = _dequantized_twin(case, dtype)
    m = case.meta
    args = (m.prefill_query_lens, m.prefill_context_lens, m.prefill_block_tables, spec.scale)
    got = paged_prefill_attention(case.q, case.k, case.v, quant.k, quant.v, *args,
                                  k_scale=quant.k_scale, v_scale=quant.v_scale)
    want = paged_prefill_attention(case.q, case.k, case.v, twin.k, twin.v, *args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and close to the float32 reference: the quantization error is small on random data
    assert float((got - case.ref).abs().max()) < (0.03 if dtype == torch.int8 else 0.15)


@pytest.mark.parametrize("name", ["kernel", "torch"])
@pytest.mark.parametrize("dtype", QDTYPES)
def test_full_step_writes_quantized_then_reads(name, dtype):
    spec = Spec(hkv=2, group=2, head_dim=32, block_size=4, prefills=[(7, 5), (6, 0)],
                decodes=[9, 30, 200], seed=3, scale=0.2)
    case = build_case(spec, torch.float32)
    quant, _ = _dequantized_twin(case, dtype)
    with backend(name):
        out = paged_attention(case.q, case.k, case.v, quant, case.meta, spec.scale)
    h, d = case.k.shape[1:]
    slots = case.meta.slot_mapping
    qk, sk = quantize(case.k, dtype)
    assert torch.equal(quant.k.view(-1, h, d)[slots].view(torch.uint8), qk.view(torch.uint8))
    assert torch.equal(quant.k_scale.view(-1, h)[slots], sk)
    assert float((out - case.ref).abs().max()) < (0.03 if dtype == torch.int8 else 0.15)


def test_scales_must_come_with_a_quantized_cache():
    spec = Spec(hkv=1, group=1, head_dim=8, block_size=4, prefills=[], decodes=[5], seed=0,
                scale=0.3)
    case = build_case(spec, torch.float32)
    quant, _ = _dequantized_twin(case, torch.int8)
    m = case.meta
    with pytest.raises(StorageMismatchError):
        paged_decode_attention(case.q, quant.k, quant.v, m.decode_block_tables, m.decode_seq_lens,
                               0.3)
    with pytest.raises(StorageMismatchError):
        paged_decode_attention(case.q, case.k_cache, case.v_cache, m.decode_block_tables,
                               m.decode_seq_lens, 0.3, k_scale=quant.k_scale,
                               v_scale=quant.v_scale)


# --- engine -----------------------------------------------------------------------------------


def test_unknown_kv_dtype_fails_before_the_model_loads(tmp_path):
    from pagedkv.engine import LLMEngine

    missing = tmp_path / "no-such-model.gguf"  # loading it would raise ModelLoadError
    with pytest.raises(CacheConfigError, match="fp8_e4m3"):
        LLMEngine(str(missing), kv_cache_dtype="q4_0")


def test_serve_parser_takes_kv_cache_dtype():
    from pagedkv.cli import build_parser

    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert args.kv_cache_dtype == "int8"


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_engine_generates_with_a_quantized_cache(smollm2, name):
    from pagedkv.engine import LLM, SamplingParams

    llm = LLM(smollm2, kv_cache_dtype=name, kv_cache_memory="16MiB", block_size=16)
    st_ = llm.engine.storage
    assert st_.dtype == resolve_kv_cache_dtype(name) and st_.memory_bytes <= 16 * 2**20
    assert st_.memory_bytes > 16 * 2**20 - st_.bytes_per_block
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


def test_int8_perplexity_within_half_a_percent_of_float32(smollm2):
    from pagedkv.bench.kvquant_eval import perplexity, text_token_ids

    ids = text_token_ids(smollm2.tokenizer, 640)
    ref = perplexity(smollm2.model, ids, torch.float32, chunk=160)
    got = perplexity(smollm2.model, ids, torch.int8, chunk=160)
    assert abs(got / ref - 1) < 0.005, (ref, got)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_prefix_cache_hit_serves_the_quantized_blocks_with_their_scales(dtype):
    st_ = KVStorage(L, 8, 4, H, D, dtype)
    c = PagedKVCache(8, 4, storage=st_)
    prompt = list(range(50, 59))  # two full blocks and one partial
    c.create("a", prompt)
    slots = c.slot_mapping(["a"], [len(prompt)])
    for layer in range(L):
        k = torch.randn(len(prompt), H, D)
        st_.write(layer, slots, k, -k)
    full = c.block_ids("a")[:2]
    written = [[st_.read(layer, b * 4 + o) for b in full for o in range(4)] for layer in range(L)]
    c.free("a")
    assert c.create("b", prompt) == 8  # the two full blocks are prefix hits
    assert c.block_ids("b")[:2] == full
    for layer in range(L):
        for i, (b, o) in enumerate((b, o) for b in full for o in range(4)):
            got = st_.read(layer, b * 4 + o)
            assert torch.equal(got[0], written[layer][i][0]) and torch.equal(got[1], written[layer][i][1])


@pytest.mark.parametrize("name", ["kernel", "torch"])
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("head_dim", [12, 20, 72])  # not a multiple of 8: the scalar tails
def test_decode_quantized_any_head_dim(name, dtype, head_dim):
    spec = Spec(hkv=2, group=3, head_dim=head_dim, block_size=4, prefills=[],
                decodes=[1, 13, 150], seed=9, scale=0.2)
    case = build_case(spec, torch.float32)
    quant, twin = _dequantized_twin(case, dtype)
    m = case.meta
    with backend(name):
        got = paged_decode_attention(case.q, quant.k, quant.v, m.decode_block_tables,
                                     m.decode_seq_lens, 0.2, k_scale=quant.k_scale,
                                     v_scale=quant.v_scale)
    want = paged_decode_attention(case.q, twin.k, twin.v, m.decode_block_tables,
                                  m.decode_seq_lens, 0.2)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_a_huge_unknown_kv_cache_dtype_is_refused_with_a_short_message() -> None:
    """A 100,000-character kv_cache_dtype (a hostile --kv-cache-dtype) is refused with a typed
    error that names the supported values and echoes only its first 40 characters."""
    from pagedkv.cache.quant import resolve_kv_cache_dtype
    from pagedkv.errors import CacheConfigError

    with pytest.raises(CacheConfigError, match="choose one of") as err:
        resolve_kv_cache_dtype("x" * 100_000)
    assert len(str(err.value)) < 300
