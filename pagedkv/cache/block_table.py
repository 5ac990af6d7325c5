"""BlockTable: one KV cache group's per-sequence block tables over the shared BlockPool, and the
persistent int32 table buffer the attention kernels read (vLLM's `BlockTable`).

A `TableRow` is one sequence's table: the Blocks it lists, in position order, and its row in the
buffer. Invariants (checked by `check`):
- every listing holds one reference: a block listed by k tables (or k times by one, after an
  aligned copy) has ref_cnt k; the table takes and releases those references itself (`open`,
  `grow`, `share`, `cut`, `splice`, `close`), so ref counts change only here;
- buffer row `r.index` lists `r.blocks`' ids and zeros after them (`refresh` rewrites it after
  block ids change, e.g. defragmentation); rows of closed tables are zero and reused;
- a listed block's data is rewritten in place only when the table holds it alone:
  `copy_on_write` gives a table a private copy first (the one copy-on-write of the cache).

The buffer is [rows, max_blocks], grown by doubling (rows when sequences are added, width when a
table outgrows it) and updated in place, so a step's tensors are a few vectorized reads of it.

One BlockTable per KV cache group: a hybrid cache (layer groups with their own attention
pattern sharing one pool, vLLM v1's hybrid KV cache manager) holds one per group and gives each
sequence one TableRow per group; nothing here assumes a single group.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedkv.cache.block_pool import NULL_BLOCK, Block, BlockPool

CopyBlocks = Callable[[list[int], list[int]], None]  # (src ids, dst ids): copy block data


@dataclass(slots=True, eq=False)
class TableRow:
    """One sequence's block table. `blocks` is read only outside BlockTable."""

    index: int  # row of the buffer
    blocks: list[Block] = field(default_factory=list)  # edited in place, never rebound
    start: int = 0  # blocks before it are NULL_BLOCK (a window group's, back in the pool)


class BlockTable:
    def __init__(self, pool: BlockPool, block_size: int, max_blocks: int,
                 copy_blocks: CopyBlocks | None = None, rows: int = 16) -> None:
        self.pool = pool
        self.block_size = block_size
        self.copy_blocks = copy_blocks  # None: bookkeeping only (no storage)
        self.buf = torch.zeros((rows, max(1, max_blocks)), dtype=torch.int32)
        self.np = self.buf.numpy()  # same memory: scalar writes without torch overhead
        self._free_rows = list(range(rows - 1, -1, -1))
        self.cow_copies = 0

    # --- rows ---------------------------------------------------------------------------------

    def open(self, shared: Sequence[Block] = (), fresh: int = 0) -> TableRow:
        """A new table listing `shared` (prefix hits: one more reference each, revived if free)
        then `fresh` newly allocated blocks. The caller checked that they fit."""
        r = TableRow(self._take_row())
        while r.start < len(shared) and shared[r.start] is NULL_BLOCK:
            r.start += 1
        self.share(r, shared)
        self.grow(r, fresh)
        return r

    def close(self, r: TableRow) -> None:
        """Release every block (tail first: evicted first) and the row."""
        self.pool.free(reversed(r.blocks[r.start :]))
        r.blocks.clear()
        r.start = 0
        self.buf[r.index].zero_()
        self._free_rows.append(r.index)

    # --- growth and cuts ----------------------------------------------------------------------

    def grow(self, r: TableRow, n: int) -> None:
        """Append `n` freshly allocated blocks."""
        if n:
            first = len(r.blocks)
            r.blocks.extend(self.pool.allocate(n))
            self._write(r, first)

    def share(self, r: TableRow, blocks: Sequence[Block]) -> None:
        """Append blocks other tables (or cached free blocks) hold: one more reference each."""
        if blocks:
            for b in blocks:
                if b is not NULL_BLOCK:
                    self.pool.touch(b)
            first = len(r.blocks)
            r.blocks.extend(blocks)
            self._write(r, first)

    def cut(self, r: TableRow, keep: int) -> None:
        """Keep the first `keep` blocks; the others lose this table's reference, tail first."""
        self.pool.free(reversed(r.blocks[max(keep, r.start) :]))
        del r.blocks[keep:]
        r.start = min(r.start, keep)
        self.buf[r.index, keep:].zero_()

    def splice(self, r: TableRow, first: int, plan: Sequence[Block | None]) -> list[Block]:
        """Replace r's blocks from `first` on by `plan`: each entry one of r's blocks (kept, the
        table's reference carried over) or None (a freshly allocated block). Blocks of the old
        tail the plan no longer lists are freed, tail first. Returns the new tail."""
        fresh = iter(self.pool.allocate(sum(1 for b in plan if b is None)))
        new = [b if b is not None else next(fresh) for b in plan]
        kept = Counter(map(id, new))  # a table can list a block twice (aligned copy)
        dropped = []
        for b in r.blocks[first:]:
            if kept[id(b)]:
                kept[id(b)] -= 1
            else:
                dropped.append(b)
        self.pool.free(reversed(dropped))
        r.blocks[first:] = new
        self.buf[r.index, first:].zero_()
        self._write(r, first)
        return new

    def release_before(self, r: TableRow, first: int) -> None:
        """A window group no longer needs r's blocks before `first`: they lose this table's
        reference (most recent first, so the oldest is evicted first; hashed ones stay cached
        and can still be hit) and their entries become NULL_BLOCK (buffer entries 0)."""
        first = min(first, len(r.blocks))
        if first <= r.start:
            return
        self.pool.free(reversed(r.blocks[r.start : first]))
        for i in range(r.start, first):
            r.blocks[i] = NULL_BLOCK
        self.np[r.index, r.start : first] = 0
        r.start = first

    # --- writes into listed blocks ------------------------------------------------------------

    def shared(self, r: TableRow, j: int) -> bool:
        return r.blocks[j].ref_cnt > 1

    def copy_on_write(self, r: TableRow, j: int) -> None:
        """Replace r's block j, which others hold too, by a private copy of it."""
        old = r.blocks[j]
        new = self.pool.allocate(1)[0]
        if self.copy_blocks is not None:
            self.copy_blocks([old.block_id], [new.block_id])
        self.pool.free([old])
        r.blocks[j] = new
        self.np[r.index, j] = new.block_id
        self.cow_copies += 1

    def before_write(self, r: TableRow, j: int) -> None:
        """Block j is about to be written in place: a shared one is copied first; a private one
        forgets its hash (it names contents about to change; a block can still hold one after a
        truncate cut into it while it was shared and full, its other holders gone since)."""
        b = r.blocks[j]
        if b.ref_cnt > 1:
            self.copy_on_write(r, j)
        elif b.hash is not None:
            self.pool.drop_hash(b)

    def forget_hash(self, b: Block) -> None:
        """b's data is being rewritten (a sequence op on a block its table holds alone)."""
        if b.hash is not None:
            self.pool.drop_hash(b)

    # --- buffer -------------------------------------------------------------------------------

    def refresh(self, r: TableRow) -> None:
        """Rewrite r's buffer row from its blocks (after block ids changed)."""
        self._write(r, 0)

    def slots(self, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """int64 cache slots of positions `pos` of the tables at buffer rows `rows`."""
        bs = self.block_size
        return self.np[rows, pos // bs].astype(np.int64) * bs + pos % bs

    def tables(self, rows: np.ndarray, width: int) -> torch.Tensor:
        """int32 [len(rows), width] view of the buffer rows (padded with 0)."""
        return torch.from_numpy(self.np[rows, :width])

    def check(self, rows: Sequence[TableRow], refs: list[int] | None = None) -> None:
        """Assert the invariants over the live tables `rows` (ref counts included). `refs`
        given (several groups over one pool): add this table's references to it and leave the
        ref-count comparison to the caller."""
        alone = refs is None
        refs = [0] * self.pool.num_blocks if refs is None else refs
        seen = set()
        for r in rows:
            assert r.index not in seen, f"row {r.index} shared"
            seen.add(r.index)
            assert 0 <= r.start <= len(r.blocks), f"row {r.index}: start"
            assert all(b is NULL_BLOCK for b in r.blocks[: r.start]), f"row {r.index}: head"
            want = [max(b.block_id, 0) for b in r.blocks]
            assert self.buf[r.index, : len(r.blocks)].tolist() == want, (
                f"row {r.index}: stale table row")
            assert not self.buf[r.index, len(r.blocks):].any(), f"row {r.index}: stale tail"
            for b in r.blocks[r.start :]:
                assert b is not NULL_BLOCK, f"row {r.index}: a NULL block after start"
                assert self.pool.blocks[b.block_id] is b
                refs[b.block_id] += 1
        assert not set(self._free_rows) & seen, "a live row is on the free list"
        if alone:
            self.pool.check_refs(refs)

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.buf.shape[0]
            self._resize(2 * old, self.buf.shape[1])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def _write(self, r: TableRow, first: int) -> None:
        """Write r.blocks[first:] into its row, growing the buffer's width if needed."""
        n = len(r.blocks)
        if n > self.buf.shape[1]:
            self._resize(self.buf.shape[0], max(n, 2 * self.buf.shape[1]))
        row = self.np[r.index]
        for i in range(first, n):
            row[i] = max(r.blocks[i].block_id, 0)  # NULL_BLOCK (-1): 0, never read

    def _resize(self, rows: int, cols: int) -> None:
        grown = torch.zeros((rows, cols), dtype=torch.int32)
        grown[: self.buf.shape[0], : self.buf.shape[1]] = self.buf
        self.buf, self.np = grown, grown.numpy()
