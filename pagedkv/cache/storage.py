"""K/V tensors of every layer, addressed by block id and slot.

Layout: one tensor `kv` of shape [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 of dim 1 is K, 1 is V). A layer's K cache `kv[l, 0]` is a contiguous
[num_blocks, block_size, H, D] view, so a slot `block_id * block_size + offset` addresses row
`slot` of its [num_blocks * block_size, H, D] flattening; a whole block (all layers, K and V) moves
with one indexed copy, which is what copy-on-write and defragmentation need.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.errors import CacheConfigError, InvalidBlockError, StorageMismatchError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise CacheConfigError(f"unsupported KV dtype {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise CacheConfigError(f"unsupported KV dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str | torch.dtype
) -> int:
    """Bytes one block takes across all layers, K and V."""
    for name, v in (("num_layers", num_layers), ("block_size", block_size),
                    ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise CacheConfigError(f"{name} must be a positive int, got {v!r}")
    item = torch.empty((), dtype=resolve_dtype(dtype)).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * item


def num_blocks_for_budget(
    budget_bytes: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str | torch.dtype,
) -> int:
    """How many blocks fit in `budget_bytes` (at least one, or CacheConfigError)."""
    per = bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
    n = int(budget_bytes) // per
    if n < 1:
        raise CacheConfigError(f"a budget of {budget_bytes} bytes holds no block of {per} bytes")
    return n


class KVStorage:
    """Pre-allocated K/V memory for `num_blocks` blocks of `block_size` tokens, every layer."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        for name, v in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(v, int) or v < 1:
                raise CacheConfigError(f"{name} must be a positive int, got {v!r}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        # [L, 2, N, bs, H, D]; zeros so an unwritten slot reads as 0, never as stale garbage
        self.kv = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
            dtype=self.dtype,
            device=self.device,
        )

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> KVStorage:
        n = num_blocks_for_budget(budget_bytes, num_layers, block_size, num_kv_heads, head_dim, dtype)
        return cls(num_layers, n, block_size, num_kv_heads, head_dim, dtype, device)

    # --- views --------------------------------------------------------------------------------

    def k_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, H, D] view of layer `layer`'s keys."""
        return self.kv[layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, H, D] view of layer `layer`'s values."""
        return self.kv[layer, 1]

    def __repr__(self) -> str:
        mib = self.memory_bytes / 2**20
        return (f"KVStorage({self.num_layers} layers, {self.num_blocks} blocks x "
                f"{self.block_size} tokens, {self.num_kv_heads} KV heads x {self.head_dim}, "
                f"{str(self.dtype).removeprefix('torch.')}, {self.device}, {mib:.1f} MiB)")

    @property
    def memory_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.memory_bytes // self.num_blocks

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    # --- writes and reads ---------------------------------------------------------------------

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write T tokens' K/V ([T, H, D] each) of one layer at `slot_mapping` ([T] int64).

        One vectorized op per tensor; slots equal to -1 are skipped (padding).
        """
        self._check_layer(layer)
        self._check_kv(k, "k")
        self._check_kv(v, "v")
        if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0] or k.shape != v.shape:
            raise StorageMismatchError(
                f"slot_mapping {tuple(slot_mapping.shape)} does not match k {tuple(k.shape)} "
                f"/ v {tuple(v.shape)}"
            )
        if slot_mapping.dtype not in (torch.int64, torch.int32):
            raise StorageMismatchError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
        if slot_mapping.device != self.device:
            raise StorageMismatchError(f"slot_mapping on {slot_mapping.device}, cache on {self.device}")
        if slot_mapping.numel() and (
            int(slot_mapping.min()) < -1 or int(slot_mapping.max()) >= self.num_slots
        ):
            raise InvalidBlockError(f"slots must lie in [0, {self.num_slots}) or be -1 (padding)")
        write_kv(self.k_cache(layer), self.v_cache(layer), slot_mapping, k, v)

    def read(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ([H, D] each) stored at one slot."""
        self._check_layer(layer)
        if not 0 <= slot < self.num_slots:
            raise InvalidBlockError(f"slot {slot} outside [0, {self.num_slots})")
        b, o = divmod(slot, self.block_size)
        return self.kv[layer, 0, b, o], self.kv[layer, 1, b, o]

    def gather(
        self, layer: int, block_ids: Sequence[int] | torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first `num_tokens` K/V as contiguous [num_tokens, H, D] tensors."""
        self._check_layer(layer)
        ids = torch.as_tensor(block_ids, dtype=torch.int64, device=self.device)
        self._check_ids(ids)
        if not 0 <= num_tokens <= ids.numel() * self.block_size:
            raise StorageMismatchError(
                f"{num_tokens} tokens do not fit in {ids.numel()} blocks of {self.block_size}"
            )
        shape = (-1, self.num_kv_heads, self.head_dim)
        k = self.k_cache(layer).index_select(0, ids).reshape(shape)[:num_tokens]
        v = self.v_cache(layer).index_select(0, ids).reshape(shape)[:num_tokens]
        return k, v

    def copy_blocks(self, src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer, K and V (one indexed copy).

        Sources are read before any destination is written, so any permutation is safe.
        """
        s = torch.as_tensor(src, dtype=torch.int64, device=self.device)
        d = torch.as_tensor(dst, dtype=torch.int64, device=self.device)
        if s.shape != d.shape or s.dim() != 1:
            raise StorageMismatchError("copy_blocks needs two 1-D id lists of equal length")
        if s.numel() == 0:
            return
        self._check_ids(s)
        self._check_ids(d)
        self.kv[:, :, d] = self.kv[:, :, s]

    # --- slot-wise moves and K rewrites (sequence operations) ---------------------------------

    def move_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy slot src[i] -> dst[i] in every layer, K and V; every source is read before any
        destination is written, so overlapping moves within one sequence are safe."""
        s, d = self._slot_tensor(src), self._slot_tensor(dst)
        if s.shape != d.shape:
            raise StorageMismatchError("move_slots needs two slot lists of equal length")
        flat = self._flat()
        flat[:, :, d] = flat[:, :, s]

    def rotated_keys(self, slots: torch.Tensor, rotate, delta: int) -> torch.Tensor:
        """K of every layer at `slots`, [L, T, H, D], passed through `rotate(k, delta)` (float32
        in, cast back to the cache dtype); nothing is written."""
        k = self._flat()[:, 0, self._slot_tensor(slots)]
        out = rotate(k.float(), delta)
        if not isinstance(out, torch.Tensor) or out.shape != k.shape:
            raise StorageMismatchError(f"rotation returned {getattr(out, 'shape', out)!r:.80}, "
                                       f"want {tuple(k.shape)}")
        return out.to(self.dtype)

    def write_keys(self, slots: torch.Tensor, k: torch.Tensor) -> None:
        """Overwrite K of every layer at `slots` with k [L, T, H, D] (V unchanged)."""
        self._flat()[:, 0, self._slot_tensor(slots)] = k

    def _flat(self) -> torch.Tensor:
        """[L, 2, num_slots, H, D] view of the whole pool."""
        return self.kv.view(self.num_layers, 2, self.num_slots, self.num_kv_heads, self.head_dim)

    def _slot_tensor(self, slots: Sequence[int] | torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(slots, dtype=torch.int64, device=self.device).reshape(-1)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.num_slots):
            raise InvalidBlockError(f"slots must lie in [0, {self.num_slots})")
        return t

    # --- whole blocks, for KV tiers and snapshots ----------------------------------------------

    def block_layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Name -> (dtype, shape) of each part of one block's full contents (all layers, K and
        V, and any per-block side data such as quantization scales)."""
        return {"kv": (self.dtype, (self.num_layers, 2, self.block_size, self.num_kv_heads,
                                    self.head_dim))}

    def export_blocks(self, block_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        """Copies of the blocks' full contents: each part [n, *block_layout shape], contiguous,
        on the CPU (one indexed gather per part)."""
        ids = torch.as_tensor(block_ids, dtype=torch.int64, device=self.device)
        self._check_ids(ids)
        kv = self.kv.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()
        return {"kv": kv.cpu()}

    def import_blocks(self, block_ids: Sequence[int], parts: dict[str, torch.Tensor]) -> None:
        """Overwrite whole blocks with `parts` as `export_blocks` returns them (checked first:
        a mismatch raises StorageMismatchError and writes nothing)."""
        ids = torch.as_tensor(block_ids, dtype=torch.int64, device=self.device)
        self._check_ids(ids)
        layout = self.block_layout()
        if set(parts) != set(layout):
            raise StorageMismatchError(f"block parts {sorted(parts)} != {sorted(layout)}")
        for name, (dt, shape) in layout.items():
            t = parts[name]
            if t.dtype != dt or tuple(t.shape) != (ids.numel(), *shape):
                raise StorageMismatchError(
                    f"part {name!r}: {t.dtype} {tuple(t.shape)}, want {dt} {(ids.numel(), *shape)}")
        if ids.numel():
            self.kv[:, :, ids] = parts["kv"].to(self.device).permute(1, 2, 0, 3, 4, 5)

    # --- checks -------------------------------------------------------------------------------

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise StorageMismatchError(f"layer {layer} outside [0, {self.num_layers})")

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise InvalidBlockError(f"block ids must lie in [0, {self.num_blocks})")

    def _check_kv(self, t: torch.Tensor, name: str) -> None:
        want = (self.num_kv_heads, self.head_dim)
        if t.dim() != 3 or tuple(t.shape[1:]) != want:
            raise StorageMismatchError(f"{name} must be [T, {want[0]}, {want[1]}], got {tuple(t.shape)}")
        if t.dtype != self.dtype:
            raise StorageMismatchError(f"{name} dtype {t.dtype} != cache dtype {self.dtype}")
        if t.device != self.device:
            raise StorageMismatchError(f"{name} on {t.device}, cache on {self.device}")


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Unchecked hot-path write: k_cache/v_cache [N, bs, H, D], slot_mapping [T], k/v [T, H, D]."""
    slots = slot_mapping.to(torch.int64)
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    h, d = k_cache.shape[-2:]
    k_cache.view(-1, h, d).index_copy_(0, slots, k)
    v_cache.view(-1, h, d).index_copy_(0, slots, v)
