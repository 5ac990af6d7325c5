"""The int8-activation matmul for many rows (qmatmul_panel.cpp): its scalar path against an
integer reference of the same arithmetic, the AVX-512 VNNI and the AVX2 paths against the scalar
one (bit for bit), QWeight's routing to it, and its argument checks."""

from __future__ import annotations

import platform
import shutil
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from test_quant import F16_FIELDS, _blocks, _f16_bytes
from test_quant_a8 import A8, _acts, _weight_ints, _weights, ref_matmul_deq, ref_quantize

from pagedkv.model import qkernel, quant
from pagedkv.model.quant import QWeight

needs_kernel = pytest.mark.skipif(not qkernel.load(), reason="needs the compiled kernel")
needs_vnni = pytest.mark.skipif(not qkernel.load() or not torch.ops.pagedkv_a8.panel_vnni(),
                                reason="needs a CPU with AVX-512 VNNI")
# the vector paths: impl 0 (VNNI where the CPU has it, else AVX2), impl 3 (VNNI, the 32-element
# types two panels at a time at every row count) and impl 2 (AVX2)
VECTOR = [pytest.param(0, id="impl0"), pytest.param(3, id="pairs"), pytest.param(2, id="avx2")]
ROWS = [1, 2, 3, 4, 5, 8, 9, 13, 40]


def ref_panel(qtype: Q, data: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y [T, N] float64, sum of |terms| per output): per block, the exact integer dot
    (Q4_0 and Q8_0 offsets folded in), times d * dx rounded to float32, plus m * sx (Q4_1)."""
    k = x.shape[1]
    xq, xd, xs = ref_quantize(x)
    w, d, m = _weight_ints(qtype, data, k)
    if qtype == Q.Q4_0:
        w = w - 8  # the kernel's d * (q - 8), exactly in integers
    wi, xi = w.astype(np.int64), xq.reshape(x.shape[0], -1, 32).astype(np.int64)
    isum = np.einsum("nbk,tbk->tnb", wi, xi)
    asum = np.einsum("nbk,tbk->tnb", np.abs(wi) + 8, np.abs(xi))  # bound for the rounding
    scale = (d[None] * xd[:, None]).astype(np.float32).astype(np.float64)
    offset = (m[None] * xs[:, None]).astype(np.float64) if qtype == Q.Q4_1 else 0 * scale
    mag = (np.abs(scale) * asum).sum(-1) + np.abs(offset).sum(-1)
    return (scale * isum + offset).sum(-1), mag


def _panel(x: np.ndarray, parts: list[tuple[Q, np.ndarray]], impl: int) -> np.ndarray:
    out = torch.full((x.shape[0], sum(d.shape[0] for _, d in parts)), float("nan"))
    torch.ops.pagedkv_a8.panel(torch.from_numpy(x), [torch.from_numpy(d) for _, d in parts],
                               [int(q) for q, _ in parts], out, impl)
    return out.numpy()


@needs_kernel
@pytest.mark.parametrize("qtype", A8, ids=lambda q: q.name)
@pytest.mark.parametrize("n,k", [(1, 32), (37, 96), (130, 576)])
def test_scalar_panel_matches_integer_reference(qtype: Q, n: int, k: int) -> None:
    data = _weights(qtype, n, k, seed=n + 3 * k)
    for t in ROWS:
        x = _acts(t, k, seed=t + n)
        got = _panel(x, [(qtype, data)], 1)
        ref, mag = ref_panel(qtype, data, x)
        err = np.abs(got - ref)
        assert (err <= 2e-6 * mag + 1e-30).all(), f"T={t}: max err {err.max()} (mag {mag.max()})"


@needs_kernel
@pytest.mark.parametrize("impl", VECTOR)
@pytest.mark.parametrize("n,k", [(1, 32), (37, 96), (130, 576), (16, 1536)])
def test_vector_panel_equals_scalar_bit_for_bit(n: int, k: int, impl: int) -> None:
    """Every type in one call (segments of odd lengths: panels end inside a segment), all row
    counts: the VNNI / AVX2 path and the scalar path write the same bits into every column."""
    parts = [(q, _weights(q, n + i, k, seed=i)) for i, q in enumerate(A8)]
    for t in ROWS:
        x = _acts(t, k, seed=5 * t)
        fast, scalar = _panel(x, parts, impl), _panel(x, parts, 1)
        assert not np.isnan(fast).any()
        assert np.array_equal(fast, scalar), f"T={t}"


OTHER = [Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]  # the rest of quant.PANEL_TYPES


@needs_kernel
@pytest.mark.parametrize("qtype", OTHER, ids=lambda q: q.name)
def test_other_types_on_the_panel(qtype: Q) -> None:
    """Every other type with one scale per 32 elements, and Q6_K, Q3_K and Q2_K (one per 16; random
    valid blocks: scales of either sign, subnormal, a zero block): the scalar path against gguf's
    dequantized weights x int8 activations per 32 (the K-quants: per 256, as the row kernel's),
    and the VNNI path (rows ending mid-panel), VNNI pairs and AVX2 equal to it bit for bit."""
    k = 512
    data = _blocks(qtype, 37, k, 11)
    group = 256 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q2_K, Q.Q3_K, Q.Q6_K) else 32
    for t in (1, 4, 9, 40):
        x = _acts(t, k, seed=t)
        scalar = _panel(x, [(qtype, data)], 1)
        ref, mag = ref_matmul_deq(qtype, data, x, group)
        err = np.abs(scalar - ref)
        assert (err <= 1e-5 * mag + 1e-30).all(), f"T={t}: max err {err.max()} (mag {mag.max()})"
        for impl in (0, 3, 2):  # VNNI (where the CPU has it, else AVX2), VNNI pairs and AVX2
            assert np.array_equal(_panel(x, [(qtype, data)], impl), scalar), (t, impl)
    assert qtype in quant.PANEL_TYPES


@needs_kernel
@pytest.mark.parametrize("impl", VECTOR)
@pytest.mark.parametrize("k", [256, 768])
def test_every_panel_type_in_one_call_bit_for_bit(k: int, impl: int) -> None:
    """Every panel type as one segment of one call (odd lengths: the last panel of each is short,
    its missing rows repeat the segment's last row in the vector unpacking), raw random bytes
    (every field's bits) and valid blocks: the VNNI / AVX2 path equals the scalar path bit for bit."""
    rng = np.random.default_rng(k)
    types = sorted(quant.PANEL_TYPES, key=int)
    parts = []
    for i, q in enumerate(types):
        block, size = GGML_QUANT_SIZES[q]
        raw = rng.integers(0, 256, size=(17 + 2 * i, k // block * size), dtype=np.uint8)
        for at in F16_FIELDS.get(q, (0, 2) if q == Q.Q4_1 else (0,)):  # finite scales: random bits can be inf/nan halves
            raw.reshape(raw.shape[0], -1, size)[..., at : at + 2] = _f16_bytes(
                rng.uniform(-1e-2, 1e-2, (raw.shape[0], k // block)))
        parts.append((q, raw))
        parts.append((q, _blocks(q, 3 + i, k, i)))
    for t in (1, 3, 8, 17, 40):
        x = _acts(t, k, seed=t)
        fast, scalar = _panel(x, parts, impl), _panel(x, parts, 1)
        assert not np.isnan(fast).any()
        assert np.array_equal(fast, scalar), f"T={t}"


@needs_kernel
def test_panel_is_close_to_exact_product() -> None:
    data = _weights(Q.Q4_1, 64, 576, 1)
    x = _acts(12, 576, 5)
    w = QWeight(576, [(Q.Q4_1, torch.from_numpy(data.copy()))])
    exact = w.linear(torch.from_numpy(x)).numpy()
    approx = _panel(x, [(Q.Q4_1, data)], 1)
    assert 0 < np.linalg.norm(approx - exact) / np.linalg.norm(exact) < 0.02


@needs_vnni
def test_qweight_uses_the_panel_from_panel_rows() -> None:
    """int8 mode, every segment Q4_0/Q4_1/Q8_0: the panel from PANEL_ROWS rows on, at any count
    (prefill sizes too); below, the row kernel; a segment of no int8 type keeps the mixed path."""
    k = 96
    parts = [(Q.Q4_1, _weights(Q.Q4_1, 23, k, 1)), (Q.Q8_0, _weights(Q.Q8_0, 5, k, 2))]
    w = QWeight(k, [(q, torch.from_numpy(d.copy())) for q, d in parts])
    w.set_activations("int8")
    ws, qt = [torch.from_numpy(d) for _, d in parts], [int(q) for q, _ in parts]
    for t in (1, quant.PANEL_ROWS - 1, quant.PANEL_ROWS, 40, 300):
        x = _acts(t, k, t)
        got = w.linear(torch.from_numpy(x)).numpy()
        if t >= quant.PANEL_ROWS:
            assert np.array_equal(got, _panel(x, parts, 0))
        else:
            row = torch.empty(t, 28)
            torch.ops.pagedkv_a8.linear(torch.from_numpy(x), ws, qt, row, 0)
            assert np.array_equal(got, row.numpy())
    mixed = QWeight(256, [(Q.Q4_1, torch.from_numpy(_weights(Q.Q4_1, 8, 256, 0))),
                          (Q.F16, torch.from_numpy(_blocks(Q.F16, 8, 256, 3)))])
    mixed.set_activations("int8")
    x = _acts(40, 256, 9)
    y = mixed.linear(torch.from_numpy(x))
    assert not np.array_equal(y[:, :8].numpy(), _panel(x, [(Q.Q4_1, _weights(Q.Q4_1, 8, 256, 0))], 0))


@needs_kernel
def test_panel_rejects_bad_arguments() -> None:
    op = torch.ops.pagedkv_a8.panel
    w = torch.zeros(3, 20, dtype=torch.uint8)  # one Q4_1 block per row: K = 32
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.zeros(2, 48), [w], [int(Q.Q4_1)], torch.zeros(2, 3), 0)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        op(torch.zeros(2, 32), [w], [int(Q.F16)], torch.zeros(2, 3), 0)
    with pytest.raises(RuntimeError, match="weight must be"):
        op(torch.zeros(2, 32), [w], [int(Q.Q8_0)], torch.zeros(2, 3), 0)
    with pytest.raises(RuntimeError, match="out must be"):
        op(torch.zeros(2, 32), [w], [int(Q.Q4_1)], torch.zeros(2, 4), 0)
    with pytest.raises(RuntimeError, match="one qtype per"):
        op(torch.zeros(2, 32), [w], [], torch.zeros(2, 3), 0)
    out = torch.full((0, 3), 1.0)
    op(torch.zeros(0, 32), [w], [int(Q.Q4_1)], out, 0)  # no rows: nothing to do


@needs_vnni
def test_k_quant_weights_take_the_panel_from_panel_sb_rows() -> None:
    """int8 mode, a Q4_K / Q5_K / IQ4_XS / Q2_K / Q3_K / Q6_K weight: the row kernel (its VNNI
    tiles, 4 activation rows per pass) below quant.panel_rows (PANEL_SB_ROWS; Q6_K:
    PANEL_Q6_K_ROWS), the panel from there on; a weight with a Q6_K
    segment beside a Q4_K one waits for Q6_K's count."""
    k = 512
    zen5, intel = quant._zen5_cpu(), quant._intel_cpu()
    assert quant.PANEL_Q6_K_ROWS == (16 if zen5 else 12)  # measured per vendor (quant.py)
    assert quant.PANEL_SB_ROWS == (12 if zen5 else 8 if intel else 6)
    assert quant.panel_rows([Q.Q4_K, Q.Q6_K]) == quant.PANEL_Q6_K_ROWS > quant.PANEL_SB_ROWS
    assert quant.panel_rows([Q.Q4_1, Q.Q8_0]) == quant.PANEL_ROWS
    assert quant.panel_rows([Q.Q2_K, Q.Q3_K]) == quant.PANEL_SB_ROWS
    firsts = {Q.Q6_K: quant.PANEL_Q6_K_ROWS}
    for qtype in (Q.Q4_K, Q.Q5_K, Q.IQ4_XS, Q.Q2_K, Q.Q3_K, Q.Q6_K):
        data = _blocks(qtype, 19, k, 4)
        w = QWeight(k, [(qtype, torch.from_numpy(data.copy()))])
        w.set_activations("int8")
        first = quant.panel_rows([qtype])
        assert first == firsts.get(qtype, quant.PANEL_SB_ROWS)
        for t in (1, 5, first - 1, first, 41):
            x = _acts(t, k, t)
            got = w.linear(torch.from_numpy(x)).numpy()
            if t >= first:
                assert np.array_equal(got, _panel(x, [(qtype, data)], 0)), (qtype.name, t)
            else:
                row = torch.empty(t, 19)
                torch.ops.pagedkv_a8.linear(torch.from_numpy(x), [torch.from_numpy(data)], [int(qtype)], row, 0)
                assert np.array_equal(got, row.numpy()), (qtype.name, t)


@pytest.mark.skipif(not qkernel.load() or not torch.ops.pagedkv_a8.panel_avx2() and not qkernel.vnni(),
                    reason="needs the kernel built with AVX2")
def test_avx2_cpu_takes_the_avx2_panel_from_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without VNNI (an AVX2 CPU; here the ISA limit at AVX2): Q5_0/Q5_1 weights take the AVX2
    panel from PANEL_AVX2_Q5_ROWS rows (Q4_0 too), Q4_1 from PANEL_AVX2_Q4_1_ROWS,
    Q8_0 and IQ4_NL from PANEL_AVX2_Q8_ROWS, Q6_K from PANEL_AVX2_Q6_ROWS, Q4_K
    from PANEL_AVX2_K4_ROWS, any other panel type (Q5_K, IQ4_XS) from PANEL_AVX2_SB_ROWS,
    a weight of several types from the largest of theirs, one with a Q2_K or Q3_K segment past
    the row kernel's cap (A8_SB_ROWS); below, the row kernel."""
    monkeypatch.setattr(qkernel._kernel, "vnni", False)
    limit = torch.ops.pagedkv_q.limit_isa(1)
    try:
        assert qkernel.panel() is not None and torch.ops.pagedkv_a8.panel_avx2()
        k = 512
        cases = [([(Q.Q5_0, _blocks(Q.Q5_0, 21, k, 1))], quant.PANEL_AVX2_Q5_ROWS),
                 ([(Q.Q5_1, _blocks(Q.Q5_1, 9, k, 18)), (Q.Q4_0, _blocks(Q.Q4_0, 7, k, 19))], quant.PANEL_AVX2_Q5_ROWS),
                 ([(Q.Q4_1, _blocks(Q.Q4_1, 11, k, 20)), (Q.Q5_0, _blocks(Q.Q5_0, 3, k, 21))], quant.PANEL_AVX2_Q4_1_ROWS),
                 ([(Q.Q4_1, _weights(Q.Q4_1, 9, k, 2)), (Q.Q8_0, _weights(Q.Q8_0, 5, k, 3))], quant.PANEL_AVX2_Q8_ROWS),
                 ([(Q.IQ4_NL, _blocks(Q.IQ4_NL, 10, k, 14))], quant.PANEL_AVX2_Q8_ROWS),
                 ([(Q.Q8_0, _weights(Q.Q8_0, 6, k, 15)), (Q.Q4_K, _blocks(Q.Q4_K, 8, k, 16))],
                  max(quant.PANEL_AVX2_K4_ROWS, quant.PANEL_AVX2_Q8_ROWS)),
                 ([(Q.IQ4_XS, _blocks(Q.IQ4_XS, 9, k, 17))], quant.PANEL_AVX2_SB_ROWS),
                 ([(Q.Q8_0, _weights(Q.Q8_0, 19, k, 12)), (Q.Q6_K, _blocks(Q.Q6_K, 5, k, 13))],
                  max(quant.PANEL_AVX2_Q8_ROWS, quant.PANEL_AVX2_Q6_ROWS)),
                 ([(Q.Q6_K, _blocks(Q.Q6_K, 6, k, 22)), (Q.IQ4_XS, _blocks(Q.IQ4_XS, 5, k, 23))], quant.PANEL_AVX2_SB_ROWS),
                 ([(Q.Q4_K, _blocks(Q.Q4_K, 11, k, 4))], quant.PANEL_AVX2_K4_ROWS),
                 ([(Q.Q4_K, _blocks(Q.Q4_K, 9, k, 8)), (Q.Q5_0, _blocks(Q.Q5_0, 4, k, 9))], quant.PANEL_AVX2_K4_ROWS),
                 ([(Q.Q4_K, _blocks(Q.Q4_K, 9, k, 10)), (Q.Q5_K, _blocks(Q.Q5_K, 4, k, 11))], quant.PANEL_AVX2_SB_ROWS),
                 ([(Q.Q6_K, _blocks(Q.Q6_K, 7, k, 5))], quant.PANEL_AVX2_Q6_ROWS),
                 ([(Q.Q2_K, _blocks(Q.Q2_K, 13, k, 6)), (Q.Q3_K, _blocks(Q.Q3_K, 6, k, 7))], quant.A8_SB_ROWS + 1)]
        for parts, first in cases:
            assert quant.panel_rows(q for q, _ in parts) == first
            w = QWeight(k, [(q, torch.from_numpy(d.copy())) for q, d in parts])
            w.set_activations("int8")
            n = sum(d.shape[0] for _, d in parts)
            for t in (1, first - 1, first, 40):
                x = _acts(t, k, t)
                got = w.linear(torch.from_numpy(x)).numpy()
                if t >= first:
                    assert np.array_equal(got, _panel(x, parts, 2)), (parts[0][0].name, t)
                else:
                    row = torch.empty(t, n)
                    torch.ops.pagedkv_a8.linear(torch.from_numpy(x), [torch.from_numpy(d) for _, d in parts],
                                                [int(q) for q, _ in parts], row, 2)
                    assert np.array_equal(got, row.numpy()), (parts[0][0].name, t)
    finally:
        torch.ops.pagedkv_q.limit_isa(limit)


@needs_kernel
@pytest.mark.parametrize("impl", VECTOR)
def test_panel_and_qgemm_equal_at_every_thread_count(impl: int) -> None:
    """The many-row kernels hand their panels out in chunks to whichever thread asks (work_split.h):
    1, 2, 3 and 5 threads (more than this machine's cores, so threads are preempted mid-op) write
    the same bits, segments and panels of odd lengths included."""
    k = 256
    parts = [(Q.Q5_0, _blocks(Q.Q5_0, 203, k, 1)), (Q.Q4_K, _blocks(Q.Q4_K, 77, k, 2)), (Q.Q6_K, _blocks(Q.Q6_K, 45, k, 3))]
    x = _acts(40, k, seed=7)
    w = torch.from_numpy(_blocks(Q.Q4_K, 333, k, 4))
    xt = torch.from_numpy(x)
    before = torch.get_num_threads()
    got = []
    try:
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            g = torch.empty(40, 333)
            torch.ops.pagedkv_q.qgemm(xt, w, int(Q.Q4_K), g, 0)
            got.append((_panel(x, parts, impl), g))
    finally:
        torch.set_num_threads(before)
    for p, g in got[1:]:
        assert np.array_equal(p, got[0][0]) and torch.equal(g, got[0][1])
    assert not np.isnan(got[0][0]).any()


def test_cpu_vendor_and_family_from_cpuinfo(tmp_path) -> None:
    """The per-CPU thresholds read the first CPU's vendor and family; anything unreadable is
    ("", 0), which takes the defaults."""
    def cpu(text: str) -> tuple[str, int]:
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        return quant._cpu(str(path))

    zen5 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n\n"
    assert cpu(zen5 + zen5.replace("26", "25")) == ("AuthenticAMD", 26)
    assert cpu("vendor_id\t: GenuineIntel\ncpu family\t: 6\n") == ("GenuineIntel", 6)
    assert cpu("vendor_id\t: AuthenticAMD\ncpu family\t: x\n") == ("AuthenticAMD", 0)
    assert cpu("") == ("", 0)
    assert quant._cpu(str(tmp_path / "missing")) == ("", 0)


# --- the panels kept from load (batch_weights="panel": r16_pack + panel_r16) ------------------------

R16 = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _r16(x: np.ndarray, parts: list[tuple[Q, np.ndarray]]) -> np.ndarray:
    pack, matmul = qkernel.r16()
    packs = [pack(torch.from_numpy(d), int(q)) for q, d in parts]
    out = torch.full((x.shape[0], sum(d.shape[0] for _, d in parts)), float("nan"))
    matmul(torch.from_numpy(x), packs, [int(q) for q, _ in parts], [d.shape[0] for _, d in parts], out)
    return out.numpy()


@needs_vnni
@pytest.mark.parametrize("qtype", R16, ids=lambda q: q.name)
@pytest.mark.parametrize("n,k", [(1, 256), (16, 512), (37, 1536)])
def test_kept_panels_equal_the_scalar_panel_bit_for_bit(qtype: Q, n: int, k: int) -> None:
    """Rows not a multiple of 16 (the last panel's zero rows never stored), every row count."""
    data = _blocks(qtype, n, k, seed=n + k)
    for t in ROWS:
        x = _acts(t, k, seed=t)
        got = _r16(x, [(qtype, data)])
        assert not np.isnan(got).any()
        assert np.array_equal(got, _panel(x, [(qtype, data)], 1)), f"T={t}"


@needs_vnni
def test_kept_panels_of_mixed_segments_bit_for_bit() -> None:
    """A fused weight (Q4_K, Q6_K, Q5_K, Q4_K segments of odd lengths), one call."""
    k = 768
    parts = [(q, _blocks(q, 5 + 11 * i, k, seed=i)) for i, q in enumerate([Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q4_K])]
    for t in (1, 4, 9, 40):
        x = _acts(t, k, seed=t)
        assert np.array_equal(_r16(x, parts), _panel(x, parts, 1)), f"T={t}"


@needs_vnni
def test_qweight_keeps_panels_for_batches() -> None:
    """batch_weights="panel": int8 calls from the panel rows on read the kept panels (the same bits
    as without), smaller calls the row kernel (untouched); the copy's bytes are reported; back to
    "quantized" (or exact activations) drops it; a weight with another type keeps none."""
    k = 512
    w = QWeight(k, [(Q.Q4_K, torch.from_numpy(_blocks(Q.Q4_K, 40, k, 1))),
                    (Q.Q6_K, torch.from_numpy(_blocks(Q.Q6_K, 9, k, 2)))])
    w.set_activations("int8")
    big = torch.from_numpy(_acts(quant.panel_rows([Q.Q4_K, Q.Q6_K]) + 5, k, seed=3))
    small = torch.from_numpy(_acts(1, k, seed=4))
    before_big, before_small = w.linear(big), w.linear(small)
    w.set_batch_weights("panel")
    assert w.batch_bytes == 3 * 16 * (k // 256) * 144 + 16 * (k // 256) * 210  # 3 Q4_K panels, 1 Q6_K
    calls = []
    pack, matmul = qkernel.r16()
    qkernel._kernel.r16 = (pack, lambda *a: (calls.append(1), matmul(*a)))
    try:
        assert torch.equal(w.linear(big), before_big) and calls == [1]
        assert torch.equal(w.linear(small), before_small) and calls == [1]
    finally:
        qkernel._kernel.r16 = (pack, matmul)
    w.set_batch_weights("quantized")
    assert w.batch_bytes == 0
    w.set_batch_weights("panel")
    w.set_activations("float32")
    assert w.batch_bytes == 0
    other = QWeight(k, [(Q.Q4_K, torch.from_numpy(_blocks(Q.Q4_K, 16, k, 1))),
                        (Q.Q8_0, torch.from_numpy(_blocks(Q.Q8_0, 16, k, 2)))])
    other.set_activations("int8")
    other.set_batch_weights("panel")
    assert other.batch_bytes == 0 and not other.r16_able()


@needs_vnni
def test_kept_panels_reject_bad_arguments() -> None:
    pack, matmul = qkernel.r16()
    w = torch.from_numpy(_blocks(Q.Q4_K, 20, 256, 0))
    with pytest.raises(RuntimeError, match="not an r16 type"):
        pack(w, int(Q.Q4_0))
    with pytest.raises(RuntimeError, match="must be a contiguous uint8"):
        pack(w[:, :100].contiguous(), int(Q.Q4_K))
    p = pack(w, int(Q.Q4_K))
    x, out = torch.randn(2, 256), torch.empty(2, 20)
    with pytest.raises(RuntimeError, match="is not the r16 records of 33 rows"):
        matmul(x, [p], [int(Q.Q4_K)], [33], torch.empty(2, 33))  # more panels than the records hold
    with pytest.raises(RuntimeError, match="is not the r16 records"):
        matmul(torch.randn(2, 512), [p], [int(Q.Q4_K)], [20], torch.empty(2, 20))  # another K
    with pytest.raises(RuntimeError, match="K a multiple of 256"):
        matmul(torch.randn(2, 288), [p], [int(Q.Q4_K)], [20], out)
    with pytest.raises(RuntimeError, match="out must be"):
        matmul(x, [p], [int(Q.Q4_K)], [20], torch.empty(2, 19))
    matmul(x, [p], [int(Q.Q4_K)], [20], out)  # and the right ones work
    assert torch.isfinite(out).all()


@needs_kernel
@pytest.mark.skipif(shutil.which("objdump") is None or platform.machine() != "x86_64", reason="needs objdump, x86-64")
def test_panel_kernels_keep_their_prefetches() -> None:
    """The VNNI panels prefetch their next panel (ahead.h). Written as a loop of _mm_prefetch
    alone, GCC deleted it (a loop with no side effects may be assumed to end): the built
    library's panel code must hold prefetch instructions."""
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "pagedkv_qmatmul" in line and line.rstrip().endswith(".so")}
    assert libs
    lib = libs.pop()
    asm = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", lib], capture_output=True, text=True,
                         check=True).stdout
    count, in_panel = 0, False
    for line in asm.splitlines():
        if line.endswith(">:"):  # a function's first line
            in_panel = "panel::panel_vnni<" in line
        elif in_panel and "prefetcht1" in line:
            count += 1
    assert count > 0


def _misaligned(t: int, n: int) -> torch.Tensor:
    """A contiguous float32 [t, n] tensor 4 bytes past a 64-byte boundary (no whole-line stores)."""
    flat = torch.full((t * n + 16,), float("nan"))
    skip = (-flat.data_ptr() // 4) % 16 + 1
    return flat[skip : skip + t * n].view(t, n)


@needs_kernel
@pytest.mark.parametrize("impl", VECTOR)
def test_big_outputs_stream_the_same_bits(impl: int) -> None:
    """A call whose output reaches out_store.h's 8 MiB (40 rows x 52,436 outputs: a large
    vocabulary's logits) writes it with streaming stores: the same bits as the same rows taken 4 at
    a time (0.8 MiB, cached stores), a short last panel (masked) included, and into an output that
    is not line-aligned (cached stores throughout). The panel, the kept panels and the qgemm."""
    t, n = 40, 52436  # 40 * 52436 * 4 bytes >= 8 MiB
    k = 32
    parts = [(Q.Q8_0, _blocks(Q.Q8_0, n - 7, k, 1)), (Q.Q4_0, _blocks(Q.Q4_0, 7, k, 2))]
    x = _acts(t, k, seed=3)
    ws, qs = [torch.from_numpy(d) for _, d in parts], [int(q) for q, _ in parts]
    xt = torch.from_numpy(x)
    whole, skew = torch.full((t, n), float("nan")), _misaligned(t, n)
    torch.ops.pagedkv_a8.panel(xt, ws, qs, whole, impl)
    torch.ops.pagedkv_a8.panel(xt, ws, qs, skew, impl)
    for r in range(0, t, 4):
        part = torch.full((4, n), float("nan"))
        torch.ops.pagedkv_a8.panel(xt[r : r + 4].contiguous(), ws, qs, part, impl)
        assert torch.equal(whole[r : r + 4], part) and torch.equal(skew[r : r + 4], part), r

    g_whole, g_skew = torch.full((t, n - 7), float("nan")), _misaligned(t, n - 7)
    for out in (g_whole, g_skew):
        torch.ops.pagedkv_q.qgemm(xt, ws[0], qs[0], out, 0)
    for r in range(0, t, 4):
        part = torch.full((4, n - 7), float("nan"))
        torch.ops.pagedkv_q.qgemm(xt[r : r + 4].contiguous(), ws[0], qs[0], part, 0)
        assert torch.equal(g_whole[r : r + 4], part) and torch.equal(g_skew[r : r + 4], part), r


@needs_vnni
def test_big_outputs_of_kept_panels_stream_the_same_bits() -> None:
    t, n, k = 40, 52436, 256
    data = _blocks(Q.Q4_K, n, k, seed=9)
    x = _acts(t, k, seed=4)
    pack, matmul = qkernel.r16()
    packs = [pack(torch.from_numpy(data), int(Q.Q4_K))]
    xt = torch.from_numpy(x)
    whole, skew = torch.full((t, n), float("nan")), _misaligned(t, n)
    for out in (whole, skew):
        matmul(xt, packs, [int(Q.Q4_K)], [n], out)
    ref = torch.full((t, n), float("nan"))
    for r in range(0, t, 4):
        matmul(xt[r : r + 4].contiguous(), packs, [int(Q.Q4_K)], [n], ref[r : r + 4])
    assert torch.equal(whole, ref) and torch.equal(skew, ref)


@needs_kernel
@pytest.mark.skipif(shutil.which("objdump") is None or platform.machine() != "x86_64", reason="needs objdump, x86-64")
def test_many_row_kernels_hold_streaming_stores() -> None:
    """out_store.h's streaming stores reach the built panel and qgemm code (the VNNI panel's, the
    AVX2 panel's and both gemms')."""
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "pagedkv_qmatmul" in line and line.rstrip().endswith(".so")}
    assert libs
    asm = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", libs.pop()], capture_output=True, text=True,
                         check=True).stdout
    found, name = set(), ""
    for line in asm.splitlines():
        if line.endswith(">:"):
            name = line
        elif "vmovntps" in line:
            found |= {k for k in ("panel::rows_vnni", "panel::rows_avx2", "z::gemm", "y::gemm") if k in name}
    assert found == {"panel::rows_vnni", "panel::rows_avx2", "z::gemm", "y::gemm"}, found


@needs_kernel
@pytest.mark.parametrize("impl", VECTOR)
@pytest.mark.parametrize("fill", [0xFF, 0x80, 0x7F])
def test_largest_products_do_not_saturate(fill: int, impl: int) -> None:
    """Every byte of every panel type's blocks set alike (the largest quants with scales at their
    limits, 0x80: the most negative int8 scale), finite fp16 scales, against activations of
    +-127 everywhere (constant and alternating sign): the int16 sums of the vector paths
    (maddubs pairs, quads summed before madd, the halves' madd by their scales) never saturate,
    so they equal the scalar path bit for bit."""
    k = 512
    parts = []
    for q in sorted(quant.PANEL_TYPES, key=int):
        block, size = GGML_QUANT_SIZES[q]
        raw = np.full((9, k // block, size), fill, dtype=np.uint8)
        for at in F16_FIELDS.get(q, (0, 2) if q == Q.Q4_1 else (0,)):
            raw[..., at : at + 2] = _f16_bytes(np.full((9, k // block), 1e-3))
        parts.append((q, raw.reshape(9, -1)))
    sign = np.where(np.arange(k) % 2 == 0, 1.0, -1.0).astype(np.float32)
    x = np.stack([np.full(k, 3.0, np.float32), -np.full(k, 3.0, np.float32), 3.0 * sign] * 14)
    fast, scalar = _panel(x, parts, impl), _panel(x, parts, 1)
    assert np.isfinite(scalar).all()
    assert np.array_equal(fast, scalar)
