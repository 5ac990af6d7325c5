"""transformers as the peer: the same GGUF weights, static `generate` and `generate_batch`."""

from __future__ import annotations

import os
import time

import torch


def load_hf(attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    from pagedkv.model.loader import default_model_path

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype, attn_implementation=attn_implementation
    )
    return model.eval()


def trim_at_eos(ids: list[int], eos: set[int]) -> list[int]:
    """Generated ids up to and including the first EOS (what an engine reports)."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def hf_static(model, prompt_ids: list[list[int]], max_tokens: int, pad_id: int,  # noqa: ANN001
              eos: set[int]) -> tuple[list[list[int]], float]:
    """One left-padded batch through `generate` (greedy); returns (outputs, seconds)."""
    width = max(map(len, prompt_ids))
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=sorted(eos))
    dt = time.perf_counter() - t0
    return [trim_at_eos(row[width:].tolist(), eos) for row in out], dt


def hf_continuous(model, prompt_ids: list[list[int]], max_tokens: int, pad_id: int,  # noqa: ANN001
                  eos: set[int]) -> tuple[list[list[int]], float]:
    """transformers' own continuous batching over its paged cache (`generate_batch`)."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id,
                           eos_token_id=sorted(eos))
    t0 = time.perf_counter()
    with torch.inference_mode():
        res = model.generate_batch(inputs=prompt_ids, generation_config=cfg, progress_bar=False)
    dt = time.perf_counter() - t0
    by_prompt = {}
    for out in res.values():
        by_prompt.setdefault(tuple(out.prompt_ids), []).append(trim_at_eos(out.generated_tokens, eos))
    return [by_prompt[tuple(p)].pop(0) for p in prompt_ids], dt
