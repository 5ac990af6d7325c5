"""Stateful property test of the cache over int8 and fp8_e4m3 storage, against a shadow model.

The float32 machine of tests/test_cache_stateful.py (create, prefix hits, append, decode steps,
fork and copy-on-write, truncate, free, evict, remove / copy / shift, defragmentation), run on a
quantized KVStorage with K/V rows that quantization really rounds (varied values, some all-zero
rows), plus two ways blocks leave the pool and come back: the KV tier (with prefix caching on,
every hashed block is written as a tier record into an in-memory tier, as the engine's tier
writer does; once the device's prefix index is dropped or evicted, prompts load them) and
whole-pool byte round trips (`block_bytes` / `write_block_bytes`, the snapshot format). After
every step `check_invariants()` holds and every sequence reads back, through `read` and `gather`,
exactly its K/V quantized ONCE: `dequantize(quantize(x))` of what it wrote, bit for bit (a K
re-rotated by a shift is quantized again, as the storage must). So scales move with their blocks
through every copy, share, move and tier trip, and nothing is ever re-quantized on the way.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_cache_stateful import CacheMachine

from pagedkv.cache.hashing import HashChain, chain_hashes
from pagedkv.cache.quant import QUANT_DTYPES, dequantize, quantize
from pagedkv.cache.tiers.base import BlockTier
from pagedkv.cache.tiers.connector import TierConnector

FINGERPRINT = b"kvquant-stateful"


class DictTier(BlockTier):
    """A BlockTier in a dict: the real record encoding and checks, no I/O."""

    scheme = "dict"

    def __init__(self) -> None:
        super().__init__(FINGERPRINT)
        self.data: dict[bytes, bytes] = {}

    def _get_raw(self, keys, max_bytes):  # noqa: ANN001, ANN202
        return [self.data.get(k) for k in keys]

    def _put_raw(self, items) -> None:  # noqa: ANN001
        self.data.update(items)

    def _contains_raw(self, key: bytes) -> bool:
        return key in self.data

    def _discard(self, key: bytes) -> None:
        self.data.pop(key, None)

    def _clear_raw(self) -> int:
        n = len(self.data)
        self.data.clear()
        return n


class QuantCacheMachine(CacheMachine):
    dtype: torch.dtype  # set per subclass
    layers, heads, dim = 2, 2, 4

    def __init__(self) -> None:
        super().__init__()
        self.tier: DictTier | None = None

    # --- data hooks ---------------------------------------------------------------------------

    def kv(self, values: list[int]) -> torch.Tensor:
        """Rows of distinct, varied values in [-512, 512) that int8/fp8 really round; the first
        head's row is all zeros for values divisible by 11 (a zero scale)."""
        n, width = len(values), self.layers * self.heads * self.dim
        v = torch.tensor(values, dtype=torch.int64).view(n, 1)
        i = torch.arange(1, width + 1, dtype=torch.int64).view(1, width)
        x = ((v * 2654435761 + i * 40503) * i % 65521 - 32760).float() / 64
        x = x.view(n, self.layers, self.heads, self.dim)
        x[(v.view(-1) % 11 == 0), :, 0] = 0.0
        return x

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        q, s = quantize(x, self.dtype)
        return dequantize(q, s)

    def expected_hit(self, prompt: list[int], extra: object) -> int:
        """Device hits, then the blocks right after them that the tier holds, then a partial
        hit of the next block."""
        dev = self.cache.lookup(prompt, extra)
        if self.tier is None or not self.cache.enable_prefix_caching or len(prompt) < 2:
            return dev
        bs = self.cache.block_size
        hashes = chain_hashes(prompt, bs, extra, max_blocks=(len(prompt) - 1) // bs)
        k = dev // bs
        while k < len(hashes) and hashes[k] in self.tier.data:
            k += 1
        if k == dev // bs:
            return dev  # no tier block: the device's partial hit of block k stands
        # after the tier's blocks, a partial hit of the block that follows them
        return k * bs + self.cache._partial(HashChain(bs, prompt, extra), len(prompt), k)[1]

    # --- blocks leaving the pool and coming back ----------------------------------------------

    def _remember_blocks(self, sid: int) -> None:
        """After each write: as the engine's tier writer does, every newly hashed block goes to
        the tier (one export of its parts, encoded as a record)."""
        super()._remember_blocks(sid)
        if not self.cache.enable_prefix_caching:
            return
        if self.tier is None:
            self.tier = DictTier()
            self.cache.attach_tier(TierConnector(self.tier, self.storage, write=False))
        new = [(h, b) for h, b in self.cache.cached_blocks() if h not in self.tier.data]
        if new:
            parts = self.storage.export_blocks([b for _, b in new])
            self.tier.put_many([(h, {n: t[i] for n, t in parts.items()})
                                for i, (h, _) in enumerate(new)])

    @precondition(lambda self: self.history and len(self.tokens) < 8)
    @rule(which=st.integers(0, 63), evict=st.booleans())
    def recreate_from_tier(self, which: int, evict: bool) -> None:
        """Drop the device's prefix index (or evict its cached blocks), then create a sequence
        from an earlier prompt: its prefix now comes from the tier when caching is on."""
        if evict:
            self.cache.evict()
        else:
            self.cache.reset_prefix_cache()
        self._create(*self.history[-1 - which % len(self.history)])

    @rule(data=st.data())
    def bytes_round_trip(self, data: st.DataObject) -> None:
        """Every block out as `block_bytes`, the pool wiped (K/V and scales), every block back
        with `write_block_bytes`, in a drawn order: the invariants then read it all back."""
        n = self.storage.num_blocks
        raw = [self.storage.block_bytes(b) for b in range(n)]
        assert all(len(r) == self.storage.bytes_per_block for r in raw)
        self.storage.kv.view(torch.uint8).fill_(0x5A)  # garbage, not zeros
        self.storage.scales.fill_(7.0)
        for b in data.draw(st.permutations(range(n))):
            self.storage.write_block_bytes(b, raw[b])


def _machine(dtype: torch.dtype) -> type:
    cls = type(f"Quant{dtype}Machine".replace("torch.", ""), (QuantCacheMachine,), {"dtype": dtype})
    cls.TestCase.settings = settings(
        max_examples=150,
        stateful_step_count=40,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    return cls


@pytest.mark.parametrize("name", list(QUANT_DTYPES))
def test_quantized_cache_machine(name: str) -> None:
    _machine(QUANT_DTYPES[name]).TestCase("runTest").runTest()
