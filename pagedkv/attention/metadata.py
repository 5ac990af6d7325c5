"""Per-step attention metadata: built once per engine step, shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where a flattened batch of new tokens goes in the paged cache, and what each attends to.

    The T new tokens of a step are flattened into one dimension, prefill sequences first, then
    decode sequences (exactly one token each):

        tokens = [prefill_0 ... | prefill_1 ... | ... | decode_0 | decode_1 | ...]

    Every layer first writes its new K/V at `slot_mapping` (slot = block_id * block_size +
    offset; -1 means "do not write"), then attends: token j of prefill sequence i sees the
    sequence's `prefill_context_lens[i]` cached tokens plus new tokens 0..j (causal); a decode
    token sees `decode_seq_lens[i]` tokens (its own included), read through its block table.
    """

    slot_mapping: torch.Tensor  # [T] int64
    # prefill part: a python-side loop over sequences is fine (few per step)
    prefill_query_lens: list[int]  # new tokens of each prefill sequence
    prefill_context_lens: list[int]  # tokens already in the cache before them (prefix hit, chunks)
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32 (padding: 0)
    # decode part
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32 (padding: 0)
    decode_seq_lens: torch.Tensor  # [num_decodes] int32, context incl. the new token
    max_decode_seq_len: int = 0
    # the KV group's window (hybrid cache): its table entries wholly before each token's window
    # are given back (0 in the table, never read); 0: a full group, every entry live. A layer
    # attends with its own window (the band), which a window group's equals.
    group_window: int = 0
    # whether slot_mapping holds a -1; None until the first layer's write checks it, once per step
    has_skips: bool | None = None
    # which attention implementation runs the step: "auto" (the triton kernels for CUDA
    # tensors when triton is installed, else the torch path), "torch" (the compiled CPU kernel
    # or the pure-torch fallback) or "triton" (kernels; interpreted on CPU tensors)
    backend: str = "auto"
    # paged.py's per-step plan (counts, checks, decode backend): None until the first layer
    # builds it; every layer of the step reuses it (see paged.AttentionPlan)
    plan: object | None = None

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_query_lens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.prefill_query_lens)

    @property
    def num_decodes(self) -> int:
        return int(self.decode_seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
