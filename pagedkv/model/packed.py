"""Pre-packed CPU matmuls for float32 weights (oneDNN).

`F.linear` on CPU re-packs the weight matrix on every call; for the small row counts of a
decode step (1..256 rows against 0.3-28M-element weights) that packing dominates, and a model
step streams every weight twice. oneDNN can pack a weight once; `_linear_pointwise` then reads
the packed copy. Measured on a 2-core AVX2 machine: 1.5x faster for the decoder's matmuls at 16
rows and 2.5x for SmolLM2's LM head. Any failure (no oneDNN, another dtype or device, an op
missing in another torch release) falls back to F.linear, which computes the same product.
PAGEDKV_NO_PACK=1 in the environment when this module is imported forces the fallback (read
once; `pack(..., enabled=False)` does the same per call).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

PACK_ROWS_HINT = 16  # the row count oneDNN tunes the layout for; any count works
PACK_ENABLED = os.environ.get("PAGEDKV_NO_PACK") != "1"  # configuration, read once at import


def pack(weight: torch.Tensor, enabled: bool = PACK_ENABLED) -> torch.Tensor | None:
    """A packed copy of `weight` [out, in], or None where packing does not apply."""
    if (
        not enabled
        or weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
        probe = torch.zeros(1, weight.shape[1])
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return None
    return packed


def linear(
    x: torch.Tensor,  # [T, in]
    weight: torch.Tensor,  # [out, in]
    packed: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, out]
    if packed is None or x.shape[0] == 0:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def plain_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ weight [out, in]^T for a weight used once (no packed copy), e.g. a tile just
    dequantized: oneDNN's matmul where available (on the AMD machine this was measured on,
    2.3x faster than F.linear, whose BLAS takes a slower path there), else F.linear."""
    if PACK_ENABLED and _ONEDNN and x.dtype == torch.float32 and x.shape[0] > 0:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")
    return F.linear(x, weight)


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")

