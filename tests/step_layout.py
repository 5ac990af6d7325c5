"""Build a step's positions + AttentionMetadata from explicit block tables.

For tests that drive the model without the engine or the cache manager: each sequence
owns a list of block ids; a step feeds `num_new` tokens after `context_len` cached ones.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class SeqStep:
    block_ids: Sequence[int]  # the sequence's blocks, enough for context_len + num_new tokens
    context_len: int  # tokens already in the cache
    num_new: int  # tokens fed this step (1 for a decode)


def assign_blocks(
    lengths: Sequence[int], block_size: int, num_blocks: int, seed: int | None = None
) -> list[list[int]]:
    """Disjoint block lists, ceil(length / block_size) blocks per sequence.

    Blocks are consecutive from 0, or drawn in a shuffled order when `seed` is given (so a
    sequence's blocks are scattered through the storage, as after real allocation churn).
    """
    need = [-(-n // block_size) for n in lengths]
    if sum(need) > num_blocks:
        raise ValueError(f"{sum(need)} blocks needed, storage has {num_blocks}")
    pool = list(range(num_blocks))
    if seed is not None:
        random.Random(seed).shuffle(pool)
    out, start = [], 0
    for n in need:
        out.append(pool[start : start + n])
        start += n
    return out


def build_step(
    seqs: Sequence[SeqStep], block_size: int, num_decodes: int = 0
) -> tuple[torch.Tensor, AttentionMetadata]:
    """positions [T] int64 and metadata for one step; the last `num_decodes` entries of `seqs`
    are decodes (num_new == 1), the others prefills (or prefill chunks), in the order given."""
    n_pre = len(seqs) - num_decodes
    if any(s.num_new != 1 for s in seqs[n_pre:]):
        raise ValueError("a decode feeds exactly one token")
    positions, slots = [], []
    for s in seqs:
        pos = torch.arange(s.context_len, s.context_len + s.num_new, dtype=torch.int64)
        if pos.numel() and int(pos[-1]) >= len(s.block_ids) * block_size:
            raise ValueError(f"{int(pos[-1]) + 1} tokens do not fit in {len(s.block_ids)} blocks")
        table = torch.as_tensor(list(s.block_ids), dtype=torch.int64)
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    pre, dec = seqs[:n_pre], seqs[n_pre:]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64),
        prefill_query_lens=[s.num_new for s in pre],
        prefill_context_lens=[s.context_len for s in pre],
        prefill_block_tables=_tables(pre),
        decode_block_tables=_tables(dec),
        decode_seq_lens=torch.tensor([s.context_len + 1 for s in dec], dtype=torch.int32),
        max_decode_seq_len=max((s.context_len + 1 for s in dec), default=0),
    )
    pos_all = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64)
    return pos_all, meta


def _tables(seqs: Sequence[SeqStep]) -> torch.Tensor:
    """[len(seqs), max_blocks] int32, padded with 0."""
    width = max((len(s.block_ids) for s in seqs), default=1)
    out = torch.zeros((len(seqs), width), dtype=torch.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s.block_ids)] = torch.as_tensor(list(s.block_ids), dtype=torch.int32)
    return out
