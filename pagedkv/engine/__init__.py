"""The serving engine: scheduler, model runner, sampling, and the LLM / LLMEngine APIs."""

from pagedkv.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSequence
from pagedkv.engine.llm_engine import LLM, EngineStats, LLMEngine, parse_size
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.sequence import CompletionOutput, RequestOutput

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSequence",
    "CompletionOutput",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "parse_size",
]
