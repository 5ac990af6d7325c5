"""Fair shares of the running slots (engine/fair_share.py) and the scheduler that applies them.

The water-filling and the admission policy are checked against a shadow model that hands out
slots one at a time (to the tenant with the fewest, then its request with the fewest), and a
stateful test drives the real scheduler (bookkeeping cache, no model) through arrivals of
greedy and small requests from several tenants, forks, steps and aborts: every request ends
with all its tokens, no block leaks, the running set never exceeds max_num_seqs, and after
every step no request under its quota is left waiting while another holds more than its own.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from pagedkv.cache import PagedKVCache
from pagedkv.engine.fair_share import plan, water_fill
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.sequence import Request, Sequence, Status

BS = 4
_ids = itertools.count()


def _req(prompt_len: int, max_tokens: int = 8, n: int = 1, tenant: str | None = None) -> Request:
    k = next(_ids)
    start = 1000 * k % 40000 + 1  # prompts share nothing
    ids = list(range(start, start + prompt_len))
    req = Request(f"r{k}", ids, SamplingParams(max_tokens=max_tokens, n=n),
                  stop_ids=frozenset({0}), tenant=tenant)
    req.arrival_time = float(k)
    req.seqs.append(Sequence(next(_ids), req, 0, list(ids)))
    return req


def _step(sched: Scheduler) -> None:
    """One engine step: plan, commit, fork n > 1 samples after the prefill (as
    LLMEngine._fork_samples), append a token to every sampler, finish what is done."""
    _after(sched, sched.schedule())


def _after(sched: Scheduler, p: object) -> None:
    sched.commit(p)
    seqs = list(p.samplers)
    for s in p.samplers:
        req = s.request
        if req.params.n > 1 and not req.forked:
            req.forked = True
            for i in range(1, req.params.n):
                child = Sequence(next(_ids), req, i, list(s.token_ids))
                sched.fork(s, child)
                req.seqs.append(child)
                seqs.append(child)
    sched.postprocess(seqs, [7] * len(seqs))
    sched.cache.check_invariants()


# --- water-filling against the one-slot-at-a-time shadow --------------------------------------


def _shadow_fill(demands: list[int], cap: int) -> list[int]:
    alloc = [0] * len(demands)
    for _ in range(cap):
        open_ = [i for i, d in enumerate(demands) if alloc[i] < d]
        if not open_:
            break
        alloc[min(open_, key=lambda i: (alloc[i], i))] += 1
    return alloc


@given(st.lists(st.integers(0, 70), max_size=12), st.integers(0, 130))
def test_water_fill_equals_the_one_slot_at_a_time_shadow(demands: list[int], cap: int) -> None:
    got = water_fill(demands, cap)
    assert got == _shadow_fill(demands, cap)
    assert sum(got) == min(cap, sum(demands)) and all(0 <= g <= d for g, d in zip(got, demands, strict=True))


def test_water_fill_small_requests_keep_what_they_ask() -> None:
    assert water_fill([64, 1], 64) == [63, 1]
    assert water_fill([64, 1, 2], 8) == [5, 1, 2]
    assert water_fill([64], 64) == [64]  # alone: every slot (work-conserving)
    assert water_fill([3, 3, 3], 4) == [2, 1, 1]  # the odd slot goes to the oldest


def _shadow_quotas(entries: list[tuple[object, int]], slots: int) -> list[int]:
    """(tenant, demand) per request, oldest first -> quotas: a slot at a time to the tenant
    with the fewest (oldest first on ties), then to its request with the fewest."""
    tenants = list(dict.fromkeys(t for t, _ in entries))
    got = [0] * len(entries)
    for _ in range(slots):
        def open_of(t: object) -> list[int]:
            return [i for i, (u, d) in enumerate(entries) if u == t and got[i] < d]
        cands = [t for t in tenants if open_of(t)]
        if not cands:
            break
        t = min(cands, key=lambda t: (sum(got[i] for i, (u, _) in enumerate(entries) if u == t),
                                      tenants.index(t)))
        i = min(open_of(t), key=lambda i: (got[i], i))
        got[i] += 1
    return got


@settings(max_examples=80)
@given(st.lists(st.tuples(st.sampled_from([None, "a", "b", "c"]), st.integers(1, 6),
                          st.integers(0, 4), st.integers(1, 8)), min_size=1, max_size=8),
       st.integers(1, 12))
def test_plan_quotas_victims_and_order_match_the_shadow(reqs: list, slots: int) -> None:
    """Each request: (tenant, running seqs, waiting seqs, n); n > 1 unforked requests count
    their samples to come."""
    running: list[Sequence] = []
    waiting: list[Sequence] = []
    entries = []
    for k, (tenant, n_run, n_wait, n) in enumerate(reqs):
        req = _req(3, n=n, tenant=tenant)
        req.arrival_time = float(k)
        req.forked = n_run > 1 or n == 1
        seqs = [Sequence(next(_ids), req, i, [1, 2, 3]) for i in range(n_run + n_wait)]
        running += seqs[:n_run]
        waiting += seqs[n_run:]
        unforked = n - 1 if n > 1 and not req.forked else 0
        entries.append((tenant, n_run + n_wait + unforked, req, seqs[:n_run], seqs[n_run:]))
    fair = plan(running, waiting, slots)
    want = _shadow_quotas([(t, d) for t, d, *_ in entries], slots)
    assert [fair.quotas[e[2].request_id] for e in entries] == want
    victims = set(map(id, fair.victims))
    after = {id(e[2]): len(e[3]) - sum(id(s) in victims for s in e[3]) for e in entries}
    for (_, _, req, run, wait), q in zip(entries, want, strict=True):
        assert after[id(req)] >= min(q, len(run))  # nobody is cut below its quota
        under = [s for s in wait if s.seq_id in fair.under]
        assert len(under) == max(0, min(len(wait), q - len(run)))
    over = [s for s in fair.order if s.seq_id not in fair.under]
    assert fair.order[: len(fair.order) - len(over)] == [s for s in fair.order if s.seq_id in fair.under]
    # room for every under-quota sequence, unless no one is left over quota to give it up
    room = slots - (len(running) - len(fair.victims))
    if room < len(fair.under):
        assert all(after[id(e[2])] <= q for e, q in zip(entries, want, strict=True))
    assert sorted(map(id, fair.order)) == sorted(map(id, waiting))


# --- the scheduler -------------------------------------------------------------------------


def _sched(num_blocks: int = 256, max_num_seqs: int = 8, budget: int = 512) -> Scheduler:
    return Scheduler(PagedKVCache(num_blocks, BS), max_num_seqs, budget,
                     dedup_inflight_prefixes=False)


def test_alone_a_request_takes_every_slot() -> None:
    sched = _sched()
    greedy = _req(5, max_tokens=6, n=8)
    sched.add(greedy.seqs[0])
    for _ in range(6):
        _step(sched)
    assert all(s.finished and len(s.output_ids) == 6 for s in greedy.seqs)
    assert sched.num_preemptions == 0 and len(greedy.seqs) == 8


def test_a_small_request_gets_a_slot_at_the_next_step() -> None:
    """The issue's case at max_num_seqs=8: n=8 fills every slot; a 4-token request of another
    client is admitted at the very next step (one sample of the greedy one is preempted),
    and the greedy one still finishes every sample with all its tokens."""
    sched = _sched()
    greedy = _req(5, max_tokens=30, n=8, tenant="g")
    sched.add(greedy.seqs[0])
    _step(sched)
    _step(sched)
    assert len(sched.running) == 8
    small = _req(3, max_tokens=4, tenant="s")
    sched.add(small.seqs[0])
    _step(sched)
    assert small.seqs[0].status is Status.RUNNING and len(sched.running) == 8
    assert sched.num_fair_preemptions == 1
    for _ in range(3):
        _step(sched)
    assert small.seqs[0].finished and len(small.seqs[0].output_ids) == 4
    for _ in range(40):
        _step(sched)
    assert all(s.finished and len(s.output_ids) == 30 for s in greedy.seqs)
    assert sched.cache.num_free_blocks == sched.cache.num_blocks


def test_tenants_share_before_requests() -> None:
    """Tenant a sends six requests, tenant b one: b's gets its slot even though a came first,
    and a's six share the other slots."""
    sched = _sched(max_num_seqs=4)
    a = [_req(3, max_tokens=50, tenant="a") for _ in range(6)]
    for r in a:
        sched.add(r.seqs[0])
    _step(sched)
    b = _req(3, max_tokens=50, tenant="b")
    sched.add(b.seqs[0])
    _step(sched)
    assert b.seqs[0].status is Status.RUNNING
    assert sum(r.seqs[0].status is Status.RUNNING for r in a) == 3


def test_forks_beyond_max_num_seqs_are_brought_back_to_it() -> None:
    sched = _sched(max_num_seqs=4)
    other = _req(3, max_tokens=40)
    greedy = _req(3, max_tokens=40, n=6)
    sched.add(other.seqs[0])
    sched.add(greedy.seqs[0])
    _step(sched)  # both prefilled; greedy forks 5 children: 7 running
    assert len(sched.running) == 7
    _step(sched)
    assert len(sched.running) == 4 and other.seqs[0].status is Status.RUNNING


class FairScheduling(RuleBasedStateMachine):
    """Greedy and small requests from three tenants, arriving, stepping and aborting; ample
    blocks and token budget, so slots are the only contended resource."""

    S = 6

    def __init__(self) -> None:
        super().__init__()
        self.sched = _sched(num_blocks=2048, max_num_seqs=self.S, budget=4096)
        self.reqs: list[Request] = []

    @rule(tenant=st.sampled_from(["a", "b", None]), n=st.integers(1, 8),
          max_tokens=st.integers(1, 12), prompt=st.integers(1, 9))
    def arrive(self, tenant: str | None, n: int, max_tokens: int, prompt: int) -> None:
        req = _req(prompt, max_tokens=max_tokens, n=n, tenant=tenant)
        self.reqs.append(req)
        self.sched.add(req.seqs[0])

    @rule()
    def step(self) -> None:
        sched = self.sched
        before = {id(r): self._counts(r) for r in self.reqs}
        entries = [r for r in sorted(self.reqs, key=lambda r: r.arrival_time)
                   if sum(before[id(r)])]
        demand = [sum(before[id(r)]) + (r.params.n - 1 if r.params.n > 1 and not r.forked else 0)
                  for r in entries]
        quotas = _shadow_quotas([(r.tenant, d) for r, d in zip(entries, demand, strict=True)],
                                self.S)
        fair = bool(sched.waiting) or len(sched.running) > self.S
        p = sched.schedule()
        if fair:
            assert len(sched.running) <= self.S
            assert not sched.waiting or len(sched.running) == self.S  # work-conserving
            for r, q in zip(entries, quotas, strict=True):
                run0, wait0 = before[id(r)]
                run1 = self._counts(r)[0]
                # every sequence under its quota runs; nobody is cut below its quota
                assert run1 >= min(q, run0 + wait0), (r.request_id, q, run0, wait0, run1)
        _after(sched, p)

    @precondition(lambda self: any(not r.finished for r in self.reqs))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from([r for r in self.reqs if not r.finished]))
        for s in r.seqs:
            if not s.finished:
                self.sched.finish(s, "abort")
        r.forked = True
        self.reqs.remove(r)

    def _counts(self, r: Request) -> tuple[int, int]:
        return (sum(s.status is Status.RUNNING for s in r.seqs),
                sum(s.status is Status.WAITING for s in r.seqs))

    def teardown(self) -> None:
        for _ in range(200):
            if not self.sched.running and not self.sched.waiting:
                break
            _step(self.sched)
        for r in self.reqs:
            assert all(s.finish_reason == "length" and len(s.output_ids) == r.params.max_tokens
                       for s in r.seqs)
            assert len(r.seqs) == r.params.n
        assert self.sched.cache.num_free_blocks == self.sched.cache.num_blocks


TestFairScheduling = FairScheduling.TestCase
TestFairScheduling.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
