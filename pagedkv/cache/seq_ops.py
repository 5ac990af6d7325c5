"""Range operations on a sequence's cache (llama.cpp's seq_rm / seq_cp / seq_add): remove, copy
and shift, as functions of a PagedKVCache (its methods `remove` / `copy` / `shift` call them) that
use only its public interface: `seq`, `create`, `truncate`, `storage`, `rotate_k` and its
`BlockTable` (`table`), through which every block is taken, shared, copied on write or released.

Invariants kept by every operation:
- All-or-nothing: arguments and free blocks are checked before anything changes; a failed call
  (OutOfBlocksError, PositionError, ...) leaves the whole state as it was.
- A sequence stays dense: position i of the sequence is slot i of its block table.
- A block is only rewritten in storage when this sequence holds it alone; a shared block is
  replaced by a fresh private one first (copy-on-write), so no other holder sees the change.
- Nothing stale is served: a rewritten block's prefix hash is dropped, and a sequence whose
  contents no longer equal what a fresh prefill of its tokens would compute (anything after an
  edit) stops hashing at the first edited block (`SeqState.hash_limit`). Blocks whose data did
  not change keep their hash: it still names exactly what they hold.

Token ids: the sequence's HashChain gets the same edit as its context (`remove` deletes the
range from it, `copy` extends dst's), so it always holds the context the cache holds; hashing
stops at the first edited block, so the chain's hashes past it are never registered.

Positions: a cached K was rotated (RoPE) at the position it was computed for. `remove` moves
data down without re-rotating it; `shift` re-rotates K of a range by `delta` through the
callback the model registers (`register_rotation`), so that `remove` + `shift` is llama.cpp's
context shift and leaves K exactly as RoPE at the new positions would have produced it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagedkv.errors import CacheConfigError, InvalidArgumentError, OutOfBlocksError, PositionError

if TYPE_CHECKING:
    from pagedkv.cache.block_pool import Block
    from pagedkv.cache.manager import PagedKVCache, SeqId, SeqState

#: k [..., H, D] stored after RoPE at positions p -> the same keys rotated as if at p + delta.
RotateK = Callable[[torch.Tensor, int], torch.Tensor]


def _int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an int, got {value!r:.80}")
    return value


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- remove -----------------------------------------------------------------------------------


def remove(cache: PagedKVCache, seq_id: SeqId, start: int, end: int) -> None:
    """Drop positions [start, end) of `seq_id`; later positions move down by end - start.

    Blocks wholly inside the range go back to the pool; when the cut is not block-aligned
    the blocks after it are rewritten (K/V moved in storage) so the sequence stays dense.
    K is not re-rotated (see `shift`). Uncomputed positions stay uncomputed.
    """
    s, start, end = _range(cache, seq_id, start, end)
    if start == end:
        return
    if end == s.num_tokens:
        cache.truncate(seq_id, start)  # nothing moves
        return
    plan = _remove_plan(s, start, end, cache.block_size)
    fresh = sum(1 for how, _ in plan if how == "fresh")
    if fresh > cache.num_free_blocks:
        raise OutOfBlocksError(fresh, cache.num_free_blocks, f"remove from {seq_id!r}")
    _apply_remove(cache, s, start, end, plan)


def _remove_plan(s: SeqState, start: int, end: int, bs: int) -> list[tuple[str, Block | None]]:
    """For each new block from start // bs on: ("keep", old block) when its data stays,
    ("reuse", old block) / ("fresh", None) when it must be rewritten."""
    r = end - start
    new_n = s.num_tokens - r
    plan: list[tuple[str, Block | None]] = []
    for j in range(start // bs, _cdiv(new_n, bs)):
        lo = j * bs
        if min(lo + bs, new_n) <= start:  # nothing moves into it
            plan.append(("keep", s.blocks[j]))
        elif r % bs == 0 and lo >= start:  # a whole old block lands aligned
            plan.append(("keep", s.blocks[j + r // bs]))
        elif s.blocks[j].ref_cnt == 1:
            plan.append(("reuse", s.blocks[j]))
        else:
            plan.append(("fresh", None))
    return plan


def _apply_remove(cache: PagedKVCache, s: SeqState, start: int, end: int, plan: list) -> None:
    bs, r, first = cache.block_size, end - start, start // cache.block_size
    new_n = s.num_tokens - r
    table = cache.table
    for how, b in plan:
        if how == "reuse":
            table.forget_hash(b)  # rewritten below: its hash no longer names it
    old = list(s.blocks)
    new = table.splice(s.table, first, [b for _, b in plan])
    src: list[int] = []
    dst: list[int] = []
    for i, (how, _) in enumerate(plan):
        if how == "keep":
            continue
        j = first + i
        for p in range(max(start, j * bs), min((j + 1) * bs, new_n)):
            src.append(old[(p + r) // bs].block_id * bs + (p + r) % bs)
            dst.append(new[i].block_id * bs + p % bs)
        if j * bs < start and how == "fresh":  # the head of a shared block stays too
            for p in range(j * bs, start):
                src.append(old[j].block_id * bs + p % bs)
                dst.append(new[i].block_id * bs + p % bs)
    if cache.storage is not None and src:
        cache.storage.move_slots(src, dst)  # reads every source before writing
    if s.chain is not None:
        s.chain.delete(start, end)
    s.num_tokens = new_n
    nc = s.num_written
    s.num_written = nc if nc <= start else max(start, nc - r)
    s.freeze(first)
    if new_n % bs and s.blocks[-1].ref_cnt == 1:
        table.forget_hash(s.blocks[-1])  # partial now: the next append overwrites it


# --- copy -------------------------------------------------------------------------------------


def copy(cache: PagedKVCache, src: SeqId, dst: SeqId, start: int, end: int) -> None:
    """Append src's positions [start, end) to `dst` (created if it does not exist).

    Block-aligned (start and dst's length multiples of block_size): src's blocks are shared
    (copy-on-write); otherwise the K/V are copied into dst's own blocks. K keeps the
    rotation of src's positions: `shift` dst afterwards if its positions differ.
    """
    s, start, end = _range(cache, src, start, end)
    if end > s.num_written:
        raise PositionError(f"{src!r}: positions up to {end} are not computed yet")
    new = dst not in cache
    if new:
        cache.check_new_id(dst)
    else:
        _check_copy_dst(cache.seq(dst), s)
    if start == end and not new:
        return
    bs = cache.block_size
    d = None if new else cache.seq(dst)
    length = 0 if d is None else d.num_tokens
    aligned = start % bs == 0 and length % bs == 0
    need = 0
    if not aligned:
        need = _cdiv(length + end - start, bs) - (0 if d is None else len(d.blocks))
        need += int(d is not None and end > start and cache.needs_cow(d))
    if need > cache.num_free_blocks:
        raise OutOfBlocksError(need, cache.num_free_blocks, f"copy into {dst!r}")
    if d is None:
        cache.create(dst, [] if s.chain is not None else 0, extra_key=s.extra_key)
        d = cache.seq(dst)
    if aligned:
        cache.table.share(d.table, s.blocks[start // bs : _cdiv(end, bs)])
    else:
        _copy_range(cache, s, d, start, end)
    if s.chain is not None and d.chain is not None:
        d.chain.extend(s.chain.ids[start:end])
    d.num_tokens += end - start
    d.num_written = d.num_tokens
    if new and start == 0:  # a prefix of src: exactly what src computed for these tokens
        d.num_hashed = min(s.num_hashed, d.num_tokens // bs)
        d.hash_limit = s.hash_limit
    else:
        d.freeze(length // bs)


def _check_copy_dst(d: SeqState, s: SeqState) -> None:
    if d is s:
        raise InvalidArgumentError("copy needs two different sequences")
    if (d.chain is None) != (s.chain is None):
        raise CacheConfigError("mixing known token ids and bare counts in one sequence")
    if d.chain is not None and len(d.chain) != d.num_tokens:
        raise CacheConfigError(f"{d.seq_id!r}: its owner appended ids ahead; copy cannot extend")
    if d.num_written != d.num_tokens:
        raise PositionError(f"{d.seq_id!r} has uncomputed tokens; copy appends after them")


def _copy_range(cache: PagedKVCache, s: SeqState, d: SeqState, start: int, end: int) -> None:
    bs, length, table = cache.block_size, d.num_tokens, cache.table
    if end > start and length % bs:
        table.before_write(d.table, len(d.blocks) - 1)
    table.grow(d.table, max(0, _cdiv(length + end - start, bs) - len(d.blocks)))
    if cache.storage is not None and end > start:
        src = [s.blocks[p // bs].block_id * bs + p % bs for p in range(start, end)]
        q = range(length, length + end - start)
        cache.storage.move_slots(src, [d.blocks[p // bs].block_id * bs + p % bs for p in q])


# --- shift ------------------------------------------------------------------------------------


def shift(cache: PagedKVCache, seq_id: SeqId, start: int, end: int, delta: int) -> None:
    """Positions [start, end) of `seq_id` now stand for positions + `delta`: their K is
    re-rotated by `delta` through the registered rotation (data does not move).

    Shared blocks in the range get private copies first. Needs computed K/V in the range
    and, with storage, a registered rotation (CacheConfigError otherwise).
    """
    s, start, end = _range(cache, seq_id, start, end)
    delta = _int(delta, "delta")
    if start == end or delta == 0:
        return
    if end > s.num_written:
        raise PositionError(f"{seq_id!r}: positions up to {end} are not computed yet")
    storage, rotate = cache.storage, cache.rotate_k
    if storage is not None and rotate is None:
        raise CacheConfigError("shift needs a K rotation: call register_rotation first")
    bs, table = cache.block_size, cache.table
    idx = range(start // bs, _cdiv(end, bs))
    shared = [j for j in idx if table.shared(s.table, j)]
    if len(shared) > cache.num_free_blocks:
        raise OutOfBlocksError(len(shared), cache.num_free_blocks, f"shift of {seq_id!r}")
    rotated = None
    if storage is not None and rotate is not None:  # compute first: a failing callback changes nothing
        rotated = storage.rotated_keys(_slots(s, start, end, bs), rotate, delta)
    for j in shared:
        table.copy_on_write(s.table, j)
    for j in idx:
        table.forget_hash(s.blocks[j])
    if storage is not None and rotated is not None:
        storage.write_keys(_slots(s, start, end, bs), rotated)
    s.freeze(start // bs)


def _slots(s: SeqState, start: int, end: int, bs: int) -> torch.Tensor:
    return torch.tensor([s.blocks[p // bs].block_id * bs + p % bs for p in range(start, end)],
                        dtype=torch.int64)


# --- helpers ----------------------------------------------------------------------------------


def _range(cache: PagedKVCache, seq_id: SeqId, start: int, end: int) -> tuple[SeqState, int, int]:
    s = cache.seq(seq_id)
    start, end = _int(start, "start"), _int(end, "end")
    n = s.num_tokens
    if not 0 <= start <= end <= n:
        raise PositionError(f"range {start}..{end} outside sequence {seq_id!r} of {n}")
    return s, start, end
