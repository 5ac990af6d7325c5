"""pagedkv: a paged KV cache for LLM inference, and the small engine that puts it to work.

`from pagedkv import LLM, SamplingParams` works as `from vllm import LLM, SamplingParams` does.
The names are imported on first use, so `import pagedkv` (and `pagedkv --help`) stays fast:
torch is only loaded when something needs it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pagedkv.lazy import lazy_names

__version__ = "0.1.0"

# PAGEDKV_MAX_ISA=avx2 runs the process as an AVX2-only CPU would (pagedkv/model/qkernel.py caps
# our kernels): torch's own kernels and oneDNN are capped the same way, before torch picks them
if os.environ.get("PAGEDKV_MAX_ISA", "").strip().lower() == "avx2":
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

# public name -> module that defines it
_LAZY = {
    "LLM": "pagedkv.engine",
    "LLMEngine": "pagedkv.engine",
    "EngineConfig": "pagedkv.engine",
    "SamplingParams": "pagedkv.engine",
    "StructuredOutputsParams": "pagedkv.engine",
    "BeamSearchParams": "pagedkv.engine",
    "RequestOutput": "pagedkv.engine",
    "CompletionOutput": "pagedkv.engine",
    "KVStorage": "pagedkv.cache",
    "PagedKVCache": "pagedkv.cache",
}

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineConfig",
    "KVStorage",
    "LLMEngine",
    "PagedKVCache",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.cache import KVStorage, PagedKVCache
    from pagedkv.engine import (
        LLM,
        BeamSearchParams,
        CompletionOutput,
        EngineConfig,
        LLMEngine,
        RequestOutput,
        SamplingParams,
        StructuredOutputsParams,
    )


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
