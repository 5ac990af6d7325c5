"""Fair shares of the running slots: one client never starves the others.

Without this, admission is first come first served and a request's n samples all fork into
the running set: one `n=64` request fills every slot of a `max_num_seqs=64` engine and a
4-token request behind it waits for the whole of it. Here, whenever sequences wait, the
`max_num_seqs` slots are divided max-min fairly (water-filling), first between tenants (the
API key identity the server records, never a field of the body), then between each tenant's
requests, by demand (a request's unfinished sequences, and the samples it will fork):

- a tenant or request that wants less than an equal share keeps all it wants; the rest is
  split evenly among the others; a slot that does not divide evenly goes to the older one;
- the policy is work-conserving: alone, a request gets every slot its demand asks for;
- quotas are only computed while something waits (or forks pushed the running set over
  `max_num_seqs`): a step with nothing waiting costs nothing here.

`plan()` gives the scheduler (a) the victims: the newest running sequences of requests over
their quota, as many as the waiting sequences under quota need slots (and as bring the running
set back to `max_num_seqs`), never taking a request below its quota; (b) the admission order
of the waiting sequences: under-quota ones first, least-served tenant first (a tenant's k-th
sequence counting its running ones goes in round k, and within a tenant a request's k-th goes
before any request's (k+1)-th), then by queue position; over-quota ones after them, admitted
only when no under-quota one is left waiting (borrowed slots, given back by preemption once
someone under quota waits). Sequences of a request with `fair_share=False` (beam search, which
must never be preempted) are never victims.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from pagedkv.engine.sequence import Request, Sequence


def water_fill(demands: Seq[int], cap: int) -> list[int]:
    """Max-min fair integer shares of `cap` slots: each gets min(demand, level); the slots
    that do not divide evenly go one each to the first unsatisfied entries (input order is
    priority). sum(result) == min(cap, sum(demands)); result[i] <= demands[i]."""
    alloc = [0] * len(demands)
    left = max(cap, 0)
    active = [i for i, d in enumerate(demands) if d > 0]
    while left > 0 and active:
        share = left // len(active)
        if share == 0:
            for i in active[:left]:
                alloc[i] += 1
            break
        still = []
        for i in active:
            give = min(share, demands[i] - alloc[i])
            alloc[i] += give
            left -= give
            if alloc[i] < demands[i]:
                still.append(i)
        active = still
    return alloc


@dataclass(slots=True, eq=False)
class _Req:
    req: Request
    running: list[Sequence] = field(default_factory=list)
    waiting: list[Sequence] = field(default_factory=list)
    quota: int = 0

    @property
    def demand(self) -> int:
        p = self.req.params
        unforked = p.n - 1 if p.n > 1 and not self.req.forked else 0
        return len(self.running) + len(self.waiting) + unforked


@dataclass(slots=True)
class FairPlan:
    victims: list[Sequence]  # to preempt before this step's decodes are reserved
    order: list[Sequence]  # the waiting sequences, in admission order
    under: set[int]  # seq ids of the waiting sequences under their request's quota
    quotas: dict[str, int]  # request id -> slots


def quotas(reqs: Seq[_Req], slots: int) -> None:
    """Sets each entry's quota: water-filling between tenants, then between a tenant's
    requests. `reqs` come oldest first (priority for the odd slot)."""
    tenants: dict[object, list[_Req]] = {}
    for r in reqs:
        tenants.setdefault(r.req.tenant, []).append(r)
    groups = list(tenants.values())
    per_tenant = water_fill([sum(r.demand for r in g) for g in groups], slots)
    for g, share in zip(groups, per_tenant, strict=True):
        for r, q in zip(g, water_fill([r.demand for r in g], share), strict=True):
            r.quota = q


def plan(running: Seq[Sequence], waiting: Seq[Sequence], slots: int) -> FairPlan:
    """The victims and the admission order for one step (see the module docstring)."""
    by_req: dict[int, _Req] = {}
    for s in running:
        _entry(by_req, s.request).running.append(s)
    for s in waiting:
        _entry(by_req, s.request).waiting.append(s)
    reqs = sorted(by_req.values(), key=lambda r: r.req.arrival_time)  # stable: oldest first
    quotas(reqs, slots)
    under_ids: set[int] = set()
    want = 0
    for r in reqs:
        room = max(0, r.quota - len(r.running))
        for s in r.waiting[:room]:
            under_ids.add(s.seq_id)
        want += min(room, len(r.waiting))
    victims = _victims(running, by_req, len(running) + want - slots)
    return FairPlan(victims, _order(reqs, waiting, under_ids), under_ids,
                    {r.req.request_id: r.quota for r in reqs})


def _entry(by_req: dict[int, _Req], req: Request) -> _Req:
    e = by_req.get(id(req))
    if e is None:
        e = by_req[id(req)] = _Req(req)
    return e


def _victims(running: Seq[Sequence], by_req: dict[int, _Req], need: int) -> list[Sequence]:
    """Up to `need` running sequences, newest first, of requests over their quota (never
    below it), skipping requests that must not be preempted."""
    if need <= 0:
        return []
    excess = {k: len(r.running) - r.quota for k, r in by_req.items()
              if len(r.running) > r.quota and r.req.fair_share}
    out: list[Sequence] = []
    for s in reversed(running):
        if len(out) >= need:
            break
        k = id(s.request)
        if excess.get(k, 0) > 0:
            excess[k] -= 1
            out.append(s)
    return out


def _order(reqs: Seq[_Req], waiting: Seq[Sequence], under: set[int]) -> list[Sequence]:
    """Under-quota first; then round by round between tenants, within a tenant between its
    requests (counting the sequences each already runs); then queue position."""
    pos = {s.seq_id: i for i, s in enumerate(waiting)}
    key: dict[int, tuple[int, int, int, int]] = {}
    tenants: dict[object, list[_Req]] = {}
    for r in reqs:
        tenants.setdefault(r.req.tenant, []).append(r)
    for group in tenants.values():
        ranked = []  # (request round, position, seq)
        for r in group:
            ranked += [(len(r.running) + k, pos[s.seq_id], s) for k, s in enumerate(r.waiting)]
        ranked.sort(key=lambda t: (t[0], t[1]))
        base = sum(len(r.running) for r in group)
        for k, (rround, p, s) in enumerate(ranked):
            key[s.seq_id] = (s.seq_id not in under, base + k, rround, p)
    return sorted(waiting, key=lambda s: key[s.seq_id])
