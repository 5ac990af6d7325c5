"""Benchmarks: `pagedkv bench cache|attention|throughput|serve` (each returns one JSON dict)."""

from __future__ import annotations

import argparse


def run_benchmark(which: str, args: argparse.Namespace) -> dict:
    quick = bool(getattr(args, "quick", False))
    if which == "cache":
        from benchmarks.bench_cache import run_cache_bench

        return run_cache_bench()
    if which == "attention":
        from benchmarks.bench_attention import run_attention_bench

        return run_attention_bench(quick=quick)
    if which == "throughput":
        from benchmarks.bench_throughput import run_throughput_bench

        return run_throughput_bench(quick=quick)
    if which == "serve":
        from benchmarks.bench_serve import run_serve_bench

        return run_serve_bench(getattr(args, "base_url", None), quick=quick)
    raise ValueError(f"unknown benchmark {which!r}")
