"""Attention over the paged KV cache (see paged.py) and its per-step metadata."""

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.paged import (
    decode_backend,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
)

__all__ = [
    "AttentionMetadata",
    "decode_backend",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
]
