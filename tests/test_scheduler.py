"""The scheduler without a model (in the style of vLLM's tests/v1/core/test_scheduler.py).

A bookkeeping-only cache (no storage) and hand-made requests; `_step` plays the engine: plan,
commit (the forward pass "wrote" the K/V), then append one sampled token per sampler. Every test
asserts exact block counts.
"""

from __future__ import annotations

import itertools

import torch

from pagedkv.cache import PagedKVCache
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.sequence import Request, Sequence, Status
from pagedkv.engine.step_plan import StepPlan

BS = 4
_ids = itertools.count()


def _seq(prompt: list[int], max_tokens: int = 8, salt: str | None = None, n: int = 1) -> Sequence:
    req = Request(f"r{next(_ids)}", list(prompt), SamplingParams(max_tokens=max_tokens, n=n),
                  cache_salt=salt, stop_ids=frozenset({0}))
    s = Sequence(next(_ids), req, 0, list(prompt))
    req.seqs.append(s)
    return s


def _sched(num_blocks: int, max_num_seqs: int = 8, budget: int = 64, **kw) -> Scheduler:
    return Scheduler(PagedKVCache(num_blocks, BS), max_num_seqs, budget, **kw)


def _step(sched: Scheduler, token: int = 7) -> StepPlan:
    plan = sched.schedule()
    sched.commit(plan)
    sched.postprocess(plan.samplers, [token] * len(plan.samplers))
    sched.cache.check_invariants()
    return plan


def _used(sched: Scheduler) -> int:
    return sched.cache.num_blocks - sched.cache.num_free_blocks


def _prompt(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def test_admission_order_and_blocks() -> None:
    sched = _sched(16)
    a, b, c = _seq(_prompt(5)), _seq(_prompt(9, 100)), _seq(_prompt(3, 200))
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert sched.running == [a, b, c] and not sched.waiting
    assert [(p.seq, p.start, p.end) for p in plan.prefills] == [(a, 0, 5), (b, 0, 9), (c, 0, 3)]
    assert _used(sched) == 2 + 3 + 1
    assert plan.samplers == [a, b, c]
    assert plan.logits_indices.tolist() == [4, 13, 16]
    assert plan.input_ids.tolist() == a.token_ids + b.token_ids + c.token_ids


def test_plan_is_complete_for_decodes() -> None:
    sched = _sched(16)
    a, b = _seq(_prompt(4)), _seq(_prompt(6, 50))
    sched.add(a)
    sched.add(b)
    _step(sched, token=9)
    plan = sched.schedule()  # both decode: the new token 9 at positions 4 and 6
    assert plan.prefills == [] and plan.decodes == [a, b]
    assert plan.input_ids.tolist() == [9, 9]
    assert plan.positions.tolist() == [4, 6]
    cache = sched.cache
    assert plan.meta.slot_mapping.tolist() == [cache.slot(a.seq_id, 4), cache.slot(b.seq_id, 6)]
    assert plan.meta.decode_seq_lens.tolist() == [5, 7]
    assert plan.meta.decode_block_tables[0, :2].tolist() == cache.block_ids(a.seq_id)
    assert plan.logits_indices.tolist() == [0, 1]
    assert _used(sched) == 2 + 2  # a grew into a second block at token 5


def test_token_budget_chunks_a_long_prompt() -> None:
    sched = _sched(16, budget=8)
    a = _seq(_prompt(20))
    sched.add(a)
    spans = []
    for _ in range(3):
        plan = _step(sched)
        spans.append([(p.start, p.end) for p in plan.prefills])
        assert plan.num_tokens == plan.positions.numel() == plan.meta.slot_mapping.numel()
    assert spans == [[(0, 8)], [(8, 16)], [(16, 20)]]
    assert plan.samplers == [a] and len(a.token_ids) == 21
    assert _used(sched) == 5


def test_budget_left_by_decodes_admits_a_chunk() -> None:
    sched = _sched(32, budget=8)
    a = _seq(_prompt(3))
    sched.add(a)
    _step(sched)
    b = _seq(_prompt(12, 40))
    sched.add(b)
    plan = sched.schedule()
    assert plan.decodes == [a]
    assert [(p.start, p.end) for p in plan.prefills] == [(0, 7)]  # 8 - 1 decode token
    assert plan.samplers == [a]  # b's prompt is not done: it does not sample yet


def test_preempts_the_newest_and_requeues_it_first() -> None:
    sched = _sched(4)
    a, b = _seq(_prompt(4)), _seq(_prompt(4, 10))
    w = _seq(_prompt(3, 20))
    sched.add(a)
    sched.add(b)
    _step(sched)  # a, b hold 1 full block each, sampled one token each
    sched.add(w)  # needs one block; headroom (1) leaves it waiting
    assert _used(sched) == 2
    _step(sched)  # a, b decode into a second block each: 4 used, w still waits
    assert _used(sched) == 4 and list(sched.waiting) == [w]
    # every block used: a and b fill their second block (3 steps), then each needs a third
    for _ in range(4):
        _step(sched)
    assert sched.num_preemptions == 1
    assert sched.running == [a] and list(sched.waiting) == [b, w]
    assert b.status is Status.WAITING and b.num_scheduled == 0
    assert _used(sched) == 3


def test_headroom_keeps_blocks_for_running_decodes() -> None:
    sched = _sched(5)
    a = _seq(_prompt(5))
    sched.add(a)
    _step(sched)  # 2 blocks
    b = _seq(_prompt(9, 30))  # 3 blocks: fits the 3 free, but not with 1 block of headroom
    sched.add(b)
    plan = sched.schedule()
    assert plan.decodes == [a] and plan.prefills == [] and list(sched.waiting) == [b]
    assert _used(sched) == 2


def test_admission_that_does_not_fit_is_not_an_error() -> None:
    sched = _sched(3)
    big = _seq(_prompt(20))  # 5 blocks: can never fit this cache
    small = _seq(_prompt(3, 50))
    sched.add(big)
    sched.add(small)
    plan = sched.schedule()
    assert plan.empty and list(sched.waiting) == [big, small]  # FCFS: small waits behind big
    assert _used(sched) == 0


def test_finish_and_abort_free_blocks() -> None:
    sched = _sched(16)
    a = _seq(_prompt(6), max_tokens=2)
    b = _seq(_prompt(9, 40), max_tokens=50)
    w = _seq(_prompt(5, 80))
    for s in (a, b):
        sched.add(s)
    _step(sched)
    _step(sched)
    assert a.finish_reason == "length" and a.status is Status.FINISHED
    assert _used(sched) == 3  # b: 9 + 2 tokens -> 3 blocks; a's 2 blocks are back
    sched.finish(b, "abort")
    sched.add(w)
    sched.finish(w, "abort")  # a waiting sequence leaves the queue, holding nothing
    assert _used(sched) == 0 and not sched.running and not sched.waiting
    sched.cache.check_invariants()


def test_stop_token_finishes() -> None:
    sched = _sched(8)
    a = _seq(_prompt(3))
    sched.add(a)
    plan = sched.schedule()
    sched.commit(plan)
    done = sched.postprocess(plan.samplers, [0])  # 0 is a stop id
    assert done == [a] and a.finish_reason == "stop" and _used(sched) == 0


def test_forks_share_blocks_and_copy_on_write_once() -> None:
    # the case: prompt of 9 (3 blocks, the last partial), fork, one free block
    sched = _sched(4)
    a = _seq(_prompt(9), n=2)
    sched.add(a)
    plan = sched.schedule()
    sched.commit(plan)
    child = Sequence(next(_ids), a.request, 1, list(a.token_ids))
    assert sched.fork(a, child) == 3
    sched.postprocess([a, child], [5, 6])
    assert _used(sched) == 3
    # both write the shared partial block: one copy, the last holder writes in place
    assert sched.cache.blocks_needed_one_each([a.seq_id, child.seq_id]) == 1
    plan = _step(sched)
    assert plan.decodes == [a, child] and sched.num_preemptions == 0
    assert _used(sched) == 4 and sched.cache.cow_copies == 1
    assert a.token_ids[9:] == [5, 7] and child.token_ids[9:] == [6, 7]


def test_hashes_registered_only_after_commit() -> None:
    sched = _sched(16)
    a = _seq(_prompt(9))
    sched.add(a)
    plan = sched.schedule()
    assert sched.cache.lookup(_prompt(9)) == 0  # K/V not written yet: nothing findable
    sched.commit(plan)
    assert sched.cache.lookup(_prompt(9)) == 8


def test_undo_after_a_failed_forward_caches_nothing() -> None:
    sched = _sched(16)
    a, b = _seq(_prompt(9)), _seq(_prompt(5, 40))
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    sched.undo(plan)  # the forward pass raised
    assert list(sched.waiting) == [a, b] and not sched.running and _used(sched) == 0
    assert sched.num_preemptions == 0
    assert sched.cache.lookup(_prompt(9)) == 0
    sched.cache.check_invariants()
    plan = _step(sched)  # and the step can run again
    assert plan.samplers == [a, b]


def test_undo_of_decodes_requeues_them_in_order() -> None:
    sched = _sched(16)
    a, b = _seq(_prompt(4)), _seq(_prompt(5, 40))
    sched.add(a)
    sched.add(b)
    _step(sched)
    plan = sched.schedule()
    sched.undo(plan)
    assert list(sched.waiting) == [a, b] and _used(sched) == 0
    assert sched.cache.lookup(a.token_ids) == 4  # the prompt's block was written in step 1
    plan = _step(sched)
    # b's partial last block (its 5th prompt token, written in step 1) was kept when it was
    # requeued: a partial hit
    assert [(p.seq, p.start, p.end) for p in plan.prefills] == [(a, 4, 5), (b, 5, 6)]


# --- in-flight prefix dedup (issue 16) --------------------------------------------------------

DOC = _prompt(20, 1000)  # five full blocks


def test_dedup_two_requests_sharing_a_prefix() -> None:
    sched = _sched(32)
    a, b = _seq(DOC + [1, 2]), _seq(DOC + [3, 4])
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [p.seq for p in plan.prefills] == [a] and list(sched.waiting) == [b]
    sched.commit(plan)
    sched.postprocess(plan.samplers, [7])
    plan = sched.schedule()
    assert [(p.seq, p.start, p.end) for p in plan.prefills] == [(b, 20, 22)]
    assert b.request.num_cached_tokens == 20
    assert sched.inflight.requests_held == 1 and sched.inflight.tokens_saved == 20
    assert _used(sched) == 6 + 1  # a: 5 shared + its own; b: 1 block of its own


def test_dedup_eight_requests_compute_the_prefix_once() -> None:
    sched = _sched(64, max_num_seqs=8)
    seqs = [_seq(DOC + [i, i]) for i in range(1, 9)]
    for s in seqs:
        sched.add(s)
    computed = 0
    while any(s.status is not Status.FINISHED and len(s.token_ids) == 22 for s in seqs):
        plan = _step(sched)
        computed += sum(p.end - p.start for p in plan.prefills)
    assert computed == 20 + 8 * 2
    assert sched.inflight.requests_held == 7 and sched.inflight.tokens_saved == 7 * 20
    assert _used(sched) == 5 + 8


def test_dedup_follows_a_chunked_leader_block_by_block() -> None:
    sched = _sched(64, budget=8)
    a, b = _seq(DOC + [1]), _seq(DOC[:12] + [5, 6])  # b shares three blocks
    sched.add(a)
    sched.add(b)
    assert [p.seq for p in _step(sched).prefills] == [a]  # a computes blocks 0-1
    assert [p.seq for p in _step(sched).prefills] == [a]  # blocks 2-3: b's shared part done
    plan = _step(sched)
    assert [(p.seq, p.start, p.end) for p in plan.prefills] == [(a, 16, 21), (b, 12, 14)]


def test_dedup_never_holds_other_salts_or_less_than_a_block() -> None:
    sched = _sched(64)
    a = _seq(DOC + [1], salt="t1")
    other_salt = _seq(DOC + [2], salt="t2")
    short = _seq(DOC[:3] + [9, 9, 9, 9, 9])  # shares 3 tokens, under one block
    for s in (a, other_salt, short):
        sched.add(s)
    plan = sched.schedule()
    assert [p.seq for p in plan.prefills] == [a, other_salt, short]
    assert sched.inflight.requests_held == 0


def test_dedup_held_request_keeps_its_place_others_go_ahead() -> None:
    sched = _sched(64)
    a, b, c = _seq(DOC + [1]), _seq(DOC + [2]), _seq(_prompt(6, 5000))
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert [p.seq for p in plan.prefills] == [a, c] and list(sched.waiting) == [b]


def test_dedup_aborted_leader_releases_held() -> None:
    sched = _sched(64, budget=8)
    a, b = _seq(DOC + [1]), _seq(DOC + [2])
    sched.add(a)
    sched.add(b)
    _step(sched)  # a computed blocks 0-1; b held
    assert list(sched.waiting) == [b]
    sched.finish(a, "abort")
    plan = sched.schedule()
    assert plan.prefills[0].seq is b and plan.prefills[0].start == 8  # goes on with the hit


def test_dedup_preempted_leader_stops_holding() -> None:
    sched = _sched(64, budget=8)
    a, b = _seq(DOC + [1]), _seq(DOC + [2])
    sched.add(a)
    sched.add(b)
    _step(sched)  # a computed blocks 0-1; b held
    sched.preempt(a)  # a goes back to the front; its old prefill holds no one
    sched.inflight.begin_step()
    assert not sched.inflight.hold(b)
    # a is admitted again first (front of the line, 8 tokens cached) and leads again
    plan = _step(sched)
    assert [(p.seq, p.start, p.end) for p in plan.prefills] == [(a, 8, 16)]
    plan = _step(sched)  # a computes the last shared block; b still waits for it
    assert [(p.seq, p.start, p.end) for p in plan.prefills] == [(a, 16, 21)]
    plan = _step(sched)
    assert [(p.seq, p.start, p.end) for p in plan.prefills] == [(b, 20, 21)]


def test_dedup_off_admits_together() -> None:
    sched = _sched(32, dedup_inflight_prefixes=False)
    a, b = _seq(DOC + [1, 2]), _seq(DOC + [3, 4])
    sched.add(a)
    sched.add(b)
    assert [p.seq for p in sched.schedule().prefills] == [a, b]
    assert sched.inflight is None


def test_plan_tensors_dtypes() -> None:
    sched = _sched(8)
    sched.add(_seq(_prompt(5)))
    plan = sched.schedule()
    assert plan.input_ids.dtype == plan.positions.dtype == torch.int64
    assert plan.meta.slot_mapping.dtype == torch.int64
