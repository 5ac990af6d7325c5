"""KVStorage: layout, dtypes, slot-mapped writes, reads, gather, block copies, sizing, errors."""

from __future__ import annotations

import pytest
import torch

from pagedkv.cache import KVStorage, PagedKVCache, bytes_per_block, num_blocks_for_budget
from pagedkv.cache.storage import resolve_dtype, write_kv
from pagedkv.errors import CacheConfigError, InvalidBlockError, StorageMismatchError

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
L, N, BS, H, D = 3, 6, 4, 2, 5


def kv(t: int, dtype: torch.dtype, start: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct, exactly representable K/V values for t tokens ([t, H, D] each)."""
    k = (start + torch.arange(t * H * D, dtype=torch.float32) / 4).view(t, H, D).to(dtype)
    return k, -k


@pytest.mark.parametrize("dtype", DTYPES)
def test_layout_and_memory(dtype):
    s = KVStorage(L, N, BS, H, D, dtype)
    assert s.kv.shape == (L, 2, N, BS, H, D) and s.kv.dtype == dtype
    assert s.k_cache(1).shape == (N, BS, H, D) and s.k_cache(1).is_contiguous()
    assert s.k_cache(1).data_ptr() == s.kv[1, 0].data_ptr()
    assert s.v_cache(2).data_ptr() == s.kv[2, 1].data_ptr()
    item = torch.empty((), dtype=dtype).element_size()
    assert s.memory_bytes == L * 2 * N * BS * H * D * item
    assert s.bytes_per_block == bytes_per_block(L, BS, H, D, dtype) == s.memory_bytes // N
    assert s.num_slots == N * BS
    assert bool((s.kv == 0).all())  # unwritten slots read as zeros


@pytest.mark.parametrize(
    "name, dtype",
    [("float32", torch.float32), ("fp32", torch.float32), ("bfloat16", torch.bfloat16),
     ("bf16", torch.bfloat16), ("float16", torch.float16), ("fp16", torch.float16)],
)
def test_dtype_names(name, dtype):
    assert resolve_dtype(name) is dtype
    assert KVStorage(1, 1, 1, 1, 1, name).dtype is dtype


@pytest.mark.parametrize("bad", ["int4", "float64", torch.float64, torch.int32, "auto"])
def test_unsupported_dtype_is_typed(bad):
    with pytest.raises(CacheConfigError):
        KVStorage(1, 1, 1, 1, 1, bad)


@pytest.mark.parametrize("field", range(5))
@pytest.mark.parametrize("bad", [0, -2, 1.5])
def test_bad_dimensions_are_typed(field, bad):
    dims = [L, N, BS, H, D]
    dims[field] = bad
    with pytest.raises(CacheConfigError):
        KVStorage(*dims)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_through_slot_mapping_then_read(dtype):
    s = KVStorage(L, N, BS, H, D, dtype)
    slots = torch.tensor([5, 0, 22, 13], dtype=torch.int64)
    k, v = kv(4, dtype)
    s.write(1, slots, k, v)
    for i, slot in enumerate(slots.tolist()):
        rk, rv = s.read(1, slot)
        assert rk.dtype == dtype and torch.equal(rk, k[i]) and torch.equal(rv, v[i])
        b, o = divmod(slot, BS)
        assert torch.equal(s.k_cache(1)[b, o], k[i])
    # other layers untouched, and every other slot of layer 1 still zero
    assert bool((s.kv[0] == 0).all()) and bool((s.kv[2] == 0).all())
    assert int((s.kv[1] != 0).any(dim=(-1, -2)).sum()) == 2 * 4


def test_write_skips_padding_slots():
    s = KVStorage(1, N, BS, H, D)
    k, v = kv(3, torch.float32)
    s.write(0, torch.tensor([3, -1, 7]), k, v)
    assert torch.equal(s.read(0, 3)[0], k[0]) and torch.equal(s.read(0, 7)[0], k[2])
    assert int((s.kv != 0).any(dim=(-1, -2)).sum()) == 4  # K and V of two slots
    s.write(0, torch.tensor([-1, -1, -1]), k, v)  # all padding: nothing happens
    s.write(0, torch.tensor([], dtype=torch.int64), k[:0], v[:0])


def test_write_accepts_int32_slots_and_unchecked_hot_path():
    s = KVStorage(1, N, BS, H, D)
    k, v = kv(2, torch.float32)
    s.write(0, torch.tensor([1, 2], dtype=torch.int32), k, v)
    assert torch.equal(s.read(0, 2)[1], v[1])
    write_kv(s.k_cache(0), s.v_cache(0), torch.tensor([9, 10]), k * 2, v * 2)
    assert torch.equal(s.read(0, 10)[0], k[1] * 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_mismatches_are_typed(dtype):
    s = KVStorage(L, N, BS, H, D, dtype)
    k, v = kv(2, dtype)
    slots = torch.tensor([0, 1])
    other = torch.float32 if dtype != torch.float32 else torch.float16
    cases = [
        (slots, k[:, :1], v[:, :1]),  # wrong head count
        (slots, k[..., :3], v[..., :3]),  # wrong head dim
        (slots, k[0], v[0]),  # not [T, H, D]
        (slots, k.to(other), v.to(other)),  # dtype
        (slots, k, v.to(other)),
        (slots, k.to("meta"), v.to("meta")),  # device
        (torch.tensor([0, 1, 2]), k, v),  # T mismatch
        (torch.tensor([[0, 1]]), k, v),  # 2-D slot mapping
        (torch.tensor([0.0, 1.0]), k, v),  # float slots
        (slots.to("meta"), k, v),  # slot mapping on another device
        (slots, k, v[:1]),  # k/v mismatch
    ]
    for sm, kk, vv in cases:
        with pytest.raises(StorageMismatchError):
            s.write(0, sm, kk, vv)
    with pytest.raises(StorageMismatchError):
        s.write(L, slots, k, v)  # layer out of range
    with pytest.raises(StorageMismatchError):
        s.write(-1, slots, k, v)
    assert bool((s.kv == 0).all())


def test_out_of_range_slots_are_typed_and_write_nothing():
    s = KVStorage(1, N, BS, H, D)
    k, v = kv(2, torch.float32)
    for bad in ([0, N * BS], [-2, 0]):
        with pytest.raises(InvalidBlockError):
            s.write(0, torch.tensor(bad), k, v)
    assert bool((s.kv == 0).all())
    for bad in (-1, N * BS):
        with pytest.raises(InvalidBlockError):
            s.read(0, bad)
    with pytest.raises(StorageMismatchError):
        s.read(L + 5, 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_one_sequence_contiguously(dtype):
    s = KVStorage(L, N, BS, H, D, dtype)
    block_ids = [4, 1, 3]
    n = 10  # 4 + 4 + 2 tokens
    slots = torch.tensor([b * BS + o for b in block_ids for o in range(BS)][:n])
    k, v = kv(n, dtype)
    s.write(2, slots, k, v)
    gk, gv = s.gather(2, block_ids, n)
    assert gk.shape == (n, H, D) and gk.is_contiguous() and gv.is_contiguous()
    assert torch.equal(gk, k) and torch.equal(gv, v)
    gk2, _ = s.gather(2, torch.tensor(block_ids), 8)
    assert torch.equal(gk2, k[:8])
    e, _ = s.gather(2, [], 0)
    assert e.shape == (0, H, D)
    with pytest.raises(StorageMismatchError):
        s.gather(2, block_ids, 13)  # more tokens than the blocks hold
    with pytest.raises(InvalidBlockError):
        s.gather(2, [0, N], 1)
    with pytest.raises(StorageMismatchError):
        s.gather(L, block_ids, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_in_every_layer(dtype):
    s = KVStorage(L, N, BS, H, D, dtype)
    s.kv.copy_(torch.arange(s.kv.numel(), dtype=torch.float32).view(s.kv.shape).to(dtype))
    before = s.kv.clone()
    s.copy_blocks([0, 2], [5, 3])
    assert torch.equal(s.kv[:, :, 5], before[:, :, 0]) and torch.equal(s.kv[:, :, 3], before[:, :, 2])
    assert torch.equal(s.kv[:, :, :3], before[:, :, :3]) and torch.equal(s.kv[:, :, 4], before[:, :, 4])
    # a permutation (swap) is safe: sources are read before destinations are written
    before = s.kv.clone()
    s.copy_blocks(torch.tensor([1, 4]), torch.tensor([4, 1]))
    assert torch.equal(s.kv[:, :, 1], before[:, :, 4]) and torch.equal(s.kv[:, :, 4], before[:, :, 1])
    s.copy_blocks([], [])


def test_copy_blocks_errors():
    s = KVStorage(1, N, BS, H, D)
    with pytest.raises(StorageMismatchError):
        s.copy_blocks([0, 1], [2])
    with pytest.raises(StorageMismatchError):
        s.copy_blocks([[0]], [[1]])
    with pytest.raises(InvalidBlockError):
        s.copy_blocks([N], [0])
    with pytest.raises(InvalidBlockError):
        s.copy_blocks([0], [-1])
    assert bool((s.kv == 0).all())


def test_sizing_from_a_byte_budget():
    per = bytes_per_block(32, 16, 8, 128, "bf16")
    assert per == 2 * 32 * 16 * 8 * 128 * 2
    assert num_blocks_for_budget(10 * per + per - 1, 32, 16, 8, 128, torch.bfloat16) == 10
    assert bytes_per_block(2, 4, 1, 8, "float32") == 2 * bytes_per_block(2, 4, 1, 8, "float16")
    with pytest.raises(CacheConfigError):
        num_blocks_for_budget(per - 1, 32, 16, 8, 128, "bf16")
    s = KVStorage.from_budget(5 * bytes_per_block(2, 4, 2, 8, "fp16") + 7, 2, 4, 2, 8, "fp16")
    assert s.num_blocks == 5 and s.memory_bytes == 5 * s.bytes_per_block
    assert s.dtype == torch.float16
    with pytest.raises(CacheConfigError):
        KVStorage.from_budget(10, 2, 4, 2, 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_with_storage_in_each_dtype(dtype):
    s = KVStorage(L, N, BS, H, D, dtype)
    c = PagedKVCache(N, BS, storage=s)
    assert c.stats().memory_total_bytes == s.memory_bytes
    c.create("a", list(range(6)))
    k, v = kv(6, dtype)
    for layer in range(L):
        s.write(layer, c.slot_mapping(["a"], 6), k, v)
    c.fork("a", "b")
    c.append("b", [1])  # copy-on-write copies the shared block's data in every layer
    c.append("a", [2])
    k2, v2 = kv(1, dtype, start=-100.0)
    s.write(0, c.slot_mapping(["a"], 1), k2, v2)
    for layer in range(L):
        gk, gv = s.gather(layer, c.block_ids("b"), 6)
        assert torch.equal(gk, k) and torch.equal(gv, v)
    assert torch.equal(s.gather(0, c.block_ids("a"), 7)[0][6], k2[0])
    assert bool((s.gather(0, c.block_ids("b"), 7)[0][6] == 0).all())  # b never wrote it
    assert c.stats().memory_used_bytes == 3 * s.bytes_per_block
