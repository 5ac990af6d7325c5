"""`bench route`'s workload: one seeded schedule shared by every run, each user's questions in
order, distinct documents of the asked size (the runs themselves: `pagedkv bench route`)."""

from __future__ import annotations

from pagedkv.bench.bench_route import _replica, documents, schedule


def test_schedule_is_seeded_and_keeps_each_users_order():
    a = schedule(32, 3, 1.5, seed=0)
    assert a == schedule(32, 3, 1.5, seed=0) != schedule(32, 3, 1.5, seed=1)
    assert len(a) == 96 and [t for t, _, _ in a] == sorted(t for t, _, _ in a)
    for u in range(32):
        assert [q for _, v, q in a if v == u] == [0, 1, 2]
    assert 40 < a[-1][0] < 100  # ~95 gaps of 1/1.5 s


def test_documents_are_distinct_and_sized():
    docs = documents(32, 700, seed=0)
    assert len(set(docs)) == 32 and len({d[:40] for d in docs}) == 32  # differ from the start
    assert all(700 <= len(d.split()) <= 710 for d in docs)


def test_replica_rates_from_metrics():
    m = {"engine_requests_finished_total": 3, "prefix_cache_queries_total": 100,
         "prefix_cache_hits_total": 40, "kv_tier_hit_tokens_total": 30,
         "kv_cache_evictions_total": 2}
    assert _replica(m) == {"requests": 3, "prefix_hit_rate": 0.4, "tier_hit_rate": 0.3,
                           "tier_write_drops": 0, "evictions": 2}
    assert _replica({})["prefix_hit_rate"] == 0.0
