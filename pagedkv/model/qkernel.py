"""Lazy build and load of the model's CPU kernels: qmatmul.cpp (quantized matmul; its vector
kernels qmatmul_simd.inc built 8 lanes wide in qmatmul_avx2.cpp and 16 wide in
qmatmul_avx512.cpp), qmatmul_a8.cpp and qmatmul_panel.cpp (the opt-in activation-quantized
matmul: few rows, and many rows with AVX-512 VNNI) and fused_ops.cpp (residual add + RMSNorm,
SwiGLU, RoPE, argmax): one library, each source its own translation unit; the block formats are
one header, ggml_blocks.h, whose type table is checked against quant.KERNEL_TYPES and the gguf
package's block sizes at load.

Built like the attention kernel (same compiler flags and cache folder, from
pagedkv/attention/kernel.py) plus -ffp-contract=off, so that the kernel dequantizes with exactly
the float32 roundings of the `gguf` package (a fused multiply-add would round d * q + m once).
Registered as torch.ops.pagedkv_q.{qmatmul,qgemm,qrows,has_gemm,limit_isa,batch_invariant,isa,types},
torch.ops.pagedkv_a8.{quantize,matmul,linear,panel,panel_vnni,panel_avx2} and
torch.ops.pagedkv_ops.{add_rms_norm,silu_mul,rope,argmax,gelu_tanh_mul,norm_add_rms_norm,norm_rope} and
decode_loop.cpp's torch.ops.pagedkv_ops.decode_layers and logits_screen.cpp's
torch.ops.pagedkv_ops.{screen,rescore} (greedy_head.py's candidates).

Attempted once per process; any failure is logged once and `load()` returns False, and the
callers (quant.py) use the pure-torch fallback. `PAGEDKV_NO_KERNEL=1` in the environment at the
first attempt forces the fallback (read once, not per call).

`PAGEDKV_MAX_ISA=avx2` caps every kernel of the library at its AVX2 code (pagedkv_q.limit_isa:
no AVX-512, no VNNI panel), so a process runs the paths an AVX2-only CPU runs; pagedkv/__init__.py
caps torch's own kernels and oneDNN alike. Unset or `avx512`: the widest the CPU has.

`PAGEDKV_BATCH_INVARIANT=1` makes the exact gemm (qgemm, from 9 rows with AVX2 and 13 with
AVX-512) and AVX2's 5-8-row row kernel (one FMA chain per row by default) sum in the row
kernels' order (pagedkv_q.batch_invariant), so that a row's result is
the same bits whatever its call's row count: a sequence's logits then do not depend on what it
was batched with. Off by default: it costs 12-27% of a 5-8-row and 10-18% of a
9-40-row exact step (Zen 2). The int8
mode is not covered (its kernels for different row counts round differently).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from pagedkv.attention.kernel import build_and_load_units
from pagedkv.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
# one translation unit each; the headers they include (ggml_blocks.h, vec.h, ...) live in _DIR
_SOURCES = [_DIR / n for n in ("qmatmul.cpp", "qmatmul_avx2.cpp", "qmatmul_avx512.cpp", "qmatmul_a8.cpp", "qmatmul_a8x.cpp",
                               "qmatmul_panel.cpp", "fused_ops.cpp", "decode_loop.cpp", "logits_screen.cpp")]
_EXTRA_FLAGS = ["-ffp-contract=off"]


class _Kernel:
    """The load outcome of this process (one instance, guarded by its lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tried = False
        self.ok = False
        self.error: str | None = None
        self.qmatmul = None  # the op's overload, once loaded
        self.a8 = None  # (quantize, matmul, linear) overloads of the activation-quantized path
        self.fused = None  # (rope, silu_mul, add_rms_norm, gelu_tanh_mul, norm_add_rms_norm, norm_rope)
        self.argmax = None  # fused_ops.cpp's argmax
        self.screen = None  # logits_screen.cpp's (screen, rescore): greedy_head.py's
        self.panel = None  # qmatmul_panel.cpp's panel op, where this CPU runs its VNNI or AVX2 code
        self.r16 = None  # (r16_pack, panel_r16) of qmatmul_panel.cpp, where this CPU runs its VNNI code
        self.vnni = False  # whether the int8 kernels run AVX-512 VNNI code (at load, within the ISA limit)
        self.gemm = None  # qmatmul.cpp's qgemm, where the build has its AVX2 / AVX-512 code
        self.decode_layers = None  # decode_loop.cpp's op
        self.invariant = False  # PAGEDKV_BATCH_INVARIANT at load (pagedkv_q.batch_invariant)


_kernel = _Kernel()


def _disabled_by_env() -> bool:
    value = os.environ.get("PAGEDKV_NO_KERNEL", "")
    return value.strip().lower() not in ("", "0", "false", "no")


MAX_ISAS = ("avx512", "avx2")
# pagedkv_q.isa()'s levels, in words
ISA_NAMES = ("scalar (no AVX2)", "AVX2", "AVX-512", "AVX-512 VNNI")


def max_isa() -> str:
    """PAGEDKV_MAX_ISA: "avx512" (unset: the widest the CPU has) or "avx2"; InvalidArgumentError
    for anything else."""
    value = os.environ.get("PAGEDKV_MAX_ISA", "").strip().lower() or "avx512"
    if value not in MAX_ISAS:
        shown = value if len(value) <= 40 else value[:40] + "..."  # never echo a huge value whole
        raise InvalidArgumentError(f"PAGEDKV_MAX_ISA={shown!r}: choose one of {list(MAX_ISAS)}")
    return value


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def batch_invariant() -> bool:
    """PAGEDKV_BATCH_INVARIANT: 1/true/yes/on or 0/false/no/off (unset: off);
    InvalidArgumentError for anything else."""
    value = os.environ.get("PAGEDKV_BATCH_INVARIANT", "").strip().lower()
    if value not in _TRUE + _FALSE:
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise InvalidArgumentError(f"PAGEDKV_BATCH_INVARIANT={shown!r}: choose 1 or 0")
    return value in _TRUE


def _build() -> None:
    build_and_load_units(_SOURCES, "pagedkv_qmatmul", _EXTRA_FLAGS, [_DIR])


def _raw(overload):  # noqa: ANN001, ANN202
    """The overload's underlying builtin (what OpOverload.__call__ forwards to, minus one Python
    frame per call); the overload itself where a torch version lacks `_op`."""
    return getattr(overload, "_op", overload)


def _check_types(table: list[int]) -> None:
    """The kernel's type table ([type, block elements, block bytes] per type, ggml_blocks.h) must
    be quant.KERNEL_TYPES with the gguf package's block sizes."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from pagedkv.model.quant import KERNEL_TYPES

    rows = {GGMLQuantizationType(t): (b, n) for t, b, n in zip(table[::3], table[1::3], table[2::3], strict=True)}
    if set(rows) != KERNEL_TYPES or any(GGML_QUANT_SIZES[t] != v for t, v in rows.items()):
        raise RuntimeError(f"the kernel's type table {rows} disagrees with quant.KERNEL_TYPES / gguf")


def load() -> bool:
    """Build (first time) and load the kernel; True when torch.ops.pagedkv_q is usable."""
    k = _kernel
    if k.tried:
        return k.ok
    cap = max_isa()  # a bad value is the caller's error, not a reason to fall back
    invariant = batch_invariant()
    with k.lock:
        if k.tried:
            return k.ok
        try:
            if _disabled_by_env():
                raise RuntimeError("disabled by PAGEDKV_NO_KERNEL")
            _build()
            if not (
                hasattr(torch.ops.pagedkv_q, "qmatmul")
                and hasattr(torch.ops.pagedkv_ops, "add_rms_norm")
                and hasattr(torch.ops.pagedkv_a8, "matmul")
                and hasattr(torch.ops.pagedkv_ops, "argmax")
            ):
                raise RuntimeError("the library loaded but did not register its ops")
            _check_types(list(torch.ops.pagedkv_q.types()))
            if cap == "avx2":
                torch.ops.pagedkv_q.limit_isa(1)
            torch.ops.pagedkv_q.batch_invariant(invariant)
            k.invariant = invariant
            k.qmatmul = _raw(torch.ops.pagedkv_q.qmatmul.default)
            a8 = torch.ops.pagedkv_a8
            k.a8 = tuple(_raw(o.default) for o in (a8.quantize, a8.matmul, a8.linear))
            f = torch.ops.pagedkv_ops
            k.fused = tuple(_raw(o.default) for o in (f.rope, f.silu_mul, f.add_rms_norm,
                                                      f.gelu_tanh_mul, f.norm_add_rms_norm, f.norm_rope))
            k.argmax = _raw(f.argmax.default)
            k.screen = (_raw(f.screen.default), _raw(f.rescore.default))
            k.decode_layers = _raw(f.decode_layers.default)
            k.vnni = bool(a8.panel_vnni())
            if hasattr(a8, "panel") and (k.vnni or a8.panel_avx2()):
                k.panel = _raw(a8.panel.default)
            if k.vnni:
                k.r16 = (_raw(a8.r16_pack.default), _raw(a8.panel_r16.default))
            if torch.ops.pagedkv_q.has_gemm():
                k.gemm = _raw(torch.ops.pagedkv_q.qgemm.default)
            k.ok = True
        except Exception as e:  # any build problem means "use the fallback"
            k.error = f"{type(e).__name__}: {e}"
            logger.warning("pagedkv: quantized matmul kernel unavailable (%s); using torch", k.error)
        k.tried = True
        return k.ok


def qmatmul():  # noqa: ANN201
    """torch.ops.pagedkv_q.qmatmul (the overload, cheapest to call) or None without the kernel."""
    return _kernel.qmatmul if (_kernel.ok or load()) else None


def a8():  # noqa: ANN201
    """(quantize, matmul, linear) ops of the activation-quantized path, or None without the kernel."""
    return _kernel.a8 if (_kernel.ok or load()) else None


def fused():  # noqa: ANN201
    """(rope, silu_mul, add_rms_norm, gelu_tanh_mul, norm_add_rms_norm, norm_rope) ops of fused_ops.cpp,
    or None without the kernel."""
    return _kernel.fused if (_kernel.ok or load()) else None


def argmax():  # noqa: ANN201
    """fused_ops.cpp's argmax(x, best, idx) op, or None without the kernel."""
    return _kernel.argmax if (_kernel.ok or load()) else None


def screen():  # noqa: ANN201
    """logits_screen.cpp's (screen, rescore) ops (the greedy head's candidates and their float64
    logits), or None without the kernel."""
    return _kernel.screen if (_kernel.ok or load()) else None


def decode_layers():  # noqa: ANN201
    """decode_loop.cpp's op (a pure-decode step's layers in one call), or None without the kernel."""
    return _kernel.decode_layers if (_kernel.ok or load()) else None


def panel():  # noqa: ANN201
    """qmatmul_panel.cpp's int8-activation op for many rows, or None: no kernel, or a CPU with
    neither AVX-512 VNNI nor AVX2 (its scalar path is for tests, not speed)."""
    return _kernel.panel if (_kernel.ok or load()) else None


def r16():  # noqa: ANN201
    """(r16_pack, panel_r16): qmatmul_panel.cpp's panel layout kept from load and its matmul, or
    None: no kernel, or no AVX-512 VNNI (within PAGEDKV_MAX_ISA)."""
    return _kernel.r16 if (_kernel.ok or load()) else None


def vnni() -> bool:
    """Whether the int8 kernels run their AVX-512 VNNI code (the CPU has it, PAGEDKV_MAX_ISA
    allows it); the routing thresholds of quant.py differ with and without."""
    return _kernel.vnni if (_kernel.ok or load()) else False


def gemm():  # noqa: ANN201
    """qmatmul.cpp's exact qgemm for many rows (AVX-512 or AVX2), or None: no kernel, or a
    build without AVX2 (where qgemm would only run qmatmul's scalar paths)."""
    return _kernel.gemm if (_kernel.ok or load()) else None


def isa() -> str | None:
    """The vector code the kernels run now, in words ("AVX-512 VNNI", "AVX2", ...), or None
    without the kernel."""
    return ISA_NAMES[torch.ops.pagedkv_q.isa()] if (_kernel.ok or load()) else None


def info() -> dict[str, object]:
    return {"loaded": _kernel.ok, "error": _kernel.error, "isa": isa() if _kernel.ok else None,
            "batch_invariant": _kernel.invariant}
