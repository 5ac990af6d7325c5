"""Runs one step's forward pass from its StepPlan; it reads nothing else (no cache, no queue)."""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.engine.step_plan import StepPlan


class ModelRunner:
    def __init__(self, model: torch.nn.Module, storage: Any) -> None:
        self.model = model
        self.storage = storage  # the KVStorage every layer writes and reads through the plan

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Logits [R, V] for the plan's R samplers (row i for `plan.samplers[i]`)."""
        with torch.inference_mode():
            logits = self.model(plan.input_ids, plan.positions, self.storage, plan.metas or plan.meta,
                                plan.logits_indices)
        return logits[: len(plan.samplers)]
