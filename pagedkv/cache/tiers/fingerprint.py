"""Model fingerprint: which stored blocks a process may read.

A block's K/V depend on the weights, the KV dtype, the block size and the storage layout; the
chained block hash covers only the tokens (and the tenant salt). The fingerprint is a sha256
over the model config, a digest of the weights' contents (a strided sample of every parameter,
so it works for in-memory models and costs milliseconds), the per-block layout and LAYOUT_VERSION.
Every key and every record carries it: a different model, dtype or layout never sees an entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import torch

from pagedkv.cache.tiers.record import Layout

LAYOUT_VERSION = 1
_SAMPLE = 4096  # values per parameter that enter the weights digest


def weights_digest(model: torch.nn.Module) -> bytes:
    """sha256 over every parameter's name, shape, dtype and a strided sample of its values."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        t = p.detach().reshape(-1)
        step = max(1, t.numel() // _SAMPLE)
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(t[::step][:_SAMPLE].float().cpu().numpy().tobytes())
    return h.digest()


def fingerprint(config: Any, weights: bytes, layout: Layout, block_size: int) -> bytes:
    """32 bytes naming (model config, weights, per-block layout, block size, layout version)."""
    cfg = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    doc = {
        "config": cfg,
        "weights": weights.hex(),
        "layout": {n: [str(dt), list(s)] for n, (dt, s) in layout.items()},
        "block_size": block_size,
        "layout_version": LAYOUT_VERSION,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).digest()
