"""Turns a scheduled step into one forward pass: flattened inputs, attention metadata, logits."""

from __future__ import annotations

import torch

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.cache import KVStorage, PagedKVCache
from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.engine.sequence import Sequence

_EMPTY_TABLE = torch.zeros((0, 1), dtype=torch.int32)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, storage: KVStorage) -> None:
        self.model = model
        self.cache = cache
        self.storage = storage

    def run(self, step: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Run the step; return logits [R, V] for the R sequences that sample a token now."""
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        logits_idx: list[int] = []
        samplers: list[Sequence] = []
        for p in step.prefills:
            s = p.seq
            ids.extend(s.token_ids[p.start : p.end])
            pos.append(torch.arange(p.start, p.end, dtype=torch.int64))
            slots.append(self.cache.slots(s.seq_id, p.start, p.end))
            if p.end == len(s.token_ids):  # prompt done: its last token's logits sample
                logits_idx.append(len(ids) - 1)
                samplers.append(s)
        prefill_tables = _EMPTY_TABLE
        if any(p.start > 0 for p in step.prefills):
            prefill_tables = self.cache.block_tables([p.seq.seq_id for p in step.prefills])[0]
        dec_tables, dec_lens = _EMPTY_TABLE, torch.zeros(0, dtype=torch.int32)
        if step.decodes:
            dec_slots, dec_tables, dec_lens = self.cache.decode_tensors(
                [s.seq_id for s in step.decodes]
            )
            first = len(ids)
            ids.extend(s.token_ids[-1] for s in step.decodes)
            pos.append(dec_lens.to(torch.int64) - 1)
            slots.append(dec_slots)
            logits_idx.extend(range(first, first + len(step.decodes)))
            samplers.extend(step.decodes)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            prefill_query_lens=[p.end - p.start for p in step.prefills],
            prefill_context_lens=[p.start for p in step.prefills],
            prefill_block_tables=prefill_tables,
            decode_block_tables=dec_tables,
            decode_seq_lens=dec_lens,
            max_decode_seq_len=int(dec_lens.max()) if step.decodes else 0,
        )
        if not logits_idx:  # only partial prefill chunks: K/V still need writing
            logits_idx = [len(ids) - 1]
            samplers = []
        with torch.inference_mode():
            logits = self.model(
                torch.tensor(ids, dtype=torch.int64),
                torch.cat(pos),
                self.storage,
                meta,
                torch.tensor(logits_idx, dtype=torch.int64),
            )
        return logits[: len(samplers)], samplers
