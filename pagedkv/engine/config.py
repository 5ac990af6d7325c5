"""EngineConfig: every engine option, declared once (default, help, CLI flag, validation).

`LLMEngine(model, **options)`, `LLM(model, **options)`, `pagedkv generate|serve`'s engine flags
and the benchmarks are all built from this dataclass (see `pagedkv/options.py` for the
machinery). Adding an option is adding one field here (`option(default, help)`, flag spelled
from the name) plus, if it has one, its check in `_check`; the engine then reads
`config.<name>`.

Invariants: an EngineConfig that exists is valid as far as it can be known without the model
(checked in `__post_init__`, before anything loads; frozen, and `dataclasses.replace` checks
again). What needs the model (the context length, n_keep's range) is checked by the engine
right after loading, through `context_len`. Errors are the project's typed ones: a bad cache
shape or size CacheConfigError, a bad KV tier TierConfigError, a bad weights/activations mode
ModelLoadError, a bad scheduler limit InvalidParamsError, an unknown option
UnknownOptionError; each names the field (the CLI re-spells it as the flag).

A field's default is also the class attribute (`EngineConfig.block_size == 16`), which is
how code that needs a default without building a config reads it. Nothing at import time is
heavy (no torch): the CLI's --help reads the fields.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

from pagedkv.errors import (
    CacheConfigError,
    DeviceError,
    InvalidParamsError,
    KVEventsConfigError,
    SpecConfigError,
    TierConfigError,
)
from pagedkv.options import (
    build,
    check_positive,
    invalid,
    is_int,
    option,
    positive_int,
)

log = logging.getLogger("pagedkv.engine")

DTYPES = ("float32", "bfloat16", "float16")
# vLLM's capture sizes: 1, 2, 4, then every multiple of 8 up to 256
DEFAULT_GRAPH_SIZES = (1, 2, 4, *range(8, 257, 8))
MAX_GRAPH_SIZE = 4096
MAX_GRAPH_SIZES = 256


def capture_sizes(sizes: Any, max_num_seqs: int) -> tuple[int, ...]:
    """Sorted distinct `sizes` below max_num_seqs, plus the smallest at or above it."""
    ordered = sorted(set(sizes))
    below = [n for n in ordered if n < max_num_seqs]
    above = [n for n in ordered if n >= max_num_seqs][:1]
    return tuple(below + above)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's options; field order is the order of `pagedkv generate --help`."""

    model: Any = option(None, "a .gguf file or a model folder (local files only); default: the "
                              "shipped SmolLM2-135M-Instruct")  # Python: also a loaded model
    dtype: Any = option("float32", "compute dtype", choices=DTYPES)  # Python: or a torch.dtype
    weights: str | None = option(
        None, "GGUF weights: keep the file's quantized blocks (the default for GGUF at float32) "
              "or dequantize them to float32 at load", choices=("quantized", "float32"))
    activations: str = option(
        "float32", "int8: round each quantized matmul's input to 8 bits per 32 values (per 256 "
                   "for K-quants) and multiply in integers (llama.cpp's way; faster, "
                   "approximate). float32: exact",
        choices=("float32", "int8"))
    batch_weights: str = option(
        "quantized", "float32: also keep a float32 copy of the quantized weights, pre-packed, "
                     "for prefill and large batches (faster there, exact; costs the memory of a "
                     "float32 model). panel (with --activations int8, AVX-512 VNNI): also keep "
                     "the Q4_K/Q5_K/Q6_K weights in the int8 panel layout, for batches (the same "
                     "results; a second copy of those weights). quantized: dequantize tile by "
                     "tile (no extra memory)",
        choices=("quantized", "float32", "panel"))
    device: str = option(
        "cpu", "where the model, the KV pool and the step's tensors live: cpu, or cuda / cuda:N "
               "(GGUF weights dequantized to --dtype at load; attention by the triton kernels)")
    attention_backend: str = option(
        "auto", "paged attention: auto (triton kernels on cuda when triton is installed, else "
                "torch), torch (the compiled CPU decode kernel, or pure torch), triton (the "
                "triton kernels; on the CPU through triton's interpreter: slow, for tests)",
        choices=("auto", "torch", "triton"))
    cuda_graph_sizes: Any = option(
        None, "decode batch sizes captured as CUDA graphs at start (vLLM's option; default "
              "1 2 4 8 16 24 ... 256, the ones below --max-num-seqs and the first at or above "
              "it): a decode-only step of n sequences replays the smallest size >= n, the extra "
              "rows padding that writes no KV; prefill, mixed, speculative and larger steps run "
              "eagerly. cuda with the triton backend only",
        parse=positive_int, nargs="+", metavar="N")  # Python: a list of ints
    enforce_eager: bool = option(
        False, "capture no CUDA graphs: every step runs eagerly (vLLM's option)")
    block_size: int = option(16, "tokens per KV block", parse=positive_int)
    kv_cache_memory: str | int = option("1GiB", "KV cache budget, e.g. 2GiB, 512MB")
    kv_cache_dtype: Any = option(
        "auto", "KV storage: auto (the compute dtype), float32, float16, bfloat16, int8, "
                "fp8_e4m3 (int8/fp8: ~3.8x the tokens of float32 in the same memory)")
    num_blocks: int | None = option(None, "KV blocks (overrides --kv-cache-memory)",
                                    parse=positive_int)
    max_num_seqs: int = option(64, "sequences decoded together", parse=positive_int)
    max_num_batched_tokens: int = option(
        2048, "tokens per engine step (prefill chunks + decodes)", parse=positive_int)
    max_model_len: int | None = option(None, "context length (default: the model's)",
                                       parse=positive_int)
    enable_prefix_caching: bool = option(True, "turn prefix caching off",
                                         flag="--no-prefix-caching")
    disable_hybrid_kv_cache_manager: bool = option(
        False, "a model with sliding-window layers keeps every layer's whole context in one KV "
               "group (by default window layers form their own groups and give back the blocks "
               "before their window: less memory, no range operations or context shift)")
    context_shift: bool = option(
        False, "a sequence that fills the context keeps its first --n-keep tokens, drops the "
               "next --n-discard and goes on (llama.cpp's context shift) instead of finishing "
               "with 'length'; longer prompts are cut the same way")
    n_keep: int = option(0, "context shift: tokens always kept at the start (the system prompt)",
                         parse=int)
    n_discard: int | None = option(
        None, "context shift: tokens dropped per shift (default: half of the rest)",
        parse=positive_int)
    kv_tier: str | None = option(
        None, "second KV level shared across restarts/replicas: disk:DIR[?max_size=10GiB] or "
              "redis://host:port/db[?ttl=SECONDS]")
    kv_tier_key: Any = option(
        None, "authenticate and encrypt every --kv-tier/--kv-snapshot record (AES-GCM, a key per "
              "tenant): a secret of 16+ bytes in hex or base64, the same on every replica "
              "sharing the tier (without one, records are plaintext and unauthenticated)",
        metavar="KEY", repr=False)  # Python: also a TierKey
    kv_tier_key_file: str | None = option(
        None, "read --kv-tier-key from a file (keeps it out of the process list)",
        metavar="PATH")
    kv_tier_read_timeout: float = option(
        0.1, "seconds a request waits on a --kv-tier read that makes no progress (reads run "
             "off the engine thread, so a slow store never stalls other streams) before it is "
             "admitted and computes the blocks that have not arrived", parse=float,
        metavar="SECONDS")
    kv_snapshot: str | None = option(
        None, "write every cached KV block here on shutdown, reload it at start", metavar="DIR")
    kv_snapshot_interval: float | None = option(
        None, "also snapshot new cached blocks every SECONDS, in the background", parse=float,
        metavar="SECONDS")
    dedup_inflight_prefixes: bool = option(
        True, "admit requests that share a prefix with a running prefill at once, instead of "
              "holding them until the shared blocks are cached",
        flag="--no-dedup-inflight-prefixes")
    threads: int | None = option(
        None, "torch threads (default: one per physical core other programs leave free, "
              "re-checked while serving; more threads than free cores slow every step down)",
        parse=positive_int)  # process-wide; None: leave as is
    greedy_head: str = option(
        "screen", "greedy requests without logit changes (no logprobs, logit_bias, penalties, "
                  "min_tokens or grammar): screen (their token is the argmax of the few logits "
                  "that can be the maximum, recomputed in float64; the other logits of an "
                  "all-greedy batch may come from the int8 kernels where those are faster) or "
                  "off (the argmax of the float32 logits)", choices=("screen", "off"))
    grammar_mask_overlap: str = option(
        "auto", "compute structured-output token masks on a worker thread while the forward "
                "pass runs: on, off, or auto (only while a CPU is left beside the torch threads: "
                "on a machine whose cores all run the forward pass the worker slows it down)",
        choices=("auto", "on", "off"))
    speculative_config: Any = option(
        None, 'speculative decoding, vLLM\'s JSON: {"method": "ngram", '
              '"num_speculative_tokens": 5, "prompt_lookup_max": 4} (drafts copied from the '
              "context after its longest matching suffix, verified in one forward pass), or "
              '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} (a smaller '
              "GGUF with the same tokenizer drafts, with its own paged KV cache); greedy output "
              "unchanged, sampled output's distribution unchanged; adaptive k, off where it "
              'would not pay; "adaptive": false always drafts)', metavar="JSON")
    kv_tier_queue: int = option(256, "blocks waiting for the KV tier's writer", flag=None)
    kv_events_config: Any = option(
        None, "publish KV cache events in vLLM's format (ZeroMQ, msgpack): a JSON object of "
              "vLLM's KVEventsConfig keys, e.g. '{\"enable_kv_cache_events\": true, "
              "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"topic\": "
              "\"kv-events\", \"replay_endpoint\": \"tcp://*:5558\"}'",
        metavar="JSON")  # Python: also a dict or a KVEventsConfig

    def __post_init__(self) -> None:
        self._check()

    @classmethod
    def build(cls, base: EngineConfig | None = None, /, **options: Any) -> EngineConfig:
        """`base` (or the defaults) with `options`; an unknown name raises UnknownOptionError."""
        return build(cls, base, options)

    # --- derived values ---------------------------------------------------------------------------

    @property
    def kv_cache_bytes(self) -> int:
        """The KV budget in bytes (kv_cache_memory parsed; only used without num_blocks)."""
        from pagedkv.cache.sizing import parse_size

        return parse_size(self.kv_cache_memory)

    def tier_key(self) -> Any:
        """The TierKey of kv_tier_key / kv_tier_key_file, or None (TierConfigError)."""
        from pagedkv.cache.tiers.seal import TierKey

        if self.kv_tier_key is not None and self.kv_tier_key_file is not None:
            raise invalid(TierConfigError, "give kv_tier_key or kv_tier_key_file, not both",
                          "kv_tier_key", "kv_tier_key_file")
        if self.kv_tier_key_file is not None:
            return TierKey.from_file(self.kv_tier_key_file)
        if isinstance(self.kv_tier_key, TierKey) or self.kv_tier_key is None:
            return self.kv_tier_key
        if not isinstance(self.kv_tier_key, str):
            raise invalid(TierConfigError, "kv_tier_key is hex or base64 text, or a TierKey",
                          "kv_tier_key")
        return TierKey.parse(self.kv_tier_key)

    @property
    def spec(self) -> Any:
        """The SpeculativeConfig of speculative_config, or None (off)."""
        from pagedkv.engine.spec_config import SpeculativeConfig

        return SpeculativeConfig.parse(self.speculative_config)

    def context_len(self, model_len: int) -> int:
        """The context the engine serves: max_model_len, or the model's. Over the model's
        context is refused (CacheConfigError): positions past it were never trained.
        (Sliding-window layers attend within their window at any length.)"""
        n = self.max_model_len or model_len
        if n > model_len:
            raise invalid(CacheConfigError, f"max_model_len ({n}) is over the model's context "
                                            f"of {model_len} tokens", "max_model_len")
        return n

    # --- validation -------------------------------------------------------------------------------

    def _check(self) -> None:
        from pagedkv.cache.quant import resolve_kv_cache_dtype
        from pagedkv.model.loader import check_activations, check_batch_weights

        resolve_kv_cache_dtype(self.kv_cache_dtype)  # CacheConfigError naming the supported ones
        check_activations(self.activations, self.weights)  # ModelLoadError
        check_batch_weights(self.batch_weights, self.weights)
        if self.greedy_head not in ("screen", "off"):
            raise invalid(InvalidParamsError, f"greedy_head is screen or off, got {self.greedy_head!r}",
                          "greedy_head")
        if self.grammar_mask_overlap not in ("auto", "on", "off"):
            raise invalid(InvalidParamsError, "grammar_mask_overlap is auto, on or off, got "
                                              f"{self.grammar_mask_overlap!r}", "grammar_mask_overlap")
        self._check_device()
        self._check_graphs()
        check_positive(self, CacheConfigError, "block_size")
        check_positive(self, CacheConfigError, "num_blocks", "max_model_len", optional=True)
        check_positive(self, InvalidParamsError, "max_num_seqs", "max_num_batched_tokens",
                       "kv_tier_queue")
        check_positive(self, InvalidParamsError, "threads", optional=True)
        if self.num_blocks is None:
            self._check_budget()
        self._check_context_shift()
        self._check_tiers()
        try:
            self.spec  # noqa: B018  (SpecConfigError naming the key)
        except SpecConfigError as e:
            raise invalid(SpecConfigError, str(e), "speculative_config") from None
        self._check_kv_events()

    def _check_kv_events(self) -> None:
        from pagedkv.engine.kv_events import parse_config

        cfg = parse_config(self.kv_events_config)  # KVEventsConfigError naming the key
        if cfg is not None and cfg.enabled and not self.enable_prefix_caching:
            raise invalid(KVEventsConfigError, "kv_events_config: KV cache events need prefix "
                                               "caching on", "kv_events_config",
                          "enable_prefix_caching")

    def kv_events(self) -> Any:
        """The parsed kv_events_config (a KVEventsConfig), or None."""
        from pagedkv.engine.kv_events import parse_config

        return parse_config(self.kv_events_config)

    def _check_device(self) -> None:
        """An unusable device or backend is a DeviceError now, before anything loads."""
        d = self.device
        if not isinstance(d, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", d):
            raise invalid(DeviceError, f"device must be cpu, cuda or cuda:N, got {d!r}", "device")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise invalid(DeviceError, f"attention_backend must be auto, torch or triton, got "
                                       f"{self.attention_backend!r}", "attention_backend")
        if self.attention_backend == "triton":
            from pagedkv.attention.triton_backend import available

            if not available():
                raise invalid(DeviceError, "attention_backend 'triton' needs triton installed "
                                           "(pip install triton)", "attention_backend")
        if d != "cpu":
            import torch

            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = int(d.partition(":")[2] or 0)
            if index >= n:
                raise invalid(DeviceError, f"device {d!r}: this machine has "
                                           f"{n or 'no'} CUDA device{'s' if n != 1 else ''}"
                                           f"{'' if n else ' (or torch is a CPU build)'}",
                              "device")
            if self.weights == "quantized":
                raise invalid(DeviceError, "weights 'quantized' runs on the CPU kernels only; on "
                                           "cuda GGUF weights are dequantized to --dtype at load",
                              "weights", "device")
            if self.activations != "float32" or self.batch_weights != "quantized":
                raise invalid(DeviceError, "activations / batch_weights are CPU matmul modes",
                              "activations", "batch_weights", "device")

    def _check_graphs(self) -> None:
        """cuda_graph_sizes: positive whole numbers up to MAX_GRAPH_SIZE, and only where they
        would be used (refused, not ignored: on the CPU, with enforce_eager, with torch
        attention, which syncs inside the step)."""
        sizes = self.cuda_graph_sizes
        if sizes is None:
            return
        if (not isinstance(sizes, list | tuple) or not sizes or len(sizes) > MAX_GRAPH_SIZES
                or not all(is_int(n) and 1 <= n <= MAX_GRAPH_SIZE for n in sizes)):
            raise invalid(InvalidParamsError, f"cuda_graph_sizes must be 1 to {MAX_GRAPH_SIZES} "
                                              f"whole numbers in [1, {MAX_GRAPH_SIZE}], got "
                                              f"{sizes!r:.80}", "cuda_graph_sizes")
        for field, off, why in (("device", self.device == "cpu", "device is cpu (CUDA graphs "
                                                                  "need cuda)"),
                                ("enforce_eager", self.enforce_eager, "enforce_eager is set"),
                                ("attention_backend", self.attention_backend == "torch",
                                 "attention_backend is torch (graphs replay the triton kernels)")):
            if off:
                raise invalid(InvalidParamsError, f"cuda_graph_sizes would be ignored: {why}",
                              "cuda_graph_sizes", field)

    def graph_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes to capture (ascending): none on the CPU or with enforce_eager;
        else cuda_graph_sizes (or DEFAULT_GRAPH_SIZES) below max_num_seqs and the first at or
        above it (a batch never exceeds max_num_seqs)."""
        if self.device == "cpu" or self.enforce_eager:
            return ()
        return capture_sizes(self.cuda_graph_sizes or DEFAULT_GRAPH_SIZES, self.max_num_seqs)

    def _check_budget(self) -> None:
        try:
            budget = self.kv_cache_bytes
        except CacheConfigError as e:
            raise invalid(CacheConfigError, f"kv_cache_memory: {e}", "kv_cache_memory") from None
        if budget < 1:
            raise invalid(CacheConfigError, f"kv_cache_memory must be positive, got "
                                            f"{self.kv_cache_memory!r}", "kv_cache_memory")

    def _check_context_shift(self) -> None:
        """n_keep / n_discard only mean something with context_shift (refused, not ignored);
        their range against the context is checked once the model is known."""
        k, d = self.n_keep, self.n_discard
        if not self.context_shift:
            for name, value, off in (("n_keep", k, 0), ("n_discard", d, None)):
                if value != off:
                    raise invalid(CacheConfigError, f"{name}={value!r} needs context_shift "
                                                    "(without it, it would be ignored)",
                                  name, "context_shift")
            return
        if not is_int(k) or k < 0:
            raise invalid(CacheConfigError, f"n_keep must be an int >= 0, got {k!r}", "n_keep")
        if d is not None and (not is_int(d) or d < 1):
            raise invalid(CacheConfigError, f"n_discard must be a positive int or None, got "
                                            f"{d!r}", "n_discard")

    def _check_tiers(self) -> None:
        t = self.kv_tier_read_timeout
        if not (isinstance(t, int | float) and not isinstance(t, bool) and 0 < t <= 60):
            raise invalid(TierConfigError, f"kv_tier_read_timeout must be in (0, 60] seconds, "
                                           f"got {t!r}", "kv_tier_read_timeout")
        iv = self.kv_snapshot_interval
        if iv is not None and not (isinstance(iv, int | float) and 0 < iv < float("inf")
                                   and self.kv_snapshot):
            raise invalid(TierConfigError, "kv_snapshot_interval needs kv_snapshot and a "
                                           "positive value", "kv_snapshot_interval", "kv_snapshot")
        if self.kv_tier:  # "" is no tier, as None
            from pagedkv.cache.tiers import parse_spec

            parse_spec(self.kv_tier)  # TierConfigError names what is wrong
        self.tier_key()  # a bad key or key file fails here, before the model loads
        if (self.kv_tier or self.kv_snapshot) and not self.enable_prefix_caching:
            raise TierConfigError("a KV tier or snapshot needs prefix caching on")


__all__ = ["DEFAULT_GRAPH_SIZES", "DTYPES", "EngineConfig", "capture_sizes"]
