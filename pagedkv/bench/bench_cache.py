"""Cache bookkeeping benchmark: a simulated decode workload through the paged cache.

256 sequences with lognormal prompt lengths (median ~200, capped at 2048) each decode 128 tokens,
block_size 16. Measured in one run:

- `utilization`: live tokens / allocated slots (at the end, and the mean over decode steps);
  `contiguous_utilization`: the same for max-length contiguous buffers (2048 + 128 per sequence).
- `bookkeeping_us_per_step`: median time of one decode step's cache work for all sequences
  (`append_one_each`, then `decode_tensors`: slot mapping, block tables, context lengths).
- `baseline_rebuild_us_per_step`: the same step done with Python-list block tables turned into a
  padded tensor with `torch.tensor` every step (the nano-vllm way), and `speedup_vs_rebuild`.
- `alloc_free_ops_per_s`: single-block BlockPool allocate + free operations per second.

`pagedkv bench cache` prints one JSON object.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque

import numpy as np
import torch

from pagedkv.cache import BlockPool, PagedKVCache
from pagedkv.cache.hashing import ROOT_HASH, block_hash

NUM_SEQS = 256
DECODE_TOKENS = 128
BLOCK_SIZE = 16
MAX_PROMPT = 2048
PROMPT_MEDIAN = 200
PROMPT_SIGMA = 0.8
VOCAB = 32_000


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_workload(seed: int) -> tuple[list[list[int]], np.ndarray]:
    """Prompts (token ids) with lognormal lengths, and the decoded tokens [DECODE_TOKENS, NUM_SEQS]."""
    rng = np.random.default_rng(seed)
    lens = np.exp(rng.normal(np.log(PROMPT_MEDIAN), PROMPT_SIGMA, NUM_SEQS))
    lens = np.clip(lens.astype(np.int64), 1, MAX_PROMPT)
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in lens]
    decoded = rng.integers(0, VOCAB, (DECODE_TOKENS, NUM_SEQS))
    return prompts, decoded


def _pool_size(prompts: list[list[int]]) -> int:
    """Enough blocks for every sequence at its final length, plus one spare each."""
    return sum(_cdiv(len(p) + DECODE_TOKENS, BLOCK_SIZE) + 1 for p in prompts)


def run_paged(prompts: list[list[int]], decoded: np.ndarray) -> dict:
    """The decode workload through PagedKVCache: per-step times (ns) and utilization."""
    cache = PagedKVCache(_pool_size(prompts), BLOCK_SIZE, max_seq_len=MAX_PROMPT + DECODE_TOKENS)
    ids = list(range(len(prompts)))
    for i, p in zip(ids, prompts, strict=True):
        cache.create(i, p)
    steps = [row.tolist() for row in decoded]
    live = sum(len(p) for p in prompts)
    times, utils, contiguous = [], [], []
    gc.collect()
    gc.disable()
    try:
        for toks in steps:
            t0 = time.perf_counter_ns()
            cache.append_one_each(ids, toks)
            cache.decode_tensors(ids)
            times.append(time.perf_counter_ns() - t0)
            live += len(ids)
            used = cache.num_blocks - cache.num_free_blocks
            utils.append(live / (used * BLOCK_SIZE))
            contiguous.append(live / (len(ids) * (MAX_PROMPT + DECODE_TOKENS)))
    finally:
        gc.enable()
    st = cache.stats()
    assert st.live_tokens == live and abs(st.utilization - utils[-1]) < 1e-12
    return {"times": times, "utils": utils, "contiguous": contiguous, "stats": st}


class ListBlockTables:
    """Baseline bookkeeping in the nano-vllm style: Python lists, tensors rebuilt every step."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.free: deque[int] = deque(range(num_blocks))
        self.ref = [0] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.tables: list[list[int]] = []
        self.tokens: list[list[int]] = []
        self.hashes: list[list[bytes]] = []

    def add(self, token_ids: list[int]) -> None:
        bs = self.bs
        table, hashes, parent = [], [], ROOT_HASH
        for i in range(_cdiv(len(token_ids), bs)):
            b = self.free.popleft()
            self.ref[b] = 1
            table.append(b)
            chunk = token_ids[i * bs : (i + 1) * bs]
            if len(chunk) == bs:
                parent = block_hash(parent, chunk)
                hashes.append(parent)
                self.hash_to_block[parent] = b
        self.tables.append(table)
        self.tokens.append(list(token_ids))
        self.hashes.append(hashes)

    def step(self, toks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bs = self.bs
        for i, t in enumerate(toks):  # append one token each: new block / hash a full block
            tokens = self.tokens[i]
            tokens.append(t)
            n = len(tokens)
            if n % bs == 1:
                b = self.free.popleft()
                self.ref[b] = 1
                self.tables[i].append(b)
            elif n % bs == 0:
                parent = self.hashes[i][-1] if self.hashes[i] else ROOT_HASH
                h = block_hash(parent, tokens[-bs:])
                self.hashes[i].append(h)
                self.hash_to_block[h] = self.tables[i][-1]
        slot_mapping, context_lens = [], []
        for table, tokens in zip(self.tables, self.tokens, strict=True):
            n = len(tokens)
            slot_mapping.append(table[-1] * bs + (n - 1) % bs)
            context_lens.append(n)
        width = max(len(t) for t in self.tables)
        padded = [t + [-1] * (width - len(t)) for t in self.tables]
        return (
            torch.tensor(slot_mapping, dtype=torch.int64),
            torch.tensor(padded, dtype=torch.int32),
            torch.tensor(context_lens, dtype=torch.int32),
        )


def run_baseline(prompts: list[list[int]], decoded: np.ndarray) -> list[int]:
    """Per-step times (ns) of the list-rebuild baseline on the same workload."""
    tables = ListBlockTables(_pool_size(prompts), BLOCK_SIZE)
    for p in prompts:
        tables.add(p)
    steps = [row.tolist() for row in decoded]
    times = []
    gc.collect()
    gc.disable()
    try:
        for toks in steps:
            t0 = time.perf_counter_ns()
            tables.step(toks)
            times.append(time.perf_counter_ns() - t0)
    finally:
        gc.enable()
    return times


def alloc_free_ops_per_s(num_blocks: int = 4096, pairs: int = 50_000) -> float:
    """Single-block allocate + free through the free queue; each counts as one op."""
    pool = BlockPool(num_blocks)
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        for _ in range(pairs):
            pool.free(pool.allocate(1))
        dt = time.perf_counter_ns() - t0
    finally:
        gc.enable()
    return 2 * pairs / (dt / 1e9)


def run_cache_bench(seed: int = 0, repeats: int = 5) -> dict:
    """Run the workload `repeats` times (paged and baseline interleaved); medians over repeats."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prompts, decoded = make_workload(seed)
        paged_us, base_us, ops = [], [], []
        first = None
        for _ in range(repeats):
            run = run_paged(prompts, decoded)
            first = first or run
            paged_us.append(statistics.median(run["times"]) / 1e3)
            base_us.append(statistics.median(run_baseline(prompts, decoded)) / 1e3)
            ops.append(alloc_free_ops_per_s())
    finally:
        torch.set_num_threads(threads)
    st = first["stats"]
    paged, base = statistics.median(paged_us), statistics.median(base_us)
    prompt_lens = [len(p) for p in prompts]
    return {
        "num_sequences": NUM_SEQS,
        "decode_tokens": DECODE_TOKENS,
        "block_size": BLOCK_SIZE,
        "prompt_len_median": float(np.median(prompt_lens)),
        "prompt_len_mean": float(np.mean(prompt_lens)),
        "prompt_len_max": int(max(prompt_lens)),
        "num_blocks": st.num_blocks,
        "utilization": round(first["utils"][-1], 4),
        "utilization_mean": round(statistics.fmean(first["utils"]), 4),
        "contiguous_utilization": round(first["contiguous"][-1], 4),
        "contiguous_utilization_mean": round(statistics.fmean(first["contiguous"]), 4),
        "internal_waste_tokens": st.internal_waste,
        "bookkeeping_us_per_step": round(paged, 1),
        "baseline_rebuild_us_per_step": round(base, 1),
        "speedup_vs_rebuild": round(base / paged, 2),
        "alloc_free_ops_per_s": round(statistics.median(ops)),
        "repeats": repeats,
        "seed": seed,
    }


def run(args) -> dict:
    return run_cache_bench(repeats=1 if args.quick else 5)
