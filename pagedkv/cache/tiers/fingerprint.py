"""Model fingerprint: which stored blocks a process may read.

A block's K/V depend on everything that changes the numbers the model computes: the weights'
contents, the model config (RoPE scaling included), the compute dtype, how the weights are
kept (quantized or dequantized), the activations mode (int8 rounds every matmul input), the
float32 batch copies, the device type and attention implementation that compute them (a
CUDA engine's fp16 K/V from Triton kernels are not a CPU engine's, even in the same dtype), the
KV dtype, the block size and the storage layout; the chained block
hash covers only the tokens (and the tenant salt). The fingerprint is a sha256 over all of them
and LAYOUT_VERSION; the weights digest hashes every parameter's full contents (a model file
that differs in one byte of one tensor gets another fingerprint). Every key and every record
carries it: a replica that would compute other K/V never sees an entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import torch

from pagedkv.cache.tiers.record import Layout

LAYOUT_VERSION = 2
MODES = ("weights", "activations", "batch_weights")  # LoadedModel fields that change K/V


def weights_digest(model: torch.nn.Module) -> bytes:
    """blake2b over every parameter's name, shape, dtype and full contents."""
    h = hashlib.blake2b(digest_size=32)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        t = p.detach().contiguous().reshape(-1).cpu()
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.digest()


def fingerprint(config: Any, weights: bytes, layout: Layout, block_size: int,
                modes: dict[str, str] | None = None) -> bytes:
    """32 bytes naming (model config, weights, compute modes, per-block layout, block size,
    layout version)."""
    cfg = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    doc = {
        "config": cfg,
        "weights": weights.hex(),
        "modes": dict(modes or {}),
        "layout": {n: [str(dt), list(s)] for n, (dt, s) in layout.items()},
        "block_size": block_size,
        "layout_version": LAYOUT_VERSION,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).digest()


def model_fingerprint(loaded: Any, layout: Layout, block_size: int, device: str = "cpu",
                      attention: str = "torch") -> bytes:
    """The fingerprint of a LoadedModel serving blocks of `layout`, computed on `device`
    (its type counts: cuda:0 and cuda:1 compute alike) by the `attention` backend that runs
    (resolved: "torch" or "triton"); the compute dtype is the weights' dtype."""
    modes = {m: str(getattr(loaded, m, "")) for m in MODES}
    params = next(iter(loaded.model.parameters()), None)
    modes["dtype"] = str(params.dtype) if params is not None else ""
    modes["device"] = torch.device(device).type
    modes["attention"] = attention
    return fingerprint(loaded.config, weights_digest(loaded.model), layout, block_size, modes)
