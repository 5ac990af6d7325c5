"""Fidelity measurements of a quantized KV cache on real model activations (bench kvquant, tests).

- `perplexity`: a text through the model over a paged cache (blocks scattered through the pool),
  filled in chunks: each chunk after the first reads every earlier token from the cache, so a
  quantized cache is really read (prefill with cached context), not just written.
- `capture_qkv` + `attention_errors`: each layer's real q/k/v on a text; the decode attention of
  the last queries over a cache holding that K/V in a quantized dtype, against float32.
- `fake_quant`: quantize-dequantize with a scale per group of `group` head_dim values (the
  granularity study: group = head_dim is the shipped per-(token, head) scheme).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.paged import paged_decode_attention
from pagedkv.cache.quant import dequantize, quantize
from pagedkv.cache.storage import KVStorage

TEXT = Path(__file__).parent / "data" / "public_domain_text.txt"


def text_token_ids(tokenizer, limit: int | None = None) -> list[int]:  # noqa: ANN001
    """The shipped public-domain text (US founding documents, Lincoln's addresses) as ids."""
    ids = tokenizer.encode(TEXT.read_text())
    return ids[:limit] if limit else ids


def _storage(model, num_tokens: int, block_size: int, dtype) -> tuple[KVStorage, torch.Tensor]:  # noqa: ANN001
    """A storage with a few spare blocks and a shuffled block table covering num_tokens."""
    c = model.config
    nb = -(-num_tokens // block_size)
    st = KVStorage(c.num_layers, nb + 3, block_size, c.num_kv_heads, c.head_dim, dtype)
    table = torch.randperm(nb + 3, generator=torch.Generator().manual_seed(0))[:nb]
    return st, table


@torch.inference_mode()
def perplexity(model, ids: list[int], kv_dtype, chunk: int = 256, block_size: int = 16) -> float:  # noqa: ANN001
    """exp(mean NLL) of ids[1:] given the prefix, the cache filled `chunk` tokens at a time."""
    n = len(ids)
    st, table = _storage(model, n, block_size, kv_dtype)
    tokens = torch.tensor(ids, dtype=torch.int64)
    nll = 0.0
    for start in range(0, n - 1, chunk):
        stop = min(start + chunk, n - 1)
        pos = torch.arange(start, stop)
        slots = table[pos // block_size] * block_size + pos % block_size
        meta = AttentionMetadata(
            slot_mapping=slots,
            prefill_query_lens=[stop - start],
            prefill_context_lens=[start],
            prefill_block_tables=table.view(1, -1).to(torch.int32),
            decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
            decode_seq_lens=torch.zeros(0, dtype=torch.int32),
        )
        logits = model(tokens[start:stop], pos, st, meta)  # [n, V] float32
        nll += float(F.cross_entropy(logits, tokens[start + 1 : stop + 1], reduction="sum"))
    return math.exp(nll / (n - 1))


@torch.inference_mode()
def capture_qkv(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    """(q [T, Hq, D], k, v [T, Hkv, D]) of every layer for one float32 prefill of ids."""
    import pagedkv.model.llama as llama

    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    real = llama.paged_attention

    def record(q, k, v, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append((q.float().clone(), k.float().clone(), v.float().clone()))
        return real(q, k, v, *args, **kw)

    st, table = _storage(model, len(ids), 16, torch.float32)
    pos = torch.arange(len(ids))
    meta = AttentionMetadata(
        slot_mapping=table[pos // 16] * 16 + pos % 16,
        prefill_query_lens=[len(ids)],
        prefill_context_lens=[0],
        prefill_block_tables=table.view(1, -1).to(torch.int32),
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        decode_seq_lens=torch.zeros(0, dtype=torch.int32),
    )
    llama.paged_attention = record
    try:
        model(torch.tensor(ids), pos, st, meta, torch.tensor([len(ids) - 1]))
    finally:
        llama.paged_attention = real
    return seen


def fake_quant(x: torch.Tensor, dtype: torch.dtype, group: int) -> torch.Tensor:
    """x [T, H, D] quantized to `dtype` with one scale per `group` consecutive head_dim values,
    then dequantized (float32)."""
    t, h, d = x.shape
    q, s = quantize(x.reshape(t, h, d // group, group), dtype)
    return dequantize(q, s).reshape(t, h, d)


@torch.inference_mode()
def attention_errors(
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    kv_dtype: torch.dtype,
    num_queries: int = 64,
    group: int | None = None,
    block_size: int = 16,
) -> list[dict[str, float]]:
    """Per layer: decode attention of the last `num_queries` positions (query i sees tokens
    0..p_i) over a cache holding the layer's real K/V in `kv_dtype`, against a float32 cache.

    group None: the real quantized storage (write quantizes, the decode reads it in place);
    group g: fake_quant with a scale per g head_dim values into a float32 cache (the study).
    Returns max and mean absolute error, and the mean |output| for scale.
    """
    out = []
    for q, k, v in layers:
        t, hkv, d = k.shape
        scale = d**-0.5
        pos = torch.arange(t - num_queries, t)
        qs = q[pos]
        lens = (pos + 1).to(torch.int32)
        ref_st, table = _kv_store(k, v, torch.float32, block_size)
        if group is None:
            st, _ = _kv_store(k, v, kv_dtype, block_size)
        else:
            st, _ = _kv_store(fake_quant(k, kv_dtype, group), fake_quant(v, kv_dtype, group),
                              torch.float32, block_size)
        tables = table.view(1, -1).expand(num_queries, -1).to(torch.int32).contiguous()
        r = ref_st.layers[0]
        ref = paged_decode_attention(qs, r.k, r.v, tables, lens, scale)
        c = st.layers[0]
        got = paged_decode_attention(qs, c.k, c.v, tables, lens, scale,
                                     k_scale=c.k_scale, v_scale=c.v_scale)
        err = (got - ref).abs()
        out.append({"max_abs": float(err.max()), "mean_abs": float(err.mean()),
                    "mean_abs_output": float(ref.abs().mean())})
    return out


def _kv_store(k: torch.Tensor, v: torch.Tensor, dtype, block_size: int):  # noqa: ANN001, ANN202
    t, hkv, d = k.shape
    nb = -(-t // block_size)
    st = KVStorage(1, nb + 3, block_size, hkv, d, dtype)
    table = torch.randperm(nb + 3, generator=torch.Generator().manual_seed(1))[:nb]
    pos = torch.arange(t)
    st.write(0, table[pos // block_size] * block_size + pos % block_size, k, v)
    return st, table


@contextlib.contextmanager
def threads(n: int | None):
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
