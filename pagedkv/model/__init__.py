"""Llama-family models over the paged KV cache: config, model, loader."""

from pagedkv.model.config import ModelConfig
from pagedkv.model.llama import LlamaModel
from pagedkv.model.loader import LoadedModel, default_model_path, load_model

__all__ = [
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "default_model_path",
    "load_model",
]
