"""What the scheduler does with a workload: per-step batch sizes, with or without the model.

`StepTrace` records every `StepPlan` a scheduler builds (decode batch size, prefill tokens);
`attach` hooks it to a live engine's scheduler. `replay` runs a workload of fixed-length requests
(`ignore_eos`: every request produces exactly `max_tokens`) through the real `Scheduler` over a
bookkeeping-only `PagedKVCache` of `num_blocks` blocks: no model, no K/V, a fraction of a second.
Scheduling depends only on token counts, so the replay makes the same decisions as the engine on
the same workload (same steps, preemptions, batch sizes); the benchmark checks that it does.
"""

from __future__ import annotations

import itertools
import statistics

from pagedkv.cache import PagedKVCache
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.sequence import Request, Sequence
from pagedkv.engine.step_plan import StepPlan


class StepTrace:
    """Per scheduled step: how many sequences decoded and how many prompt tokens were computed."""

    def __init__(self) -> None:
        self.decodes: list[int] = []
        self.prefill_tokens: list[int] = []

    def record(self, plan: StepPlan) -> None:
        self.decodes.append(len(plan.decodes))
        self.prefill_tokens.append(sum(p.end - p.start for p in plan.prefills))

    def attach(self, scheduler: Scheduler) -> None:
        """Record every plan `scheduler.schedule()` returns from now on."""
        schedule = scheduler.schedule

        def traced() -> StepPlan:
            plan = schedule()
            if not plan.empty:
                self.record(plan)
            return plan

        scheduler.schedule = traced  # type: ignore[method-assign]

    def summary(self, prompt_tokens: int, slices: int = 8) -> dict:
        """steps, prefill tokens computed, of which recomputed (beyond the prompts: K/V that
        preemption threw away), mean decode batch over steps that decode, and that mean in
        `slices` equal runs of steps (the batch size over time)."""
        n = len(self.decodes)
        dec = [d for d in self.decodes if d]
        computed = sum(self.prefill_tokens)
        runs = [self.decodes[i * n // slices : (i + 1) * n // slices] for i in range(slices)]
        return {
            "steps": n,
            "prefill_tokens": computed,
            "recomputed_tokens": computed - prompt_tokens,
            "mean_decode_batch": round(float(statistics.mean(dec)), 1) if dec else 0.0,
            "decode_batch_over_time": [round(float(statistics.mean(r)), 1) if r else 0.0 for r in runs],
        }


def replay(
    num_blocks: int,
    prompt_lens: list[int],
    max_tokens: int,
    *,
    block_size: int = EngineConfig.block_size,
    max_num_seqs: int = EngineConfig.max_num_seqs,
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
) -> dict:
    """Run the requests (prompt lengths, each exactly `max_tokens` out, no prefix caching)
    through a Scheduler on `num_blocks` blocks; the trace summary plus `preemptions`. The
    limits default to the engine's (EngineConfig's defaults)."""
    cache = PagedKVCache(num_blocks, block_size, enable_prefix_caching=False)
    sched = Scheduler(cache, max_num_seqs, max_num_batched_tokens)
    ids = itertools.count()
    for i, n in enumerate(prompt_lens):
        prompt = list(range(n))
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        s = Sequence(next(ids), req, 0, list(prompt))
        req.seqs.append(s)
        sched.add(s)
    trace = StepTrace()
    while sched.waiting or sched.running:
        plan = sched.schedule()
        if plan.empty:  # nothing fits and nothing runs: the workload can never finish
            raise RuntimeError(f"{num_blocks} blocks cannot hold a request of this workload")
        trace.record(plan)
        sched.commit(plan)
        sched.postprocess(plan.samplers, [1] * len(plan.samplers))
    return {"preemptions": sched.num_preemptions, **trace.summary(sum(prompt_lens))}
