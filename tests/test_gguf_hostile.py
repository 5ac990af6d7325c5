"""A GGUF file is untrusted input: every malformed header, tensor record or metadata value is
refused at load with a ModelLoadError naming it, before anything is allocated by it; never an
untyped exception, a huge allocation or a crash. Each case edits one field of a valid file."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from tiny_gguf import SPECS, write_tiny_gguf

from pagedkv.engine import LLMEngine
from pagedkv.errors import InvalidParamsError, ModelLoadError
from pagedkv.model import load_model
from pagedkv.model.gguf_file import GGUFFile


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(SPECS["qwen2"], tmp_path_factory.mktemp("hostile") / "qwen2.gguf", fast=True)


def _offsets(path: Path) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """Byte offsets of each metadata value (key -> offset, numpy dtype) and of each tensor
    record's parts (name -> [n_dims, dims (n_dims uint64), type, offset])."""
    r = gguf.GGUFReader(path)
    b0 = r.data.__array_interface__["data"][0]

    def at(part: np.ndarray) -> int:
        return part.__array_interface__["data"][0] - b0

    fields = {k: (at(f.parts[-1]), f.parts[-1].dtype) for k, f in r.fields.items()}
    tensors = {t.name: [at(p) for p in t.field.parts[2:]] for t in r.tensors}
    return fields, tensors


def _edit(base: Path, tmp_path: Path, pos: int, fmt: str, value: object) -> Path:
    data = bytearray(base.read_bytes())
    data[pos:pos + struct.calcsize(fmt)] = struct.pack(fmt, value)
    out = tmp_path / "edited.gguf"
    out.write_bytes(bytes(data))
    return out


# (tensor, part: "n_dims" / "dim0" / "dim1" / "type" / "offset", value, message)
TENSOR_CASES = [
    ("blk.0.attn_q.weight", "n_dims", 0, "dimensions"),
    ("blk.0.attn_q.weight", "n_dims", 9, "dimensions"),
    ("blk.0.attn_q.weight", "dim0", (1 << 63) - 1, "whole|past the end"),
    ("blk.0.attn_q.weight", "dim1", 1 << 40, "past the end"),
    ("token_embd.weight", "type", int(gguf.GGMLQuantizationType.Q4_K), "whole Q4_K blocks"),
    ("blk.0.ffn_down.weight", "type", int(gguf.GGMLQuantizationType.Q6_K), "whole Q6_K blocks"),
    ("blk.0.attn_norm.weight", "type", int(gguf.GGMLQuantizationType.Q4_K), "whole Q4_K blocks"),
    ("blk.0.attn_q.weight", "type", 99, "not a valid GGUF"),
    ("blk.0.attn_q.weight", "offset", 1 << 50, "past the end"),
    ("blk.0.attn_q.weight", "offset", 1, "alignment"),
]


@pytest.mark.parametrize(("tensor", "part", "value", "match"), TENSOR_CASES)
def test_bad_tensor_records_are_refused(base: Path, tmp_path: Path, tensor: str, part: str, value: int,
                                        match: str) -> None:
    _, tensors = _offsets(base)
    parts = tensors[tensor]
    pos, fmt = {"n_dims": (parts[0], "<I"), "dim0": (parts[1], "<Q"), "dim1": (parts[1] + 8, "<Q"),
                "type": (parts[-2], "<I"), "offset": (parts[-1], "<Q")}[part]
    if part == "offset" and value == 1:  # one byte past its place: misaligned
        value = struct.unpack_from("<Q", base.read_bytes(), pos)[0] + 1
    with pytest.raises(ModelLoadError, match=match):
        load_model(_edit(base, tmp_path, pos, fmt, value))


# (metadata key, value, message): sizes the tensors do not have, values no model can use
META_CASES = [
    ("qwen2.embedding_length", 1 << 31, "embedding_length"),
    ("qwen2.embedding_length", 0, "positive"),
    ("qwen2.attention.head_count", 0, "positive"),
    ("qwen2.attention.head_count", 10**9, "head_count"),
    ("qwen2.attention.head_count_kv", 10**9, "head_count_kv|multiple"),
    ("qwen2.block_count", 1000, "block_count"),
    ("qwen2.feed_forward_length", 7, "feed_forward_length"),
    ("qwen2.rope.freq_base", float("nan"), "rope_theta"),
    ("qwen2.rope.freq_base", -1.0, "rope_theta"),
    ("qwen2.attention.layer_norm_rms_epsilon", -1.0, "rms_norm_eps"),
    ("qwen2.attention.layer_norm_rms_epsilon", float("inf"), "rms_norm_eps"),
]


@pytest.mark.parametrize(("key", "value", "match"), META_CASES)
def test_bad_metadata_is_refused_before_allocating(base: Path, tmp_path: Path, key: str, value: object,
                                                   match: str) -> None:
    fields, _ = _offsets(base)
    pos, dtype = fields[key]
    fmt = {np.dtype(np.uint32): "<I", np.dtype(np.int32): "<i", np.dtype(np.uint64): "<Q",
           np.dtype(np.float32): "<f"}[dtype]
    with pytest.raises(ModelLoadError, match=match):
        load_model(_edit(base, tmp_path, pos, fmt, value))


@pytest.mark.parametrize("align", [0, 3, 48, 1 << 40])
def test_bad_alignment_is_refused(tmp_path: Path, align: int) -> None:
    """general.alignment (uint64 here) must be a power of two: it divides the data offset."""
    key = b"general.alignment"
    out = tmp_path / "align.gguf"
    out.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                    + struct.pack("<IQ", int(gguf.GGUFValueType.UINT64), align))
    with pytest.raises(ModelLoadError, match="power of two"):
        GGUFFile(out)


@pytest.mark.parametrize("cut", [3, 23, 200, 5000, -1])
def test_truncated_files_are_refused(base: Path, tmp_path: Path, cut: int) -> None:
    out = tmp_path / "cut.gguf"
    out.write_bytes(base.read_bytes()[:cut])
    with pytest.raises(ModelLoadError):
        load_model(out)


def test_a_file_without_a_usable_tokenizer_takes_token_ids(base: Path, tmp_path: Path) -> None:
    """A vocabulary the tokenizer cannot be built from (one token's bytes edited: a merge then
    names a token that is not in it) loads without a tokenizer: text prompts get a typed error
    naming that, token ids still run."""
    r = gguf.GGUFReader(base)
    f = r.fields["tokenizer.ggml.tokens"]
    b0 = r.data.__array_interface__["data"][0]
    merges = [str(bytes(r.fields["tokenizer.ggml.merges"].parts[i]), "utf-8")
              for i in r.fields["tokenizer.ggml.merges"].data]
    merged = {a + b for a, b in (m.split(" ") for m in merges)}
    tokens = [str(bytes(f.parts[i]), "utf-8") for i in f.data]
    i = next(i for i, t in enumerate(tokens) if t in merged and t.isascii() and len(t) > 2)
    pos = f.parts[f.data[i]].__array_interface__["data"][0] - b0
    data = bytearray(base.read_bytes())
    data[pos] = ord("~") if data[pos] != ord("~") else ord("!")
    out = tmp_path / "notok.gguf"
    out.write_bytes(bytes(data))
    engine = LLMEngine(str(out), threads=1)
    assert engine.tokenizer is None
    with pytest.raises(InvalidParamsError, match="no tokenizer"):
        engine.add_request("a", "hello")
    with pytest.raises(InvalidParamsError, match="no tokenizer"):
        engine.add_request("b", [{"role": "user", "content": "hi"}])
    engine.add_request("c", [1, 2, 3])
    while engine.has_unfinished_requests():
        engine.step()


def test_a_tensor_named_twice_is_refused(base: Path, tmp_path: Path) -> None:
    data = base.read_bytes()
    a, b = b"blk.0.attn_q.weight", b"blk.0.attn_k.weight"  # the same length
    out = tmp_path / "twice.gguf"
    out.write_bytes(data.replace(a, b, 1))
    with pytest.raises(ModelLoadError, match="twice"):
        GGUFFile(out)


def test_a_huge_claimed_context_costs_nothing_until_used(base: Path, tmp_path: Path) -> None:
    """context_length is the model's claim, not an allocation: the block tables start narrow
    and grow with the sequences (2^31 tokens' tables were 8.6 GB a KV group, an OOM kill for
    a Gemma 3 file's three groups)."""
    fields, _ = _offsets(base)
    pos, dtype = fields["qwen2.context_length"]
    engine = LLMEngine(str(_edit(base, tmp_path, pos, "<I" if dtype == np.uint32 else "<Q", 1 << 31)), threads=1)
    assert engine.max_model_len == 1 << 31
    assert all(t.buf.shape[1] <= 4096 for t in engine.cache.tables)
    engine.add_request("a", list(range(1, 40)))
    while engine.has_unfinished_requests():
        engine.step()


# --- a checkpoint folder (config.json + safetensors) is checked the same way -------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    path = tmp_path_factory.mktemp("hf")
    tf.Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize(("key", "value", "match"), [
    ("hidden_size", 1 << 31, "hidden_size"),
    ("num_attention_heads", 0, "positive|num_attention_heads"),
    ("num_attention_heads", 10**9, "head_dim|num_attention_heads"),
    ("num_hidden_layers", 1000, "num_hidden_layers"),
    ("intermediate_size", 7, "intermediate_size"),
    ("vocab_size", 10**9, "vocab_size"),
    ("rope_theta", "fast", "rope_theta|invalid config"),
    ("rms_norm_eps", -1.0, "rms_norm_eps"),
])
def test_bad_checkpoint_configs_are_refused(hf_dir: Path, tmp_path: Path, key: str, value: object,
                                            match: str) -> None:
    import json
    import shutil

    out = tmp_path / "hf"
    shutil.copytree(hf_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    if key == "rope_theta" and "rope_parameters" in cfg:  # transformers 5 keeps it in there
        cfg["rope_parameters"][key] = value
    else:
        cfg[key] = value
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        load_model(out)
    assert load_model(hf_dir).config.hidden_size == 64  # the untouched folder loads
