"""`pagedkv demo`: what the paged KV cache buys, shown on a simulated workload.

`run_cache_demo()` returns a short report: sequences of realistic lengths in the paged cache vs
max-length contiguous buffers (utilization, memory, fragmentation and compaction), a fork with
copy-on-write on real K/V tensors, and a prefix-cache hit on a shared system prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from pagedkv.cache import KVStorage, PagedKVCache, bytes_per_block

# Called at the demo's key moments with (name, cache): `--plot` draws the block map there.
Moment = Callable[[str, PagedKVCache], None]

# An 8B-class model shape (32 layers, 8 KV heads of 128, fp16) and its max context.
LAYERS, KV_HEADS, HEAD_DIM, DTYPE, MAX_CONTEXT = 32, 8, 128, "float16", 4096
BLOCK_SIZE = 16
VOCAB = 49152


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _lengths(rng: np.random.Generator, n: int) -> list[int]:
    """Prompt + generated lengths: lognormal, median ~300 tokens, capped at the max context."""
    lens = np.exp(rng.normal(np.log(300), 0.9, n)).astype(np.int64)
    return np.clip(lens, 8, MAX_CONTEXT).tolist()


def paged_vs_contiguous(num_seqs: int = 64, seed: int = 0, moment: Moment | None = None,
                        num_blocks: int | None = None) -> list[str]:
    """Memory and utilization of `num_seqs` live sequences, forks, churn and compaction.

    `num_blocks`: the pool (default: the contiguous cache's memory, paged); `moment(name,
    cache)` is called after admission, forks, churn and defragmentation.
    """
    moment = moment or (lambda name, cache: None)
    rng = np.random.default_rng(seed)
    per_block = bytes_per_block(LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, DTYPE)
    per_token = per_block // BLOCK_SIZE
    num_blocks = num_blocks or num_seqs * MAX_CONTEXT // BLOCK_SIZE
    cache = PagedKVCache(num_blocks, BLOCK_SIZE, bytes_per_block=per_block)
    tokens = np.random.default_rng(seed + 1)  # random prompts: no prefix hits among them

    def ids(n: int) -> list[int]:
        return tokens.integers(0, VOCAB, n).tolist()

    lens = _lengths(rng, num_seqs)
    for i, n in enumerate(lens):
        cache.create(i, ids(n))
    st = cache.stats()
    live = sum(lens)
    contiguous = num_seqs * MAX_CONTEXT * per_token
    fit = num_blocks // max(1, -(-int(np.median(lens)) // BLOCK_SIZE))
    out = [
        f"1. {num_seqs} sequences, lengths median {int(np.median(lens))}, max {max(lens)} tokens "
        f"(model: {LAYERS} layers, {KV_HEADS}x{HEAD_DIM} KV heads, {DTYPE}; "
        f"max context {MAX_CONTEXT})",
        f"   contiguous (one max-length buffer each): {_gib(contiguous)}, "
        f"utilization {live / (num_seqs * MAX_CONTEXT):.1%}",
        f"   paged (blocks of {BLOCK_SIZE}):               {_gib(st.memory_used_bytes)}, "
        f"utilization {st.utilization:.1%} ({st.used_blocks} blocks, "
        f"{st.internal_waste} slots of internal waste)",
        f"   -> {contiguous / st.memory_used_bytes:.1f}x less memory; the same memory holds about "
        f"{fit} median-length sequences instead of {num_seqs}",
    ]
    moment("after admission", cache)
    out += _forks(cache, rng)
    moment("after forks", cache)
    # churn: half the sequences finish (their full blocks stay cached), shorter ones arrive ->
    # holes; then compact
    live = list(cache.seqs)
    for i in rng.permutation(len(live))[: len(live) // 2].tolist():
        cache.free(live[i])
    for j, n in enumerate(_lengths(rng, num_seqs // 4)):
        cache.create(num_seqs + j, ids(n // 2))
    moment("after churn", cache)
    st = cache.stats()
    out.append(
        f"   after churn: {st.used_blocks} used blocks, {st.holes} free holes below the highest "
        f"used id, largest free run {st.largest_free_run}; defragment worth it: "
        f"{cache.should_defragment()}"
    )
    moved = cache.defragment()
    moment("after defragmentation", cache)
    st = cache.stats()
    out.append(
        f"   defragment moved {moved} blocks: {st.holes} holes, largest free run "
        f"{st.largest_free_run} = all {st.free_blocks} free blocks"
    )
    cache.check_invariants()
    return out


def _forks(cache: PagedKVCache, rng: np.random.Generator, n: int = 8, samples: int = 4
           ) -> list[str]:
    """n sequences each sample `samples` answers (parallel sampling): the prompt is shared."""
    before = cache.stats()
    parents = rng.choice(len(cache.seqs), n, replace=False).tolist()
    shared = sum(len(cache.block_ids(p)) for p in parents) * (samples - 1)
    for p in parents:
        for k in range(1, samples):
            cache.fork(p, (p, k))
            cache.append((p, k), [k])  # the sample's first token: copies a partial last block
        cache.append(p, [0])
    st = cache.stats()
    return [
        f"   forks: {n} sequences sample {samples} answers each; {shared} prompt blocks shared "
        f"instead of copied, {st.used_blocks - before.used_blocks} new blocks "
        f"({st.cow_copies - before.cow_copies} copy-on-write copies of partial last blocks)"
    ]


def utilization_over_time(steps: int = 600, max_live: int = 48, seed: int = 0
                          ) -> dict[str, list[float]]:
    """Requests arrive, decode one token per step and finish: utilization of the reserved KV
    memory at every step, paged (blocks) vs contiguous (one max-length buffer per sequence)."""
    rng = np.random.default_rng(seed)
    per_block = bytes_per_block(LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, DTYPE)
    cache = PagedKVCache(max_live * MAX_CONTEXT // BLOCK_SIZE, BLOCK_SIZE,
                         enable_prefix_caching=False)
    left: dict[int, int] = {}  # live sequence -> tokens still to generate
    live_tokens, next_id = 0, 0
    out: dict[str, list[float]] = {k: [] for k in (
        "step", "paged_util", "contiguous_util", "paged_gib", "contiguous_gib")}
    for step in range(steps):
        for _ in range(rng.poisson(0.25)):
            if len(left) < max_live:
                prompt = _lengths(rng, 1)[0] // 2
                cache.create(next_id, prompt)
                left[next_id] = max(1, min(_lengths(rng, 1)[0] // 2, MAX_CONTEXT - prompt))
                live_tokens += prompt
                next_id += 1
        for sid in list(left):
            cache.append(sid, 1)
            live_tokens += 1
            left[sid] -= 1
            if left[sid] == 0:
                live_tokens -= cache.num_tokens(sid)
                cache.free(sid)
                del left[sid]
        used = cache.num_blocks - cache.num_free_blocks
        reserved = len(left) * MAX_CONTEXT
        out["step"].append(step)
        out["paged_util"].append(live_tokens / (used * BLOCK_SIZE) if used else float("nan"))
        out["contiguous_util"].append(live_tokens / reserved if reserved else float("nan"))
        out["paged_gib"].append(used * per_block / 2**30)
        out["contiguous_gib"].append(reserved * per_block / BLOCK_SIZE / 2**30)
    return out


def write_plots(out_dir: str | Path, num_blocks: int = 3072) -> list[Path]:
    """The block map at the demo's key moments and utilization over time, as PNGs.

    The map's pool is sized to the workload (`num_blocks`, as a server sizes it from its memory
    budget) rather than to the contiguous cache's memory, which would be mostly empty cells.
    """
    from pagedkv.cache.block_map import block_map
    from pagedkv.plot import render_block_map, render_utilization

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    def draw(name: str, cache: PagedKVCache) -> None:
        path = out_dir / f"blockmap_{len(paths) + 1}_{name.split()[-1]}.png"
        render_block_map(block_map(cache), path, f"KV block map {name}")
        paths.append(path)

    paged_vs_contiguous(moment=draw, num_blocks=num_blocks)
    path = out_dir / "utilization.png"
    render_utilization(utilization_over_time(), path)
    return [*paths, path]


def fork_and_copy_on_write() -> list[str]:
    """A parent and a forked child share blocks until the child writes into a shared one."""
    bs = 4
    storage = KVStorage(2, 8, bs, 1, 1, torch.float32)
    cache = PagedKVCache(8, bs, storage=storage)
    cache.create("parent", [11, 12, 13, 14, 15, 16])

    def write(seq: str, values: list[float]) -> None:
        slots = cache.slot_mapping([seq], len(values))
        kv = torch.tensor(values).view(-1, 1, 1)
        for layer in range(storage.num_layers):
            storage.write(layer, slots, kv, -kv)

    def reads(seq: str) -> list[float]:
        return [storage.read(1, cache.slot(seq, p))[0].item() for p in range(cache.num_tokens(seq))]

    def refs(seq: str) -> list[int]:
        return cache.block_states()[0][cache.block_ids(seq)].tolist()

    write("parent", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    cache.fork("parent", "child")
    out = [
        "2. Fork + copy-on-write (block size 4)",
        f"   fork: parent blocks {cache.block_ids('parent')}, child blocks "
        f"{cache.block_ids('child')}, ref counts {refs('child')}",
    ]
    cache.append("child", [17])  # first write into the shared, partly filled block: copy it
    write("child", [70.0])
    cache.append("parent", [18])
    write("parent", [7.0])
    out += [
        f"   child appends a token: it gets a private copy of block {cache.block_ids('parent')[-1]} "
        f"-> block {cache.block_ids('child')[-1]} (cow copies: {cache.cow_copies}); "
        f"ref counts now parent {refs('parent')}, child {refs('child')}",
        f"   parent reads {reads('parent')}",
        f"   child  reads {reads('child')}  (each sees only its own later writes)",
    ]
    cache.check_invariants()
    return out


def prefix_cache_hit() -> list[str]:
    """Requests that share a system prompt reuse its cached blocks."""
    bs = BLOCK_SIZE
    cache = PagedKVCache(64, bs)
    system = list(range(1000, 1000 + 100))  # a 100-token system prompt
    hit1 = cache.create("req-1", system + [1, 2, 3, 4, 5])
    cache.free("req-1")  # finished: its full blocks stay cached, and its partial last one
    hit2 = cache.create("req-2", system + [9, 8, 7])
    hit3 = cache.create("req-3", system + [9, 8, 7], extra_key="tenant-b")
    st = cache.stats()
    cache.check_invariants()
    return [
        f"3. Prefix caching (block size {bs}, chained sha256 block hashes)",
        f"   req-1 (105-token prompt): {hit1} tokens from the cache, then finishes",
        f"   req-2, same 100-token system prompt: {hit2} tokens reused "
        f"({hit2 // bs} blocks + {hit2 % bs} tokens copied from req-1's last block), "
        f"only {103 - hit2} computed",
        f"   req-3, same prompt but another tenant's salt: {hit3} tokens reused",
        f"   hit rate {st.prefix_hits}/{st.prefix_queries} tokens = {st.prefix_hit_rate:.1%}",
    ]


def run_cache_demo() -> str:
    """The whole report, as text."""
    lines = ["pagedkv cache demo", ""]
    lines += paged_vs_contiguous()
    lines.append("")
    lines += fork_and_copy_on_write()
    lines.append("")
    lines += prefix_cache_hit()
    return "\n".join(lines)


if __name__ == "__main__":
    print(run_cache_demo())


DEMO_PROMPTS = [
    "What is a KV cache, in one sentence?",
    "Write a haiku about memory pages.",
    "Give three tips for writing readable Python.",
    "What is the capital of Italy?",
]


def run_demo(model: str | None = None, max_tokens: int = 48, plot: str | None = None) -> None:
    """`make demo`: the cache report, then the model answering a few prompts in one batch.
    `plot`: a directory for the block-map and utilization PNGs."""
    import time

    from pagedkv.engine import LLM, SamplingParams

    print(run_cache_demo(), flush=True)
    if plot:
        for path in write_plots(plot):
            print(f"wrote {path}", flush=True)
    print("\n== SmolLM2-135M-Instruct over the paged cache ==", flush=True)
    t0 = time.perf_counter()
    llm = LLM(model, kv_cache_memory="256MiB")
    print(f"loaded {llm.engine.model_name} in {time.perf_counter() - t0:.1f} s; "
          f"{llm.engine.cache.num_blocks} blocks of {llm.engine.cache.block_size} tokens")
    chats = [[{"role": "user", "content": p}] for p in DEMO_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate(chats[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(chats, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    for p, o in zip(DEMO_PROMPTS, outs, strict=True):
        print(f"\n> {p}\n{o.text.strip()}")
    n = sum(len(o.token_ids) for o in outs)
    st = llm.engine.stats()
    print(f"\n{len(outs)} requests, {n} tokens in {dt:.2f} s: {n / dt:.1f} tok/s "
          f"(batched); prefix hit rate {st.prefix_hit_rate:.0%}, blocks in use {st.blocks_used}")
