"""Range operations on a sequence's cache (llama.cpp's seq_rm / seq_cp / seq_add): remove, copy
and shift. Mixed into PagedKVCache.

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

Token ids: a sequence that references its owner's list (`share_ids`, the engine) never has that
list edited here: the owner keeps its own view (the engine's context shift keeps every token and
records what the context dropped). Hashing stops at the first edited block, so the ids past it
are never read again.

Positions: a cached K was rotated (RoPE) at the position it was computed for. `remove` moves
data down without re-rotating it; `shift` re-rotates K of a range by `delta` through the
callback the model registers (`register_rotation`), so that `remove` + `shift` is llama.cpp's
context shift and leaves K exactly as RoPE at the new positions would have produced it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagedkv.cache.block_pool import Block
from pagedkv.errors import CacheConfigError, InvalidArgumentError, OutOfBlocksError, PositionError

if TYPE_CHECKING:
    from pagedkv.cache.manager import SeqId, SeqState

#: k [..., H, D] stored after RoPE at positions p -> the same keys rotated as if at p + delta.
RotateK = Callable[[torch.Tensor, int], torch.Tensor]


def _int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an int, got {value!r:.80}")
    return value


class SeqOpsMixin:
    """remove / copy / shift over the state of a PagedKVCache (see the module docstring)."""

    rotate_k: RotateK | None = None

    def register_rotation(self, fn: RotateK | None) -> None:
        """Set the model's K re-rotation (RoPE by an angle difference); None removes it."""
        if fn is not None and not callable(fn):
            raise InvalidArgumentError(f"a callable expected, got {fn!r:.80}")
        self.rotate_k = fn

    # --- remove -------------------------------------------------------------------------------

    def remove(self, seq_id: SeqId, start: int, end: int) -> None:
        """Drop positions [start, end) of `seq_id`; later positions move down by end - start.

        Blocks wholly inside the range go back to the pool; when the cut is not block-aligned
        the blocks after it are rewritten (K/V moved in storage) so the sequence stays dense.
        K is not re-rotated (see `shift`). Uncomputed positions stay uncomputed.
        """
        s, start, end = self._range(seq_id, start, end)
        if start == end:
            return
        if end == s.num_tokens:
            self.truncate(seq_id, start)  # nothing moves
            return
        plan = self._remove_plan(s, start, end)
        fresh = sum(1 for how, _ in plan if how == "fresh")
        if fresh > self.pool.num_free:
            raise OutOfBlocksError(fresh, self.pool.num_free, f"remove from {seq_id!r}")
        self._apply_remove(s, start, end, plan)

    def _remove_plan(self, s: SeqState, start: int, end: int) -> list[tuple[str, Block | None]]:
        """For each new block from start // bs on: ("keep", old block) when its data stays,
        ("reuse", old block) / ("fresh", None) when it must be rewritten."""
        bs, r = self.block_size, end - start
        new_n = s.num_tokens - r
        plan: list[tuple[str, Block | None]] = []
        for j in range(start // bs, -(-new_n // bs)):
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

    def _apply_remove(self, s: SeqState, start: int, end: int, plan: list) -> None:
        bs, r, first = self.block_size, end - start, start // self.block_size
        new_n = s.num_tokens - r
        fresh = iter(self.pool.allocate(sum(1 for how, _ in plan if how == "fresh")))
        new_blocks = [b if how != "fresh" else next(fresh) for how, b in plan]
        src: list[int] = []
        dst: list[int] = []
        for i, (how, b) in enumerate(plan):
            if how == "keep":
                continue
            if how == "reuse" and b.hash is not None:
                self.pool.drop_hash(b)  # rewritten below: its hash no longer names it
            j = first + i
            for p in range(max(start, j * bs), min((j + 1) * bs, new_n)):
                src.append(s.blocks[(p + r) // bs].block_id * bs + (p + r) % bs)
                dst.append(new_blocks[i].block_id * bs + p % bs)
            if j * bs < start and how == "fresh":  # the head of a shared block stays too
                old = s.blocks[j]
                for p in range(j * bs, start):
                    src.append(old.block_id * bs + p % bs)
                    dst.append(new_blocks[i].block_id * bs + p % bs)
        if self.storage is not None and src:
            self.storage.move_slots(src, dst)  # reads every source before writing
        kept = Counter(map(id, new_blocks))  # a table can list a block twice (aligned copy)
        dropped = []
        for b in s.blocks[first:]:
            if kept[id(b)]:
                kept[id(b)] -= 1
            else:
                dropped.append(b)
        self.pool.free(reversed(dropped))
        s.blocks[first:] = new_blocks
        self._tables[s.row, first:].zero_()
        self._write_row(s, first)
        if s.token_ids is not None and not s.shared_ids:  # an owner's list is the owner's
            del s.token_ids[start:end]
        s.num_tokens = new_n
        nc = s.num_computed
        s.num_computed = nc if nc <= start else max(start, nc - r)
        self._freeze_hashes(s, first)
        if new_n % bs and s.blocks[-1].ref_cnt == 1 and s.blocks[-1].hash is not None:
            self.pool.drop_hash(s.blocks[-1])  # partial now: the next append overwrites it

    # --- copy ---------------------------------------------------------------------------------

    def copy(self, src: SeqId, dst: SeqId, start: int, end: int) -> None:
        """Append src's positions [start, end) to `dst` (created if it does not exist).

        Block-aligned (start and dst's length multiples of block_size): src's blocks are shared
        (copy-on-write); otherwise the K/V are copied into dst's own blocks. K keeps the
        rotation of src's positions: `shift` dst afterwards if its positions differ.
        """
        s, start, end = self._range(src, start, end)
        if end > s.num_computed:
            raise PositionError(f"{src!r}: positions up to {end} are not computed yet")
        new = dst not in self.seqs
        if new:
            self._check_new(dst)
        else:
            d = self.seq(dst)
            if d is s:
                raise InvalidArgumentError("copy needs two different sequences")
            if (d.token_ids is None) != (s.token_ids is None):
                raise CacheConfigError("mixing known token ids and bare counts in one sequence")
            if d.shared_ids:
                raise CacheConfigError(f"{dst!r} reads its owner's ids; copy cannot extend them")
            if d.num_computed != d.num_tokens:
                raise PositionError(f"{dst!r} has uncomputed tokens; copy appends after them")
        if start == end and not new:
            return
        bs = self.block_size
        length = 0 if new else self.seq(dst).num_tokens
        aligned = start % bs == 0 and length % bs == 0
        if aligned:
            need = 0
        else:
            need = -(-(length + end - start) // bs) - (0 if new else len(self.seq(dst).blocks))
            need += int(not new and end > start and self._needs_cow(self.seq(dst)))
        if need > self.pool.num_free:
            raise OutOfBlocksError(need, self.pool.num_free, f"copy into {dst!r}")
        if new:
            self._copy_new(s, dst)
        d = self.seq(dst)
        if aligned:
            self._share_range(s, d, start, end)
        else:
            self._copy_range(s, d, start, end)
        if s.token_ids is not None:
            d.token_ids.extend(s.token_ids[start:end])  # type: ignore[union-attr]
        d.num_tokens += end - start
        d.num_computed = d.num_tokens
        if new and start == 0:  # a prefix of src: exactly what src computed for these tokens
            d.block_hashes = list(s.block_hashes[: d.num_tokens // bs])
            d.hash_limit = s.hash_limit
        else:
            self._freeze_hashes(d, length // bs)

    def _copy_new(self, s: SeqState, dst: SeqId) -> None:
        from pagedkv.cache.manager import SeqState

        t = SeqState(dst, self._take_row(), [], None if s.token_ids is None else [])
        t.extra_key = s.extra_key
        self.seqs[dst] = t

    def _share_range(self, s: SeqState, d: SeqState, start: int, end: int) -> None:
        bs = self.block_size
        shared = s.blocks[start // bs : -(-end // bs)]
        for b in shared:
            self.pool.touch(b)
        first = len(d.blocks)
        d.blocks.extend(shared)
        self._write_row(d, first)

    def _copy_range(self, s: SeqState, d: SeqState, start: int, end: int) -> None:
        bs, length = self.block_size, d.num_tokens
        if end > start and self._needs_cow(d):
            self._copy_on_write(d)
        elif end > start:
            self._drop_stale_tail_hash(d)
        grow = -(-(length + end - start) // bs) - len(d.blocks)
        if grow > 0:
            first = len(d.blocks)
            d.blocks.extend(self.pool.allocate(grow))
            self._write_row(d, first)
        if self.storage is not None and end > start:
            src = [s.blocks[p // bs].block_id * bs + p % bs for p in range(start, end)]
            q = range(length, length + end - start)
            self.storage.move_slots(src, [d.blocks[p // bs].block_id * bs + p % bs for p in q])

    # --- shift --------------------------------------------------------------------------------

    def shift(self, seq_id: SeqId, start: int, end: int, delta: int) -> None:
        """Positions [start, end) of `seq_id` now stand for positions + `delta`: their K is
        re-rotated by `delta` through the registered rotation (data does not move).

        Shared blocks in the range get private copies first. Needs computed K/V in the range
        and, with storage, a registered rotation (CacheConfigError otherwise).
        """
        s, start, end = self._range(seq_id, start, end)
        delta = _int(delta, "delta")
        if start == end or delta == 0:
            return
        if end > s.num_computed:
            raise PositionError(f"{seq_id!r}: positions up to {end} are not computed yet")
        if self.storage is not None and self.rotate_k is None:
            raise CacheConfigError("shift needs a K rotation: call register_rotation first")
        bs = self.block_size
        idx = range(start // bs, -(-end // bs))
        shared = [j for j in idx if s.blocks[j].ref_cnt > 1]
        if len(shared) > self.pool.num_free:
            raise OutOfBlocksError(len(shared), self.pool.num_free, f"shift of {seq_id!r}")
        if self.storage is not None:  # compute first: a failing callback changes nothing
            slots = torch.tensor([s.blocks[p // bs].block_id * bs + p % bs
                                  for p in range(start, end)], dtype=torch.int64)
            rotated = self.storage.rotated_keys(slots, self.rotate_k, delta)  # type: ignore[arg-type]
        for j in shared:
            self._private_copy(s, j)
        for j in idx:
            if s.blocks[j].hash is not None:
                self.pool.drop_hash(s.blocks[j])
        if self.storage is not None:
            slots = torch.tensor([s.blocks[p // bs].block_id * bs + p % bs
                                  for p in range(start, end)], dtype=torch.int64)
            self.storage.write_keys(slots, rotated)
        self._freeze_hashes(s, start // bs)

    def _private_copy(self, s: SeqState, j: int) -> None:
        """Replace s's shared block j by a private copy of it (copy-on-write for block j)."""
        old = s.blocks[j]
        new = self.pool.allocate(1)[0]
        if self.storage is not None:
            self.storage.copy_blocks([old.block_id], [new.block_id])
        self.pool.free([old])
        s.blocks[j] = new
        self._np[s.row, j] = new.block_id
        self.cow_copies += 1

    # --- helpers ------------------------------------------------------------------------------

    def _range(self, seq_id: SeqId, start: int, end: int) -> tuple[SeqState, int, int]:
        s = self.seq(seq_id)
        start, end = _int(start, "start"), _int(end, "end")
        n = s.num_tokens
        if not 0 <= start <= end <= n:
            raise PositionError(f"range {start}..{end} outside sequence {seq_id!r} of {n}")
        return s, start, end

    def _freeze_hashes(self, s: SeqState, first_block: int) -> None:
        """s's blocks from `first_block` on no longer equal a fresh prefill: never hash them."""
        del s.block_hashes[first_block:]
        s.hash_limit = first_block if s.hash_limit is None else min(s.hash_limit, first_block)
