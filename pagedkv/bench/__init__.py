"""Benchmarks: `pagedkv bench NAME [options]`, each printing one JSON object.

A benchmark is one module, `pagedkv/bench/bench_NAME.py`, holding
`add_args(parser)` (optional: its own options) and `run(args) -> dict`. Adding such a file adds
the subcommand; nothing else lists them. Every benchmark also takes `--output FILE` and `--quick`.
Shipped prompt sets live in `pagedkv/bench/data/`.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

DATA = Path(__file__).parent / "data"


def names() -> list[str]:
    """The benchmarks there are (found by file name, without importing them)."""
    return sorted(p.stem.removeprefix("bench_") for p in Path(__file__).parent.glob("bench_*.py"))


def parser_for(name: str) -> argparse.ArgumentParser:
    mod = importlib.import_module(f"pagedkv.bench.bench_{name}")
    ap = argparse.ArgumentParser(prog=f"pagedkv bench {name}", description=mod.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", "-o", default=None, help="also write the JSON here")
    ap.add_argument("--quick", action="store_true", help="a small smoke run")
    if hasattr(mod, "add_args"):
        mod.add_args(ap)
    ap.set_defaults(_run=mod.run)
    return ap


def run_benchmark(name: str, argv: list[str]) -> dict:
    """Parse `argv` with the benchmark's own parser and run it."""
    if name not in names():
        raise ValueError(f"unknown benchmark {name!r}; there are: {', '.join(names())}")
    args = parser_for(name).parse_args(argv)
    return args._run(args)
