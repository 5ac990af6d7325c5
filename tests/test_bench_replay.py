"""The model-free workload replay behind `bench kvquant`'s end-to-end figures (bench/replay.py):
it drives the real Scheduler, and a trace attached to a live scheduler records the same steps."""

from __future__ import annotations

from pagedkv.bench.replay import StepTrace, replay
from pagedkv.cache import PagedKVCache
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.sequence import Request, Sequence


def test_a_workload_that_fits_never_preempts() -> None:
    # 4 x (32 prompt + 8 out) = 10 blocks of 16 at most; 12 blocks hold it all
    r = replay(12, [32] * 4, 8, max_num_seqs=4)
    assert r["preemptions"] == 0 and r["recomputed_tokens"] == 0
    assert r["prefill_tokens"] == 128
    assert r["steps"] == 8  # one prefill step (the first token), then 7 decode steps of 4
    assert r["mean_decode_batch"] == 4.0


def test_a_small_cache_preempts_and_recomputes() -> None:
    r = replay(6, [32] * 4, 40, max_num_seqs=4)  # each ends at 72 tokens = 5 blocks
    assert r["preemptions"] > 0
    assert r["recomputed_tokens"] > 0
    assert r["prefill_tokens"] == 128 + r["recomputed_tokens"]
    more = replay(24, [32] * 4, 40, max_num_seqs=4)
    assert more["preemptions"] == 0 and more["steps"] < r["steps"]


def test_trace_on_a_live_scheduler_matches_the_replay() -> None:
    sched = Scheduler(PagedKVCache(6, 16, enable_prefix_caching=False), 4, 2048)
    for i in range(4):
        req = Request(f"r{i}", list(range(32)), SamplingParams(max_tokens=40, ignore_eos=True))
        s = Sequence(i, req, 0, list(range(32)))
        req.seqs.append(s)
        sched.add(s)
    trace = StepTrace()
    trace.attach(sched)
    while sched.waiting or sched.running:
        plan = sched.schedule()
        sched.commit(plan)
        sched.postprocess(plan.samplers, [5] * len(plan.samplers))
    got = {"preemptions": sched.num_preemptions, **trace.summary(128)}
    assert got == replay(6, [32] * 4, 40, max_num_seqs=4)
