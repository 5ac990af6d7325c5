"""QWeight: a matmul weight or embedding table kept as the GGUF file's quantized blocks.

A QWeight is an [N, K] matrix stored as row segments, each a contiguous uint8 [n_i, row_bytes]
tensor of one ggml type (fused projections such as q/k/v may mix types: a Q4_K_M file keeps v in
Q6_K). Types the kernel reads (KERNEL_TYPES, the table of qmatmul.cpp's ggml_blocks.h, checked
against the gguf package's block sizes when the kernel loads): every type the llama.cpp presets
Q2_K .. Q8_0 and IQ4_NL / IQ4_XS put into a file (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) and F32, F16, BF16. A segment of any other type the `gguf`
package can dequantize (the IQ2/IQ3/IQ1 and ternary types) is stored as F32 rows instead, and
`expanded` says which types and the float32 bytes they became (the start-up report shows it).

Invariant: every path multiplies by exactly the float32 values `gguf.quants.dequantize` returns
for the stored blocks; only the summation order differs.

- `linear(x)`: x [T, K] float32 -> [T, N]. Up to TILED_ROWS rows, the compiled kernel
  (qmatmul.cpp) dequantizes each weight row in registers and dots it with every activation row:
  each weight byte is read once per call (decode is bandwidth-bound). Above TILED_ROWS rows
  (prefill, big batches: compute-bound) the weight is dequantized TILE_ELEMS at a time into a
  float32 tile that one BLAS matmul reuses across all rows; the tile is transient (4 MiB), so the
  memory cost is that of the quantized model plus one tile. The tile is multiplied by oneDNN
  (packed.plain_linear), about 2.3x faster than torch.mm's BLAS on the AMD machine measured.
  TILED_ROWS and A8_ROWS are the measured crossovers for the CPU's vector width (_crossovers).
  Opt-in `set_batch_weights("float32")`: those calls multiply a float32 copy pre-packed for
  oneDNN instead (the memory of a float32 model on top of the quantized one; no per-call
  dequantizing, so large batches and prefill run at float32 speed).
  Calls of gemm_min_rows(k) rows and more (many users decoding at once, prefill; not with the
  float32 copy; K a multiple of 32) go to the kernel's qgemm instead (AVX-512 or AVX2), in
  blocks of GEMM_MAX_ROWS rows: no float32 tile in memory, no oneDNN repacking, and each output
  one sequential FMA chain over K (the same bits whatever the row count). The tiles remain for
  a build without AVX2 and for K not a multiple of 32.
- `rows(ids)`: dequantizes only the rows looked up (token embeddings).
- Without the kernel (no compiler, PAGEDKV_NO_KERNEL=1) the pure-torch fallback dequantizes the
  whole weight once with the gguf package, keeps the float32 copy, and uses F.linear / indexing.

Opt-in approximate mode, `activations = "int8"` (set by LlamaModel.set_activations): up to
A8_ROWS activation rows, `linear(x)` quantizes x once per call to int8 per 32-element block
(qmatmul_a8.cpp; shared by all the segments, e.g. q/k/v) and multiplies every quantized segment
(A8_TYPES: the 32-element types by qmatmul_a8.cpp, x quantized per 32; the K-quants and IQ4_XS by
qmatmul_a8x.cpp, x quantized per 256 as llama.cpp's q8_K) in integers, as llama.cpp does; the invariant above then does not hold
(the activations are rounded to 8 bits). A weight whose segments are all PANEL_TYPES (every
A8 type) is multiplied from panel_rows() rows on (big
batches, prefill) by the panel kernel (qmatmul_panel.cpp: 16 weight rows unpacked per panel
straight from the file's blocks and vpdpbusd on a CPU with AVX-512 VNNI; 8 rows and maddubs
with AVX2 only), with no upper limit. F16/BF16/F32 segments take the exact path with the float32 x, as do calls above
A8_ROWS rows without the panel kernel (prefill: the tiled path) and every call without the kernel.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from pagedkv.errors import UnsupportedModelError
from pagedkv.model import qkernel
from pagedkv.model.packed import linear as packed_linear
from pagedkv.model.packed import pack, plain_linear

Q = GGMLQuantizationType
KERNEL_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS,
})
# QWeight.route: the kernel a call takes
ROUTE_R16, ROUTE_PANEL, ROUTE_A8, ROUTE_A8_MIXED, ROUTE_GEMM, ROUTE_PACKED, ROUTE_TILED, ROUTE_ROWS, ROUTE_FALLBACK = range(9)
_generation = 0  # bumped by every change of a QWeight's routes (changed())


def changed() -> None:
    """Any QWeight's routes may have changed (set_activations, set_batch_weights, a rebind)."""
    global _generation
    _generation += 1


def route_key() -> tuple:
    """What a cached plan of routes (LlamaModel._decode_plan) is valid for: the count of
    changed() calls and the module's routing knobs QWeight.route reads at call time (tests
    change some)."""
    return (_generation, A8_IMPL, A8_ROWS, A8_SB_ROWS, A8_SB_VNNI_ROWS, PACKED_A8_ROWS, TILED_ROWS,
            PACKED_TILED_ROWS, GEMM_MIN_ROWS, GEMM_MIN_ROWS_PAIRED, GEMM_MAX_ROWS, PAIRED_K)


TILE_ELEMS = 1 << 20  # float32 elements per dequantized tile (4 MiB)
ACTIVATIONS = ("float32", "int8")  # activation modes; "int8" is the approximate, opt-in one
BATCH_WEIGHTS = ("quantized", "float32", "panel")  # what calls above the kernels' rows multiply by
# the types whose panels batch_weights="panel" keeps (int8 mode, AVX-512 VNNI: qmatmul_panel.cpp's r16)
R16_TYPES = frozenset({Q.Q4_K, Q.Q5_K, Q.Q6_K})
# the int8 panel kernel's types (many rows): every type with one scale per 32 elements, and those
# with one per 16 (Q6_K, Q3_K, Q2_K)
PANEL_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
                         Q.IQ4_XS})
# segment types the int8 row kernel multiplies: 32-element blocks (qmatmul_a8.cpp, activations
# quantized per 32) and super-blocks (qmatmul_a8x.cpp, activations quantized per 256)
A8_SB_TYPES = frozenset({Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS})
A8_TYPES = PANEL_TYPES | A8_SB_TYPES


def _crossovers(capability: str, packed: bool = False) -> tuple[int, int]:
    """(TILED_ROWS, A8_ROWS): up to how many activation rows the row-streaming kernel, and the
    int8 kernel, beat dequantized tiles + oneDNN's matmul. They depend on the widest vector ISA
    the matmul library uses (ATen's CPU capability, which oneDNN's own dispatch agrees with).
    Measured as a decode step sees them: all of SmolLM2's matmuls (30 layers + the Q8_0 LM
    head, 96 MB, streamed from memory) at T rows, 2 threads of a Zen 5 EPYC, ms per step, with
    oneDNN limited to AVX2 (ONEDNN_MAX_CPU_ISA) or not. The tiles cost ~15 ms per step whatever
    T (every weight dequantized to float32 and repacked by oneDNN), then scale well:
    - AVX-512: exact kernel vs tiles 14.8 vs 24.0 at 8 rows, 30.2 vs 29.2 at 16; int8 kernel
      vs tiles 34.1 vs 50.6 at 24, 46.6 vs 38.3 at 32, 59.9 vs 45.3 at 40.
    - AVX2: exact 14.6 vs 30.4 at 8, 30.6 vs 42.3 at 16, 53.2 vs 50.6 at 24; the int8 kernel
      ties the tiles between 40 and 64 rows (single-thread, earlier).
    `packed`: against the pre-packed float32 copy (set_batch_weights), which has no fixed cost:
    - AVX-512: exact kernel vs copy 14.8 vs 19.1 at 8, 30.5 vs 21.1 at 16; int8 12.7 vs 17.2
      at 8, 23.6 vs 22.0 at 16, 60 vs 35 at 40.
    - AVX2: exact 30.7 vs 34.2 at 16, 73.4 vs 51.4 at 32; int8 23.4 vs 34.2 at 16, 46.2 vs 51.4
      at 32."""
    if capability.startswith("AVX512"):
        return (8, 16) if packed else (16, 28)
    return (20, 40) if packed else (24, 64)


TILED_ROWS, A8_ROWS = _crossovers(torch.backends.cpu.get_cpu_capability())
PACKED_TILED_ROWS, PACKED_A8_ROWS = _crossovers(torch.backends.cpu.get_cpu_capability(), packed=True)
A8_IMPL = 0  # qmatmul_a8.cpp impl: 0 the fastest built, 1 scalar (same results)
# From this many rows on, int8 mode multiplies by the VNNI panel kernel (qmatmul_panel.cpp) where
# the CPU has it, at any row count (it beats the tiles and the float32 copy everywhere). SmolLM2's
# matmuls of one step (layers + LM head, streamed from memory), 2 threads of the Zen 5 EPYC, ms
# (bench decode's a8_crossover_ms): panel vs the int8 row kernel 6.5 vs 3.7 at 1 row, 6.7 vs 5.0
# at 2, 6.2-7.6 vs 7.3 at 4, 7.8 vs 12.7 at 8; at 40 rows 17.9 vs 51 (tiles), at 256 83 vs 198.
PANEL_ROWS = 4
# Weights with a K-quant panel segment (Q4_K, Q5_K, IQ4_XS, Q3_K, Q2_K) take the panel from PANEL_SB_ROWS
# rows, with a Q6_K segment from PANEL_Q6_K_ROWS: below, the int8 row kernel (AVX-512 VNNI, 4
# activation rows per pass) is faster. The panel's unpacking is a fixed cost per call (Q6_K's
# ~1.5x Q4_K's: 13 16-row transposes a super-block against 9). 2 threads (Zen 4 EPYC), ns per
# weight per call, interleaved min of 7, panel vs row kernel, 8960x1536: Q4_K 0.055 vs 0.037 at 4
# rows, 0.068 vs 0.059 at 6, 0.070 vs 0.079 at 8, 0.099 vs 0.141 at 16 (1536x8960: 0.041 vs 0.040
# at 4, 0.058 vs 0.075 at 8); Q5_K 0.080 vs 0.083 at 8, IQ4_XS 0.062 vs 0.082; Q6_K 0.113 vs 0.074
# at 8, 0.122 vs 0.107 at 12, 0.143 vs 0.144 at 16 (1536x8960: 0.160 vs 0.169 at 16).
# On an Intel Xeon (AVX-512 VNNI, full-width 512-bit units) the Q6_K panel overtakes sooner: the
# same measure, panel vs row kernel, Q6_K 8960x1536 0.067 vs 0.077 at 8, 0.090 vs 0.115 at 12;
# 1536x8960 0.073 vs 0.071 at 8, 0.088 vs 0.111 at 12; 32768x1536 0.092 vs 0.111 at 12. In process
# the 1.5B K-quant file's int8 decode step (alternated, medians), Q6_K from 12 rows instead of 16:
# 12 rows 176.7 -> 166.7 and 177.7 -> 167.7 ms; from 8: 8 rows 135.2 -> 138.2 (slower: not taken).
# Its K-quant panel leads from 6 rows there (Q4_K 0.045 vs 0.060), but the step at 6 rows moved
# within the noise (119.9 -> 117.8 ms): PANEL_SB_ROWS stays 8 there.
# On a Zen 5 EPYC (cpuid family 0x1A) the row kernel holds out longer for weights streamed from
# DRAM: 2 threads, 65536 x 1536, ps per multiply-add and thread, row kernel vs panel (pairs),
# min of 9 alternated: Q4_K 10.3 vs 13.0 at 8 rows, 10.3 vs 9.6 at 12, 10.2 vs 8.0 at 16; Q6_K
# 10.5 vs 20.0 at 8, 10.2 vs 11.7 at 16 (in L3, 8960 x 1536, the panel led from 4 rows). The
# 1.5B K-quant file's int8 step (one engine, alternated, medians), K-quants from 12 rows instead
# of 8: 8 rows 90.1 -> 82.3 and 104.6 -> 84.0 ms, 12 / 16 / 20 rows the same within 1%; Q6_K
# from 24 instead of 16: 16 rows 134.6 -> 132.0, 20 rows 140.5 -> 146.6 (not taken).


def _cpu(path: str = "/proc/cpuinfo") -> tuple[str, int]:
    """The first CPU's vendor_id and cpu family in /proc/cpuinfo ("", 0 where it cannot be read)."""
    vendor, family = "", 0
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    vendor = value.strip()
                elif key.strip() == "cpu family" and value.strip().isdigit():
                    family = int(value.strip())
                elif not line.strip() and vendor:
                    break
    except OSError:
        pass
    return vendor, family


def _intel_cpu() -> bool:
    return _cpu()[0] == "GenuineIntel"


def _zen5_cpu() -> bool:  # AMD Zen 5 and later (family 0x1A on)
    vendor, family = _cpu()
    return vendor == "AuthenticAMD" and family >= 0x1A


# The measurements above were taken while the panel's prefetch of its next panel never ran (ahead.h:
# the compiler had deleted it); with it running, on the Zen 4 (2 threads, 65536 x 1536 from DRAM,
# ps per multiply-add, row kernel / panel): Q4_K 10.6 / 8.1 at 6 rows, 8.4 / 6.5 at 8; Q6_K 8.3 /
# 11.4 at 8, 8.3 / 6.8 at 12; Q3_K 10.6 / 7.5 at 6, 9.6 / 7.5 at 8; Q2_K 8.4 / 6.8 at 6. The
# 1.5B K-quant file's int8 step, alternated: 6 rows, K-quants from 6 instead of 8, 94-96 -> 85-90
# ms; 12 rows, Q6_K from 12 instead of 16, 122-126 -> 113-116; the 1.5B Q3_K_M-like file at 8
# rows, Q3_K from 8 instead of 12, 122-123 -> 95-96. Zen 5 and Intel keep their (earlier) counts.
# Q3_K and Q2_K weights follow PANEL_SB_ROWS.
PANEL_SB_ROWS = 12 if _zen5_cpu() else 8 if _intel_cpu() else 6
PANEL_Q6_K_ROWS = 16 if _zen5_cpu() else 12
# Without VNNI the AVX2 panel trails the row kernel there (2 threads, 8960 x 1536, PAGEDKV_MAX_ISA=avx2,
# ps per multiply-add at 12 rows, row kernel / panel: Q2_K 7.7 / 9.3, Q3_K 9.1 / 11.2) but beats
# the exact path past the row kernel's cap (16 rows: Q2_K 19.0 -> 8.4, Q3_K 19.5 -> 10.2; 40
# rows: 11.2 -> 6.4, 11.1 -> 7.9): from A8_SB_ROWS + 1 rows there
# Without VNNI (an AVX2 CPU: the panel's maddubs code, 8 weight rows a panel) the AVX2 row kernel
# holds out longer where a type's products cost more there (Q8_0 / IQ4_NL / IQ4_XS: two maddubs
# a quad; the K-quants: scales unpacked per row): the rows below for weights of only Q4_0 / Q4_1 /
# Q5_0 / Q5_1 (4 before unpack_nibbles_avx2), PANEL_AVX2_SB_ROWS with any other type. 1 thread,
# PAGEDKV_MAX_ISA=avx2 on the Zen 4, 2048 x 1536, ns per multiply-add, panel / row kernel,
# interleaved min of 5: Q5_0 0.022 / 0.032 at 4 rows, 0.016 / 0.031 at 8; Q8_0 0.034 / 0.027 at
# 4, 0.028 / 0.027 at 8, 0.026 / 0.028 at 16; Q4_K 0.032 / 0.022 at 4, 0.022 / 0.021 at 8, 0.018 / 0.021 at 16; Q6_K 0.024 /
# 0.022 at 8, 0.020 / 0.021 at 16 (and the row kernel's Q6_K stops at A8_SB_ROWS); IQ4_NL 0.027
# / 0.028 at 8. At 40 rows the panel: Q4_0 / Q4_1 / Q5_0 0.013, Q4_K 0.015, Q6_K 0.017, Q8_0
# 0.026 (VNNI: 0.007-0.008). A step's matmuls of the Qwen2.5-0.5B Q4_K_M mix, 2 threads, ms,
# row kernel -> panel: 349 -> 200 at 40 rows, 2,176 (the tiles) -> 1,285 at 256.
PANEL_AVX2_SB_ROWS = 10
# Q5_0 / Q5_1 / Q4_0 weights from PANEL_AVX2_Q5_ROWS and Q4_1 from PANEL_AVX2_Q4_1_ROWS: their
# row kernel decodes each block per call and row (Q5's fifth bits the most), the panel once per call,
# 8 rows per instruction after the transpose (unpack_nibbles_avx2). Zen 2 EPYC, 2 threads, int8 step,
# alternated, ms, the row kernel -> the panel for those weights: the 0.5B Q4_K_M mix (Q5_0) 2 rows
# 30.4 -> 28.5, 3 rows 40.4 -> 33.9; the same shapes in Q5_1 29.9 -> 28.8, 38.7 -> 32.8; in Q4_0
# 28.7 -> 27.2, 37.7 -> 31.0; in Q4_1 25.7 -> 27.1 (so not 2), 35.6 -> 31.2, and SmolLM2-135M's
# Q4_1 file 9.7 -> 10.8, 14.0 -> 13.5. Q8_0 weights from 4 rows instead of 5: the all-Q8_0 0.5B
# 42.5 -> 45.2 (so not).
PANEL_AVX2_Q5_ROWS = 2
PANEL_AVX2_Q4_1_ROWS = 3
# Q4_K weights (beside those types) from PANEL_AVX2_K4_ROWS: the AVX2 unpacking decodes their
# super-blocks' scales 8 rows per instruction (header_k4_avx2), half the cost of a call's
# unpacking before. The 1.5B K-quant file's int8 step on a Zen 2 EPYC (AVX2 only; 2 threads, one
# engine, alternated, medians), Q4_K-only weights from these rows instead of 12 (its Q6_K ones as
# before): 8 rows 185.1 -> 159.1 ms (every weight from 8: 165.7), 6 rows 142.2 -> 129.1, 4 rows
# 97.0 -> 99.6 (not taken); the 0.5B Q4_K_M mix at 8 rows 66.4 -> 62.3. With their quants decoded
# after the transpose too (unpack_k4_avx2), from 4 rows instead of 6: 5 rows 124.6 -> 112.7, 4
# rows 96.6 -> 94.1 and 95.3 -> 92.4 (the 0.5B mix 37.0 -> 37.3), 3 rows 82.3 -> 83.1 (not taken).
PANEL_AVX2_K4_ROWS = 4
# Q6_K weights from PANEL_AVX2_Q6_ROWS, with its quants decoded after the transpose too
# (unpack_q6k_avx2): the 1.5B's step (its Q6_K weights from these rows instead of 10) at 8 rows
# 153.1 -> 146.3 ms, the 0.5B mix's 59.0 -> 58.6; at 6 rows 122.7 -> 122.1 (so not lower).
PANEL_AVX2_Q6_ROWS = 8
# Q8_0 and IQ4_NL from PANEL_AVX2_Q8_ROWS (their panel by the sign trick, one maddubs a quad; two
# panels at a time when measured, one since stop 62), any other type (Q5_K, IQ4_XS; Q6_K before unpack_q6k_avx2) from
# PANEL_AVX2_SB_ROWS (Q6_K's scales decoded 8 rows at a time too); a weight of several types from
# the largest of theirs. The same
# Zen 2, alternated step medians, ms: every weight from 10 at 10 rows 80.7 -> 75.1; the 1.5B at 10
# rows (its Q6_K weights from 10) 192.7 -> 185.8, at 8 rows from 8 163.9 -> 166.0 (not taken); the
# 0.5B mix, its weights with a Q8_0 segment from these rows instead of 8: 6 rows 54.5 -> 51.1, 5
# rows 48.7 -> 46.3, 4 rows 39.7 -> 39.3, 3 rows 39.2 -> 40.4 (not taken). 4864 x 896, 2 threads,
# panel / row kernel: Q8_0 1.22 at 4 rows, 0.91 at 5, 0.83 at 8; IQ4_NL 1.02, 0.87, 0.84; IQ4_XS
# 1.46, 1.19, 1.16 (1.04 at 10); with its scales decoded 8 rows at a time (header_xs_avx2), 4864 x
# 1024: 1.26 at 4, 1.12 at 5, 1.05 at 8, 0.96 at 10 (its row kernel, per 256, is the faster one),
# so IQ4_XS stays at PANEL_AVX2_SB_ROWS.
PANEL_AVX2_Q8_ROWS = 5
PANEL_AVX2_FROM = {Q.Q5_0: PANEL_AVX2_Q5_ROWS, Q.Q5_1: PANEL_AVX2_Q5_ROWS, Q.Q4_0: PANEL_AVX2_Q5_ROWS,
                   Q.Q4_1: PANEL_AVX2_Q4_1_ROWS, Q.Q4_K: PANEL_AVX2_K4_ROWS, Q.Q6_K: PANEL_AVX2_Q6_ROWS,
                   Q.Q8_0: PANEL_AVX2_Q8_ROWS, Q.IQ4_NL: PANEL_AVX2_Q8_ROWS}


def panel_rows(qtypes: Iterable[Q]) -> int:
    """From how many activation rows on a weight of these segment types takes the int8 panel
    (the VNNI one, or the AVX2 one on a CPU without VNNI)."""
    qtypes = set(qtypes)
    if not qkernel.vnni():
        if qtypes & {Q.Q2_K, Q.Q3_K}:  # the row kernel leads up to its cap (A8_SB_ROWS), the panel after
            return A8_SB_ROWS + 1
        return max((PANEL_AVX2_FROM.get(q, PANEL_AVX2_SB_ROWS) for q in qtypes), default=PANEL_AVX2_Q5_ROWS)
    if Q.Q6_K in qtypes:
        return PANEL_Q6_K_ROWS
    return PANEL_SB_ROWS if qtypes & A8_SB_TYPES else PANEL_ROWS


# Up to this many rows, weights with a Q6_K, Q3_K or Q2_K segment use the int8 row kernel where
# there is no panel kernel (or before its rows); above, the exact path is faster: Q6_K, 4096x4096, 2
# threads, ns per weight, AVX2 int8 row kernel vs exact: 0.133 vs 0.174 at 8 rows, 0.468 vs
# 0.387 at 28. Where the CPU has AVX-512 VNNI (the row kernel's VNNI tiles), A8_SB_VNNI_ROWS:
# 8960x1536, 2 threads, row kernel vs exact: Q6_K 0.185 vs 0.411 at 16 rows, 0.447 vs 0.698 at
# 40, 0.730 vs 1.019 at 64, 1.556 vs 1.608 at 128 (Q3_K, Q2_K alike).
A8_SB_ROWS = 12
A8_SB_VNNI_ROWS = 64
# the super-block types those caps apply to (where the panel does not take the call)
A8_SB_CAP_TYPES = frozenset({Q.Q2_K, Q.Q3_K, Q.Q6_K})


def _gemm_rows(capability: str) -> tuple[int, int]:
    """(GEMM_MIN_ROWS, GEMM_MAX_ROWS): the exact path's calls with that many rows go to
    qmatmul.cpp's qgemm (panels of weight rows dequantized and transposed into L1/L2, activations
    broadcast: 32 rows and 6 activation rows per pass with AVX-512, 16 and 5 with AVX2) instead
    of the row kernel or the tiles + oneDNN. Whole step's matmuls (SmolLM2, 2 threads), ms, row
    kernel / tiles / qgemm:
    - AVX-512: 19.3 / 25.0 / 19.2 at 12 rows, 23.1 / 26.4 / 21.7 at 14, 26.1 / 28.2 / 21.8 at 16;
      43.1 (tiles) / 34.7 at 40, 64.3 / 46.8 at 64, 95.9 / 83.1 at 128, 178.4 / 183.1 at 256.
    - AVX2 (our kernels limited to AVX2, oneDNN to AVX2 by ONEDNN_MAX_CPU_ISA): 30.3 / 41.5 /
      30.0 at 16, 53.3 / 48.7 / 36.4 at 24; 70.1 / 54.8 at 40, 140.3 / 82.4 at 64, 216.9 / 155.3
      at 128, 359.8 / 358.0 at 256. On a real AVX2 CPU (Zen 2 EPYC; the row kernels as of stop
      62), whole decode steps, 2 threads, ms, qgemm from 17 -> from 13 rows (the 12-row step
      slower that way: 441 -> 470): the 1.5B K-quant file 535-539 -> 488 at 13 rows, 541 -> 516-518
      at 14, 569-570 -> 467-468 at 15, 593 -> 537 at 16; the 0.5B Q4_K_M mix 179-180 -> 159-160 at
      13, 184 -> 169 at 14, 203-204 -> 174 at 16: from 13 on both ISAs. With the row kernel's
      blocks (qmatmul.cpp: ROW_BLOCK) row kernel / qgemm: the 1.5B 482 / 487 at 13, 545 / 539 at
      16; the 0.5B mix 163 / 161 at 13, 185 / 174 at 16. Stop 63 (Zen 2), the AVX2 gemm's panels
      decoded from byte transposes (qmatmul_panel.cpp: f32_avx2), its register blocks of up to 6
      rows split evenly, its tails' sums kept in registers: whole steps, row kernel / qgemm, ms,
      the 1.5B 231 / 230 at 6, 252 / 300 at 7, 273 / 300 at 8, 346 / 300 at 9, 368 / 310 at 10,
      407 / 383 at 12 (qgemm 430 at 13, was 488); the 0.5B mix 93.5 / 103 at 8, 117 / 105 at 9,
      124 / 106 at 10, 139 / 130 at 12: from 9 with AVX2 (AVX-512, not measured since, from 13).
    Above GEMM_MAX_ROWS, qgemm in blocks of GEMM_MAX_ROWS rows (a block's x stays in the L3; a
    panel is dequantized once per block), not the tiles: Zen 5 EPYC, 2 threads, ms, tiles +
    oneDNN / qgemm blocks: 8960 x 1536 Q4_K 26.6 / 21.4 at 384 rows, 74.9 / 58.9 at 1024, 420.5
    / 118.6 at 2048; 1536 x 8960 Q4_K 30.3 / 24.4 at 384, 140.7 / 129.9 at 2048; 4864 x 896 Q5_0
    7.3 / 7.0 at 384, 46.3 / 37.6 at 2048; both limited to AVX2: 8960 x 1536 Q4_K 46.8 / 41.8 at
    384, 129.4 / 114.0 at 1024; 1536 x 8960 53.8 / 43.3 at 384."""
    return (13 if capability.startswith("AVX512") else 9), 192


GEMM_MIN_ROWS, GEMM_MAX_ROWS = _gemm_rows(torch.backends.cpu.get_cpu_capability())
# With AVX-512, rows longer than PAIRED_K (where 8 activation rows pass L1) take the row kernel's
# weight-row pairs (qmatmul.cpp: pair_group), which beat qgemm up to 16 rows: 2 threads, ns per
# weight, pairs / qgemm, 8960 x 1536 Q4_K 0.261 / 0.324 at 12, 0.352 / 0.374 at 16, 0.718 / 0.408
# at 20; Q6_K 0.331 / 0.398 at 16; 1536 x 8960 Q5_0 0.291 / 0.393 at 16, 0.466 / 0.447 at 20.
PAIRED_K = 1024
GEMM_MIN_ROWS_PAIRED = 17 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else GEMM_MIN_ROWS


def gemm_min_rows(k: int) -> int:
    """The fewest activation rows of length k that `linear` sends to qgemm."""
    return GEMM_MIN_ROWS if k <= PAIRED_K else max(GEMM_MIN_ROWS, GEMM_MIN_ROWS_PAIRED)


def row_bytes(qtype: GGMLQuantizationType, k: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise UnsupportedModelError(f"row of {k} elements is not a whole number of {qtype.name} blocks")
    return k // block * size


@dataclass(frozen=True, slots=True)
class QPart:
    """One tensor's rows as stored in the file: `data` uint8 [rows, row_bytes] of `qtype`."""

    qtype: GGMLQuantizationType
    data: torch.Tensor
    k: int  # elements per row

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.k)


class QWeight:
    """[N, K] weight as quantized row segments; see the module docstring."""

    def __init__(self, k: int, parts: list[tuple[GGMLQuantizationType, torch.Tensor]]) -> None:
        self.k = k
        self.parts: list[tuple[GGMLQuantizationType, torch.Tensor]] = []
        self.expanded: dict[str, int] = {}  # type without a kernel -> float32 bytes it became
        for qtype, data in parts:
            qtype = GGMLQuantizationType(qtype)
            if qtype not in KERNEL_TYPES:  # store as float32 rows: exact, just bigger
                values = dequantize(data.numpy(), qtype).astype(np.float32, copy=False)
                data = torch.from_numpy(values.reshape(data.shape[0], k)).view(torch.uint8)
                self.expanded[qtype.name] = self.expanded.get(qtype.name, 0) + data.numel()
                qtype = Q.F32
            if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes(qtype, k):
                raise UnsupportedModelError(f"{qtype.name} rows of shape {tuple(data.shape)} for K={k}")
            self.parts.append((qtype, data.contiguous()))
        self.n = sum(d.shape[0] for _, d in self.parts)
        self._float: torch.Tensor | None = None  # the fallback's float32 copy
        # per-call arguments of the kernel, built once: (blocks, type id, first output column)
        cols = np.cumsum([0] + [d.shape[0] for _, d in self.parts])
        self._calls = [(d, int(q), int(c)) for (q, d), c in zip(self.parts, cols, strict=False)]
        self._batch: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set_batch_weights
        self._r16: tuple[list[torch.Tensor], list[int], list[int]] | None = None  # (packs, types, rows)
        self.a8 = False  # activations="int8": see set_activations
        self._a8_all = False
        self._panel = False
        self._panel_from = PANEL_ROWS
        self._sb_cap = False
        self._a8_args = ([d for _, d in self.parts], [int(q) for q, _ in self.parts])

    def set_activations(self, mode: str) -> None:
        """"float32" (exact) or "int8" (approximate; effective where a segment is A8_TYPES)."""
        if mode not in ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported activations {mode!r}; choose one of {list(ACTIVATIONS)}")
        changed()
        self.a8 = mode == "int8" and self.int8_able()
        self._a8_all = all(q in A8_TYPES for q, _ in self.parts)  # one op call per linear
        self._panel = self._a8_all and all(q in PANEL_TYPES for q, _ in self.parts)
        sb = any(q in A8_SB_TYPES for q, _ in self.parts)
        self._panel_from = panel_rows(q for q, _ in self.parts)
        self._sb_cap = sb and (not self._panel or any(q in A8_SB_CAP_TYPES for q, _ in self.parts))
        if not self.a8:
            self._r16 = None  # (the kept panels serve int8 calls only)

    def int8_able(self) -> bool:
        """Whether activations="int8" changes how this weight is multiplied (a segment of a type
        the int8 kernels take, rows of whole 32-element blocks)."""
        return any(q in A8_TYPES for q, _ in self.parts) and self.k % 32 == 0

    def set_batch_weights(self, mode: str) -> None:
        """"quantized" (the default): calls above the kernels' rows multiply dequantized tiles.
        "float32": keep a float32 copy of the weight, pre-packed for oneDNN where it can be,
        for those calls instead (4-8x this weight's bytes; no per-call dequantizing).
        "panel" (int8 activations, after set_activations): keep the int8 panel kernel's layout of
        the weight (1.0x its bytes; r16_able) for the calls from its panel rows on, which then
        skip unpacking the file's blocks; the same results bit for bit."""
        if mode not in BATCH_WEIGHTS:
            raise UnsupportedModelError(f"unsupported batch weights {mode!r}; choose one of {list(BATCH_WEIGHTS)}")
        changed()
        if mode != "panel":
            self._r16 = None
        if mode != "float32":
            self._batch = None
        if mode == "panel":
            if self._r16 is None and self.r16_able():
                r16_pack = qkernel.r16()[0]
                self._r16 = ([r16_pack(d, int(q)) for q, d in self.parts], [int(q) for q, _ in self.parts],
                             [d.shape[0] for _, d in self.parts])
        elif mode == "float32" and self._batch is None:
            w = self.dequantize()
            packed = pack(w)  # oneDNN's own copy: the plain one can go
            self._batch = (w, None) if packed is None else (torch.empty(0, self.k), packed)

    def r16_able(self) -> bool:
        """Whether batch_weights="panel" keeps this weight's panels: every segment R16_TYPES,
        rows of whole super-blocks, int8 activations, and the kernel's AVX-512 VNNI code."""
        return (self.a8 and self.k % 256 == 0 and all(q in R16_TYPES for q, _ in self.parts)
                and qkernel.r16() is not None)

    @property
    def batch_bytes(self) -> int:
        """Bytes of the batch copy: float32, or the kept panels (0 without one)."""
        if self._r16 is not None:
            return sum(p.numel() for p in self._r16[0])
        return 0 if self._batch is None else self.n * self.k * 4

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return sum(d.numel() for _, d in self.parts)

    def __repr__(self) -> str:
        types = "+".join(dict.fromkeys(q.name for q, _ in self.parts))
        return f"QWeight({self.n}x{self.k}, {types}, {self.nbytes} bytes)"

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, by the gguf package's own dequantizer."""
        rows = [
            torch.from_numpy(np.ascontiguousarray(dequantize(d.numpy(), q), dtype=np.float32)).reshape(-1, self.k)
            for q, d in self.parts
        ]
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def _fallback(self) -> torch.Tensor:
        if self._float is None:
            self._float = self.dequantize()
        return self._float

    def route(self, t: int) -> int:
        """Which kernel `linear` runs for a call of t activation rows (a ROUTE_* code). The one
        decision: `linear` follows it, and the decode loop (decode_loop.cpp) calls the same op."""
        if qkernel.qmatmul() is None:
            return ROUTE_FALLBACK
        packed = self._batch is not None
        if self.a8 and self._panel and t >= self._panel_from:
            if self._r16 is not None and A8_IMPL == 0:  # the kept panels: the same bits, no unpacking
                return ROUTE_R16
            if qkernel.panel() is not None:
                return ROUTE_PANEL
        if self.a8 and 0 < t <= self._a8_rows(packed):
            return ROUTE_A8 if self._a8_all else ROUTE_A8_MIXED
        if not packed and t >= gemm_min_rows(self.k) and self.k % 32 == 0 and qkernel.gemm() is not None:
            return ROUTE_GEMM
        if t > (PACKED_TILED_ROWS if packed else TILED_ROWS):
            return ROUTE_PACKED if packed else ROUTE_TILED
        return ROUTE_ROWS

    def linear(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] float32 -> x W^T [T, N] float32. `out`: a contiguous float32 [T, N] tensor
        the kernel paths write into (the fallback ignores it); use the returned tensor."""
        x = x.contiguous()
        t = x.shape[0]
        r = self.route(t)
        if r == ROUTE_FALLBACK:
            return F.linear(x, self._fallback())
        if out is None:
            out = torch.empty(t, self.n, dtype=torch.float32)
        if r == ROUTE_R16:
            qkernel.r16()[1](x, *self._r16, out)
        elif r == ROUTE_PANEL:
            qkernel.panel()(x, *self._a8_args, out, A8_IMPL)
        elif r == ROUTE_A8:  # the common case: one op quantizes x and fills every segment
            qkernel.a8()[2](x, *self._a8_args, out, A8_IMPL)
        elif r == ROUTE_A8_MIXED:
            self._linear_a8(x, out, qkernel.qmatmul())
        elif r == ROUTE_GEMM:
            gemm = qkernel.gemm()
            for a in range(0, t, GEMM_MAX_ROWS):  # row blocks (each row's bits are the same)
                xa, oa = (x, out) if t <= GEMM_MAX_ROWS else (x[a : a + GEMM_MAX_ROWS], out[a : a + GEMM_MAX_ROWS])
                for data, qtype, col in self._calls:
                    gemm(xa, data, qtype, oa, col)
        elif r == ROUTE_PACKED:  # oneDNN allocates its result: returned as is (no copy into `out`)
            return packed_linear(x, *self._batch)
        elif r == ROUTE_TILED:
            self._tiled(x, out)
        else:
            op = qkernel.qmatmul()
            for data, qtype, col in self._calls:
                op(x, data, qtype, out, col)
        return out

    def step_call(self, t: int) -> tuple[int, list[torch.Tensor], list[int]] | None:
        """What decode_loop.cpp calls for t rows, as (kind, tensors, ints): kind 0 the int8 row
        op (ints: impl, the types), 1 the panel op (impl, types), 2 the kept panels (types, then
        each segment's rows), 3 / 4 the exact row kernel / qgemm once per segment (each
        segment's type and first column). None where `linear` takes another way (tiles, the
        float32 copy, mixed int8 segments, the torch fallback, qgemm in row blocks)."""
        r = self.route(t)
        types = [int(q) for q, _ in self.parts]
        if r == ROUTE_A8:
            return 0, self._a8_args[0], [A8_IMPL, *types]
        if r == ROUTE_PANEL:
            return 1, self._a8_args[0], [A8_IMPL, *types]
        if r == ROUTE_R16:
            return 2, self._r16[0], [*self._r16[1], *self._r16[2]]
        if r in (ROUTE_ROWS, ROUTE_GEMM) and (r == ROUTE_ROWS or t <= GEMM_MAX_ROWS):
            return 3 if r == ROUTE_ROWS else 4, [d for d, _, _ in self._calls], [v for _, q, c in self._calls for v in (q, c)]
        return None

    def _a8_rows(self, packed: bool) -> int:
        """Up to how many rows int8 mode takes the int8 row kernel (the panel aside)."""
        if packed:  # against the float32 copy
            return min(PACKED_A8_ROWS, A8_SB_ROWS) if self._sb_cap else PACKED_A8_ROWS
        if self._sb_cap:  # a super-block segment the panel does not take (Q6_K: below its panel rows)
            return A8_SB_VNNI_ROWS if qkernel.vnni() else min(A8_ROWS, A8_SB_ROWS)
        return A8_ROWS  # (from panel_rows() on, the panel: VNNI, or AVX2 without it)

    def _linear_a8(self, x: torch.Tensor, out: torch.Tensor, op) -> None:  # noqa: ANN001
        """out = x W^T in int8 for the A8_TYPES segments (x quantized to 32-element blocks once
        for all the PANEL_TYPES ones; each super-block segment by the linear op, which quantizes
        x per 256), the exact kernel for the rest (F16/BF16/F32)."""
        quantize, matmul, linear = qkernel.a8()
        if self._a8_all:  # the common case: one op quantizes x and fills every segment
            linear(x, *self._a8_args, out, A8_IMPL)
            return
        xa = None
        for data, qtype, col in self._calls:
            if qtype in A8_SB_TYPES:
                seg = torch.empty(x.shape[0], data.shape[0])
                linear(x, [data], [qtype], seg, A8_IMPL)
                out[:, col : col + data.shape[0]] = seg
            elif qtype in A8_TYPES:
                xa = xa or quantize_activations(x, quantize)
                matmul(*xa, data, qtype, out, col, A8_IMPL)
            else:
                op(x, data, qtype, out, col)

    def _tiled(self, x: torch.Tensor, out: torch.Tensor) -> None:
        rows_per_tile = max(1, TILE_ELEMS // self.k)
        tile = torch.empty(min(rows_per_tile, self.n), self.k)
        col = 0
        for qtype, data in self.parts:
            for a in range(0, data.shape[0], rows_per_tile):
                b = min(a + rows_per_tile, data.shape[0])
                t = tile[: b - a]
                idx = torch.arange(a, b, dtype=torch.int64)
                torch.ops.pagedkv_q.qrows(data, int(qtype), self.k, idx, t)
                out[:, col + a : col + b] = plain_linear(x, t)
            col += data.shape[0]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [R] int64 (each in [0, N)) -> the dequantized rows [R, K] float32."""
        if not qkernel.load() or len(self.parts) != 1:  # embedding tables have one segment
            return F.embedding(ids, self._fallback())
        qtype, data = self.parts[0]
        out = torch.empty(ids.shape[0], self.k)
        torch.ops.pagedkv_q.qrows(data, int(qtype), self.k, ids.contiguous().to(torch.int64), out)
        return out


def quantize_activations(x: torch.Tensor, quantize=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """x [T, K] float32 (K a multiple of 32) -> (q int8 [T, K], d [T, K/32], s [T, K/32]) with
    d = max|block| / 127, q = nearbyint(x / d) (as x * (1 / d)), s = d * sum(q); the kernel's op."""
    quantize = quantize or qkernel.a8()[0]
    t, k = x.shape
    xq = torch.empty(t, k, dtype=torch.int8)
    xd = torch.empty(t, k // 32)
    xs = torch.empty(t, k // 32)
    quantize(x, xq, xd, xs, A8_IMPL)
    return xq, xd, xs
