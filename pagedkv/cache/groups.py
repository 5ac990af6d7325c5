"""KV cache groups: which layers share a block table (vLLM v1's hybrid KV cache manager).

Layers of one attention type (full, or one sliding-window size) form groups of equal size; every
group's blocks come from the one pool and have the one page size: a block holds, for the group
that took it, `layers_per_group` layers' K/V of `block_size` tokens. Storage layer k of a block
is layer `group_layers[g][k]` of the model for the group g that holds the block. A window group
needs only the last `window` tokens of a sequence, so its blocks wholly before the window go
back to the pool.

Invariants: every model layer is in exactly one group, at one storage slot; groups are listed
full ones first (group 0 of a model without windows is the whole model, so a Llama cache is one
group exactly as before); a group's layers all have its window.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import CacheConfigError


@dataclass(frozen=True, slots=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its window in tokens, None for full attention
    group_layers: tuple[tuple[int, ...], ...]  # per group: its model layers, by storage slot
    layers_per_group: int  # storage layers of one block (the largest group)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return sum(len(g) for g in self.group_layers)

    @property
    def layer_group(self) -> tuple[int, ...]:
        """Per model layer: its group."""
        out = [0] * self.num_layers
        for g, layers in enumerate(self.group_layers):
            for layer in layers:
                out[layer] = g
        return tuple(out)

    @property
    def layer_slot(self) -> tuple[int, ...]:
        """Per model layer: its storage layer within its group's blocks."""
        out = [0] * self.num_layers
        for layers in self.group_layers:
            for k, layer in enumerate(layers):
                out[layer] = k
        return tuple(out)

    @property
    def has_windows(self) -> bool:
        return any(w is not None for w in self.windows)

    def summary(self) -> str:
        """`6 KV groups of 3 layers (1 full, 5 window 512)`."""
        kinds: dict[str, int] = {}
        for w in self.windows:
            k = "full" if w is None else f"window {w}"
            kinds[k] = kinds.get(k, 0) + 1
        inner = ", ".join(f"{n} {k}" for k, n in kinds.items())
        return f"{self.num_groups} KV groups of {self.layers_per_group} layers ({inner})"

    def describe(self) -> str:
        """`6 groups of 3 layers: full [5, 11, 17], window 512 [0, 1, 2], ...`."""
        parts = [f"{'full' if w is None else f'window {w}'} {list(ls)}"
                 for w, ls in zip(self.windows, self.group_layers, strict=True)]
        return f"{self.num_groups} group(s) of {self.layers_per_group} layers: " + ", ".join(parts)


def single_group(num_layers: int) -> KVGroups:
    """Every layer in one full-attention group (a model without windows, or hybrid off)."""
    return KVGroups((None,), (tuple(range(num_layers)),), num_layers)


def kv_groups(layer_windows: list[int | None], hybrid: bool = True) -> KVGroups:
    """Group layers by attention type. `layer_windows`: per layer its window (None: full).

    hybrid=False (or no window layer): one full group of every layer (windowed layers keep the
    whole context and still attend within their window). Otherwise the types' layer counts set
    the group size (the smallest count), and each type is cut into groups of that size in layer
    order (a last, shorter group leaves storage slots unused)."""
    n = len(layer_windows)
    if n < 1:
        raise CacheConfigError("a model needs at least one layer")
    for w in layer_windows:
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise CacheConfigError(f"a layer window must be a positive int or None, got {w!r}")
    if not hybrid or all(w is None for w in layer_windows):
        return single_group(n)
    by_type: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        by_type.setdefault(w, []).append(i)
    size = min(len(v) for v in by_type.values())
    order = sorted(by_type, key=lambda w: (w is not None, w or 0))  # full first, then by window
    windows: list[int | None] = []
    groups: list[tuple[int, ...]] = []
    for w in order:
        layers = by_type[w]
        for i in range(0, len(layers), size):
            windows.append(w)
            groups.append(tuple(layers[i : i + size]))
    return KVGroups(tuple(windows), tuple(groups), size)
