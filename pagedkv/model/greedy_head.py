"""The greedy LM head: a greedy row's token from the few logits that can be its maximum,
recomputed in float64.

A row whose token is the plain argmax of its raw logits (greedy, and nothing that changes the
logits: no logit_bias, penalties, min_tokens or grammar; `sampler.greedy_kind`) needs only the
maximum. For such rows the quantized LM head (one segment, a type the kernels read):
1. computes every logit: with the model's own path, or, where every row of the call needs only
   its argmax and the int8 kernels are faster (`int8_faster`), with activations rounded to 8 bits
   (quant.QWeight with activations="int8", over the same blocks);
2. bounds each logit's distance from its exact value t_j = w_j . x (real arithmetic; w_j the
   `gguf` float32 weights, x the normed hidden state);
3. lists the candidates (logits_screen.cpp): every j whose upper bound reaches the largest lower
   bound of the row, which the true argmax always does;
4. recomputes the candidates in float64 (a product of two float32 is exact there) and writes them,
   rounded to float32, in place.
Every other logit stays strictly below the best candidate's (the screen's |a| 2^-20 term), so
the sampler's first maximum is the argmax of t over the candidates, which is the argmax of t
(up to float64 rounding, about K 2^-53 relative). Invariant: a greedy row's token depends
neither on which way step 1 took nor on the other rows of the call; only x does (the model's
part). A row with logprobs keeps every logit exact and has its candidates rewritten the same way.

Bounds, per row and vocabulary entry j (u = 2^-24, |.| the 2-norm):
- int8 (SCREEN_BLOCK's types: Q8_0, whose int8 kernels round x per 32 elements, and Q6_K, per
  256): each block is rounded to d q with d = amax / 127 (float32) and |x - d q| <= 0.502 d
  (d / 2 and the rounding of x / d); a block so small that 1 / d overflows, |x - d q| <= 2.1
  amax. So |sum_i w_i (x_i - xhat_i)| <= |w_j| |e| with |e|^2 <= sum over blocks of B f^2.
- the kernels' float roundings: at most (K + 64) u sum_i |terms_i| <= (K + 64) u M_j (|x| + |e|),
  M_j = |w_j| for the exact kernels and Q8_0's int8 ones, |w_j| + 2 |o_j| for Q6_K's int8 ones
  (they subtract its 32 d sc offsets in float; o_j is the row with every quant at 0). The largest
  M_j of the head is used for every j (a term ~1e-4 of the others).
Rows whose logits or bounds are not finite are left to the model's exact path. A row with more
than MAX_CANDIDATES candidates (a near-flat distribution) takes its exact logits and their
tighter bound; one crowded even then (degenerate, e.g. a head of equal rows) keeps its float32
logits, and the sampler takes their argmax.

Measured (Zen 2, 2 threads, the LM head alone, ms, exact vs int8): Gemma 3 270M's Q8_0
262,144 x 640: 6.16 vs 6.13 at 1 row, 10.5 vs 7.75 at 2, 24.8 vs 21.4 at 8, 70.7 vs 64.5 at 32,
82.3 vs 82.7 at 40; Qwen2.5-0.5B's Q8_0 151,936 x 896: 18.7 vs 18.4 at 8, 34.0 vs 27.8 at 16;
Qwen2.5-1.5B's Q6_K 151,936 x 1536: 14.1 vs 8.7 at 1, 48.5 vs 24.3 at 8, 114 vs 84 at 40.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from pagedkv.model import qkernel
from pagedkv.model.quant import QWeight

Q = GGMLQuantizationType
SCREEN_BLOCK = {Q.Q8_0: 32, Q.Q6_K: 256}  # int8-screened types -> elements per activation block
# Q6_K's 210-byte block: ql[128], qh[64], scales[16] (int8), d (float16)
_Q6_K_SCALES, _Q6_K_D, _Q6_K_BLOCK = 192, 208, 210
_U = 2.0 ** -24
_UP = 1 + 2.0 ** -20  # rounding a bound up
INT8_MIN_ROWS, INT8_MAX_ROWS = 2, 32  # Q8_0 heads without AVX-512 VNNI: where int8 is faster
_CHUNK = 1 << 22  # weights dequantized at a time (norms, rescoring): 16 MiB of float32
# a row with more candidates (a near-flat distribution: real hidden states gave 8 a row, at most
# 872, of Gemma 3's 262,144 with the int8 bound) gets its exact logits and their bound instead,
# or, still crowded, the float32 argmax: rescoring is bounded by K MAX_CANDIDATES a row
MAX_CANDIDATES = 1024


def int8_faster(qtype: Q, rows: int) -> bool:
    """Whether the int8 kernels compute a head of `qtype` faster than the exact ones for `rows`
    rows: with AVX-512 VNNI (vpdpbusd) always; with AVX2 the measures above; with AVX-512 and no
    VNNI never (its int8 kernels run their AVX2 code against 16-lane exact ones: not measured,
    so not taken)."""
    isa = qkernel.isa()
    if isa == "AVX-512 VNNI":
        return True
    if isa != "AVX2":
        return False
    return qtype != Q.Q8_0 or INT8_MIN_ROWS <= rows <= INT8_MAX_ROWS


def _q6_k_offset_norms(data: torch.Tensor) -> torch.Tensor:
    """float64 [N]: the 2-norm of each Q6_K row's offsets o = -32 d sc (16 elements a scale),
    from its scale bytes alone."""
    n = data.shape[0]
    out = torch.empty(n, dtype=torch.float64)
    step = max(1, _CHUNK // data.shape[1])
    for s in range(0, n, step):
        b = data[s : s + step].view(-1, data.shape[1] // _Q6_K_BLOCK, _Q6_K_BLOCK)
        d = b[:, :, _Q6_K_D:].contiguous().view(torch.float16).double()  # [rows, blocks, 1]
        sc = b[:, :, _Q6_K_SCALES:_Q6_K_D].contiguous().view(torch.int8).double()
        out[s : s + b.shape[0]] = ((32 * d * sc).square().sum((1, 2)) * 16).sqrt()
    return out


def _crowded(rows: torch.Tensor, n: int) -> torch.Tensor:
    """The rows of [n] holding more than MAX_CANDIDATES candidates."""
    if rows.numel() <= MAX_CANDIDATES:
        return rows[:0]
    return (torch.bincount(rows, minlength=n) > MAX_CANDIDATES).nonzero().flatten()


class GreedyHead:
    """The greedy rows' logits of one quantized LM head (`able` heads only)."""

    def __init__(self, q: QWeight) -> None:
        (qtype, data), = q.parts
        self.q, self.qtype, self.data, self.k = q, qtype, data, q.k
        self.block = SCREEN_BLOCK.get(qtype)
        self._twin: QWeight | None = None  # the same blocks, activations="int8"
        self._norms: tuple | None = None  # norms(): (|w_j|, max |w_j|, max M_j), () if not finite

    @staticmethod
    def able(q: QWeight | None) -> bool:
        return (q is not None and len(q.parts) == 1 and not q.expanded and qkernel.screen() is not None
                and q.parts[0][1].device.type == "cpu")

    def logits(self, x: torch.Tensor, rows: torch.Tensor, approx: bool,
               out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, K] float32 -> (logits [T, V], tokens [T] int64 or None); rows (int64): the greedy
        rows, whose candidates are recomputed; approx: every row is greedy and needs no other
        logit exactly. tokens[r]: row r's argmax (the first maximum) where it was decided here,
        -1 elsewhere (other rows; a row with a value that is not finite)."""
        x = x.contiguous()
        norms = self.norms()
        if norms is None:  # a weight that is not finite: the model's path, as it is
            return self.q.linear(x, out), None
        fast = approx and not self.q.a8 and self.block is not None and int8_faster(self.qtype, x.shape[0])
        a = (self.twin() if fast else self.q).linear(x, out)
        int8 = fast or self.q.a8
        if int8 and self.block is None:  # int8 mode with a head type of no known bound
            return a, None
        block, m = (self.block, norms[2]) if int8 else (0, norms[1])
        screen, c = qkernel.screen()[0], (self.k + 64) * _U
        cand_rows, cols, bad = screen(a, x, rows, norms[0], block, m, c)
        redo = rows[bad] if fast else rows[:0]  # their exact logits, as the model's path gives them
        crowded = _crowded(cand_rows, x.shape[0])
        if crowded.numel():  # rescoring them would cost more than the exact logits
            keep = ~torch.isin(cand_rows, crowded)
            cand_rows, cols = cand_rows[keep], cols[keep]
            if fast:  # the exact logits, then their (tight) bound: a few candidates
                a[crowded] = self.q.linear(x.index_select(0, crowded))
                more_rows, more_cols, _ = screen(a, x, crowded, norms[0], 0, norms[1], c)
                keep = ~torch.isin(more_rows, _crowded(more_rows, x.shape[0]))
                cand_rows = torch.cat([cand_rows, more_rows[keep]])
                cols = torch.cat([cols, more_cols[keep]])
            # (else, or still crowded: the sampler's float32 argmax of the row)
        tokens = self._rescore(a, x, cand_rows, cols)
        if redo.numel():
            a[redo] = self.q.linear(x.index_select(0, redo))
        return a, tokens

    def _rescore(self, a: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor
                 ) -> torch.Tensor | None:
        """a[rows, cols] = the float64 dots of those weight rows with x's rows, rounded to
        float32; the rows' first maxima (logits_screen.cpp's rescore), or None where the
        candidates took more than one chunk (the sampler then finds them in a)."""
        step = max(1, _CHUNK // self.k)
        tokens = None
        for s in range(0, max(1, rows.numel()), step):
            r, c = rows[s : s + step], cols[s : s + step]
            w = torch.empty(c.numel(), self.k)
            torch.ops.pagedkv_q.qrows(self.data, int(self.qtype), self.k, c, w)
            tokens = qkernel.screen()[1](w, x, r, c, a)
        return tokens if rows.numel() <= step else None

    def twin(self) -> QWeight:
        if self._twin is None:
            t = QWeight(self.k, [(self.qtype, self.data)])
            t.set_activations("int8")
            self._twin = t
        return self._twin

    def norms(self) -> tuple[torch.Tensor, float, float] | None:
        """(|w_j| float32 [V] rounded up, max_j |w_j|, max_j M_j), computed once; None where a
        weight is not finite."""
        if self._norms is None:
            self._norms = self._all_norms()
        return self._norms or None

    def _all_norms(self) -> tuple[torch.Tensor, float, float] | tuple[()]:
        """norms(), or () where a weight is not finite."""
        wn = self._row_norms(self.data)
        if not bool(torch.isfinite(wn).all()):
            return ()
        mg = float(wn.max()) if wn.numel() else 0.0
        mi = mg if self.qtype != Q.Q6_K else float((wn + 2 * _q6_k_offset_norms(self.data)).max())
        return (wn * _UP).float(), mg * _UP, mi * _UP

    def _row_norms(self, data: torch.Tensor) -> torch.Tensor:
        """The 2-norm of each dequantized row of `data` (blocks of self.qtype), float64, rounded up."""
        n = data.shape[0]
        out = torch.empty(n, dtype=torch.float64)
        step = max(1, _CHUNK // self.k)
        for s in range(0, n, step):
            idx = torch.arange(s, min(n, s + step))
            w = torch.empty(idx.numel(), self.k)
            torch.ops.pagedkv_q.qrows(data, int(self.qtype), self.k, idx, w)
            out[s : s + idx.numel()] = torch.linalg.vector_norm(w, dim=1)
        # summed in float32 (8x faster than in float64): within K u of the true norm, so rounded up
        # by that (the weights' squares neither overflow nor underflow: a Q8_0 / Q6_K weight is 0 or
        # at least 2^-24 in magnitude and at most 65504 * 128 * 32; any other head reads only the
        # largest)
        return out * (1 + (self.k + 16) * _U)
