"""StepPlan: the complete plan of one engine step, built once by the scheduler.

The model runner reads only this: the flattened token ids and positions of the step's new
tokens (prefill chunks first, then one token per decode), the attention metadata (slot mapping,
block tables, context lengths), the logits rows to compute, and which sequence samples from each
row. Built with a few vectorized reads of the cache's persistent block-table buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.cache import PagedKVCache
from pagedkv.engine.sequence import Sequence

_EMPTY_TABLE = torch.zeros((0, 1), dtype=torch.int32)
_EMPTY_I64 = torch.zeros(0, dtype=torch.int64)
_EMPTY_I32 = torch.zeros(0, dtype=torch.int32)


@dataclass(slots=True)
class ScheduledPrefill:
    seq: Sequence
    start: int  # first position computed this step
    end: int  # one past the last


@dataclass(slots=True)
class StepPlan:
    """Invariants: `input_ids`, `positions` and `meta.slot_mapping` have one entry per new
    token; `logits_indices` has one row per sampler (or one dummy row when nothing samples, so
    the forward pass still writes the chunk's K/V); row i of the logits belongs to `samplers[i]`."""

    prefills: list[ScheduledPrefill] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    input_ids: torch.Tensor = _EMPTY_I64  # [T] int64
    positions: torch.Tensor = _EMPTY_I64  # [T] int64
    meta: AttentionMetadata | None = None  # KV group 0's (the only one of a plain cache)
    metas: tuple[AttentionMetadata, ...] = ()  # every group's, group 0's first (meta itself)
    logits_indices: torch.Tensor = _EMPTY_I64  # [max(R, 1)] int64
    samplers: list[Sequence] = field(default_factory=list)  # R sequences that sample this step
    # speculative steps only ([] otherwise): the draft tokens each sampler verifies, parallel
    # to samplers; sampler i then owns 1 + len(drafts[i]) consecutive logits rows
    drafts: list[list[int]] = field(default_factory=list)
    # (logits rows whose token is their plain argmax, whether every row is such a row) for the
    # model's greedy head (greedy_head.py), or None; set by LLMEngine.forward for step()
    greedy: tuple[torch.Tensor, bool] | None = None

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_rows(self) -> int:
        """Logits rows that sample: one per sampler, plus one per draft."""
        return len(self.samplers) + sum(len(d) for d in self.drafts)

    def first_rows(self) -> list[int]:
        """The first logits row of each sampler."""
        out, r = [], 0
        for i in range(len(self.samplers)):
            out.append(r)
            r += 1 + (len(self.drafts[i]) if self.drafts else 0)
        return out

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


# The old name: a scheduler's output is the step plan.
SchedulerOutput = StepPlan


def build_plan(
    cache: PagedKVCache, prefills: list[ScheduledPrefill], decodes: list[Sequence],
    drafts: list[list[int]] | None = None,
) -> StepPlan:
    """Tensors of one step from the cache's tables (the decodes already grown by one token;
    `drafts`, parallel to decodes: tokens each verifies in its reserved lookahead slots)."""
    plan = StepPlan(prefills, decodes)
    if plan.empty:
        return plan
    ids: list[int] = []
    pos: list[torch.Tensor] = []
    rows: list[int] = []
    for p in prefills:
        s = p.seq
        ids.extend(s.ctx_ids(p.start, p.end))
        pos.append(torch.arange(p.start, p.end, dtype=torch.int64))
        if p.end == s.num_ctx:  # prompt done: its last token's logits sample
            rows.append(len(ids) - 1)
            plan.samplers.append(s)
    if decodes and drafts and any(drafts):
        first = len(ids)
        for s, d in zip(decodes, drafts, strict=True):
            ids.append(s.token_ids[-1])
            ids.extend(d)
        rows.extend(range(first, len(ids)))
        plan.samplers.extend(decodes)
        plan.drafts = [[] for _ in plan.samplers[: len(plan.samplers) - len(decodes)]]
        plan.drafts.extend(drafts)
    elif decodes:
        first = len(ids)
        ids.extend([s.token_ids[-1] for s in decodes])
        rows.extend(range(first, first + len(decodes)))
        plan.samplers.extend(decodes)
    ks = [len(d) for d in drafts] if plan.drafts else None
    dec = cache.decode_tensors_groups([s.seq_id for s in decodes], ks) if decodes else None
    longest = int(dec[0][2].numpy().max()) if dec else 0  # (the groups share the lengths)
    plan.metas = tuple(_group_meta(cache, g, prefills, decodes, pos, dec and dec[g], longest)
                       for g in range(cache.num_groups))
    plan.meta = plan.metas[0]
    plan.input_ids = torch.tensor(ids, dtype=torch.int64)
    plan.positions = _cat(pos)
    plan.logits_indices = torch.tensor(rows or [len(ids) - 1], dtype=torch.int64)
    return plan


def _group_meta(cache: PagedKVCache, group: int, prefills: list[ScheduledPrefill],
                decodes: list[Sequence], pos: list[torch.Tensor],
                dec: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, longest: int) -> AttentionMetadata:
    """One KV group's metadata (its slots and block tables; `dec` its decode tensors, from
    decode_tensors_groups, built once for all groups); group 0 also appends the decode positions
    to `pos` (every group has the same lengths)."""
    slots = [cache.slots(p.seq.seq_id, p.start, p.end, group) for p in prefills]
    prefill_tables = _EMPTY_TABLE
    if any(p.start > 0 for p in prefills):
        prefill_tables = cache.block_tables([p.seq.seq_id for p in prefills], group)[0]
    dec_tables, dec_lens = _EMPTY_TABLE, _EMPTY_I32
    if decodes:
        dec_slots, dec_tables, dec_lens = dec
        if group == 0:
            pos.append(dec_lens.to(torch.int64) - 1)
        slots.append(dec_slots)
    return AttentionMetadata(
        slot_mapping=_cat(slots),
        prefill_query_lens=[p.end - p.start for p in prefills],
        prefill_context_lens=[p.start for p in prefills],
        prefill_block_tables=prefill_tables,
        decode_block_tables=dec_tables,
        decode_seq_lens=dec_lens,
        max_decode_seq_len=longest,
        group_window=cache.groups.windows[group] or 0,
    )


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat, without the copy when there is one part (a pure-decode step); every part is a
    fresh tensor, so the result never aliases the cache's buffers."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)
