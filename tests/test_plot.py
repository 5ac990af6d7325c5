"""PNG block maps and the utilization plot (`pagedkv demo --plot`): real files, real pixels."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from pagedkv.cache import PagedKVCache
from pagedkv.cache.block_map import State, block_map
from pagedkv.demo import utilization_over_time, write_plots
from pagedkv.plot import (
    CACHED_RGB,
    FREE_RGB,
    OWNED_PALETTE,
    cell_color,
    map_image,
    render_block_map,
    shared_rgb,
)


def pixels(path) -> np.ndarray:
    with Image.open(path) as im:
        im.verify()  # a valid PNG, not just a file
    with Image.open(path) as im:
        assert im.format == "PNG"
        return np.asarray(im.convert("RGB"))


def every_state_cache() -> PagedKVCache:
    cache = PagedKVCache(24, 4)
    cache.create("gone", list(range(9)))  # 2 full (hashed) blocks + 1 partial
    cache.free("gone")  # -> 2 cached, 1 free
    cache.create("a", [50 + i for i in range(10)])
    cache.fork("a", "a2")  # 3 shared by 2
    cache.fork("a", "a3")  # ... by 3
    cache.create("b", [90 + i for i in range(6)])  # owned
    cache.create("c", [70 + i for i in range(5)])  # owned, another colour
    return cache


def test_pixels_match_states(tmp_path) -> None:
    cache = every_state_cache()
    m = block_map(cache)
    assert all(m.counts()[s] > 0 for s in ("free", "cached", "owned", "shared"))
    layout = render_block_map(m, tmp_path / "map.png", "test map")
    img = pixels(tmp_path / "map.png")
    for b in range(cache.num_blocks):
        x, y = layout.center(b)
        assert tuple(img[y, x]) == cell_color(m, b), f"block {b} ({State(m.state[b]).name})"
    # the colours say the states
    for b in np.flatnonzero(m.state == State.FREE):
        assert cell_color(m, b) == FREE_RGB
    for b in np.flatnonzero(m.state == State.CACHED):
        assert cell_color(m, b) == CACHED_RGB
    for b in np.flatnonzero(m.state == State.SHARED):
        assert cell_color(m, b) == shared_rgb(3)
    owned = {sid: cell_color(m, cache.block_ids(sid)[0]) for sid in ("b", "c")}
    assert owned["b"] != owned["c"] and set(owned.values()) <= set(OWNED_PALETTE)
    assert shared_rgb(2) != shared_rgb(8)  # intensity grows with the count


def test_demo_plots(tmp_path) -> None:
    paths = write_plots(tmp_path, num_blocks=3072)
    names = [p.name for p in paths]
    assert names == ["blockmap_1_admission.png", "blockmap_2_forks.png", "blockmap_3_churn.png",
                     "blockmap_4_defragmentation.png", "utilization.png"]
    imgs = {p.name: pixels(p) for p in paths}
    assert all(im.shape[0] > 300 and im.shape[1] > 600 for im in imgs.values())
    # same pool size, same geometry: the layout of an empty pool locates the demo's cells
    layout = render_block_map(block_map(PagedKVCache(3072, 16)), tmp_path / "empty.png")

    def at(name: str, b: int) -> tuple[int, ...]:
        x, y = layout.center(b)
        return tuple(imgs[name][y, x])

    assert at("blockmap_1_admission.png", 0) in OWNED_PALETTE  # allocation starts at id 0
    assert at("blockmap_1_admission.png", 3071) == FREE_RGB
    forks = imgs["blockmap_2_forks.png"]
    assert any(np.all(forks == shared_rgb(4), axis=-1).ravel())  # 4 samples share a prompt
    churn = imgs["blockmap_3_churn.png"]
    assert any(np.all(churn == CACHED_RGB, axis=-1).ravel())  # finished prompts stay cached
    # after defragmentation: used blocks first, then the cached ones, then the free ones
    rank = {FREE_RGB: 2, CACHED_RGB: 1}
    ranks = [rank.get(at("blockmap_4_defragmentation.png", b), 0) for b in range(3072)]
    assert ranks[0] == 0 and ranks[-1] == 2 and 1 in ranks and ranks == sorted(ranks)


@pytest.mark.parametrize("seed", [0, 1])
def test_utilization_series(seed: int) -> None:
    s = utilization_over_time(steps=300, seed=seed)
    paged = np.array(s["paged_util"])[50:]
    contiguous = np.array(s["contiguous_util"])[50:]
    assert (paged > 0.9).all() and (contiguous < 0.3).all()
    assert (np.array(s["paged_gib"]) <= np.array(s["contiguous_gib"]) + 1e-9).all()


def test_cli_takes_plot_dir() -> None:
    from pagedkv.cli import build_parser

    assert build_parser().parse_args(["demo", "--plot", "out"]).plot == "out"


def test_shared_colours_round_half_up() -> None:
    """The page (JavaScript Math.round) and the PNG must agree on every shared colour."""
    cache = PagedKVCache(4, 4)
    cache.create("a", [1, 2, 3])
    for k in range(2, 9):
        cache.fork("a", k)
        m = block_map(cache)
        assert tuple(map_image(m, 4)[0, 0]) == shared_rgb(k) == cell_color(m, 0)
    assert shared_rgb(3)[2] == 99  # 114 + (21 - 114) / 6 = 98.5 rounds up
