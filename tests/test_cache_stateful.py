"""Stateful property test: random cache operations against a shadow model, with real K/V data.

The shadow holds, for each live sequence, its token ids, its extra key and the value it wrote at
each position. Values are a deterministic function of (extra key, token prefix), so a prefix hit
(which the cache grants only when the whole prefix matches, a partial last block included) must
read back exactly what the original writer wrote. After every step: `check_invariants()` holds, and every live sequence
reads back its own K/V at every position, through `slot()` + `storage.read()` and through
`storage.gather()`; a failed operation leaves the whole state (pool, tables, hashes, free queue,
storage) exactly as before.

Sequence operations (remove / copy / shift) edit a sequence: from the first edited block on its
values no longer follow from its tokens, so the shadow tracks them explicitly (`written`, and
`kshift`: the deltas each position's K was re-rotated by, in order, with K + delta as the
"rotation"), and the first edited block (`frozen`), from which the cache must never hash that
sequence again.

The machine is written for any storage dtype: `kv` (what is written for given values) and
`stored` (what the storage reads back for written data: the identity here) are the hooks that
tests/test_kv_quant_stateful.py overrides for int8 and fp8 storage.
"""

from __future__ import annotations

import torch
from cache_snapshot import brute_partial, same_state, snapshot
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.cache import KVStorage, PagedKVCache
from pagedkv.cache.hashing import HashChain, chain_hashes
from pagedkv.errors import OutOfBlocksError

LAYERS, HEADS, DIM = 2, 1, 2
VOCAB = 4  # tiny, so prompts share prefixes often
MAX_LIVE = 8
SEEDS = {None: 17, "tenant-a": 91}
MASK = (1 << 20) - 1

# K of (layer l, element d) at a position with value h: h + 0.5*l + 0.25*d; V = -K (exact in fp32)
_OFFSETS = (0.5 * torch.arange(LAYERS).view(LAYERS, 1, 1)
            + 0.25 * torch.arange(DIM).view(1, 1, DIM)).expand(LAYERS, HEADS, DIM)


def prefix_values(tokens: list[int], extra: object, start: int = 0) -> list[int]:
    """Value of each position in [start, len): a rolling function of the salted token prefix."""
    h = SEEDS[extra]
    out = []
    for p, t in enumerate(tokens):
        h = ((h * 1_000_003) ^ (t + 1)) & MASK
        if p >= start:
            out.append(h + 1)  # never 0: unwritten storage reads 0
    return out


def kv_of(values: list[int]) -> torch.Tensor:
    """[T, L, H, D] keys for the given values."""
    base = torch.tensor(values, dtype=torch.float32).view(-1, 1, 1, 1)
    return base + _OFFSETS


class CacheMachine(RuleBasedStateMachine):
    dtype = torch.float32
    layers, heads, dim = LAYERS, HEADS, DIM

    def __init__(self) -> None:
        super().__init__()
        self.cache: PagedKVCache | None = None
        self.tokens: dict[int, list[int]] = {}
        self.extra: dict[int, object] = {}
        self.written: dict[int, list[int]] = {}  # what each live sequence wrote, per position
        self.kshift: dict[int, list[tuple[int, ...]]] = {}  # per position: its K's shifts
        self.frozen: dict[int, int | None] = {}  # first edited block (never hashed from there)
        self.history: list[tuple[list[int], object]] = []  # prompts seen (live or freed)
        self.block_content: dict[bytes, list[int]] = {}  # chained hash -> its block's values
        self.next_id = 0

    # --- data hooks (a quantized storage overrides them) ---------------------------------------

    def kv(self, values: list[int]) -> torch.Tensor:
        """[T, L, H, D] float32 keys written for these values (V is -K)."""
        return kv_of(values)

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """What the storage reads back for written rows x [..., D] (float32: x itself)."""
        return x

    def expected_kv(self, values: list[int], shifts: list[tuple[int, ...]]) -> tuple:
        """K and V [T, L, H, D] a sequence must read back: written once, then each position's K
        re-rotated (here: + delta) by each of its shifts in order, stored again each time."""
        x = self.kv(values)
        k, v = self.stored(x), self.stored(-x)
        for p, deltas in enumerate(shifts):
            for d in deltas:
                k[p] = self.stored(k[p] + d)
        return k, v

    def expected_hit(self, prompt: list[int], extra: object) -> int:
        """Prompt tokens a new sequence gets from the cache."""
        return self.cache.lookup(prompt, extra)

    # --- helpers ------------------------------------------------------------------------------

    def _live(self) -> list[int]:
        return sorted(self.tokens)

    def _pick(self, idx: int) -> int:
        live = self._live()
        return live[idx % len(live)]

    def _write(self, sid: int, start: int, slots: torch.Tensor) -> None:
        """Write positions [start, len) of `sid` at `slots` in every layer, record the values."""
        vals = prefix_values(self.tokens[sid], self.extra[sid], start)
        assert slots.tolist() == [self.cache.slot(sid, p) for p in range(start, len(self.tokens[sid]))]
        self._store(slots, vals)
        del self.written[sid][start:]
        self.written[sid].extend(vals)
        del self.kshift[sid][start:]
        self.kshift[sid].extend([()] * len(vals))
        self._remember_blocks(sid)

    def _remember_blocks(self, sid: int) -> None:
        """Record what each full block of `sid` must hold, under its chained hash."""
        bs, tokens = self.cache.block_size, self.tokens[sid]
        stop = self.frozen[sid]
        for i, h in enumerate(chain_hashes(tokens, bs, self.extra[sid], max_blocks=stop)):
            self.block_content[h] = self.written[sid][i * bs : (i + 1) * bs]

    def _remember_partial(self, sid: int) -> None:
        """What freeing sid may keep (unless edited): its last block's written part, under
        its partial key."""
        bs = self.cache.block_size
        i, w = divmod(self.cache.seq(sid).num_written, bs)
        key = HashChain(bs, self.tokens[sid], self.extra[sid]).partial_key(i, w)
        self.block_content[key] = self.written[sid][i * bs : i * bs + w]

    def _store(self, slots: torch.Tensor, vals: list[int]) -> None:
        if not vals:
            return
        k = self.kv(vals)
        for layer in range(self.layers):
            self.storage.write(layer, slots, k[:, layer].contiguous(), (-k[:, layer]).contiguous())

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _try(self, fn):
        """Run fn; on OutOfBlocksError check that nothing changed and return the error."""
        before = snapshot(self.cache)
        try:
            fn()
        except OutOfBlocksError as e:
            assert e.needed > e.available >= 0
            assert same_state(before, snapshot(self.cache)), "a failed operation changed state"
            return e
        return None

    # --- setup --------------------------------------------------------------------------------

    @initialize(
        num_blocks=st.integers(2, 14),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.storage = KVStorage(self.layers, num_blocks, block_size, self.heads, self.dim,
                                 self.dtype)
        self.cache = PagedKVCache(num_blocks, block_size, storage=self.storage,
                                  enable_prefix_caching=caching)
        self.cache.register_rotation(lambda k, delta: k + delta)

    # --- rules --------------------------------------------------------------------------------

    def _create(self, prompt: list[int], extra: object) -> None:
        sid = self._new_id()
        expected_hit = self.expected_hit(prompt, extra)
        assert expected_hit <= max(0, len(prompt) - 1)
        bs = self.cache.block_size  # the partial part, by brute force over the index
        assert expected_hit % bs == brute_partial(self.cache, prompt, extra, expected_hit // bs)
        if not self.cache.enable_prefix_caching:
            assert expected_hit == 0
        out: list[int] = []
        if self._try(lambda: out.append(self.cache.create(sid, prompt, extra_key=extra))):
            return
        (cached,) = out
        assert cached == expected_hit
        self.tokens[sid], self.extra[sid] = list(prompt), extra
        self.written[sid] = prefix_values(prompt, extra)[:cached]  # served by the cache
        self.kshift[sid], self.frozen[sid] = [()] * cached, None
        self.history.append((list(prompt), extra))
        self._write(sid, cached, self.cache.slot_mapping([sid], len(prompt) - cached))

    @precondition(lambda self: len(self.tokens) < MAX_LIVE)
    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), max_size=20),
          extra=st.sampled_from([None, None, "tenant-a"]))
    def create(self, prompt: list[int], extra: object) -> None:
        self._create(prompt, extra)

    @precondition(lambda self: len(self.tokens) < MAX_LIVE and self.history)
    @rule(which=st.integers(0, 63), cut=st.none() | st.integers(0, 24),
          tail=st.lists(st.integers(0, VOCAB - 1), max_size=6),
          same_extra=st.sampled_from([True, True, True, False]))
    def create_sharing_prefix(
        self, which: int, cut: int | None, tail: list[int], same_extra: bool
    ) -> None:
        """A prompt that repeats a (live or freed) sequence's prefix: a prefix-cache candidate."""
        tokens, extra = self.history[-1 - which % len(self.history)]
        if not same_extra:
            extra = "tenant-a" if extra is None else None
        self._create(tokens[:cut] + tail, extra)

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 63), new=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9))
    def append(self, idx: int, new: list[int]) -> None:
        sid = self._pick(idx)
        need = self.cache.blocks_needed(len(new), sid)
        free = self.cache.num_free_blocks
        err = self._try(lambda: self.cache.append(sid, new))
        assert (err is not None) == (need > free)
        if err is not None:
            return
        start = len(self.tokens[sid])
        self.tokens[sid].extend(new)
        self.history.append((list(self.tokens[sid]), self.extra[sid]))
        self._write(sid, start, self.cache.slot_mapping([sid], len(new)))

    @precondition(lambda self: self.tokens)
    @rule(idxs=st.lists(st.integers(0, 63), min_size=1, max_size=6),
          toks=st.lists(st.integers(0, VOCAB - 1), min_size=6, max_size=6))
    def decode_step(self, idxs: list[int], toks: list[int]) -> None:
        """The decode fast path: one token each, then the step's tensors, then the write."""
        sids = list(dict.fromkeys(self._pick(i) for i in idxs))
        toks = toks[: len(sids)]
        need = self._one_each_need(sids)
        assert need == self.cache.blocks_needed_one_each(sids)
        free = self.cache.num_free_blocks
        err = self._try(lambda: self.cache.append_one_each(sids, toks))
        assert (err is not None) == (need > free)
        if err is not None:
            return
        for s, t in zip(sids, toks, strict=True):
            self.tokens[s].append(t)
        slots, tables, lens = self.cache.decode_tensors(sids)
        assert lens.tolist() == [len(self.tokens[s]) for s in sids]
        for i, s in enumerate(sids):
            ids = self.cache.block_ids(s)
            assert tables[i, : len(ids)].tolist() == ids
            assert tables.shape[1] == max(len(self.cache.block_ids(x)) for x in sids)
        assert torch.equal(slots, self.cache.slot_mapping(sids, 1))
        vals = []
        for s in sids:
            vals += prefix_values(self.tokens[s], self.extra[s], len(self.tokens[s]) - 1)
            self.written[s].append(vals[-1])
            self.kshift[s].append(())
        self._store(slots, vals)
        for s in sids:
            self._remember_blocks(s)

    def _one_each_need(self, sids: list[int]) -> int:
        """Blocks one token each takes: a new block at a block boundary; a copy of a shared
        partial last block for each of its writers, except that when all its holders write,
        the last one finds it unshared and writes in place."""
        bs, need, writers = self.cache.block_size, 0, {}
        for s in sids:
            if len(self.tokens[s]) % bs == 0:
                need += 1
            else:
                b = self.cache.block_ids(s)[-1]
                writers[b] = writers.get(b, 0) + 1
        for b, k in writers.items():
            refs = self.cache._pool.blocks[b].ref_cnt
            need += k - (k == refs) if refs > 1 else 0
        return need

    @precondition(lambda self: self.tokens and len(self.tokens) < MAX_LIVE)
    @rule(idx=st.integers(0, 63))
    def fork(self, idx: int) -> None:
        src, dst = self._pick(idx), self._new_id()
        shared = self.cache.block_ids(src)
        refs = [self.cache._pool.blocks[b].ref_cnt for b in shared]
        self.cache.fork(src, dst)
        assert self.cache.block_ids(dst) == shared
        # + one per table entry (an aligned `copy` can list a block twice in one table)
        assert [self.cache._pool.blocks[b].ref_cnt for b in shared] == [
            r + shared.count(b) for r, b in zip(refs, shared, strict=True)]
        self.tokens[dst] = list(self.tokens[src])
        self.extra[dst] = self.extra[src]
        self.written[dst] = list(self.written[src])
        self.kshift[dst] = list(self.kshift[src])
        self.frozen[dst] = self.frozen[src]

    @precondition(lambda self: self.tokens and len(self.tokens) < MAX_LIVE)
    @rule(idx=st.integers(0, 63), drop=st.integers(1, 5), drop_parent=st.booleans())
    def fork_and_roll_back(self, idx: int, drop: int, drop_parent: bool) -> None:
        """Speculation: a branch drops its last tokens (often inside a shared block)."""
        src = self._pick(idx)
        self.fork(self._live().index(src))
        dst = self.next_id
        self.truncate(self._live().index(dst), drop, True)
        if drop_parent:
            self.free(self._live().index(src))

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 63), keep=st.integers(0, 30), from_end=st.booleans())
    def truncate(self, idx: int, keep: int, from_end: bool) -> None:
        """Trim to `keep` tokens, or drop `keep % 7` from the end."""
        sid = self._pick(idx)
        n = len(self.tokens[sid])
        n = max(0, n - keep % 7) if from_end else min(keep, n)
        self.cache.truncate(sid, n)
        del self.tokens[sid][n:]
        del self.written[sid][n:]
        del self.kshift[sid][n:]

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 63))
    def free(self, idx: int) -> None:
        sid = self._pick(idx)
        self._remember_partial(sid)
        self.cache.free(sid)
        del self.tokens[sid], self.extra[sid], self.written[sid], self.kshift[sid]
        del self.frozen[sid]

    # --- sequence operations ------------------------------------------------------------------

    def _freeze(self, sid: int, block: int) -> None:
        old = self.frozen[sid]
        self.frozen[sid] = block if old is None else min(old, block)

    def _span(self, sid: int, a: int, b: int) -> tuple[int, int]:
        n = len(self.tokens[sid])
        a, b = a % (n + 1), b % (n + 1)
        return min(a, b), max(a, b)

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 63), a=st.integers(0, 40), b=st.integers(0, 40))
    def remove(self, idx: int, a: int, b: int) -> None:
        sid = self._pick(idx)
        start, end = self._span(sid, a, b)
        n = len(self.tokens[sid])
        if self._try(lambda: self.cache.remove(sid, start, end)):
            return
        for shadow in (self.tokens, self.written, self.kshift):
            del shadow[sid][start:end]
        if start < end < n:
            self._freeze(sid, start // self.cache.block_size)

    @precondition(lambda self: self.tokens)
    @rule(src_idx=st.integers(0, 63), dst_idx=st.none() | st.integers(0, 63),
          a=st.integers(0, 40), b=st.integers(0, 40))
    def copy(self, src_idx: int, dst_idx: int | None, a: int, b: int) -> None:
        src = self._pick(src_idx)
        start, end = self._span(src, a, b)
        new = dst_idx is None or self._pick(dst_idx) == src
        if new and len(self.tokens) >= MAX_LIVE:
            return
        dst = self._new_id() if new else self._pick(dst_idx)
        length = 0 if new else len(self.tokens[dst])
        if self._try(lambda: self.cache.copy(src, dst, start, end)):
            return
        if new:
            self.tokens[dst], self.written[dst], self.kshift[dst] = [], [], []
            self.extra[dst], self.frozen[dst] = self.extra[src], None
        for shadow in (self.tokens, self.written, self.kshift):
            shadow[dst].extend(shadow[src][start:end])
        if new and start == 0:
            self.frozen[dst] = self.frozen[src]
        elif start < end or new:
            self._freeze(dst, length // self.cache.block_size)

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 63), a=st.integers(0, 40), b=st.integers(0, 40),
          delta=st.integers(-3, 3))
    def shift(self, idx: int, a: int, b: int, delta: int) -> None:
        sid = self._pick(idx)
        start, end = self._span(sid, a, b)
        if self._try(lambda: self.cache.shift(sid, start, end, delta)):
            return
        for p in range(start, end):
            self.kshift[sid][p] += (delta,) if delta else ()
        if start < end and delta:
            self._freeze(sid, start // self.cache.block_size)

    @rule(n=st.none() | st.integers(0, 4))
    def evict(self, n: int | None) -> None:
        cached = self.cache._pool.num_cached_free
        got = self.cache.evict(n)
        assert got == (cached if n is None else min(n, cached))
        assert self.cache._pool.num_cached_free == cached - got

    @rule()
    def reset_prefix_cache(self) -> None:
        self.cache.reset_prefix_cache()
        assert not self.cache._pool.hash_to_block
        for tokens, extra in self.history:
            assert self.cache.lookup(tokens, extra) == 0

    @precondition(lambda self: self.cache.enable_prefix_caching)
    @rule()
    def warm_restart(self) -> None:
        """As a snapshot restore does: every hashed block's contents out, the prefix index
        dropped, then the blocks back through `import_cached` as cached prefix blocks: with
        room for all of them, every earlier prompt finds the same cached prefix as before."""
        cached = self.cache.cached_blocks()
        if not cached:
            return
        before = [self.cache.lookup(t, e) for t, e in self.history]
        data = self.storage.export_blocks([b for _, b in cached])
        parts = [{n: t[i] for n, t in data.items()} for i in range(len(cached))]
        self.cache.reset_prefix_cache()
        room = min(self.cache.num_free_blocks, len(cached))
        assert self.cache.import_cached([h for h, _ in cached][:room], parts[:room]) == room
        if room == len(cached):  # whole blocks: an import carries no ids for partial hits
            bs = self.cache.block_size
            after = [self.cache.lookup(t, e) for t, e in self.history]
            assert [n // bs for n in after] == [n // bs for n in before]

    @rule()
    def defragment(self) -> None:
        self.cache.defragment()
        st_ = self.cache.stats()
        assert st_.holes == 0
        assert st_.largest_free_run == st_.free_blocks

    @precondition(lambda self: self.history)
    @rule(which=st.integers(0, 63))
    def lookup_changes_nothing(self, which: int) -> None:
        tokens, extra = self.history[which % len(self.history)]
        before = snapshot(self.cache)
        self.cache.lookup(tokens, extra)
        assert same_state(before, snapshot(self.cache))

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if self.cache is None:
            return
        self.cache.check_invariants()
        st_ = self.cache.stats()
        assert st_.active_sequences == len(self.tokens)
        assert st_.used_blocks + st_.free_blocks == self.cache.num_blocks

    @invariant()
    def every_hashed_block_holds_its_prefix(self) -> None:
        """A block in the prefix index (used or cached) holds exactly the K/V its hash names."""
        if self.cache is None:
            return
        bs = self.cache.block_size
        for h, b in self.cache._pool.hash_to_block.items():
            assert h in self.block_content, f"block {b.block_id} hashed for unknown contents"
            x = self.kv(self.block_content[h])
            k, v = self.stored(x), self.stored(-x)
            for layer in range(self.layers):
                gk, gv = self.storage.gather(layer, [b.block_id], bs)
                gk, gv = gk[: len(x)], gv[: len(x)]  # a partial block: its written part
                assert torch.equal(gk, k[:, layer]) and torch.equal(gv, v[:, layer]), (
                    f"cached block {b.block_id} was overwritten"
                )

    @invariant()
    def every_sequence_reads_its_own_kv(self) -> None:
        if self.cache is None:
            return
        for sid in self._live():
            tokens = self.tokens[sid]
            n = len(tokens)
            assert self.cache.num_tokens(sid) == n
            assert self.cache.seq(sid).hash_limit == self.frozen[sid]
            assert self.cache.seq(sid).token_ids == tokens
            if self.frozen[sid] is None:
                assert self.written[sid] == prefix_values(tokens, self.extra[sid])
            if n == 0:
                continue
            k, v = self.expected_kv(self.written[sid], self.kshift[sid])  # [n, L, H, D]
            for p in range(n):
                slot = self.cache.slot(sid, p)
                for layer in range(self.layers):
                    got_k, got_v = self.storage.read(layer, slot)
                    assert torch.equal(got_k, k[p, layer]), f"seq {sid} pos {p} layer {layer}: K"
                    assert torch.equal(got_v, v[p, layer]), f"seq {sid} pos {p} layer {layer}: V"
            ids = self.cache.block_ids(sid)
            for layer in range(self.layers):
                gk, gv = self.storage.gather(layer, ids, n)
                assert torch.equal(gk, k[:, layer]) and torch.equal(gv, v[:, layer])


CacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCacheMachine = CacheMachine.TestCase
