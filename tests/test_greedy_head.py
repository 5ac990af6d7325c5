"""The greedy LM head (pagedkv/model/greedy_head.py + logits_screen.cpp).

Its claim: a greedy row's token is the argmax of the logits computed in float64 from the file's
float32 weights, whichever way the other logits were computed (exact or int8) and whatever the
batch. Checked against a float64 reference on random heads of both screened types, with
activations drawn to stress the int8 bound (outliers, zero and tiny blocks, near-ties, a weight
row aligned with the int8 rounding error); the bound itself on every entry; then through the
engine (tokens equal to greedy_head="off" where nothing is near a tie, logprobs, mixed batches,
rows that cannot be sampled).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_quant import _blocks

from pagedkv.engine import LLM, SamplingParams
from pagedkv.errors import InvalidParamsError
from pagedkv.model import qkernel
from pagedkv.model.greedy_head import MAX_CANDIDATES, SCREEN_BLOCK, GreedyHead, _q6_k_offset_norms
from pagedkv.model.quant import QWeight

pytestmark = pytest.mark.skipif(not qkernel.load(), reason="needs the compiled kernel")

V = 384


def _head(qtype: Q, k: int, seed: int) -> tuple[GreedyHead, torch.Tensor]:
    """A GreedyHead over V random rows of `qtype` and its float64 weights."""
    data = _blocks(qtype, V, k, seed)
    ref = torch.from_numpy(dequantize(data, qtype).astype(np.float32)).reshape(V, k).double()
    q = QWeight(k, [(qtype, torch.from_numpy(data.copy()))])
    assert GreedyHead.able(q)
    return GreedyHead(q), ref


def _x(rng: np.random.Generator, t: int, k: int, kind: str) -> torch.Tensor:
    x = rng.standard_normal((t, k)).astype(np.float32)
    if kind == "outliers":  # a few huge dims: coarse int8 blocks elsewhere in theirs
        x[:, rng.integers(0, k, 3)] *= 300
    elif kind == "scaled":
        x *= np.float32(10.0 ** rng.uniform(-30, 30))
    elif kind == "blocks":  # a zero block, a tiny one, a subnormal one
        x[:, :32] = 0
        x[:, 32:64] *= np.float32(1e-30)
        x[:, 64:96] = np.float32(1e-40) * np.sign(x[:, 64:96])
    return torch.from_numpy(x)


def _bound(h: GreedyHead, x: torch.Tensor, int8: bool) -> torch.Tensor:
    """[T, V]: logits_screen.cpp's bound on |a - t| (without its |a| 2^-20 term)."""
    wn, mg, mi = h.norms()
    xd = x.double()
    e = torch.zeros(x.shape[0], dtype=torch.float64)
    if int8:
        b = h.block
        amax = xd.view(x.shape[0], -1, b).abs().amax(-1)
        f = torch.where(amax < 2.0 ** -60, 2.1 * amax, amax * (0.502 / 127))
        e = (f.square().sum(-1) * b).sqrt()
    beta = (h.k + 64) * 2.0 ** -24 * (mi if int8 else mg) * (xd.norm(dim=1) + e)
    return wn.double()[None] * e[:, None] + beta[:, None]


@pytest.mark.parametrize("qtype", list(SCREEN_BLOCK), ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("kind", ["normal", "outliers", "scaled", "blocks"])
def test_tokens_are_the_float64_argmax(qtype: Q, rows: int, kind: str) -> None:
    k = 512
    h, w64 = _head(qtype, k, seed=rows)
    x = _x(np.random.default_rng(rows), rows, k, kind)
    t = x.double() @ w64.t()
    for approx in (True, False):
        a, tokens = h.logits(x, torch.arange(rows), approx, None)
        assert tokens is not None and tokens.tolist() == t.argmax(1).tolist()
        assert a.argmax(1).tolist() == tokens.tolist()  # the row's first maximum is the token
    # the int8 logits are within the bound on every entry, and so are the exact ones
    for int8, q in ((True, h.twin()), (False, h.q)):
        a = q.linear(x)
        assert bool(((a.double() - t).abs() <= _bound(h, x, int8)).all())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 12), byte=st.integers(0, 31), q6=st.booleans())
def test_near_ties_and_an_adversarial_row(seed: int, rows: int, byte: int, q6: bool) -> None:
    """Row 5 of the head is row 3 with one quant one step apart (a near-tie, made the top pair
    by aligning row 3 with x[0]); for Q8_0, row 7 is aligned with the int8 rounding error of x[0]
    (the bound's worst case). The float64 argmax wins, the int8 logits stay within the bound."""
    qtype, k = (Q.Q6_K, 256) if q6 else (Q.Q8_0, 256)
    rng = np.random.default_rng(seed)
    x = _x(rng, rows, k, "normal")
    x0 = x[0].double().numpy()
    data = _blocks(qtype, V, k, seed % 1000)
    if qtype == Q.Q8_0:
        top = np.ascontiguousarray(quantize((x0 * 0.05 / np.linalg.norm(x0)).astype(np.float32)[None], qtype))
        data[3] = top.view(np.uint8).reshape(-1)
        d = np.abs(x0.reshape(-1, 32)).max(1, keepdims=True) / 127
        err = (x0.reshape(-1, 32) - d * np.round(x0.reshape(-1, 32) / d)).reshape(-1)
        aligned = (err / max(np.linalg.norm(err), 1e-30) * 0.08).astype(np.float32)
        data[7] = np.ascontiguousarray(quantize(aligned[None], qtype)).view(np.uint8).reshape(-1)
        at = 2 + byte  # a quant byte of the first block
    else:
        at = byte  # a byte of ql
    data[5] = data[3]
    data[5, at] ^= 1
    w64 = torch.from_numpy(dequantize(data, qtype).astype(np.float32)).reshape(V, k).double()
    h = GreedyHead(QWeight(k, [(qtype, torch.from_numpy(data.copy()))]))
    t = x.double() @ w64.t()
    for approx in (True, False):
        a, tokens = h.logits(x, torch.arange(rows), approx, None)
        assert tokens.tolist() == t.argmax(1).tolist()
    a = h.twin().linear(x)
    assert bool(((a.double() - t).abs() <= _bound(h, x, True)).all())


@pytest.mark.parametrize("qtype", list(SCREEN_BLOCK), ids=lambda q: q.name)
def test_int8_activations_mode_gets_the_float64_argmax_too(qtype: Q) -> None:
    """activations="int8" (the head's own path rounds x): the token is still t's argmax."""
    h, w64 = _head(qtype, 256, seed=9)
    h.q.set_activations("int8")
    x = _x(np.random.default_rng(3), 5, 256, "outliers")
    a, tokens = h.logits(x, torch.arange(5), False, None)
    assert tokens.tolist() == (x.double() @ w64.t()).argmax(1).tolist()


def test_crowded_rows_take_the_exact_bound_or_the_float32_argmax() -> None:
    """A near-flat row (every logit within the int8 bound of the top) takes its exact logits and
    their bound; a flat one (a head of equal rows) is left to the sampler."""
    n, k = MAX_CANDIDATES + 500, 256
    rng = np.random.default_rng(6)
    base = rng.standard_normal(k).astype(np.float32) * 0.05
    w = base + rng.standard_normal((n, k)).astype(np.float32) * 2e-4  # logits a few 1e-3 apart
    data = np.ascontiguousarray(quantize(w, Q.Q8_0)).view(np.uint8).reshape(n, -1)
    w64 = torch.from_numpy(dequantize(data, Q.Q8_0).astype(np.float32)).reshape(n, k).double()
    h = GreedyHead(QWeight(k, [(Q.Q8_0, torch.from_numpy(data.copy()))]))
    x = torch.from_numpy(base[None].repeat(4, 0) * 20 + rng.standard_normal((4, k)).astype(np.float32))
    a, tokens = h.logits(x, torch.arange(4), True, None)
    assert tokens.tolist() == (x.double() @ w64.t()).argmax(1).tolist()
    flat = np.ascontiguousarray(np.repeat(data[:1], n, axis=0))
    h = GreedyHead(QWeight(k, [(Q.Q8_0, torch.from_numpy(flat))]))
    a, tokens = h.logits(x, torch.arange(4), True, None)
    assert tokens.tolist() == [-1] * 4 and torch.equal(a, h.q.linear(x))  # the float32 logits


def test_q6_k_offset_norms_from_the_scales() -> None:
    """M's offset norms (from each block's scales and d) equal the rows dequantized with every
    quant at 0 (o = -32 d sc)."""
    data = _blocks(Q.Q6_K, 40, 512, 8)
    zeroed = data.copy().reshape(40, 2, 210)
    zeroed[:, :, :192] = 0
    o = torch.from_numpy(dequantize(zeroed.reshape(40, -1), Q.Q6_K).astype(np.float64)).reshape(40, 512)
    got = _q6_k_offset_norms(torch.from_numpy(data))
    assert torch.allclose(got, o.norm(dim=1), rtol=1e-6)


def test_only_the_greedy_rows_change() -> None:
    h, w64 = _head(Q.Q8_0, 256, seed=3)
    x = _x(np.random.default_rng(0), 6, 256, "normal")
    exact = h.q.linear(x)
    a, tokens = h.logits(x, torch.tensor([1, 4]), False, None)
    other = [0, 2, 3, 5]
    assert torch.equal(a[other], exact[other])  # untouched, exact
    assert tokens[other].tolist() == [-1] * 4
    t = x.double() @ w64.t()
    assert tokens[[1, 4]].tolist() == t[[1, 4]].argmax(1).tolist()
    changed = (a[[1, 4]] != exact[[1, 4]]).sum().item()
    assert changed <= 8  # the few candidates, rewritten by at most float32 rounding
    assert torch.allclose(a, exact, rtol=1e-5, atol=1e-6)


def test_rows_that_are_not_finite_are_left_to_the_sampler() -> None:
    h, _ = _head(Q.Q8_0, 256, seed=4)
    x = _x(np.random.default_rng(1), 3, 256, "normal")
    x[1, 5] = float("inf")
    a, tokens = h.logits(x, torch.arange(3), True, None)
    assert tokens[1].item() == -1 and tokens[0].item() >= 0 and tokens[2].item() >= 0
    assert not torch.isfinite(a[1]).all()  # the exact path's values: the sampler fails the row


def test_a_head_with_a_weight_that_is_not_finite_keeps_its_path() -> None:
    data = _blocks(Q.Q8_0, V, 256, 5)
    data[9, :2] = np.frombuffer(np.float16(np.inf).tobytes(), dtype=np.uint8)  # a block's scale
    q = QWeight(256, [(Q.Q8_0, torch.from_numpy(data.copy()))])
    h = GreedyHead(q)
    x = _x(np.random.default_rng(2), 2, 256, "normal")
    a, tokens = h.logits(x, torch.arange(2), True, None)
    assert tokens is None
    assert torch.equal(a.nan_to_num(), q.linear(x).nan_to_num())


def test_screen_and_rescore_reject_bad_arguments() -> None:
    screen, rescore = qkernel.screen()
    a, x, wn = torch.zeros(2, 8), torch.zeros(2, 32), torch.ones(8)
    for args in ((a, x, torch.tensor([2]), wn, 32, 1.0, 1e-5),   # a row outside a
                 (a, x, torch.tensor([0]), torch.ones(7), 32, 1.0, 1e-5),  # wn of another V
                 (a, x, torch.tensor([0]), wn, 5, 1.0, 1e-5),  # a block not dividing K
                 (a, x, torch.tensor([0]), wn, 32, math.nan, 1e-5),
                 (a, x[:1], torch.tensor([0]), wn, 32, 1.0, 1e-5)):
        with pytest.raises(RuntimeError):
            screen(*args)
    with pytest.raises(RuntimeError):
        rescore(torch.zeros(1, 32), x, torch.tensor([0]), torch.tensor([8]), a)  # a col outside a
    rows, cols, bad = screen(a, x, torch.tensor([0, 1]), wn, 32, 1.0, 1e-5)
    assert not bad.any() and rows.numel() == 16  # all-equal logits: every column is a candidate


# --- through the engine --------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def engines(smollm2) -> tuple[LLM, LLM]:  # noqa: ANN001
    return LLM(smollm2, num_blocks=128, greedy_head="screen"), LLM(smollm2, num_blocks=128, greedy_head="off")


def test_engine_tokens_equal_the_float32_argmax_away_from_ties(engines: tuple[LLM, LLM]) -> None:
    on, off = engines
    p = SamplingParams(temperature=0, max_tokens=24)
    assert [o.token_ids for o in on.generate(PROMPTS, p)] == [o.token_ids for o in off.generate(PROMPTS, p)]
    assert on.engine.runner.greedy_tokens is not None  # the screened head took them


def test_logprobs_and_sampled_rows_beside_greedy_ones(engines: tuple[LLM, LLM]) -> None:
    on, off = engines
    params = [SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0, max_tokens=12, logprobs=2),
              SamplingParams(temperature=0.8, max_tokens=12, seed=7),
              SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3)]
    a, b = on.generate(PROMPTS, params), off.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a[1].outputs[0].logprobs, b[1].outputs[0].logprobs, strict=True):
        assert x.keys() == y.keys()
        assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_greedy_head_option_is_checked(smollm2) -> None:  # noqa: ANN001
    with pytest.raises(InvalidParamsError, match="greedy_head"):
        LLM(smollm2, num_blocks=8, greedy_head="fast")
