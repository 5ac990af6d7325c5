"""Runs one step's forward pass from its StepPlan; it reads nothing else (no cache, no queue).

On a device other than the CPU the runner moves the plan's tensors there (one batch of small
host-to-device copies), decides on the host what would otherwise need a device sync (whether
any slot is -1, the RoPE tables' reach), and copies the logits back: the step's one
device-to-host sync. The scheduler, the sampler and the detokenizer stay on the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.paged import use_triton
from pagedkv.engine.step_plan import StepPlan


class ModelRunner:
    """`graphs`: a GraphRunner serving the decode-only steps it has a size for (CUDA graphs);
    every other step, and every step without one, runs eagerly here."""

    def __init__(self, model: torch.nn.Module, storage: Any, attention_backend: str = "auto",
                 graphs: Any = None) -> None:
        self.model = model
        self.storage = storage  # the KVStorage every layer writes and reads through the plan
        self.device = torch.device(getattr(storage, "device", "cpu"))
        self.attention_backend = attention_backend
        # what runs: "triton" or "torch" (the tier fingerprint names it: it changes the K/V)
        self.attention = "triton" if use_triton(attention_backend, self.device) else "torch"
        self.graphs = graphs  # an engine.cuda_graphs.GraphRunner, or None
        # the last run's greedy rows' tokens [R] int64 (-1: not decided), where the model's
        # greedy head decided them (LlamaModel.greedy_tokens), else None
        self.greedy_tokens: torch.Tensor | None = None

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Logits [R, V] on the CPU, `plan.num_rows` rows: row i for `plan.samplers[i]`
        (speculative steps: each sampler's 1 + len(drafts) rows in turn). `plan.greedy` goes to
        the model's greedy head (LlamaModel.forward; CPU steps only), and the tokens it decided
        to `greedy_tokens`."""
        self.greedy_tokens = None
        if self.graphs is not None:
            logits = self.graphs.run(plan)
            if logits is not None:
                return logits
        metas = plan.metas or (plan.meta,)  # every KV group's metadata, group 0's first
        ids, pos, rows = plan.input_ids, plan.positions, plan.logits_indices
        for m in metas:
            m.backend = self.attention_backend
        if self.device.type != "cpu":
            if pos.numel():
                self.model.reserve_positions(int(pos.max()))  # host tensor: no sync
            metas = tuple(device_metadata(m, self.device) for m in metas)
            ids, pos, rows = (t.to(self.device, non_blocking=True) for t in (ids, pos, rows))
        with torch.inference_mode():
            if plan.greedy is not None and self.device.type == "cpu":
                logits = self.model(ids, pos, self.storage, metas, rows, greedy=plan.greedy)
                self.greedy_tokens = getattr(self.model, "greedy_tokens", None)
            else:
                logits = self.model(ids, pos, self.storage, metas, rows)
        logits = logits[: plan.num_rows]
        if self.greedy_tokens is not None:
            self.greedy_tokens = self.greedy_tokens[: plan.num_rows]
        return logits if logits.is_cpu else logits.float().cpu()


def device_metadata(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """A copy of host metadata with every tensor on `device` and has_skips decided on the
    host (the per-step plan is left for the first layer to build)."""
    moved = {
        f.name: getattr(meta, f.name).to(device, non_blocking=True)
        for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)
    }
    skips = meta.has_skips
    if skips is None:
        skips = bool(meta.slot_mapping.numel()) and bool((meta.slot_mapping < 0).any())
    return dataclasses.replace(meta, **moved, has_skips=skips, plan=None)
