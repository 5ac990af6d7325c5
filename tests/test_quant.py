"""Quantized weights (pagedkv/model/quant.py + qmatmul.cpp) against the gguf package.

Every ggml type the kernel reads is checked on blocks made by gguf's own quantizer (Q4_0, Q4_1,
Q8_0, F16/BF16/F32) or on random bytes (every byte pattern is a valid block; the fp16 scale
fields are drawn finite), against `gguf.quants.dequantize`: looked-up rows must be
bit-identical, products equal up to float32 summation order, on the AVX2 and AVX-512 paths. The
same holds for the pure-torch fallback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from test_model import F32_TOL, _tokens, hf_logits, max_diff, prefill_then_decode, run_paged

from pagedkv.errors import InvalidArgumentError, ModelLoadError, UnsupportedModelError
from pagedkv.model import load_model, qkernel, quant
from pagedkv.model.quant import QWeight

KERNEL_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
                Q.Q6_K, Q.IQ4_XS, Q.F16, Q.BF16, Q.F32]
GGUF_QUANTIZED = {Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16, Q.F32}  # blocks from gguf's quantizer
F16_FIELDS = {  # byte offsets of each block's fp16 scales (the rest of a block: any bytes)
    Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.IQ4_NL: (0,), Q.Q2_K: (80, 82), Q.Q3_K: (108,),
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_XS: (0,), Q.TQ2_0: (64,),
}


def _f16_bytes(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).view(np.uint8).reshape(*a.shape, 2)


def _blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, row_bytes] of valid `qtype` blocks."""
    rng = np.random.default_rng(seed)
    if qtype in GGUF_QUANTIZED:
        w = rng.standard_normal((n, k)).astype(np.float32)
        w[0, :32] = 0.0  # an all-zero block (scale 0)
        return np.ascontiguousarray(quantize(w, qtype)).view(np.uint8).reshape(n, -1)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:  # signed scales of either sign, some subnormal, one zero
        raw[..., at : at + 2] = _f16_bytes(rng.uniform(-2e-2, 2e-2, (n, k // block)))
    raw[0, 0, F16_FIELDS[qtype][0] : F16_FIELDS[qtype][0] + 2] = 0
    return raw.reshape(n, -1)


def _case(qtype: Q, n: int = 72, seed: int = 0, k: int = 0) -> tuple[QWeight, torch.Tensor]:
    k = k or (512 if GGML_QUANT_SIZES[qtype][0] == 256 else 160)
    data = _blocks(qtype, n, k, seed)
    ref = torch.from_numpy(dequantize(data, qtype).astype(np.float32)).reshape(n, k)
    return QWeight(k, [(qtype, torch.from_numpy(data.copy()))]), ref


@pytest.fixture(params=["kernel", "fallback"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "kernel":
        if not qkernel.load():
            pytest.skip(f"kernel unavailable: {qkernel.info()['error']}")
    else:
        monkeypatch.setattr(qkernel, "load", lambda: False)
        monkeypatch.setattr(qkernel, "qmatmul", lambda: None)
    return request.param


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda q: q.name)
def test_rows_and_products_match_gguf(qtype: Q, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    qw, ref = _case(qtype)
    ids = torch.tensor([5, 0, 71, 5])
    assert torch.equal(qw.rows(ids), ref[ids])  # bit-identical dequantization
    gen = torch.Generator().manual_seed(1)
    monkeypatch.setattr(quant, "GEMM_MIN_ROWS", 1 << 30)  # qgemm: test_gemm_for_many_rows
    for limit in (1 << 30, 0):  # every row count through the streaming kernel, then the tiles
        monkeypatch.setattr(quant, "TILED_ROWS", limit)
        for t in (1, 2, 3, 4, 5, 6, 7, 8, 16, 41):  # fused groups of 4, one chain per row at 5-8
            x = torch.randn(t, qw.k, generator=gen)
            got, want = qw.linear(x), x @ ref.t()
            assert got.shape == (t, qw.n)
            assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()) + 1e-6


@pytest.mark.parametrize("k", [0, 1280], ids=["small-k", "k1280"])
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda q: q.name)
def test_exact_rows_do_not_depend_on_the_batch(qtype: Q, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the streaming kernel, each row gets the bits it gets alone at every row count
    (weight-row pairs for one row, groups of 4 or 8 and their remainders; with AVX-512 weight-row
    pairs against groups of up to 4 rows, an odd weight row left alone), on the AVX2 path and on
    the AVX-512 one where the CPU has it (pagedkv_q.limit_isa); the two agree up to summation
    order, and both dequantize rows (qrows: the tiles) bit for bit. K = 1280: 8 rows of x pass
    L1, so AVX-512 pairs weight rows at every row count there. AVX2 sums 5-8 rows in one chain
    per row by default (qmatmul.cpp: wide_rows): the same bits as alone only with
    pagedkv_q.batch_invariant on, else the same sums up to rounding."""
    if not qkernel.load():
        pytest.skip(f"kernel unavailable: {qkernel.info()['error']}")
    qw, ref = _case(qtype, n=73, k=k)
    monkeypatch.setattr(quant, "TILED_ROWS", 1 << 30)
    monkeypatch.setattr(quant, "GEMM_MIN_ROWS", 1 << 30)
    x = torch.randn(16, qw.k, generator=torch.Generator().manual_seed(4))
    ops, alone = torch.ops.pagedkv_q, {}
    avx512 = ops.isa() >= 2
    before = ops.batch_invariant(False)
    try:
        for level in (1, 2):
            ops.limit_isa(level)
            assert torch.equal(qw.rows(torch.arange(qw.n)), ref)  # the tiles' dequantizer
            alone[level] = torch.cat([qw.linear(x[i : i + 1]) for i in range(16)])
            wide = level == 1 or not avx512  # this level runs the AVX2 code
            for t in (2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16):  # groups of 4 / 8, pairs of 4, remainders
                got = qw.linear(x[:t])
                if wide and 5 <= t <= 8:  # one chain per row: the same sums up to rounding
                    err = float((got - alone[level][:t]).abs().max())
                    assert err <= 1e-5 * float(alone[level].abs().max()) + 1e-6, (level, t)
                    ops.batch_invariant(True)
                    got = qw.linear(x[:t])
                    ops.batch_invariant(False)
                assert torch.equal(got, alone[level][:t]), (level, t)
    finally:
        ops.limit_isa(2)
        ops.batch_invariant(before)
    want = x @ ref.t()
    for got in alone.values():
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()) + 1e-6
    with pytest.raises(RuntimeError, match="level must be"):
        ops.limit_isa(3)


SUPER_TYPES = [q for q in KERNEL_TYPES if GGML_QUANT_SIZES[q][0] == 256]


@pytest.mark.parametrize("blocks", [1, 3], ids=["1sb", "3sb"])
@pytest.mark.parametrize("qtype", SUPER_TYPES, ids=lambda q: q.name)
def test_rows_of_one_and_three_super_blocks(qtype: Q, blocks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The row kernel unpacks a super-block's scales one super-block ahead: rows of one (nothing
    ahead) and three (the buffers' parity comes round) give gguf's products on both ISAs."""
    if not qkernel.load():
        pytest.skip(f"kernel unavailable: {qkernel.info()['error']}")
    k, n = 256 * blocks, 37
    data = _blocks(qtype, n, k, seed=blocks)
    ref = torch.from_numpy(dequantize(data, qtype).astype(np.float32)).reshape(n, k)
    qw = QWeight(k, [(qtype, torch.from_numpy(data.copy()))])
    monkeypatch.setattr(quant, "TILED_ROWS", 1 << 30)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(9))
    want = x @ ref.t()
    try:
        for level in (1, 2):
            torch.ops.pagedkv_q.limit_isa(level)
            for t in (1, 2, 8):
                got = qw.linear(x[:t])
                assert float((got - want[:t]).abs().max()) <= 1e-5 * float(want.abs().max()) + 1e-6, (level, t)
    finally:
        torch.ops.pagedkv_q.limit_isa(2)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda q: q.name)
def test_gemm_for_many_rows(qtype: Q) -> None:
    """qgemm (QWeight's path from gemm_min_rows(k) rows, in blocks of GEMM_MAX_ROWS), on its AVX2
    path and on its AVX-512 one where the CPU has it (pagedkv_q.limit_isa): gguf's values up to
    summation order, only its columns written, each row the same bits at every row count, and
    QWeight routes those calls to it, past GEMM_MAX_ROWS in blocks (the same bits)."""
    if not qkernel.load():
        pytest.skip(f"kernel unavailable: {qkernel.info()['error']}")
    # 75 rows: a partial panel of weight rows (past 16 and 32); K past one of the AVX2 gemm's
    # slices (qmatmul_simd.inc: slice_for, 256 up to 16 rows), the 32-element types' with a partial last one
    qw, ref = _case(qtype, n=75, k=512 if GGML_QUANT_SIZES[qtype][0] == 256 else 416)
    data, gen = qw.parts[0][1], torch.Generator().manual_seed(9)
    x = torch.randn(100, qw.k, generator=gen)
    want = x @ ref.t()
    limit = torch.ops.pagedkv_q.limit_isa
    try:
        for level in (1, 2):
            limit(level)
            full = torch.empty(100, qw.n)
            torch.ops.pagedkv_q.qgemm(x, data, int(qtype), full, 0)
            assert float((full - want).abs().max()) <= 1e-5 * float(want.abs().max()) + 1e-6
            for t in (1, 4, 5, 6, 7, 8, 13, 40, 65):  # register blocks of up to 6 rows, split evenly
                out = torch.full((t, qw.n + 3), float("nan"))
                torch.ops.pagedkv_q.qgemm(x[:t], data, int(qtype), out, 2)
                assert out[:, :2].isnan().all() and out[:, -1].isnan().all()
                if qkernel.gemm() is not None:
                    assert torch.equal(out[:, 2:-1], full[:t]), (level, t)
                if quant.gemm_min_rows(qw.k) <= t <= quant.GEMM_MAX_ROWS and qkernel.gemm() is not None:
                    assert torch.equal(qw.linear(x[:t]), full[:t])
            if qkernel.gemm() is not None:  # 100 rows in blocks of 24: four and a partial one
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(quant, "GEMM_MAX_ROWS", 24)
                    assert torch.equal(qw.linear(x), full), level
    finally:
        limit(2)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda q: q.name)
def test_batch_invariant_gemm_gives_the_row_kernels_bits(qtype: Q) -> None:
    """pagedkv_q.batch_invariant (PAGEDKV_BATCH_INVARIANT=1): qgemm sums in the row kernels' order,
    so each row of a many-row call is the bits of that row alone (the row kernel), at every row
    count and across its slices and partial panels, on the AVX2 path and the AVX-512 one where the
    CPU has it. Off (the default) qgemm keeps its own order: the same sums up to rounding."""
    if not qkernel.load() or qkernel.gemm() is None:
        pytest.skip("needs the compiled gemm")
    qw, _ = _case(qtype, n=75, k=512 if GGML_QUANT_SIZES[qtype][0] == 256 else 416)
    data, x = qw.parts[0][1], torch.randn(70, qw.k, generator=torch.Generator().manual_seed(4))
    ops = torch.ops.pagedkv_q
    before = ops.batch_invariant(True)
    try:
        for level in (1, 2):
            ops.limit_isa(level)
            alone = torch.empty(70, qw.n)
            for i in range(70):
                ops.qmatmul(x[i : i + 1], data, int(qtype), alone[i : i + 1], 0)
            for t in (2, 8, 9, 13, 17, 40, 70):  # row kernel groups, then qgemm's blocks of 1-6 rows
                out = torch.empty(t, qw.n)
                (ops.qgemm if t >= 9 else ops.qmatmul)(x[:t], data, int(qtype), out, 0)
                assert torch.equal(out.view(torch.int32), alone[:t].view(torch.int32)), (level, t)
        ops.batch_invariant(False)
        out = torch.empty(40, qw.n)
        ops.qgemm(x[:40], data, int(qtype), out, 0)
        assert float((out - alone[:40]).abs().max()) <= 1e-5 * float(alone.abs().max()) + 1e-6
    finally:
        ops.limit_isa(2)
        ops.batch_invariant(before)


def test_batch_invariant_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """PAGEDKV_BATCH_INVARIANT takes 1/true/yes/on or 0/false/no/off; anything else is a typed
    error naming the variable, never a silent default."""
    for value, want in (("1", True), (" On ", True), ("0", False), ("", False), ("no", False)):
        monkeypatch.setenv("PAGEDKV_BATCH_INVARIANT", value)
        assert qkernel.batch_invariant() is want
    monkeypatch.setenv("PAGEDKV_BATCH_INVARIANT", "sometimes" * 20)
    with pytest.raises(InvalidArgumentError, match="PAGEDKV_BATCH_INVARIANT"):
        qkernel.batch_invariant()


def test_gemm_rejects_bad_arguments() -> None:
    if not qkernel.load():
        pytest.skip(f"kernel unavailable: {qkernel.info()['error']}")
    qw, _ = _case(Q.Q4_1)
    data, op = qw.parts[0][1], torch.ops.pagedkv_q.qgemm
    with pytest.raises(RuntimeError, match="out must be"):
        op(torch.zeros(20, qw.k), data, int(Q.Q4_1), torch.zeros(20, qw.n - 1), 0)
    with pytest.raises(RuntimeError, match="out must be"):
        op(torch.zeros(20, qw.k), data, int(Q.Q4_1), torch.zeros(20, qw.n), 1)
    with pytest.raises(RuntimeError):
        op(torch.zeros(20, qw.k), data, int(Q.Q8_0), torch.zeros(20, qw.n), 0)  # wrong row bytes
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.zeros(qw.k, 20).t(), data, int(Q.Q4_1), torch.zeros(20, qw.n), 0)


def test_mixed_segments_and_output_columns(path: str) -> None:
    """A fused projection whose parts have different types writes each part's columns."""
    a, ra = _case(Q.Q4_K, n=32, seed=1)
    data_b = _blocks(Q.Q6_K, 48, 512, seed=2)
    rb = torch.from_numpy(dequantize(data_b, Q.Q6_K).astype(np.float32)).reshape(48, 512)
    qw = QWeight(512, [a.parts[0], (Q.Q6_K, torch.from_numpy(data_b.copy()))])
    assert qw.shape == (80, 512) and qw.nbytes == a.nbytes + data_b.size
    x = torch.randn(3, 512)
    want = x @ torch.cat([ra, rb]).t()
    assert float((qw.linear(x) - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_types_without_kernel_become_exact_float_rows() -> None:
    """A type no kernel reads (here the ternary TQ2_0) becomes float32 rows, and says so."""
    data = _blocks(Q.TQ2_0, 8, 512, seed=3)
    qw = QWeight(512, [(Q.TQ2_0, torch.from_numpy(data.copy()))])
    assert qw.parts[0][0] == Q.F32 and qw.expanded == {"TQ2_0": 8 * 512 * 4}
    ref = torch.from_numpy(dequantize(data, Q.TQ2_0).astype(np.float32)).reshape(8, 512)
    assert torch.equal(qw.dequantize(), ref)
    kept, _ = _case(Q.Q5_0)
    assert kept.parts[0][0] == Q.Q5_0 and kept.expanded == {}


def test_kernel_type_table_matches_gguf() -> None:
    """ggml_blocks.h's table (pagedkv_q.types) is quant.KERNEL_TYPES at gguf's block sizes; a
    table that disagrees makes the kernel unusable rather than wrong."""
    if not qkernel.load():
        pytest.skip(f"kernel unavailable: {qkernel.info()['error']}")
    table = list(torch.ops.pagedkv_q.types())
    assert {Q(t) for t in table[::3]} == quant.KERNEL_TYPES == set(KERNEL_TYPES)
    qkernel._check_types(table)
    with pytest.raises(RuntimeError, match="disagrees"):
        qkernel._check_types([*table[:-1], table[-1] + 2])


def test_bad_shapes_are_typed_errors() -> None:
    with pytest.raises(UnsupportedModelError):
        QWeight(100, [(Q.Q8_0, torch.zeros(4, 34, dtype=torch.uint8))])  # 100 % 32 != 0
    with pytest.raises(UnsupportedModelError):
        QWeight(64, [(Q.Q8_0, torch.zeros(4, 34, dtype=torch.uint8))])  # 64 elements need 68 bytes
    if qkernel.load():
        qw, _ = _case(Q.Q8_0)
        with pytest.raises(RuntimeError, match="outside"):
            qw.rows(torch.tensor([qw.n]))


def test_fused_add_rms_norm_matches_torch() -> None:
    if not qkernel.load():
        pytest.skip("kernel unavailable")
    x, d, w = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    want_x = x + d
    want = torch.nn.functional.rms_norm(want_x, (96,), w, 1e-5)
    out = torch.empty_like(x)
    torch.ops.pagedkv_ops.add_rms_norm(x, d, w, 1e-5, out)
    assert torch.equal(x, want_x) and torch.allclose(out, want, rtol=1e-5, atol=1e-6)


# --- whole models -------------------------------------------------------------------------------


def _write_quantized_tiny(hf: Any, path: Path, kinds: tuple[Q, ...] = (Q.Q8_0, Q.Q4_0, Q.Q4_1)) -> None:
    """A tiny qwen2 GGUF whose matrices are `kinds` blocks (in turn) made by gguf's quantizer."""
    import gguf
    from test_model import _GGUF_LAYER_NAMES

    c = hf.config
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    for i, (name, t) in enumerate(hf.state_dict().items()):
        if name == "lm_head.weight":
            continue  # tied
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, li, *mid, kind = name.split(".")
            gname = f"blk.{li}.{_GGUF_LAYER_NAMES['.'.join(mid)]}.{kind}"
        arr = t.float().numpy()
        if arr.ndim == 2:
            qt = kinds[i % len(kinds)]
            w.add_tensor(gname, quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_quantized_gguf_matches_transformers(tmp_path: Path) -> None:
    from test_model import _tiny
    from transformers import AutoModelForCausalLM

    _write_quantized_tiny(_tiny("qwen2"), tmp_path / "q.gguf")
    quant = load_model(tmp_path / "q.gguf")  # default: quantized
    flat = load_model(tmp_path / "q.gguf", weights="float32")
    assert quant.weights == "quantized" and flat.weights == "float32"
    assert quant.weight_bytes < flat.weight_bytes / 2
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q.gguf", dtype=torch.float32)
    seq = _tokens(21, seed=8)
    out = run_paged(quant.model, [seq], prefill_then_decode(17, 21), block_size=16)
    assert max_diff(out, [hf_logits(ref.eval(), seq)]) < F32_TOL
    assert max_diff(out, run_paged(flat.model, [seq], prefill_then_decode(17, 21), 16)) < F32_TOL


def test_llama_cpp_fallback_types_stay_quantized(tmp_path: Path) -> None:
    """Q5_0 / Q5_1 (what llama.cpp's K-quant presets put into matrices whose rows are not a
    multiple of 256) are kept as the file's blocks, none expanded, and the model computes what
    the float32 dequantization computes; the start-up line says so."""
    from test_model import _tiny

    from pagedkv.startup import engine_lines

    _write_quantized_tiny(_tiny("qwen2"), tmp_path / "q.gguf", (Q.Q5_0, Q.Q5_1, Q.Q8_0))
    quant = load_model(tmp_path / "q.gguf")
    flat = load_model(tmp_path / "q.gguf", weights="float32")
    types = {q for w in quant.model.qweights() for q, _ in w.parts}
    assert {Q.Q5_0, Q.Q5_1} <= types and quant.model.expanded_weights() == {}
    seq = _tokens(21, seed=3)
    out = run_paged(quant.model, [seq], prefill_then_decode(17, 21), block_size=16)
    assert max_diff(out, run_paged(flat.model, [seq], prefill_then_decode(17, 21), 16)) < F32_TOL
    from pagedkv import LLM

    llm = LLM(str(tmp_path / "q.gguf"), num_blocks=8)
    line = engine_lines(llm.engine, str(tmp_path / "q.gguf"), "float32")[0]
    assert "kept quantized as in the file," in line and "expanded" not in line
    assert "exact float32 activations (--activations int8:" in line  # the faster mode, named
    fast = LLM(str(tmp_path / "q.gguf"), num_blocks=8, activations="int8")
    assert "int8 activations (approximate)" in engine_lines(fast.engine, str(tmp_path / "q.gguf"), "float32")[0]
    if qkernel.load():  # the vector code the matmuls run
        assert f", {qkernel.isa()} kernels" in line


def test_weights_option_is_validated(tmp_path: Path) -> None:
    from test_model import _tiny

    hf = _tiny("qwen2")
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(hf, weights="quantized")
    with pytest.raises(ModelLoadError, match="unsupported weights"):
        load_model(hf, weights="int3")
    with pytest.raises(ModelLoadError, match="float32"):
        load_model(hf, weights="quantized", dtype="bfloat16")
    assert load_model(hf).weights == "float32"  # not a GGUF: float weights


def test_smollm2_keeps_file_bytes(smollm2: Any) -> None:
    """The default model stays as small as its file: Q4_1 layers, Q8_0 tied embeddings."""
    assert smollm2.weights == "quantized"
    m = smollm2.model
    assert m.lm_head_q is m.embed_q and m.embed_q.parts[0][0] == Q.Q8_0
    assert m.layers[0].gate_up_proj.q.parts[0][0] == Q.Q4_1
    assert smollm2.weight_bytes < 100e6  # float32 weights would be ~538 MB


def test_smollm2_quantized_logits_match_transformers(smollm2: Any, hf_smollm2: Any) -> None:
    ids = torch.tensor(smollm2.tokenizer("The paged KV cache stores keys and values").input_ids)
    out = run_paged(smollm2.model, [ids], prefill_then_decode(len(ids) - 3, len(ids)), 16)
    assert max_diff(out, [hf_logits(hf_smollm2, ids)]) < F32_TOL


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q6_K], ids=lambda q: q.name)
def test_batch_weights_float32_copy_is_used_above_the_kernel_rows(qtype: Q) -> None:
    """batch_weights="float32": calls above PACKED_TILED_ROWS multiply the (packed) float32 copy, equal
    to the dequantized product up to summation order; smaller calls are untouched (bitwise);
    back to "quantized" drops the copy and gives the tiles' products again (bitwise)."""
    if not qkernel.load():
        pytest.skip(f"kernel unavailable: {qkernel.info()['error']}")
    w, ref = _case(qtype)
    big, small = (torch.randn(t, w.k, generator=torch.Generator().manual_seed(t))
                  for t in (max(quant.TILED_ROWS, quant.PACKED_TILED_ROWS) + 3, 2))
    tiles, kernel = w.linear(big), w.linear(small)
    assert w.batch_bytes == 0
    w.set_batch_weights("float32")
    assert w.batch_bytes == w.n * w.k * 4
    got, want = w.linear(big), big @ ref.t()
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()) + 1e-6
    assert torch.equal(w.linear(small), kernel)
    w.set_batch_weights("quantized")
    assert w.batch_bytes == 0 and torch.equal(w.linear(big), tiles)


def test_batch_weights_option_is_validated() -> None:
    from test_model import _tiny

    w, _ = _case(Q.Q4_1)
    with pytest.raises(UnsupportedModelError, match="batch weights"):
        w.set_batch_weights("bfloat16")
    assert w.batch_bytes == 0  # nothing changed
    hf = _tiny("qwen2")
    with pytest.raises(ModelLoadError, match="unsupported batch_weights"):
        load_model(hf, batch_weights="int8")
    with pytest.raises(ModelLoadError, match="needs weights='quantized'"):
        load_model(hf, weights="float32", batch_weights="float32")
    with pytest.raises(ModelLoadError, match="needs quantized GGUF weights"):
        load_model(hf, batch_weights="float32")  # not a GGUF: float weights
    with pytest.raises(ModelLoadError, match="needs activations='int8'"):
        load_model(hf, batch_weights="panel")  # checked before anything loads


def test_smollm2_batch_weights_float32_matches_transformers(smollm2: Any, hf_smollm2: Any) -> None:
    """The float32 copy serves the prefill (more rows than TILED_ROWS); logits stay
    transformers' within the float32 tolerance. The shared model is restored afterwards."""
    ids = torch.tensor(smollm2.tokenizer("A paged cache hands out fixed-size blocks of KV memory "
                                         "from a pool, mapped per sequence by a table").input_ids)
    assert len(ids) - 3 > quant.PACKED_TILED_ROWS
    m = smollm2.model
    try:
        m.set_batch_weights("float32")
        assert m.batch_weight_bytes() > 4 * smollm2.weight_bytes
        out = run_paged(m, [ids], prefill_then_decode(len(ids) - 3, len(ids)), 16)
    finally:
        m.set_batch_weights("quantized")
    assert m.batch_weight_bytes() == 0
    assert max_diff(out, [hf_logits(hf_smollm2, ids)]) < F32_TOL


def test_fused_gelu_tanh_mul_matches_torch() -> None:
    """GeGLU in one pass (x / (1 + e^(-2y)) through the vectorized exp) equals torch's tanh gelu
    (gate) * up to float32 rounding, over the whole range."""
    if not qkernel.load():
        pytest.skip(f"kernel unavailable: {qkernel.info()['error']}")
    gen = torch.Generator().manual_seed(4)
    gu = torch.randn(5, 2 * 77, generator=gen) * 4
    gu[0, :8] = torch.tensor([-200.0, -12.0, -5.0, -1e-30, 0.0, 1e-30, 12.0, 200.0])
    out = torch.empty(5, 77)
    qkernel.fused()[3](gu, out)
    gate, up = gu[:, :77], gu[:, 77:]
    want = torch.nn.functional.gelu(gate.double(), approximate="tanh") * up.double()
    torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=1e-12)


def test_fused_norm_add_rms_norm_matches_torch() -> None:
    """Gemma's output norm, residual add and next norm in one pass equal the three torch ops."""
    if not qkernel.load():
        pytest.skip(f"kernel unavailable: {qkernel.info()['error']}")
    gen = torch.Generator().manual_seed(5)
    x, delta = torch.randn(7, 640, generator=gen), torch.randn(7, 640, generator=gen) * 30
    wd, w = torch.rand(640, generator=gen) + 0.5, torch.rand(640, generator=gen) * 4
    want_x = x + torch.nn.functional.rms_norm(delta, (640,), wd, 1e-6)
    want = torch.nn.functional.rms_norm(want_x, (640,), w, 1e-6)
    out = torch.empty_like(x)
    qkernel.fused()[4](x, delta, wd, w, 1e-6, out)
    torch.testing.assert_close(x, want_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_fused_norm_rope_matches_torch() -> None:
    """QK-norm and RoPE in one pass (Qwen3, Gemma 3): each head of a strided q|k view RMS-normed,
    times its weights, then rotated, equals rms_norm + mul + the rope op; bad weights or eps are
    refused before anything is written."""
    if not qkernel.load():
        pytest.skip(f"kernel unavailable: {qkernel.info()['error']}")
    gen = torch.Generator().manual_seed(6)
    t, h, d = 5, 6, 128
    qkv = torch.randn(t, (h + 2) * d, generator=gen) * 20
    x = qkv[:, : h * d].view(t, h, d)  # rows of stride (h + 2) d, as DecoderLayer's view
    w = torch.rand(h, d, generator=gen) + 0.5
    cos, sin = torch.randn(t, d, generator=gen), torch.randn(t, d, generator=gen)
    want = torch.empty(t, h, d)
    qkernel.fused()[0](torch.nn.functional.rms_norm(x, (d,), None, 1e-6).mul_(w), cos, sin, want)
    out = torch.full((t, h, d), float("nan"))
    qkernel.fused()[5](x, w, 1e-6, cos, sin, out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    for bad_w, eps, match in ((w[:, :64], 1e-6, r"\[H, D\]"), (w.t(), 1e-6, "contiguous"),
                              (w, float("nan"), "eps"), (w, -1.0, "eps")):
        out.fill_(float("nan"))
        with pytest.raises(RuntimeError, match=match):
            qkernel.fused()[5](x, bad_w, eps, cos, sin, out)
        assert out.isnan().all()


def test_fused_silu_mul_matches_torch() -> None:
    """SwiGLU in one pass (vectorized exp with AVX2) equals torch's silu(gate) * up to float32
    rounding, over the whole range (very negative gates give 0, very positive ones the gate)."""
    if not qkernel.load():
        pytest.skip(f"kernel unavailable: {qkernel.info()['error']}")
    gen = torch.Generator().manual_seed(3)
    gu = torch.randn(5, 2 * 77, generator=gen) * 6  # 77: 9 vectors of 8 and a scalar tail
    gu[0, :8] = torch.tensor([-200.0, -90.0, -87.0, -1e-30, 0.0, 1e-30, 87.0, 200.0])
    out = torch.empty(5, 77)
    qkernel.fused()[1](gu, out)
    gate, up = gu[:, :77], gu[:, 77:]
    want = torch.nn.functional.silu(gate.double()) * up.double()
    torch.testing.assert_close(out.double(), want, rtol=3e-7, atol=1e-30)


def test_batch_weights_copies_are_all_or_nothing(smollm2: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that cannot be built (memory) leaves no copy behind: the model is as before."""
    m = smollm2.model
    calls = {"n": 0}
    real = QWeight.dequantize

    def fail_third(self: QWeight) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise MemoryError("no room for the float32 copy")
        return real(self)

    monkeypatch.setattr(QWeight, "dequantize", fail_third)
    with pytest.raises(MemoryError):
        m.set_batch_weights("float32")
    assert calls["n"] == 3 and m.batch_weight_bytes() == 0


def test_fused_argmax_is_torch_max() -> None:
    """The sampler's row maximum: the first maximum and its index, as torch.max(dim=-1), with
    NaN winning (first NaN) and +inf/-inf rows as torch reports them; any width."""
    if not qkernel.load():
        pytest.skip(f"kernel unavailable: {qkernel.info()['error']}")
    gen = torch.Generator().manual_seed(5)
    for v in (1, 7, 8, 9, 64, 49152 + 3):
        x = torch.randn(9, v, generator=gen)
        x[1] = x[1].round()  # many ties: the first maximum wins
        x[2, v // 2] = float("nan")
        x[3, -1] = float("inf")
        x[4] = float("-inf")
        x[5] = 7.0  # all equal
        if v > 3:
            x[6, 1] = x[6, v - 1] = float("nan")
            x[7, 2] = x[7, v - 2] = 100.0  # a tie at the maximum, far apart
        best, idx = torch.empty(9), torch.empty(9, dtype=torch.int64)
        qkernel.argmax()(x, best, idx)
        want_best, want_idx = x.max(dim=-1)
        assert torch.equal(idx, want_idx), (v, idx, want_idx)
        assert torch.equal(best.isnan(), want_best.isnan())
        assert torch.equal(best[~best.isnan()], want_best[~want_best.isnan()])


def test_kernels_build_without_avx2_and_agree(tmp_path: Path) -> None:
    """The fallback rule's other half: qmatmul.cpp, qmatmul_a8.cpp, qmatmul_a8x.cpp, qmatmul_panel.cpp
    and fused_ops.cpp built with no AVX2/FMA/F16C (their scalar paths, under renamed op namespaces)
    compute what the AVX2 build computes: the exact matmul up to summation order, the int8 ones
    and the argmax bit for bit, SwiGLU within float32 rounding."""
    if not qkernel.load():
        pytest.skip(f"kernel unavailable: {qkernel.info()['error']}")
    from torch.utils.cpp_extension import load as cpp_load

    from pagedkv.attention.kernel import SIMD_PRELUDE

    sources = []
    for path in qkernel._SOURCES:  # each its own translation unit, as qkernel builds them
        text = path.read_text()
        for ns in ("pagedkv_q", "pagedkv_a8", "pagedkv_ops"):
            text = text.replace(f"TORCH_LIBRARY({ns},", f"TORCH_LIBRARY({ns}_s,")
            text = text.replace(f"TORCH_LIBRARY_FRAGMENT({ns},", f"TORCH_LIBRARY_FRAGMENT({ns}_s,")
            text = text.replace(f"TORCH_LIBRARY_IMPL({ns},", f"TORCH_LIBRARY_IMPL({ns}_s,")
        sources.append(tmp_path / path.name)
        sources[-1].write_text(text)
    (tmp_path / "build").mkdir()
    cpp_load("pagedkv_scalar_check", [str(p) for p in sources], extra_cflags=["-O2", "-fopenmp", "-ffp-contract=off"],
             extra_ldflags=["-fopenmp"], extra_include_paths=[str(qkernel._DIR), str(SIMD_PRELUDE.parent)],
             build_directory=str(tmp_path / "build"), is_python_module=False)
    ops, sops = (torch.ops.pagedkv_q, torch.ops.pagedkv_a8, torch.ops.pagedkv_ops), (
        torch.ops.pagedkv_q_s, torch.ops.pagedkv_a8_s, torch.ops.pagedkv_ops_s)
    gen = torch.Generator().manual_seed(7)
    for qtype in KERNEL_TYPES:
        data = torch.from_numpy(_blocks(qtype, 70, 512, 1).copy())
        for t in (1, 2, 5):
            x = torch.randn(t, 512, generator=gen)
            a, b = torch.empty(t, 70), torch.empty(t, 70)
            ops[0].qmatmul(x, data, int(qtype), a, 0)
            sops[0].qmatmul(x, data, int(qtype), b, 0)
            assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max()) + 1e-6
            if qtype in quant.A8_TYPES:
                ops[1].linear(x, [data], [int(qtype)], a, 0)
                sops[1].linear(x, [data], [int(qtype)], b, 0)
                assert torch.equal(a, b)
            if qtype in quant.PANEL_TYPES:
                ops[1].panel(x, [data], [int(qtype)], a, 0)  # VNNI where the CPU has it
                sops[1].panel(x, [data], [int(qtype)], b, 1)
                assert torch.equal(a, b)
    gu = torch.randn(3, 2 * 77, generator=gen) * 5
    o1, o2 = torch.empty(3, 77), torch.empty(3, 77)
    ops[2].silu_mul(gu, o1)
    sops[2].silu_mul(gu, o2)
    torch.testing.assert_close(o1, o2, rtol=1e-6, atol=1e-7)
    x = torch.randn(5, 1003, generator=gen)
    x[2, 5] = float("nan")
    (b1, i1), (b2, i2) = ((torch.empty(5), torch.empty(5, dtype=torch.int64)) for _ in range(2))
    ops[2].argmax(x, b1, i1)
    sops[2].argmax(x, b2, i2)
    assert torch.equal(i1, i2)
