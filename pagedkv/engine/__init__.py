"""The serving engine: scheduler, model runner, sampling, and the LLM / LLMEngine APIs.

The names are imported on first use, so `pagedkv.engine.config` (read by the CLI's --help)
loads without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.lazy import lazy_names

_LAZY = {
    "LLM": "pagedkv.engine.llm_engine",
    "LLMEngine": "pagedkv.engine.llm_engine",
    "EngineStats": "pagedkv.engine.llm_engine",
    "EngineConfig": "pagedkv.engine.config",
    "BeamSearchOutput": "pagedkv.engine.beam_search",
    "BeamSearchParams": "pagedkv.engine.beam_search",
    "BeamSequence": "pagedkv.engine.beam_search",
    "SamplingParams": "pagedkv.engine.sampling_params",
    "StructuredOutputsParams": "pagedkv.engine.structured_params",
    "GuidedDecodingParams": "pagedkv.engine.structured_params",
    "CompletionOutput": "pagedkv.engine.sequence",
    "RequestOutput": "pagedkv.engine.sequence",
    "parse_size": "pagedkv.cache.sizing",  # re-exported: it lives in the cache layer
}

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSequence",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "parse_size",
]

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.cache.sizing import parse_size
    from pagedkv.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSequence
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import LLM, EngineStats, LLMEngine
    from pagedkv.engine.sampling_params import SamplingParams
    from pagedkv.engine.sequence import CompletionOutput, RequestOutput
    from pagedkv.engine.structured_params import GuidedDecodingParams, StructuredOutputsParams


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
