"""Llama-family models over the paged KV cache: config, model, loader."""

from pagedkv.model.config import ModelConfig
from pagedkv.model.layout import SeqStep, assign_blocks, build_step
from pagedkv.model.llama import LlamaModel
from pagedkv.model.loader import LoadedModel, default_model_path, load_model

__all__ = [
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "SeqStep",
    "assign_blocks",
    "build_step",
    "default_model_path",
    "load_model",
]
