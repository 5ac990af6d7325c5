"""PNG pictures of the KV pool (matplotlib): a block map, and utilization over time.

`render_block_map` draws one cell per block in id order, left to right and top to bottom,
coloured by state: free (light grey), cached (light blue), owned (one colour per sequence, from
a fixed palette), shared (red, darker with more holders). A strip above the map gives the counts
and summary figures; a legend below names the colours. `cell_color` is the single source of the
colours, so tests can check pixels against it; the returned `MapLayout` says where each cell's
centre lies in the PNG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedkv.cache.block_map import BlockMap, State

FREE_RGB = (230, 230, 230)
CACHED_RGB = (158, 202, 225)
SHARED_LIGHT, SHARED_DARK = (252, 146, 114), (165, 15, 21)
SHARED_MAX = 8  # ref counts at or above this get the darkest red
OWNED_PALETTE = (  # distinguishable hues; no reds, oranges or pinks (those mean shared)
    (31, 119, 180), (44, 160, 44), (148, 103, 189), (188, 189, 34), (23, 190, 207),
    (87, 117, 144), (214, 175, 40), (60, 60, 60), (102, 194, 165), (117, 107, 177),
    (0, 90, 50),
)


@dataclass(frozen=True)
class MapLayout:
    """Where the cells lie in the saved PNG (pixels, origin top left)."""

    cols: int
    x0: float  # left edge of cell column 0
    y0: float  # top edge of cell row 0
    cell_w: float
    cell_h: float

    def center(self, block_id: int) -> tuple[int, int]:
        r, c = divmod(block_id, self.cols)
        return (int(self.x0 + (c + 0.5) * self.cell_w), int(self.y0 + (r + 0.5) * self.cell_h))


def shared_rgb(refs: int) -> tuple[int, int, int]:
    t = min(max(refs, 2), SHARED_MAX) - 2
    t /= SHARED_MAX - 2
    # floor(x + 0.5): half rounds up, as in the dashboard's JavaScript (Python's round() would
    # round half to even)
    return tuple(math.floor(a + (b - a) * t + 0.5)
                 for a, b in zip(SHARED_LIGHT, SHARED_DARK, strict=True))


def cell_color(m: BlockMap, block_id: int) -> tuple[int, int, int]:
    """The RGB colour of one block's cell."""
    s = m.state[block_id]
    if s == State.FREE:
        return FREE_RGB
    if s == State.CACHED:
        return CACHED_RGB
    if s == State.OWNED:
        return OWNED_PALETTE[int(m.owner[block_id]) % len(OWNED_PALETTE)]
    return shared_rgb(int(m.refs[block_id]))


def map_image(m: BlockMap, cols: int) -> np.ndarray:
    """uint8 [rows, cols, 3]: the map as an image, one pixel per block (vectorized)."""
    rows = math.ceil(m.num_blocks / cols)
    img = np.full((rows * cols, 3), 255, np.uint8)  # cells past the last block stay white
    st = m.state
    img[: m.num_blocks][st == State.FREE] = FREE_RGB
    img[: m.num_blocks][st == State.CACHED] = CACHED_RGB
    owned = np.flatnonzero(st == State.OWNED)
    palette = np.array(OWNED_PALETTE, np.uint8)
    img[owned] = palette[m.owner[owned] % len(palette)]
    shared = np.flatnonzero(st == State.SHARED)
    t = (np.clip(m.refs[shared], 2, SHARED_MAX) - 2) / (SHARED_MAX - 2)
    lo, hi = np.array(SHARED_LIGHT, float), np.array(SHARED_DARK, float)
    img[shared] = np.floor(lo + (hi - lo) * t[:, None] + 0.5).astype(np.uint8)
    return img.reshape(rows, cols, 3)


def summary_line(m: BlockMap) -> str:
    c, s = m.counts(), m.summary
    return (
        f"{m.num_blocks} blocks of {m.block_size}:  free {c['free']}  cached {c['cached']}  "
        f"owned {c['owned']}  shared {c['shared']}\n"
        f"utilization {s['utilization']:.1%}   internal waste {s['internal_waste']} slots   "
        f"prefix hit rate {s['prefix_hit_rate']:.1%}   CoW copies {s['cow_copies']}   "
        f"sequences {s['active_sequences']}"
    )


def render_block_map(m: BlockMap, path: str | Path, title: str = "KV block map",
                     cols: int | None = None) -> MapLayout:
    """Write the block map of `m` as a PNG at `path`; return where its cells lie."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    cols = cols or max(8, math.ceil(math.sqrt(m.num_blocks * 2)))
    img = map_image(m, cols)
    rows = img.shape[0]
    dpi, width_in = 100, 10.0
    map_h = width_in * 0.9 * rows / cols
    h = map_h + 1.6
    fig = plt.figure(figsize=(width_in, h), dpi=dpi)
    ax = fig.add_axes((0.05, 0.5 / h, 0.9, map_h / h))
    ax.imshow(img, interpolation="nearest", aspect="auto", extent=(0, cols, rows, 0))
    ax.set_xticks([])
    ax.set_yticks([])
    if width_in * 0.9 * dpi / cols >= 6:  # cells big enough to separate with thin lines
        ax.vlines(np.arange(1, cols), 0, rows, colors="white", linewidths=0.4)
        ax.hlines(np.arange(1, rows), 0, cols, colors="white", linewidths=0.4)
    fig.text(0.05, 1 - 0.25 / h, title, fontsize=13, weight="bold", va="top")
    fig.text(0.05, 1 - 0.6 / h, summary_line(m), fontsize=9, va="top", family="monospace")
    legend = [
        Patch(color=np.array(FREE_RGB) / 255, label="free"),
        Patch(color=np.array(CACHED_RGB) / 255, label="cached (evictable prefix)"),
        Patch(color=np.array(OWNED_PALETTE[0]) / 255, label="owned (one colour per sequence)"),
        Patch(color=np.array(shared_rgb(2)) / 255, label="shared by 2"),
        Patch(color=np.array(shared_rgb(SHARED_MAX)) / 255, label=f"shared by {SHARED_MAX}+"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=5, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.1 / h))
    fig.canvas.draw()
    (left, top), (right, bottom) = ax.transData.transform([(0, 0), (cols, rows)])
    height_px = fig.get_figheight() * dpi
    layout = MapLayout(cols, left, height_px - top, (right - left) / cols, (top - bottom) / rows)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return layout


def render_utilization(series: dict[str, list[float]], path: str | Path) -> None:
    """Utilization and reserved KV memory over time, paged vs contiguous, as a PNG.

    `series`: step, paged_util, contiguous_util (fractions), paged_gib, contiguous_gib.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), dpi=100, sharex=True)
    t = series["step"]
    a.plot(t, np.array(series["paged_util"]) * 100, label="paged (blocks of 16)", color="C0")
    a.plot(t, np.array(series["contiguous_util"]) * 100, label="contiguous (max-length buffer)",
           color="C3")
    a.set_ylabel("utilization (%)")
    a.set_ylim(0, 105)
    a.legend(loc="center right")
    a.set_title("KV cache utilization over time: live tokens / reserved slots")
    b.plot(t, series["paged_gib"], color="C0", label="paged")
    b.plot(t, series["contiguous_gib"], color="C3", label="contiguous")
    b.set_ylabel("KV memory reserved (GiB)")
    b.set_xlabel("decode step")
    b.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
