"""K/V tensors of every layer, addressed by block id and slot, in a float or quantized dtype.

Layout: one tensor `kv` of shape [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 of dim 1 is K, 1 is V). A layer's K cache `kv[l, 0]` is a contiguous
[num_blocks, block_size, H, D] view, so a slot `block_id * block_size + offset` addresses row
`slot` of its [num_blocks * block_size, H, D] flattening; a whole block (all layers, K and V) moves
with one indexed copy, which is what copy-on-write and defragmentation need.

Quantized dtypes (int8, fp8_e4m3; see quant.py) add `scales` [num_layers, 2, num_blocks,
block_size, num_kv_heads] float32, one per (token, KV head), laid out like `kv` without D: every
operation that moves K/V moves its scales with the same index (copy_blocks, move_slots,
export_blocks/import_blocks, block_bytes), and `memory_bytes` / `bytes_per_block` count them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.cache.quant import (
    FLOAT_DTYPES,
    SCALE_DTYPE,
    byte_view,
    dequantize,
    dtype_name,
    is_quantized,
    quantize,
    resolve_kv_cache_dtype,
)
from pagedkv.errors import CacheConfigError, InvalidBlockError, StorageMismatchError

DTYPES = FLOAT_DTYPES  # float dtype names (the model loader shares this table)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A storage dtype from a torch dtype or a kv_cache_dtype name other than "auto"."""
    out = resolve_kv_cache_dtype(dtype)
    if out is None:
        raise CacheConfigError('"auto" needs the model\'s dtype; resolve it first')
    return out


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str | torch.dtype
) -> int:
    """Bytes one block takes across all layers, K and V, scales included."""
    for name, v in (("num_layers", num_layers), ("block_size", block_size),
                    ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise CacheConfigError(f"{name} must be a positive int, got {v!r}")
    dt = resolve_dtype(dtype)
    item = torch.empty((), dtype=dt).element_size()
    rows = 2 * num_layers * block_size * num_kv_heads
    scale = SCALE_DTYPE.itemsize if is_quantized(dt) else 0
    return rows * (head_dim * item + scale)


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


@dataclass(frozen=True, slots=True)
class LayerKV:
    """One layer's cache as attention reads it: k/v [num_blocks, block_size, H, D] views, and
    for quantized dtypes k_scale/v_scale [num_blocks, block_size, H] float32 views (else None)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class KVStorage:
    """Pre-allocated K/V memory for `num_blocks` blocks of `block_size` tokens, every layer.

    `dtype` is the storage dtype: a torch dtype or a kv_cache_dtype name (float32, float16,
    bfloat16, int8, fp8_e4m3). Writes take K/V in any float dtype when quantized (in `dtype`
    exactly otherwise); reads (`read`, `gather`) return float values (dequantized).
    """

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
        self.quantized = is_quantized(self.dtype)
        self.device = torch.device(device)
        # [L, 2, N, bs, H, D]; zeros so an unwritten slot reads as 0, never as stale garbage
        self.kv = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        # [L, 2, N, bs, H] (zero scales read back as zeros too)
        self.scales = (
            torch.zeros(self.kv.shape[:-1], dtype=SCALE_DTYPE, device=self.device)
            if self.quantized
            else None
        )
        # per-layer views, built once (the model reads one per layer per step)
        self.layers = [self._layer_view(i) for i in range(num_layers)]
        # the model's layers: each one's view and KV group (`bind_groups`; unbound: model
        # layer i is storage layer i, all in group 0)
        self.model_layers = self.layers
        self.layer_group: tuple[int, ...] = (0,) * num_layers
        self.groups_desc = ""

    def bind_groups(self, groups) -> None:  # noqa: ANN001 (a cache.groups.KVGroups)
        """Map the model's layers onto the storage's by KV group: model layer i reads storage
        layer `groups.layer_slot[i]` through group `groups.layer_group[i]`'s block table."""
        if groups.layers_per_group != self.num_layers:
            raise StorageMismatchError(f"groups of {groups.layers_per_group} layers for a "
                                       f"storage of {self.num_layers}")
        self.model_layers = [self.layers[k] for k in groups.layer_slot]
        self.layer_group = groups.layer_group
        self.groups_desc = groups.describe() if groups.num_groups > 1 or groups.has_windows else ""

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

    def _layer_view(self, layer: int) -> LayerKV:
        sc = self.scales
        return LayerKV(
            self.kv[layer, 0],
            self.kv[layer, 1],
            None if sc is None else sc[layer, 0],
            None if sc is None else sc[layer, 1],
        )

    def layer(self, layer: int) -> LayerKV:
        """Layer `layer`'s K/V (and scales) views, as paged_attention takes them."""
        self._check_layer(layer)
        return self.layers[layer]

    def k_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, H, D] view of layer `layer`'s keys (raw storage dtype)."""
        return self.kv[layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, H, D] view of layer `layer`'s values (raw storage dtype)."""
        return self.kv[layer, 1]

    def __repr__(self) -> str:
        mib = self.memory_bytes / 2**20
        return (f"KVStorage({self.num_layers} layers, {self.num_blocks} blocks x "
                f"{self.block_size} tokens, {self.num_kv_heads} KV heads x {self.head_dim}, "
                f"{str(self.dtype).removeprefix('torch.')}, {self.device}, {mib:.1f} MiB)")

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def memory_bytes(self) -> int:
        """Exact bytes held: K/V plus scales."""
        n = self.kv.numel() * self.kv.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
        return n

    @property
    def bytes_per_block(self) -> int:
        return self.memory_bytes // self.num_blocks

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def layout(self) -> str:
        """Identifies the byte format of a block (see block_bytes): two storages can exchange
        blocks exactly when their layouts are equal."""
        out = (
            f"pagedkv-kv1:{self.dtype_name}:L{self.num_layers}:bs{self.block_size}"
            f":H{self.num_kv_heads}:D{self.head_dim}"
        )
        return out + (f":groups[{self.groups_desc}]" if self.groups_desc else "")

    # --- writes and reads ---------------------------------------------------------------------

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write T tokens' K/V ([T, H, D] each) of one layer at `slot_mapping` ([T] int64).

        One vectorized op per tensor (quantizing first for int8/fp8); slots equal to -1 are
        skipped (padding).
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
        write_layer(self.layers[layer], slot_mapping, k, v)

    def read(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ([H, D] each) stored at one slot (dequantized to float32 when quantized)."""
        self._check_layer(layer)
        if not 0 <= slot < self.num_slots:
            raise InvalidBlockError(f"slot {slot} outside [0, {self.num_slots})")
        b, o = divmod(slot, self.block_size)
        k, v = self.kv[layer, 0, b, o], self.kv[layer, 1, b, o]
        if self.scales is None:
            return k, v
        return dequantize(k, self.scales[layer, 0, b, o]), dequantize(v, self.scales[layer, 1, b, o])

    def gather(
        self, layer: int, block_ids: Sequence[int] | torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first `num_tokens` K/V as contiguous [num_tokens, H, D] tensors
        (dequantized to float32 when quantized: only these blocks are touched)."""
        self._check_layer(layer)
        ids = torch.as_tensor(block_ids, dtype=torch.int64, device=self.device)
        self._check_ids(ids)
        if not 0 <= num_tokens <= ids.numel() * self.block_size:
            raise StorageMismatchError(
                f"{num_tokens} tokens do not fit in {ids.numel()} blocks of {self.block_size}"
            )
        c = self.layers[layer]
        k = gather_blocks(c.k, c.k_scale, ids, num_tokens)
        v = gather_blocks(c.v, c.v_scale, ids, num_tokens)
        return k, v

    def copy_blocks(self, src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer, K, V and scales (indexed copies).

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
        kv = byte_view(self.kv)
        kv[:, :, d] = kv[:, :, s]
        if self.scales is not None:
            self.scales[:, :, d] = self.scales[:, :, s]

    # --- slot-wise moves and K rewrites (sequence operations) ---------------------------------

    def move_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy slot src[i] -> dst[i] in every layer, K and V (and scales); every source is read
        before any destination is written, so overlapping moves within one sequence are safe."""
        s, d = self._slot_tensor(src), self._slot_tensor(dst)
        if s.shape != d.shape:
            raise StorageMismatchError("move_slots needs two slot lists of equal length")
        flat = byte_view(self._flat())
        flat[:, :, d] = flat[:, :, s]
        if self.scales is not None:
            sc = self._flat_scales()
            sc[:, :, d] = sc[:, :, s]

    def rotated_keys(self, slots: torch.Tensor, rotate, delta: int) -> torch.Tensor:
        """K of every layer at `slots`, [L, T, H, D], passed through `rotate(k, delta)` (float32
        in; cast back to the cache dtype, or float32 for a quantized cache, which write_keys
        quantizes); nothing is written."""
        idx = self._slot_tensor(slots)
        k = self._flat()[:, 0, idx]
        kf = k.float() if self.scales is None else dequantize(k, self._flat_scales()[:, 0, idx])
        out = rotate(kf, delta)
        if not isinstance(out, torch.Tensor) or out.shape != k.shape:
            raise StorageMismatchError(f"rotation returned {getattr(out, 'shape', out)!r:.80}, "
                                       f"want {tuple(k.shape)}")
        return out.to(torch.float32 if self.quantized else self.dtype)

    def write_keys(self, slots: torch.Tensor, k: torch.Tensor) -> None:
        """Overwrite K of every layer at `slots` with k [L, T, H, D] (V unchanged; quantized
        caches quantize k and rewrite its scales)."""
        idx = self._slot_tensor(slots)
        if self.scales is None:
            self._flat()[:, 0, idx] = k
            return
        q, s = quantize(k, self.dtype)
        byte_view(self._flat())[:, 0, idx] = byte_view(q)
        self._flat_scales()[:, 0, idx] = s

    def _flat(self) -> torch.Tensor:
        """[L, 2, num_slots, H, D] view of the whole pool."""
        return self.kv.view(self.num_layers, 2, self.num_slots, self.num_kv_heads, self.head_dim)

    def _flat_scales(self) -> torch.Tensor:
        """[L, 2, num_slots, H] view of the scales (quantized storages only)."""
        return self.scales.view(self.num_layers, 2, self.num_slots, self.num_kv_heads)

    def _slot_tensor(self, slots: Sequence[int] | torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(slots, dtype=torch.int64, device=self.device).reshape(-1)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.num_slots):
            raise InvalidBlockError(f"slots must lie in [0, {self.num_slots})")
        return t

    # --- whole blocks, for KV tiers and snapshots ----------------------------------------------

    def block_layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Name -> (dtype, shape) of each part of one block's full contents (all layers, K and
        V, and for int8/fp8 the float32 scales, one per (layer, K/V, token, kv head))."""
        shape = (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        out = {"kv": (self.dtype, shape)}
        if self.scales is not None:
            out["scales"] = (SCALE_DTYPE, shape[:-1])
        return out

    def export_blocks(self, block_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        """Copies of the blocks' full contents: each part [n, *block_layout shape], contiguous,
        on the CPU (one indexed gather per part)."""
        ids = torch.as_tensor(block_ids, dtype=torch.int64, device=self.device)
        self._check_ids(ids)
        kv = self.kv.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()
        out = {"kv": kv.cpu()}
        if self.scales is not None:
            out["scales"] = self.scales.index_select(2, ids).permute(2, 0, 1, 3, 4).contiguous().cpu()
        return out

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
            kv = parts["kv"].to(self.device).permute(1, 2, 0, 3, 4, 5)
            byte_view(self.kv)[:, :, ids] = byte_view(kv)
            if self.scales is not None:
                self.scales[:, :, ids] = parts["scales"].to(self.device).permute(1, 2, 0, 3, 4)

    def block_bytes(self, block_id: int) -> bytes:
        """Block `block_id` as exactly `bytes_per_block` bytes: each block_layout part in order
        (K/V [L, 2, bs, H, D] in the storage dtype, then any scales [L, 2, bs, H] float32), C
        order, native byte order; `layout` names the format."""
        parts = self.export_blocks([block_id])
        return b"".join(_raw(t) for t in parts.values())

    def write_block_bytes(self, block_id: int, raw: bytes | bytearray | memoryview) -> None:
        """Inverse of block_bytes. A wrong length raises StorageMismatchError, changing nothing."""
        if len(raw) != self.bytes_per_block:
            raise StorageMismatchError(f"{len(raw)} bytes given, a block is {self.bytes_per_block}")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        parts, at = {}, 0
        for name, (dt, shape) in self.block_layout().items():
            n = math.prod(shape) * dt.itemsize
            parts[name] = flat[at : at + n].view(dt).view(1, *shape)
            at += n
        self.import_blocks([block_id], parts)

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
        ok = t.is_floating_point() and t.itemsize > 1 if self.quantized else t.dtype == self.dtype
        if not ok:
            raise StorageMismatchError(f"{name} dtype {t.dtype} does not fit cache dtype {self.dtype}")
        if t.device != self.device:
            raise StorageMismatchError(f"{name} on {t.device}, cache on {self.device}")


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()


def write_layer(
    cache: LayerKV, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    skips: bool | None = None,
) -> None:
    """Unchecked hot-path write of one layer: slot_mapping [T], k/v [T, H, D] (any float dtype,
    converted to the cache's).

    Quantized caches get q and scale from one vectorized quantize per tensor, then the same
    indexed copy as the float path writes both. Slots equal to -1 are skipped. `skips`: whether
    slot_mapping holds a -1, if the caller already knows (None: checked here, a device sync).
    """
    slots = slot_mapping.to(torch.int64)
    if skips is None:
        skips = bool(slots.numel()) and bool((slots < 0).any())
    if skips:
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    h, d = cache.k.shape[-2:]
    if cache.k_scale is None:
        if k.dtype != cache.k.dtype:  # e.g. a float32 model over a bfloat16 cache
            k, v = k.to(cache.k.dtype), v.to(cache.v.dtype)
        cache.k.view(-1, h, d).index_copy_(0, slots, k)
        cache.v.view(-1, h, d).index_copy_(0, slots, v)
        return
    for data, scale, x in ((cache.k, cache.k_scale, k), (cache.v, cache.v_scale, v)):
        q, s = quantize(x, data.dtype)
        byte_view(data).view(-1, h, d).index_copy_(0, slots, byte_view(q))
        scale.view(-1, h).index_copy_(0, slots, s)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Unchecked hot-path write: k_cache/v_cache [N, bs, H, D], slot_mapping [T], k/v [T, H, D];
    k_scale/v_scale [N, bs, H] for quantized caches."""
    write_layer(LayerKV(k_cache, v_cache, k_scale, v_scale), slot_mapping, k, v)


def gather_blocks(
    cache: torch.Tensor,
    scale: torch.Tensor | None,
    ids: torch.Tensor,
    num_tokens: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The first `num_tokens` rows of blocks `ids` of one layer's K or V ([N, bs, H, D]) as a
    contiguous [num_tokens, H, D] tensor; quantized rows are dequantized to `dtype` (only the
    gathered blocks), float rows keep the cache dtype."""
    x = cache.index_select(0, ids).flatten(0, 1)[:num_tokens]
    if scale is None:
        return x
    s = scale.index_select(0, ids).flatten(0, 1)[:num_tokens]
    return dequantize(x, s, dtype)
