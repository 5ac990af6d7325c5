"""KV cache dtypes and the symmetric per-(token, KV head) quantization of K/V rows.

`kv_cache_dtype` names (what users type) map to a storage dtype:

    auto      the model's dtype (float32 by default here)
    float32, float16, bfloat16   (aliases fp32, fp16, bf16)
    int8      torch.int8, one float32 scale per (token, KV head)
    fp8_e4m3  torch.float8_e4m3fn, one float32 scale per (token, KV head)

Quantized rows: for one token and one KV head, the D values x are stored as
q = round(x / s) with s = max|x| / QMAX (int8: QMAX = 127, rounded to nearest; fp8: QMAX = 448,
the largest finite e4m3 value, rounded by the float8 conversion), and read back as q * s. An
all-zero row has s = 0 and reads back as zeros. Why one scale per (token, head) rather than per
group of head_dim: see benchmarks/results/NOTES.md ("Quantized KV cache"), measured by `pagedkv bench
kvquant` (`granularity`): finer groups cost more bytes for an error the perplexity does not see.
"""

from __future__ import annotations

import torch

from pagedkv.errors import CacheConfigError

FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

_FP8 = getattr(torch, "float8_e4m3fn", None)  # absent in old torch builds

QUANT_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8}
if _FP8 is not None:
    QUANT_DTYPES["fp8_e4m3"] = _FP8

QMAX: dict[torch.dtype, float] = {torch.int8: 127.0}
if _FP8 is not None:
    QMAX[_FP8] = 448.0

SCALE_DTYPE = torch.float32


def supported_kv_cache_dtypes() -> list[str]:
    """Every name `kv_cache_dtype` accepts on this torch build."""
    return ["auto", *FLOAT_DTYPES, *QUANT_DTYPES]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def resolve_kv_cache_dtype(
    name: str | torch.dtype, model_dtype: torch.dtype | None = None
) -> torch.dtype | None:
    """The storage dtype for `name`; "auto" gives `model_dtype` (None before the model is known).

    Raises CacheConfigError naming the supported values for anything else.
    """
    if isinstance(name, torch.dtype):
        if name in FLOAT_DTYPES.values() or name in QUANT_DTYPES.values():
            return name
        raise CacheConfigError(
            f"unsupported KV cache dtype {name}; choose one of {supported_kv_cache_dtypes()}"
        )
    if not isinstance(name, str):
        raise CacheConfigError(f"kv_cache_dtype must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    if key == "auto":
        return model_dtype
    if key in FLOAT_DTYPES:
        return FLOAT_DTYPES[key]
    if key in QUANT_DTYPES:
        return QUANT_DTYPES[key]
    hint = " (this torch has no float8_e4m3fn)" if key.startswith("fp8") and _FP8 is None else ""
    shown = name if len(name) <= 40 else name[:40] + "..."  # never echo a huge value whole
    raise CacheConfigError(
        f"unsupported KV cache dtype {shown!r}{hint}; choose one of {supported_kv_cache_dtypes()}"
    )


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical kv_cache_dtype name of a storage dtype."""
    for table in (QUANT_DTYPES, FLOAT_DTYPES):
        for k, v in table.items():
            if v == dtype:
                return k
    return str(dtype).removeprefix("torch.")


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (q [..., D] in `dtype`, scale [...] float32)."""
    xf = x.float()
    qmax = QMAX[dtype]
    amax = xf.abs().amax(dim=-1)  # [...]
    scale = amax / qmax
    inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax)).unsqueeze(-1)
    y = (xf * inv).clamp_(-qmax, qmax)
    if dtype == torch.int8:
        return y.round_().to(torch.int8), scale
    return y.to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., D], scale [...] -> q * scale in `dtype`."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a 1-byte tensor, for ops torch lacks on float8 (index_copy_, equal...)."""
    return t.view(torch.uint8) if t.dtype == _FP8 else t
