"""The opt-in activation-quantized matmul (activations="int8", qmatmul_a8.cpp and qmatmul_a8x.cpp)
against a numpy reference of the same int8 arithmetic, for Q4_0, Q4_1 and Q8_0 weights made by
the gguf package's quantizer and random valid blocks of every other kernel type; the scalar path
against the AVX2 one (bit-identical); QWeight's routing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from test_quant import _blocks

from pagedkv.errors import UnsupportedModelError
from pagedkv.model import qkernel, quant
from pagedkv.model.quant import QWeight

A8 = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
A8B = [Q.Q5_0, Q.Q5_1, Q.IQ4_NL]  # the other 32-element types (activations per 32)
A8X = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]  # super-block types (activations per 256)
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 40]

needs_kernel = pytest.mark.skipif(not qkernel.load(), reason="needs the compiled kernel")


def _weights(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block
    return np.ascontiguousarray(quantize(w, qtype)).view(np.uint8).reshape(n, -1)


def _acts(t: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 1)
    x = (rng.standard_normal((t, k)) * rng.uniform(0.01, 10, (t, 1))).astype(np.float32)
    x[0, 32:64] = 0.0  # an all-zero activation block (scale 0)
    if k > 64:
        x[-1, 64:96] *= 1e4  # one loud block
    return x


def ref_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int8 blocks of 32: d = max|x| / 127, q = rint(x * (1 / d)), s = d * sum(q) (float32)."""
    t, k = x.shape
    b = x.reshape(t, k // 32, 32)
    d = (np.abs(b).max(-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(b * inv[..., None]).astype(np.int8)
    s = (d * q.astype(np.int32).sum(-1).astype(np.float32)).astype(np.float32)
    return q.reshape(t, k), d, s


def _weight_ints(qtype: Q, data: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(integer weights [N, nb, 32], d [N, nb], m [N, nb]) as the kernel reads the blocks."""
    n = data.shape[0]
    size = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}[qtype]
    blk = data.reshape(n, k // 32, size)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == Q.Q8_0:
        return blk[..., 2:].copy().view(np.int8).astype(np.int32), d, np.zeros_like(d)
    qs = blk[..., 4:] if qtype == Q.Q4_1 else blk[..., 2:]
    w = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int32)
    m = blk[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if qtype == Q.Q4_1 else -8 * d
    return w, d, m


def ref_matmul(qtype: Q, data: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y [T, N] float64, the sum of |terms| per output for the tolerance)."""
    k = x.shape[1]
    xq, xd, xs = ref_quantize(x)
    w, d, m = _weight_ints(qtype, data, k)
    wi, xi = w.astype(np.int64), xq.reshape(x.shape[0], -1, 32).astype(np.int64)
    isum = np.einsum("nbk,tbk->tnb", wi, xi)
    asum = np.einsum("nbk,tbk->tnb", np.abs(wi), np.abs(xi))  # for the rounding bound
    scale = (d[None] * xd[:, None]).astype(np.float32).astype(np.float64)  # dw * dx rounded once
    offset = (m[None] * xs[:, None]).astype(np.float64)
    mag = (np.abs(scale) * asum).sum(-1) + np.abs(offset).sum(-1)
    return (scale * isum + offset).sum(-1), mag


def _ops():  # noqa: ANN202
    return qkernel.a8()[:2]  # quantize, matmul


def _run(qtype: Q, data: np.ndarray, x: np.ndarray, impl: int) -> np.ndarray:
    quantize_op, matmul = _ops()
    xt = torch.from_numpy(x)
    t, k = x.shape
    xq, xd, xs = torch.empty(t, k, dtype=torch.int8), torch.empty(t, k // 32), torch.empty(t, k // 32)
    quantize_op(xt, xq, xd, xs, impl)
    out = torch.full((t, data.shape[0] + 3), -7.0)
    matmul(xq, xd, xs, torch.from_numpy(data), int(qtype), out, 2, impl)
    assert (out[:, :2] == -7).all() and (out[:, -1] == -7).all()  # only its columns written
    return out[:, 2:-1].numpy()


@needs_kernel
@pytest.mark.parametrize("impl", [0, 1], ids=["fast", "scalar"])
def test_quantize_matches_reference_exactly(impl: int) -> None:
    x = _acts(40, 576, 3)
    x[1, :32] = np.linspace(-2.5, 2.5, 32, dtype=np.float32)  # exact halves: ties to even
    quantize_op, _ = _ops()
    xq, xd, xs = torch.empty(40, 576, dtype=torch.int8), torch.empty(40, 18), torch.empty(40, 18)
    quantize_op(torch.from_numpy(x), xq, xd, xs, impl)
    rq, rd, rs = ref_quantize(x)
    assert np.array_equal(xq.numpy(), rq)
    assert np.array_equal(xd.numpy(), rd) and np.array_equal(xs.numpy(), rs)


@needs_kernel
@pytest.mark.parametrize("qtype", A8, ids=lambda q: q.name)
@pytest.mark.parametrize("n,k", [(1, 32), (37, 96), (130, 576)])
def test_matmul_matches_int8_reference(qtype: Q, n: int, k: int) -> None:
    data = _weights(qtype, n, k, seed=n + k)
    for t in ROWS:
        x = _acts(t, k, seed=t)
        fast, scalar = _run(qtype, data, x, 0), _run(qtype, data, x, 1)
        assert np.array_equal(fast, scalar), f"T={t}: the fastest and scalar paths differ"
        assert np.array_equal(_run(qtype, data, x, 2), scalar), f"T={t}: AVX2 and scalar paths differ"
        ref, mag = ref_matmul(qtype, data, x)
        err = np.abs(fast - ref)
        assert (err <= 2e-6 * mag + 1e-30).all(), f"T={t}: max err {err.max()} (mag {mag.max()})"


def ref_matmul_deq(qtype: Q, data: np.ndarray, x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Any type: the gguf package's dequantized weights against x quantized to int8 in blocks of
    `group` (d = max|x| / 127 per block), in float64, and the sum of |terms| for the tolerance."""
    t, k = x.shape
    b = x.reshape(t, k // group, group)
    d = (np.abs(b).max(-1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    xi = np.rint(b * inv[..., None]).astype(np.float64)
    w = dequantize(data, qtype).reshape(data.shape[0], k // group, group).astype(np.float64)
    dd = d[:, None].astype(np.float64)
    return (np.einsum("nbk,tbk->tnb", w, xi) * dd).sum(-1), (np.einsum("nbk,tbk->tnb", np.abs(w), np.abs(xi)) * dd).sum(-1)


def _run_linear(qtype: Q, data: np.ndarray, x: np.ndarray, impl: int) -> np.ndarray:
    out = torch.empty(x.shape[0], data.shape[0])
    qkernel.a8()[2](torch.from_numpy(x), [torch.from_numpy(data)], [int(qtype)], out, impl)
    return out.numpy()


@needs_kernel
@pytest.mark.parametrize("qtype", A8B + A8X, ids=lambda q: q.name)
def test_other_types_match_int8_reference(qtype: Q) -> None:
    """Every other kernel type on the int8 row kernel: random valid blocks (scales of both signs,
    subnormal ones, a zero block), row counts not a multiple of 4; the fastest path (AVX-512
    VNNI for the super-block types where the CPU has it), AVX2 and scalar agree bit for bit."""
    sb = qtype in A8X
    k = 512 if sb else 96
    for n in (1, 37):
        data = _blocks(qtype, n, k, seed=n)
        for t in (1, 2, 3, 4, 5, 9, 17):
            x = _acts(t, k, seed=t)
            fast, scalar = _run_linear(qtype, data, x, 0), _run_linear(qtype, data, x, 1)
            assert np.array_equal(fast, scalar), f"T={t}: the fastest and scalar paths differ"
            # impl 2: AVX2 where impl 0 takes AVX-512 VNNI
            assert np.array_equal(_run_linear(qtype, data, x, 2), scalar), f"T={t}: AVX2 != scalar"
            if not sb:  # the matmul op (activations quantized beforehand) gives the same
                assert np.array_equal(fast, _run(qtype, data, x, 0))
            ref, mag = ref_matmul_deq(qtype, data, x, 256 if sb else 32)
            err = np.abs(fast - ref)
            assert (err <= 1e-5 * mag + 1e-30).all(), f"T={t}: max err {err.max()} (mag {mag.max()})"


@needs_kernel
@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_other_types_are_close_to_exact(qtype: Q) -> None:
    """A real Q4_K_M file's types: int8 activations within ~1.5% of exact."""
    k = 512
    w = QWeight(k, [(qtype, torch.from_numpy(_blocks(qtype, 64, k, 7)))])
    x = torch.from_numpy(_acts(3, k, 5))
    exact = w.linear(x)
    w.set_activations("int8")
    assert w.a8
    rel = (w.linear(x) - exact).norm() / exact.norm()
    assert 0 < rel < 0.015


@needs_kernel
def test_int8_products_are_close_to_exact() -> None:
    """The approximation itself: int8 activations stay within ~1% of the float32 product."""
    data = _weights(Q.Q4_1, 64, 576, 1)
    x = _acts(4, 576, 5)
    w = QWeight(576, [(Q.Q4_1, torch.from_numpy(data.copy()))])
    exact = w.linear(torch.from_numpy(x))
    w.set_activations("int8")
    approx = w.linear(torch.from_numpy(x))
    rel = (approx - exact).norm() / exact.norm()
    assert 0 < rel < 0.02


@needs_kernel
def test_qweight_routes_segments_and_rows() -> None:
    """Q4_1 / Q3_K / Q8_0 segments of one weight, all int8 (one op call quantizes x for all):
    each segment by its row kernel below the panel's rows (quant.panel_rows), the panel from
    there on; without a panel kernel, above A8_SB_ROWS rows the exact path's product, as in
    float32 mode."""
    k = 512
    parts = [(Q.Q4_1, _weights(Q.Q4_1, 24, k, 1)), (Q.Q3_K, _blocks(Q.Q3_K, 8, k, 3)),
             (Q.Q8_0, _weights(Q.Q8_0, 5, k, 2))]
    w = QWeight(k, [(q, torch.from_numpy(d.copy())) for q, d in parts])
    first = quant.panel_rows(q for q, _ in parts) if qkernel.panel() is not None else 0
    cap = min(quant.A8_ROWS, quant.A8_SB_ROWS)  # (without the panel kernel)
    for t in (1, 6, first - 1, first, 40) if first else (1, 6, cap, cap + 1):
        x = _acts(t, k, t)
        exact = w.linear(torch.from_numpy(x))
        w.set_activations("int8")
        mixed = w.linear(torch.from_numpy(x))
        w.set_activations("float32")
        assert torch.equal(w.linear(torch.from_numpy(x)), exact)
        if first and t >= first:
            panel = torch.empty(t, 37)
            torch.ops.pagedkv_a8.panel(torch.from_numpy(x), [torch.from_numpy(d) for _, d in parts],
                                       [int(q) for q, _ in parts], panel, 0)
            assert torch.equal(mixed, panel)
            continue
        if not first and t > cap:
            assert torch.equal(mixed, exact)
            continue
        assert np.array_equal(mixed[:, 24:32].numpy(), _run_linear(Q.Q3_K, parts[1][1], x, 0))
        assert np.array_equal(mixed[:, :24].numpy(), _run(Q.Q4_1, parts[0][1], x, 0))
        assert np.array_equal(mixed[:, 32:].numpy(), _run(Q.Q8_0, parts[2][1], x, 0))


def test_mode_is_validated_and_float_types_stay_exact() -> None:
    w = QWeight(256, [(Q.F16, torch.zeros(4, 512, dtype=torch.uint8))])
    with pytest.raises(UnsupportedModelError, match="activations"):
        w.set_activations("int4")
    w.set_activations("int8")
    assert not w.a8  # no segment the int8 kernel multiplies


@needs_kernel
def test_op_rejects_bad_shapes() -> None:
    quantize_op, matmul = _ops()
    x = torch.zeros(2, 48)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        quantize_op(x, torch.empty(2, 48, dtype=torch.int8), torch.empty(2, 1), torch.empty(2, 1), 0)
    xq, xd, xs = torch.zeros(2, 64, dtype=torch.int8), torch.zeros(2, 2), torch.zeros(2, 2)
    w = torch.zeros(3, 40, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        matmul(xq, xd, xs, w, int(Q.F16), torch.zeros(2, 3), 0, 0)
    with pytest.raises(RuntimeError, match="super-block types take linear"):
        matmul(xq, xd, xs, w, int(Q.Q4_K), torch.zeros(2, 3), 0, 0)
    with pytest.raises(RuntimeError, match="not whole blocks"):  # 64 elements of a 256-block type
        qkernel.a8()[2](torch.zeros(2, 64), [w], [int(Q.Q4_K)], torch.zeros(2, 3), 0)
    with pytest.raises(RuntimeError, match="weight must be"):
        matmul(xq, xd, xs, w, int(Q.Q8_0), torch.zeros(2, 3), 0, 0)
    with pytest.raises(RuntimeError, match="out must be"):
        matmul(xq, xd, xs, w, int(Q.Q4_1), torch.zeros(2, 2), 0, 0)


def test_activations_option_is_validated() -> None:
    from test_model import _tiny

    from pagedkv.engine import LLMEngine
    from pagedkv.errors import ModelLoadError
    from pagedkv.model import load_model

    with pytest.raises(ModelLoadError, match="unsupported activations"):
        load_model(_tiny("qwen2"), activations="int4")
    with pytest.raises(ModelLoadError, match="needs quantized GGUF"):
        load_model(_tiny("qwen2"), activations="int8")
    with pytest.raises(ModelLoadError, match="needs weights='quantized'"):
        LLMEngine("/nonexistent.gguf", weights="float32", activations="int8")  # before loading


@needs_kernel
def test_smollm2_int8_activations_stay_close_to_exact(smollm2) -> None:  # noqa: ANN001
    """The approximate mode on the real model (Q4_1 layers, Q8_0 LM head): measured 2.3%
    relative logit error, KL 0.005, top-1 agreeing at all 35 positions of this prompt."""
    from test_model import prefill_then_decode, run_paged

    text = ("The paged KV cache stores keys and values of every token in fixed-size blocks, so "
            "that memory is allocated on demand and shared between sequences with a common prefix.")
    ids = torch.tensor(smollm2.tokenizer(text).input_ids)
    sched = prefill_then_decode(len(ids) - 8, len(ids))
    exact = run_paged(smollm2.model, [ids], sched, 16)[0]
    try:
        smollm2.model.set_activations("int8")
        approx = run_paged(smollm2.model, [ids], sched, 16)[0]
    finally:
        smollm2.model.set_activations("float32")
    assert torch.equal(run_paged(smollm2.model, [ids], sched, 16)[0], exact)  # restored
    assert 0 < float((approx - exact).norm() / exact.norm()) < 0.05
    logp, logq = torch.log_softmax(exact, -1), torch.log_softmax(approx, -1)
    assert float((logp.exp() * (logp - logq)).sum(-1).mean()) < 0.02
    assert float((approx.argmax(-1) == exact.argmax(-1)).float().mean()) >= 0.9


@needs_kernel
@pytest.mark.parametrize("impl", [0, 1], ids=["fast", "scalar"])
def test_one_call_linear_equals_per_segment_products(impl: int) -> None:
    """pagedkv_a8.linear (QWeight's path when every segment is Q4_0/Q4_1/Q8_0) quantizes x once
    and gives each segment's columns exactly what the per-segment op gives."""
    k = 96
    parts = [(Q.Q4_1, _weights(Q.Q4_1, 23, k, 1)), (Q.Q8_0, _weights(Q.Q8_0, 5, k, 2)),
             (Q.Q4_0, _weights(Q.Q4_0, 38, k, 3))]
    ws = [torch.from_numpy(d.copy()) for _, d in parts]
    w = QWeight(k, [(q, torch.from_numpy(d.copy())) for q, d in parts])
    w.set_activations("int8")
    for t in (1, 3, 8, 40):
        x = _acts(t, k, t)
        out = torch.empty(t, 66)
        torch.ops.pagedkv_a8.linear(torch.from_numpy(x), ws, [int(q) for q, _ in parts], out, impl)
        want = np.concatenate([_run(q, d, x, impl) for q, d in parts], axis=1)
        assert np.array_equal(out.numpy(), want)
        panel = qkernel.panel() is not None and t >= quant.PANEL_ROWS  # QWeight's other op
        if t <= quant.A8_ROWS and impl == 0 and not panel:  # QWeight calls the same op
            assert torch.equal(w.linear(torch.from_numpy(x)), out)


def test_without_the_kernel_int8_mode_is_the_exact_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler (or PAGEDKV_NO_KERNEL=1): activations="int8" changes nothing, the pure-torch
    fallback multiplies the gguf-dequantized weights."""
    monkeypatch.setattr(qkernel, "load", lambda: False)
    monkeypatch.setattr(qkernel, "qmatmul", lambda: None)
    monkeypatch.setattr(qkernel, "a8", lambda: None)
    data = _weights(Q.Q4_1, 16, 64, 0)
    w = QWeight(64, [(Q.Q4_1, torch.from_numpy(data.copy()))])
    x = torch.from_numpy(_acts(3, 64, 0))
    exact = w.linear(x)
    w.set_activations("int8")
    assert torch.equal(w.linear(x), exact)
    assert torch.allclose(exact, x @ w.dequantize().t(), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.IQ4_NL, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_odd_activation_blocks_give_the_same_bits_on_every_path(qtype: Q) -> None:
    """Activation blocks whose scale max|x| / 127 is subnormal (they quantize to zeros: 1 / d
    would overflow), or that hold an inf or a NaN (such a block quantizes to zeros with a NaN
    scale): the scalar and vector quantizers take the same steps, so the row kernel (impl 0, 2,
    1) and the panel (0, 3, 2, 1) each give one set of bits, NaNs in the same places; finite
    rows stay finite. Q8_0's weights at the non-finite inputs are 0 and -128 in turn (where the
    sign trick's sign(x, w) and the offset form u x - 128 x parted when inf * 0 cast to -128)."""
    k, n = 512, 21
    data = _blocks(qtype, n, k, 5)
    if qtype == Q.Q8_0:
        for e in (40, 300, 7, 400):  # element e: block e // 32, byte 2 + e % 32 of its 34
            data[:, 34 * (e // 32) + 2 + e % 32] = np.where(np.arange(n) % 2 == 0, 0x00, 0x80)
    x = _acts(6, k, seed=2)
    x[1] *= np.float32(1e-38)  # every block's scale subnormal
    x[2, 40] = np.inf
    x[3, 300] = np.nan
    x[4, 7] = -np.inf
    x[4, 400] = np.nan
    for op, impls in (("linear", (0, 2, 1)), ("panel", (0, 3, 2, 1))):
        outs = []
        for impl in impls:
            out = torch.full((6, n), 7.0)
            getattr(torch.ops.pagedkv_a8, op)(torch.from_numpy(x), [torch.from_numpy(data)], [int(qtype)], out, impl)
            outs.append(out.numpy())
        for o in outs[1:]:
            assert np.array_equal(o, outs[0], equal_nan=True), op
        got = outs[0]
        assert np.isfinite(got[[0, 1, 5]]).all() and not (got[1] != 0).any(), op  # subnormal blocks: zeros
        assert not np.isfinite(got[[2, 3, 4]]).all(axis=1).any(), op  # a non-finite input shows


@needs_kernel
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K], ids=lambda q: q.name)
def test_paired_k4_rows_give_the_generic_bits(qtype: Q) -> None:
    """Q4_K / Q5_K take their own VNNI tile for pairs of weight rows at 1-3 activation rows (Q4_K
    also from 4 on): rows of 9 super-blocks, an odd row count (the last row alone on the generic
    tile), random bytes with one block's d infinite and another's dmin NaN: the same bits as the
    AVX2 and scalar paths, NaNs in the same places."""
    k, n = 9 * 256, 7
    data = _blocks(qtype, n, k, seed=3)
    blocks = data.view(np.uint8).reshape(n, 9, -1)
    blocks[2, 4, 0:2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)  # d
    blocks[5, 1, 2:4] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)  # dmin
    for t in (1, 2, 3, 4, 5, 6):
        x = _acts(t, k, seed=10 + t)
        outs = [_run_linear(qtype, data, x, impl) for impl in (0, 2, 1)]
        for o in outs[1:]:
            assert np.array_equal(outs[0], o, equal_nan=True), f"T={t}"
        assert np.isfinite(np.delete(outs[0], [2, 5], axis=1)).all()
        assert not np.isfinite(outs[0][:, [2, 5]]).any()
