"""A GGUF loads as views of the mapped file: no copy of the quantized blocks, no numpy pass."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_gguf import SPECS, write_tiny_gguf

from pagedkv.model import load_model
from pagedkv.model.gguf_file import GGUFFile


def _mapped_file(ptr: int) -> str | None:
    """The file /proc/self/maps says address `ptr` belongs to (None: anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= ptr < hi:
            return fields[5] if len(fields) > 5 else None
    return None


@pytest.fixture(scope="module")
def qwen2_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(SPECS["qwen2"], tmp_path_factory.mktemp("load") / "qwen2.gguf")


def test_quantized_blocks_are_views_of_the_file(qwen2_file: Path) -> None:
    model = load_model(qwen2_file).model  # qwen2: no q/k row reordering, so nothing is copied
    qws = model.qweights()
    assert qws and all(_mapped_file(d.data_ptr()) == str(qwen2_file) for q in qws for _, d in q.parts)
    # the views survive the reader that made them (the tensors keep the mapping alive)
    g = GGUFFile(qwen2_file)
    name = "blk.1.ffn_down.weight"
    expected = np.asarray(g.raw(name))
    del g
    assert torch.equal(model.layers[1].down_proj.q.parts[0][1], torch.from_numpy(expected.copy()))


def test_views_are_private_copy_on_write(qwen2_file: Path) -> None:
    """Writing into a view (nothing in pagedkv does) changes this process's copy, never the file."""
    before = qwen2_file.read_bytes()
    g = GGUFFile(qwen2_file)
    assert g.copy_on_write
    t = g.tensor_bytes("blk.0.attn_v.weight")
    t.zero_()
    assert int(GGUFFile(qwen2_file).tensor_bytes("blk.0.attn_v.weight").sum()) > 0
    assert qwen2_file.read_bytes() == before


def test_llama_qk_rows_are_reordered_copies(tmp_path: Path) -> None:
    """Only a llama file's q/k rows (llama.cpp's interleave undone) leave the mapping."""
    path = write_tiny_gguf(SPECS["llama"], tmp_path / "llama.gguf")
    layer = load_model(path).model.layers[0]
    q, k, v = (d for _, d in layer.qkv_proj.q.parts)
    assert _mapped_file(q.data_ptr()) != str(path) and _mapped_file(k.data_ptr()) != str(path)
    assert _mapped_file(v.data_ptr()) == str(path)
    assert _mapped_file(layer.gate_up_proj.q.parts[0][1].data_ptr()) == str(path)


def test_bench_decode_any_model(qwen2_file: Path) -> None:
    """`pagedkv bench decode --model PATH --quick` on a file that is not the shipped one."""
    import argparse

    from pagedkv.bench import bench_decode

    args = argparse.Namespace(model=str(qwen2_file), threads=1, quick=True, decode_tokens=8,
                              prefill_tokens=16, repeats=1)
    res = bench_decode.run(args)
    assert res["architecture"] == "qwen2" and res["file_bytes"] == qwen2_file.stat().st_size
    assert set(res["types"]) == {"Q8_0", "Q4_0", "F32"}
    assert res["types"]["Q4_0"]["tensors"] == 3 * 2  # gate, up, down in both layers
    assert 0.9 < res["weight_bytes_vs_file"] <= 1.0
    for mode in ("quantized", "quantized_int8"):
        assert res[mode]["decode_tok_s"] > 0 and res[mode]["prefill_tok_s"] > 0
