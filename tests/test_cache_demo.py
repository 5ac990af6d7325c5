"""The cache demo report and the cache benchmark (numbers checked, timings only reported)."""

from __future__ import annotations

import re

from pagedkv.bench.bench_cache import run_cache_bench
from pagedkv.demo import run_cache_demo


def test_cache_demo_report():
    text = run_cache_demo()
    assert "contiguous" in text and "paged" in text
    util = [float(x) for x in re.findall(r"utilization ([\d.]+)%", text)]
    assert len(util) == 2 and util[1] > 95 > 20 > util[0]  # paged vs contiguous
    assert "defragment moved" in text and " 0 holes" in text
    assert "cow copies: 1" in text and "each sees only its own later writes" in text
    assert "100 tokens reused" in text and "another tenant's salt: 0 tokens reused" in text


def test_cache_bench_runs_and_reports():
    out = run_cache_bench(seed=0, repeats=1)
    for key in ("utilization", "utilization_mean", "contiguous_utilization",
                "bookkeeping_us_per_step", "alloc_free_ops_per_s",
                "baseline_rebuild_us_per_step", "speedup_vs_rebuild"):
        assert key in out
    assert out["utilization"] >= 0.95 and out["utilization_mean"] >= 0.95
    assert out["contiguous_utilization"] < 0.3
    assert out["num_sequences"] == 256 and out["prompt_len_max"] <= 2048
    assert out["bookkeeping_us_per_step"] > 0 and out["alloc_free_ops_per_s"] > 0
