"""Stateful property test of the hybrid cache: KV groups (full and sliding-window) over one pool.

Random operations (create with prefix hits, append, decode steps, speculative verify steps
(lookahead slots in every group, accepted or given back, or undone), fork and copy-on-write,
roll-backs, truncate, free, evict, reset, warm restart, defragmentation, refused range
operations) against a shadow model with real K/V data. Each group writes its own values (a
function of the salted token prefix and the group), so a block served to the wrong group or a
stale block is caught. After every step:
- `check_invariants()` holds (ref counts summed over the groups' tables, rows in step, no
  window group holding a block the next position does not need, none missing one it needs);
- a window group holds exactly the blocks from its window's first one (given back eagerly);
- every live sequence reads back its own K/V in every group at every position the group holds;
- every block in the prefix index holds the contents its (group-keyed) hash names (a freed
  sequence's kept partial block: its written part);
- a create's hit is the longest block-aligned prefix every full group holds whole and every
  window group holds the last `window` tokens of, then the partial hit of the next block every
  group can serve (both checked by brute force over the index);
- a failed operation (OutOfBlocksError, SlidingWindowError) leaves the whole state as it was.
"""

from __future__ import annotations

import torch
from cache_snapshot import brute_partial, same_state, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.cache import KVStorage, PagedKVCache
from pagedkv.cache.block_map import block_map
from pagedkv.cache.groups import KVGroups
from pagedkv.cache.hashing import HashChain, chain_hashes
from pagedkv.errors import OutOfBlocksError, SlidingWindowError

SLOTS, HEADS, DIM = 2, 1, 2  # storage layers per block
VOCAB = 3
MAX_LIVE = 6
SEEDS = {None: 17, "tenant-a": 91}
MASK = (1 << 18) - 1
# group layouts: (windows per group); a window group with window w tokens
LAYOUTS = [(None, 3), (None, 2, 5), (4,), (None, 1), (2, None)]


def values(tokens: list[int], extra: object, group: int, start: int = 0) -> list[int]:
    h = SEEDS[extra]
    out = []
    for p, t in enumerate(tokens):
        h = ((h * 1_000_003) ^ (t + 1)) & MASK
        if p >= start:
            out.append(h + 1 + (group << 19))  # never 0; distinct per group; exact in float32
    return out


def kv_of(vals: list[int]) -> torch.Tensor:
    """[T, SLOTS, H, D] keys for the values (V is -K)."""
    base = torch.tensor(vals, dtype=torch.float32).view(-1, 1, 1, 1)
    off = (0.5 * torch.arange(SLOTS).view(SLOTS, 1, 1) + 0.25 * torch.arange(DIM).view(1, 1, DIM))
    return base + off.expand(SLOTS, HEADS, DIM)


class HybridMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: PagedKVCache | None = None
        self.tokens: dict[int, list[int]] = {}
        self.extra: dict[int, object] = {}
        self.history: list[tuple[list[int], object]] = []
        self.content: dict[bytes, list[int]] = {}  # group key -> the block's values
        self.next_id = 0

    # --- helpers ------------------------------------------------------------------------------

    @property
    def windows(self) -> tuple[int | None, ...]:
        return self.cache.groups.windows

    def _pick(self, idx: int) -> int:
        live = sorted(self.tokens)
        return live[idx % len(live)]

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _try(self, fn, *errors):
        before = snapshot(self.cache)
        try:
            fn()
        except (OutOfBlocksError, *errors) as e:
            assert same_state(before, snapshot(self.cache)), "a failed operation changed state"
            return e
        return None

    def _write(self, sid: int, start: int) -> None:
        """Write positions [start, len) of sid in every group, remember its full blocks."""
        tokens, extra = self.tokens[sid], self.extra[sid]
        n = len(tokens)
        for g in range(len(self.windows)):
            if start < n:
                slots = self.cache.slot_mapping([sid], n - start, group=g)
                assert slots.tolist() == [self.cache.slot(sid, p, g) for p in range(start, n)]
                k = kv_of(values(tokens, extra, g, start))
                for layer in range(SLOTS):
                    self.storage.write(layer, slots, k[:, layer].contiguous(),
                                       (-k[:, layer]).contiguous())
        self._remember(sid)

    def _remember(self, sid: int) -> None:
        bs, tokens, extra = self.cache.block_size, self.tokens[sid], self.extra[sid]
        for g in range(len(self.windows)):
            vals = values(tokens, extra, g)
            for i, h in enumerate(chain_hashes(tokens, bs, extra)):
                self.content[self.cache.group_key(h, g)] = vals[i * bs : (i + 1) * bs]

    def _expected_hit(self, prompt: list[int], extra: object) -> int:
        """Brute force: the largest m every group can serve, straight from the definition."""
        c, bs = self.cache, self.cache.block_size
        if not c.enable_prefix_caching or len(prompt) < 2:
            return 0
        hashes = chain_hashes(prompt, bs, extra, max_blocks=(len(prompt) - 1) // bs)
        index = c._pool.hash_to_block
        for m in range(len(hashes), 0, -1):
            ok = True
            for g, w in enumerate(self.windows):
                lo = 0 if w is None else max(0, m * bs - w + 1) // bs
                if any(c.group_key(hashes[i], g) not in index for i in range(lo, m)):
                    ok = False
            if ok:
                return m * bs + brute_partial(c, prompt, extra, m)
        return brute_partial(c, prompt, extra, 0)

    # --- setup --------------------------------------------------------------------------------

    @initialize(num_blocks=st.integers(3, 24), block_size=st.sampled_from([1, 2, 3]),
                layout=st.sampled_from(LAYOUTS), caching=st.sampled_from([True, True, False]))
    def setup(self, num_blocks: int, block_size: int, layout: tuple, caching: bool) -> None:
        groups = KVGroups(layout, tuple((2 * g, 2 * g + 1) for g in range(len(layout))), SLOTS)
        self.storage = KVStorage(SLOTS, num_blocks, block_size, HEADS, DIM)
        self.cache = PagedKVCache(num_blocks, block_size, storage=self.storage,
                                  enable_prefix_caching=caching, groups=groups)

    # --- rules --------------------------------------------------------------------------------

    def _create(self, prompt: list[int], extra: object) -> None:
        sid = self._new_id()
        expected = self._expected_hit(prompt, extra)
        assert self.cache.lookup(prompt, extra) == expected
        out: list[int] = []
        if self._try(lambda: out.append(self.cache.create(sid, prompt, extra_key=extra,
                                                          computed=False))):
            return
        (cached,) = out
        assert cached == expected
        self.tokens[sid], self.extra[sid] = list(prompt), extra
        self.history.append((list(prompt), extra))
        self._write(sid, cached)
        self.cache.mark_computed(sid, len(prompt))

    @precondition(lambda self: len(self.tokens) < MAX_LIVE)
    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), max_size=16),
          extra=st.sampled_from([None, None, "tenant-a"]))
    def create(self, prompt: list[int], extra: object) -> None:
        self._create(prompt, extra)

    @precondition(lambda self: len(self.tokens) < MAX_LIVE and self.history)
    @rule(which=st.integers(0, 63), cut=st.none() | st.integers(0, 20),
          tail=st.lists(st.integers(0, VOCAB - 1), max_size=5))
    def create_sharing_prefix(self, which: int, cut: int | None, tail: list[int]) -> None:
        tokens, extra = self.history[-1 - which % len(self.history)]
        self._create(tokens[:cut] + tail, extra)

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 63), new=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=7))
    def append(self, idx: int, new: list[int]) -> None:
        sid = self._pick(idx)
        need, free = self.cache.blocks_needed(len(new), sid), self.cache.num_free_blocks
        err = self._try(lambda: self.cache.append(sid, new, computed=False))
        assert (err is not None) == (need > free)
        if err is not None:
            return
        start = len(self.tokens[sid])
        self.tokens[sid].extend(new)
        self.history.append((list(self.tokens[sid]), self.extra[sid]))
        self._write(sid, start)
        self.cache.mark_computed(sid, len(self.tokens[sid]))

    @precondition(lambda self: self.tokens)
    @rule(idxs=st.lists(st.integers(0, 63), min_size=1, max_size=4),
          toks=st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=4))
    def decode_step(self, idxs: list[int], toks: list[int]) -> None:
        sids = list(dict.fromkeys(self._pick(i) for i in idxs))
        toks = toks[: len(sids)]
        sids = [s for s in sids if self.tokens[s]]  # a decode extends a held context
        toks = toks[: len(sids)]
        if not sids:
            return
        need, free = self.cache.blocks_needed_one_each(sids), self.cache.num_free_blocks
        err = self._try(lambda: self.cache.append_one_each(sids, toks, computed=False))
        assert (err is not None) == (need > free)
        if err is not None:
            return
        for s, t in zip(sids, toks, strict=True):
            self.tokens[s].append(t)
        _same_per_group(self.cache, sids, None)
        for g in range(len(self.windows)):
            slots, tables, lens = self.cache.decode_tensors(sids, g)
            assert lens.tolist() == [len(self.tokens[s]) for s in sids]
            assert torch.equal(slots, self.cache.slot_mapping(sids, 1, group=g))
            for i, s in enumerate(sids):
                ids = [max(b, 0) for b in self.cache.block_ids(s, g)]
                assert tables[i, : len(ids)].tolist() == ids
        for s in sids:
            self._write(s, len(self.tokens[s]) - 1)
            self.cache.mark_computed(s, len(self.tokens[s]))

    @precondition(lambda self: self.tokens)
    @rule(idxs=st.lists(st.integers(0, 63), min_size=1, max_size=3),
          toks=st.lists(st.integers(0, VOCAB - 1), min_size=3, max_size=3),
          drafts=st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=5), min_size=3,
                          max_size=3),
          accepted=st.lists(st.integers(0, 5), min_size=3, max_size=3),
          undo=st.booleans())
    def speculative_step(self, idxs: list[int], toks: list[int], drafts: list[list[int]],
                         accepted: list[int], undo: bool) -> None:
        """The engine's verify step in every group: a decode append, lookahead slots for the
        drafts (all-or-nothing: False changes nothing), the K/V of the token and its drafts
        written through decode_tensors' slots, then the first m drafts accepted (their ids
        appended to the chain first) and the rest given back; or, `undo` (a failed forward
        pass), the sequences freed with their lookahead held."""
        sids = [s for s in dict.fromkeys(self._pick(i) for i in idxs) if self.tokens[s]]
        if not sids:
            return
        toks, drafts, accepted = toks[: len(sids)], drafts[: len(sids)], accepted[: len(sids)]
        c, bs, ng = self.cache, self.cache.block_size, len(self.windows)
        need, free = c.blocks_needed_one_each(sids), c.num_free_blocks
        if self._try(lambda: c.append_one_each(sids, toks, computed=False)) is not None:
            assert need > free
            return
        for s, t in zip(sids, toks, strict=True):
            self.tokens[s].append(t)
        ks = []
        for s, d in zip(sids, drafts, strict=True):
            n, held = len(self.tokens[s]), len(c.seq(s).blocks)
            fits = (-(-(n + len(d)) // bs) - held) * ng <= c.num_free_blocks
            before = snapshot(c)
            got = c.try_lookahead(s, len(d))
            assert got == fits
            if not got:
                assert same_state(before, snapshot(c)), "a refused lookahead changed state"
            ks.append(len(d) if got else 0)
        _same_per_group(c, sids, ks)
        for g in range(ng):
            slots, _, lens = c.decode_tensors(sids, g, ks)
            r = 0
            for s, d, k in zip(sids, drafts, ks, strict=True):
                full = self.tokens[s] + d[:k]
                assert lens[r : r + k + 1].tolist() == list(range(len(self.tokens[s]), len(full) + 1))
                x = kv_of(values(full, self.extra[s], g, len(self.tokens[s]) - 1))
                for layer in range(SLOTS):
                    self.storage.write(layer, slots[r : r + k + 1], x[:, layer].contiguous(),
                                       (-x[:, layer]).contiguous())
                r += k + 1
        if undo:
            for s in sids:
                self._remember_partial(s)
                c.free(s)
                del self.tokens[s]
            return
        for s, d, k, m in zip(sids, drafts, ks, accepted, strict=True):
            m = min(m, k)
            c.mark_computed(s, len(self.tokens[s]))
            c.seq(s).chain.extend(d[:m])
            c.accept_lookahead(s, m)
            self.tokens[s].extend(d[:m])
            self.history.append((list(self.tokens[s]), self.extra[s]))
            self._remember(s)

    @precondition(lambda self: self.tokens and len(self.tokens) < MAX_LIVE)
    @rule(idx=st.integers(0, 63))
    def fork(self, idx: int) -> None:
        src, dst = self._pick(idx), self._new_id()
        shared = [self.cache.block_ids(src, g) for g in range(len(self.windows))]
        self.cache.fork(src, dst)
        assert [self.cache.block_ids(dst, g) for g in range(len(self.windows))] == shared
        self.tokens[dst], self.extra[dst] = list(self.tokens[src]), self.extra[src]

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 63), keep=st.integers(0, 20), from_end=st.booleans())
    def truncate(self, idx: int, keep: int, from_end: bool) -> None:
        sid = self._pick(idx)
        n = len(self.tokens[sid])
        n = max(0, n - keep % 5) if from_end else min(keep, n)
        s = self.cache.seq(sid)
        bs = self.cache.block_size
        refused = any(s.tables[g].start > max(0, n - w + 1) // bs
                      for g, w in enumerate(self.windows) if w is not None)
        err = self._try(lambda: self.cache.truncate(sid, n), SlidingWindowError)
        assert (err is not None) == refused
        if err is None:
            del self.tokens[sid][n:]

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 63))
    def free(self, idx: int) -> None:
        sid = self._pick(idx)
        self._remember_partial(sid)
        self.cache.free(sid)
        del self.tokens[sid], self.extra[sid]

    def _remember_partial(self, sid: int) -> None:
        """What freeing sid may keep: its last block's written part, under its partial key."""
        bs, tokens, extra = self.cache.block_size, self.tokens[sid], self.extra[sid]
        i, w = divmod(self.cache.seq(sid).num_written, bs)
        key = HashChain(bs, tokens, extra).partial_key(i, w)
        for g in range(len(self.windows)):
            self.content[self.cache.group_key(key, g)] = values(tokens, extra, g)[i * bs : i * bs + w]

    @precondition(lambda self: self.tokens)
    @rule(idx=st.integers(0, 63), op=st.sampled_from(["remove", "copy", "shift"]))
    def range_ops_refused(self, idx: int, op: str) -> None:
        """With groups, range operations are a SlidingWindowError that changes nothing."""
        sid = self._pick(idx)
        n = len(self.tokens[sid])
        if op == "remove" and n < 2:
            return  # removing the tail is a truncate (allowed)
        call = {"remove": lambda: self.cache.remove(sid, 0, 1),
                "copy": lambda: self.cache.copy(sid, sid, 0, n),
                "shift": lambda: self.cache.shift(sid, 0, n, 1)}[op]
        err = self._try(call, SlidingWindowError)
        assert isinstance(err, SlidingWindowError)

    @rule(n=st.none() | st.integers(0, 4))
    def evict(self, n: int | None) -> None:
        self.cache.evict(n)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.cache.reset_prefix_cache()
        for tokens, extra in self.history:
            assert self.cache.lookup(tokens, extra) == 0

    @precondition(lambda self: self.cache.enable_prefix_caching)
    @rule()
    def warm_restart(self) -> None:
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
        assert self.cache.stats().holes == 0

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if self.cache is None:
            return
        self.cache.check_invariants()
        bs = self.cache.block_size
        for sid in self.tokens:
            s = self.cache.seq(sid)
            for g, w in enumerate(self.windows):
                want = 0 if w is None else max(0, s.num_written - w + 1) // bs
                assert s.tables[g].start == want, f"seq {sid} group {g}: window blocks"

    @invariant()
    def block_map_matches_stats(self) -> None:
        """The block map walks every group's tables: its counts equal stats()'s."""
        if self.cache is None:
            return
        bm, st_ = block_map(self.cache), self.cache.stats()
        for k in ("live_tokens", "internal_waste", "holes", "active_sequences", "cow_copies"):
            assert bm.summary[k] == getattr(st_, k), k
        refs, _ = self.cache.block_states()
        assert int((refs > 0).sum()) == st_.used_blocks

    @invariant()
    def hashed_blocks_hold_their_contents(self) -> None:
        if self.cache is None:
            return
        bs = self.cache.block_size
        for h, b in self.cache._pool.hash_to_block.items():
            x = kv_of(self.content[h])  # a partial block: its written part
            for layer in range(SLOTS):
                gk, gv = self.storage.gather(layer, [b.block_id], bs)
                gk, gv = gk[: len(x)], gv[: len(x)]
                assert torch.equal(gk, x[:, layer]) and torch.equal(gv, -x[:, layer])

    @invariant()
    def sequences_read_their_own_kv(self) -> None:
        if self.cache is None:
            return
        for sid, tokens in self.tokens.items():
            assert self.cache.seq(sid).token_ids == tokens
            s = self.cache.seq(sid)
            assert self.cache.seq_pos_min(sid) == max(
                [r.start for r in s.tables], default=0) * self.cache.block_size
            for g in range(len(self.windows)):
                held = s.tables[g].start * self.cache.block_size
                x = kv_of(values(tokens, self.extra[sid], g))
                for p in range(held, len(tokens)):
                    slot = self.cache.slot(sid, p, g)
                    for layer in range(SLOTS):
                        got_k, got_v = self.storage.read(layer, slot)
                        assert torch.equal(got_k, x[p, layer]), f"seq {sid} group {g} pos {p}"
                        assert torch.equal(got_v, -x[p, layer])


HybridMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestHybridMachine = HybridMachine.TestCase


def _check_all(m: HybridMachine) -> None:
    m.consistent()
    m.block_map_matches_stats()
    m.hashed_blocks_hold_their_contents()
    m.sequences_read_their_own_kv()


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
spec_steps = st.tuples(st.lists(st.integers(0, 63), min_size=1, max_size=3),
                       st.lists(st.integers(0, VOCAB - 1), min_size=3, max_size=3),
                       st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5),
                                min_size=3, max_size=3),
                       st.lists(st.integers(0, 5), min_size=3, max_size=3),
                       st.sampled_from([False] * 5 + [True]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(4, 16), block_size=st.sampled_from([1, 2, 3]),
       layout=st.sampled_from(LAYOUTS), caching=st.booleans(),
       first=st.lists(prompts, min_size=1, max_size=3),
       ops=st.lists(st.one_of(st.tuples(st.just("create"), prompts),
                              *[st.tuples(st.just("spec"), spec_steps)] * 4,
                              st.tuples(st.just("fork"), st.integers(0, 63)),
                              st.tuples(st.just("free"), st.integers(0, 63))), max_size=30))
def test_speculative_steps_on_every_group_layout(num_blocks, block_size, layout, caching,
                                                 first, ops) -> None:  # noqa: ANN001
    """Mostly verify steps (the machine's rule above): lookahead slots and their roll-back in
    every group, window groups giving back only what accepted positions left behind, forks
    (copy-on-write before the slots) and preemption (free) between them; every invariant of
    the machine after each operation."""
    m = HybridMachine()
    m.setup(num_blocks, block_size, layout, caching)
    for op, arg in [("create", p) for p in first] + ops:
        if op == "create" and len(m.tokens) < MAX_LIVE:
            m.create(arg, None)
        elif op == "spec" and m.tokens:
            m.speculative_step(*arg)
        elif op == "fork" and m.tokens and len(m.tokens) < MAX_LIVE:
            m.fork(arg)
        elif op == "free" and m.tokens:
            m.free(arg)
        _check_all(m)


def _same_per_group(cache: PagedKVCache, sids: list[str], drafts: list[int] | None) -> None:
    """decode_tensors_groups (the step plan's one call for all groups) gives each group's
    decode_tensors, the lengths tensor shared."""
    every = cache.decode_tensors_groups(sids, drafts)
    assert len(every) == cache.num_groups
    for g, got in enumerate(every):
        for a, b in zip(got, cache.decode_tensors(sids, g, drafts), strict=True):
            assert torch.equal(a, b)
        assert got[2] is every[0][2]
