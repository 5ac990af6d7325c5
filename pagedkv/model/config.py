"""ModelConfig: the few numbers a Llama-family decoder needs, from HF configs or GGUF metadata."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedkv.errors import ModelLoadError, UnsupportedModelError

logger = logging.getLogger("pagedkv.model")

# HF model_type / GGUF general.architecture -> our name. All share one decoder layout; Qwen3
# adds an RMSNorm over each q and k head before RoPE (`qk_norm`), Phi-3 stores q/k/v and gate/up
# fused in one matrix each (`fused_projections`), Gemma 2 and 3 add a norm after attention and
# after the MLP (`sandwich_norms`), scale the embeddings, use GeGLU and window some layers;
# Gemma 2 soft-caps attention scores and logits, Gemma 3 norms q and k.
SUPPORTED_ARCHITECTURES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
    "gemma3_text": "gemma3", "gemma2": "gemma2", "smollm3": "smollm3", "granite": "granite",
}
_HF_CLASS_TO_TYPE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma2ForCausalLM": "gemma2",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
}
# GGUF general.architecture values read here (llama.cpp files Mistral under "llama")
_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "smollm3", "granite")
# Granite's four scalars: transformers' config names -> llama.cpp's GGUF keys (under granite.)
GRANITE_SCALES = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
                  "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}
# configs whose sliding_window applies only with use_sliding_window (Qwen's layout)
_WINDOW_FLAG_ARCHS = ("qwen2", "qwen3", "smollm3")
# SmolLM3: every 4th layer (3, 7, ...) attends without RoPE (llama.cpp fixes the step; no GGUF key)
SMOLLM3_NOPE_STEP = 4
# Gemma 3: every 6th layer (5, 11, ...) attends to the whole context, the others to a window
GEMMA3_PATTERN = 6
# Gemma 2's soft-caps when a file or config does not give them (llama.cpp's and transformers' defaults)
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
GEMMA3_LOCAL_THETA = 10000.0
LAYER_TYPES = ("sliding", "full")
# llama.cpp's per-frequency divisors: Llama 3.1+ files store their "llama3" scaling this way,
# Phi-3 LongRoPE files their short- and long-context factors (only the short ones are used)
GGUF_ROPE_FREQS = "rope_freqs.weight"
GGUF_ROPE_SHORT, GGUF_ROPE_LONG = "rope_factors_short.weight", "rope_factors_long.weight"
GGUF_ROPE_TENSORS = (GGUF_ROPE_FREQS, GGUF_ROPE_SHORT, GGUF_ROPE_LONG)  # config, not weights
# architectures whose transformers model rotates only the first rotary_dim dims of a head (the
# GGUF converter keeps their q/k rows in transformers' order)
PARTIAL_ROTARY = ("phi3",)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(slots=True)
class ModelConfig:
    # "llama" | "mistral" | "qwen2" | "qwen3" | "phi3" | "gemma2" | "gemma3" | "smollm3" | "granite"
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # None (plain RoPE) or {"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}
    rope_scaling: dict[str, Any] | None = None
    # each of the head_dim / 2 rotary frequencies divided by its factor, as llama.cpp does: a GGUF
    # file's rope_freqs (Llama 3.1+'s "llama3" scaling, precomputed by its converter), a linear
    # scaling's factor, LongRoPE's short factors; None: none
    rope_freq_factors: tuple[float, ...] | None = None
    # cos and sin of the RoPE tables times this (LongRoPE's attention factor; 1: none)
    rope_attention_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm (weights [head_dim]) on every q and k head before RoPE (Qwen3)
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Sliding-window attention: a token at position p attends to positions (p - window, p] on
    # the layers `layer_types` marks "sliding"; None there: every layer (Mistral, Phi-3, Qwen2)
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer "sliding" | "full" (Gemma 3)
    rope_local_theta: float | None = None  # the sliding layers' RoPE base (Gemma 3: 10,000)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)
    hidden_act: str = "silu"  # "silu" (SwiGLU) | "gelu_tanh" (GeGLU, Gemma)
    # RoPE over the first `rotary_dim` dims of each head, the rest passed through (Phi-4-mini:
    # 96 of 128); None: all head_dim
    rotary_dim: int | None = None
    # Gemma 2's soft-capping, c * tanh(x / c): of every attention score (scaled q.k) and of the
    # final logits; None: none
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # layers that attend without RoPE (SmolLM3's NoPE layers: every 4th); None: none
    nope_layers: tuple[int, ...] | None = None
    # Granite: embeddings times embedding_multiplier, each block's output times
    # residual_multiplier before its residual add, attention scale attention_multiplier (not
    # head_dim ** -0.5), logits divided by logits_scaling; None: Llama's
    granite_scales: dict[str, float] | None = None

    def __post_init__(self) -> None:
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling)
        self.validate()

    def validate(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES.values():
            raise UnsupportedModelError(f"unsupported architecture {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ModelLoadError(f"config: {name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"config: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                f"{self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"config: RoPE needs an even head_dim, got {self.head_dim}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise UnsupportedModelError(f"config: hidden_act {self.hidden_act!r} is not supported")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ModelLoadError(f"config: sliding_window must be a positive int, got {self.sliding_window!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
                raise ModelLoadError(
                    f"config: layer_types must name {self.num_layers} layers, each one of "
                    f"{list(LAYER_TYPES)}, got {self.layer_types!r}"
                )
            if "sliding" in self.layer_types and self.sliding_window is None:
                raise ModelLoadError("config: sliding layers need a sliding_window")
        self._check_rotary_dim()
        if self.nope_layers is not None and (
            not isinstance(self.nope_layers, tuple)
            or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers
                   for i in self.nope_layers)):
            raise ModelLoadError(f"config: nope_layers must be a tuple of layer indices below "
                                 f"{self.num_layers}, got {self.nope_layers!r}")
        if self.granite_scales is not None and (
            set(self.granite_scales) != set(GRANITE_SCALES)
            or not all(_finite_positive(v) for v in self.granite_scales.values())):
            raise ModelLoadError(f"config: granite_scales must give {sorted(GRANITE_SCALES)} as finite "
                                 f"positive floats, got {self.granite_scales!r}")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            v = getattr(self, name)
            if v is not None and not _finite_positive(v):
                raise ModelLoadError(f"config: {name} must be a finite positive float or None, got {v!r}")
        if self.rope_freq_factors is not None:
            self._check_freq_factors()
        for name in ("rope_theta", "rope_local_theta"):
            v = getattr(self, name)
            if (v is not None or name == "rope_theta") and not (_real(v) and v > 0):
                raise ModelLoadError(f"config: {name} must be a finite positive number, got {v!r}")
        if not (_real(self.rms_norm_eps) and self.rms_norm_eps >= 0):
            raise ModelLoadError(f"config: rms_norm_eps must be a finite number >= 0, got {self.rms_norm_eps!r}")
        a = self.rope_attention_factor
        if not _finite_positive(a):
            raise ModelLoadError(f"config: rope_attention_factor must be a finite positive float, got {a!r}")

    def _check_rotary_dim(self) -> None:
        r = self.rotary_dim
        if r is None:
            return
        if isinstance(r, bool) or not isinstance(r, int) or r < 2 or r % 2 or r > self.head_dim:
            raise ModelLoadError(f"config: rotary_dim must be an even int in [2, head_dim "
                                 f"{self.head_dim}], got {r!r}")
        if r < self.head_dim and self.architecture not in PARTIAL_ROTARY:
            raise UnsupportedModelError(f"{self.architecture}: partial rotary embeddings ({r} of "
                                        f"{self.head_dim} head dims) are not supported")

    @property
    def rotary(self) -> int:
        """Head dims RoPE rotates (the first ones, in transformers' order): rotary_dim or all."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def _check_freq_factors(self) -> None:
        f = self.rope_freq_factors
        if self.rope_scaling is not None:
            raise ModelLoadError("config: rope_freq_factors and rope_scaling are two scalings; give one")
        if len(f) != self.rotary // 2:
            raise ModelLoadError(f"config: rope_freq_factors has {len(f)} values; {self.rotary} "
                                 f"rotary head dims have {self.rotary // 2} frequencies")
        bad = next((v for v in f if not (math.isfinite(v) and v > 0)), None)
        if bad is not None:
            raise ModelLoadError(f"config: rope_freq_factors must be finite and positive, got {bad!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def fused_projections(self) -> bool:
        """Checkpoints store `self_attn.qkv_proj` and `mlp.gate_up_proj` whole (Phi-3)."""
        return self.architecture == "phi3"

    @property
    def sandwich_norms(self) -> bool:
        """Gemma: an RMSNorm on the attention output and on the MLP output, each before its
        residual add (four norms per layer); embeddings scaled by sqrt(hidden_size)."""
        return self.architecture in ("gemma2", "gemma3")

    @property
    def embedding_scale(self) -> float | None:
        """The factor on the looked-up embeddings (not the tied LM head): Gemma's sqrt(hidden),
        Granite's embedding_multiplier."""
        if self.granite_scales is not None:
            return self.granite_scales["embedding_multiplier"]
        return self.hidden_size**0.5 if self.sandwich_norms else None

    @property
    def attention_scale(self) -> float:
        if self.granite_scales is not None:
            return self.granite_scales["attention_multiplier"]
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def residual_scale(self) -> float | None:
        """Granite: each attention / MLP output times this before its residual add."""
        return None if self.granite_scales is None else self.granite_scales["residual_multiplier"]

    @property
    def logit_divisor(self) -> float | None:
        """Granite: the logits divided by this."""
        return None if self.granite_scales is None else self.granite_scales["logits_scaling"]

    def layer_window(self, i: int) -> int | None:
        """Layer i's attention window in tokens, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[i] == "sliding":
            return self.sliding_window
        return None

    def layer_rope_theta(self, i: int) -> float:
        """Layer i's RoPE base: the local base on a windowed layer when the model has one."""
        if self.rope_local_theta is not None and self.layer_window(i) is not None:
            return self.rope_local_theta
        return self.rope_theta

    @property
    def has_windows(self) -> bool:
        return any(self.layer_window(i) is not None for i in range(self.num_layers))

    # --- constructors ---------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf_config: Any, context: int | None = None) -> ModelConfig:
        """From a transformers PretrainedConfig or a config.json dict. `context`: the context
        to be served (None: the model's), which picks LongRoPE's factors (_longrope)."""
        d = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
        arch = _hf_architecture(d)
        if arch in ("gemma2", "gemma3"):
            return _gemma_from_hf(d, arch)
        if d.get("hidden_act", "silu") != "silu" or d.get("mlp_bias", False):
            raise UnsupportedModelError(
                f"{arch}: only a bias-free SwiGLU (silu) MLP is supported, got "
                f"hidden_act={d.get('hidden_act')!r} mlp_bias={d.get('mlp_bias')!r}"
            )
        heads = d["num_attention_heads"]
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ModelLoadError(f"config: num_attention_heads must be a positive int, got {heads!r}")
        rope = dict(d.get("rope_parameters") or {})  # transformers 5: theta lives in here
        theta = rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
        partial = rope.pop("partial_rotary_factor", None)
        partial = d.get("partial_rotary_factor") if partial is None else partial
        scaling = d.get("rope_scaling") or rope or None
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        rotary = _rotary_dim(partial, head_dim, arch)
        context, context_asked = d.get("max_position_embeddings", 2048), context
        factors, attention = None, 1.0
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if kind == "linear":  # positions divided by the factor: every frequency alike
            factors, scaling = _linear(scaling.get("factor"), rotary, "rope scaling factor"), None
        elif kind == "yarn":  # Qwen2.5 / Qwen3 past 32k
            orig = scaling.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
            orig = _context(orig, "yarn original_max_position_embeddings")
            factor = scaling.get("factor") or context / orig
            if scaling.get("attention_factor") is None and scaling.get("mscale") and scaling.get("mscale_all_dim"):
                raise UnsupportedModelError("yarn rope scaling with mscale / mscale_all_dim is not supported")
            factors, attention = _yarn(rotary, float(theta), factor, orig, scaling.get("beta_fast"),
                                       scaling.get("beta_slow"), scaling.get("attention_factor"),
                                       scaling.get("truncate", True))
            scaling = None
        elif kind == "dynamic":  # transformers: plain RoPE up to max_position_embeddings
            scaling = None
        elif kind in ("longrope", "su"):  # Phi-3.5 and 128k Phi-3 (su: the old name)
            short, long = (_factors(scaling.get(k), f"longrope {k}") for k in ("short_factor", "long_factor"))
            if short is None:
                raise ModelLoadError("longrope short_factor must be a list of numbers, got None")
            orig = scaling.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
            factors, attention, context = _longrope(context, orig, scaling.get("attention_factor"), (
                "max_position_embeddings", "original_max_position_embeddings", "attention_factor"),
                short, long, context_asked)
            scaling = None
        window, types = d.get("sliding_window"), _hf_layer_types(d)
        if arch in _WINDOW_FLAG_ARCHS and not d.get("use_sliding_window", False):
            window = types = None
        elif arch in _WINDOW_FLAG_ARCHS and window and types is None:  # older configs
            first = d.get("max_window_layers", 0)
            types = ["sliding" if i >= first else "full" for i in range(d["num_hidden_layers"])]
        if types is not None and "sliding" not in types:
            window = types = None
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rope_theta=float(theta),
            rope_scaling=scaling,
            rope_freq_factors=factors,
            rope_attention_factor=attention,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            max_position_embeddings=context,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_id_list(d.get("eos_token_id")),
            sliding_window=window,
            layer_types=types if window else None,
            rotary_dim=None if rotary == head_dim else rotary,
            nope_layers=_hf_nope_layers(d, arch),
            granite_scales=None if arch != "granite" else {
                k: _positive(d.get(k, 1.0), f"granite {k}") for k in GRANITE_SCALES},
        )

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], tensor_names: Iterable[str],
                  rope_freqs: Sequence[float] | None = None, rope_long: Sequence[float] | None = None,
                  context: int | None = None) -> ModelConfig:
        """From GGUF key/values (`general.architecture`, `<arch>.block_count`, ...); a file with
        a rope_freqs tensor needs its values as `rope_freqs` (the caller reads the file), and
        those of LongRoPE's long factors as `rope_long` for a `context` (the one to be served;
        None: the model's) past the original (_longrope)."""
        gguf_arch = metadata.get("general.architecture")
        if gguf_arch not in _GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {gguf_arch!r}; supported: {list(_GGUF_ARCHITECTURES)}"
            )
        names = set(tensor_names)
        if gguf_arch in ("gemma2", "gemma3"):
            return _gemma_from_gguf(metadata, names, gguf_arch)
        longrope = GGUF_ROPE_SHORT in names or GGUF_ROPE_LONG in names
        if longrope and (GGUF_ROPE_SHORT not in names or GGUF_ROPE_FREQS in names):
            raise ModelLoadError(f"GGUF RoPE factors {sorted(n for n in GGUF_ROPE_TENSORS if n in names)}: "
                                 "LongRoPE needs its short factors, and not with rope_freqs")
        if rope_long is not None and GGUF_ROPE_LONG not in names:
            raise ModelLoadError("rope_long given, but the file has no rope_factors_long tensor")
        if any(n in names for n in GGUF_ROPE_TENSORS) != (rope_freqs is not None):
            raise ModelLoadError("GGUF rope_freqs / rope_factors: the values must come with the tensor"
                                 if rope_freqs is None else "rope_freqs given, but the file has no such tensor")
        scaling_type = metadata.get(f"{gguf_arch}.rope.scaling.type", "none")
        if scaling_type not in ("none", "linear", "yarn"):
            raise UnsupportedModelError(f"GGUF rope scaling {scaling_type!r} is not supported")

        def get(key: str, default: Any = None) -> Any:
            v = metadata.get(f"{gguf_arch}.{key}", default)
            if v is None:
                raise ModelLoadError(f"GGUF metadata lacks {gguf_arch}.{key}")
            return v

        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        if hidden < 1 or heads < 1:
            raise ModelLoadError(f"GGUF {gguf_arch}: embedding_length {hidden} and attention.head_count "
                                 f"{heads} must be positive")
        head_dim = int(get("attention.key_length", hidden // heads))
        rotary = get("rope.dimension_count", head_dim)
        if isinstance(rotary, bool) or not isinstance(rotary, int):
            raise ModelLoadError(f"{gguf_arch}.rope.dimension_count must be an int, got {rotary!r}")
        if rotary != head_dim and gguf_arch not in PARTIAL_ROTARY:  # llama's permuted q/k rows too
            raise UnsupportedModelError(
                f"GGUF {gguf_arch}: RoPE over {rotary} of {head_dim} head dims (partial rotary) is "
                "not supported"
            )
        if scaling_type == "linear":  # positions divided by the factor: every frequency alike
            linear = _positive(get("rope.scaling.factor"), f"{gguf_arch}.rope.scaling.factor")
            rope_freqs = [linear * float(v) for v in (rope_freqs or [1.0] * (rotary // 2))]
        context_asked, context, attention = context, int(get("context_length", 2048)), 1.0
        if scaling_type == "yarn":
            if rope_freqs is not None:
                raise ModelLoadError("GGUF yarn rope scaling and rope_freqs / rope_factors: two scalings")
            rope_freqs, attention = _gguf_yarn(metadata, gguf_arch, rotary)
        if longrope:
            keys = [f"{gguf_arch}.{k}" for k in ("context_length", "rope.scaling.original_context_length",
                                                  "rope.scaling.attn_factor")]
            long = None if rope_long is None else _factors(rope_long, GGUF_ROPE_LONG)
            rope_freqs, attention, context = _longrope(
                context, get("rope.scaling.original_context_length"), metadata.get(keys[2]), keys,
                tuple(float(v) for v in rope_freqs), long, context_asked)
        # only Phi-3 files carry a window that applies to every layer (Phi-3-mini: 2047)
        window = metadata.get("phi3.attention.sliding_window") if gguf_arch == "phi3" else None
        vocab = metadata.get(f"{gguf_arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", []))
        name = str(metadata.get("general.name", "")).lower()
        eos = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return cls(
            architecture="mistral" if gguf_arch == "llama" and "mistral" in name else gguf_arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_freq_factors=None if rope_freqs is None else tuple(float(v) for v in rope_freqs),
            rope_attention_factor=attention,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            max_position_embeddings=context,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_id_list([e for e in eos if e is not None]),
            sliding_window=int(window) if window else None,
            rotary_dim=None if rotary == head_dim else rotary,
            nope_layers=_nope_every(SMOLLM3_NOPE_STEP, int(get("block_count"))) if gguf_arch == "smollm3" else None,
            granite_scales=None if gguf_arch != "granite" else {
                k: _positive(metadata.get(f"granite.{key}", 1.0), f"granite.{key}") for k, key in GRANITE_SCALES.items()},
        )


def _nope_every(step: int, n: int) -> tuple[int, ...]:
    return tuple(i for i in range(n) if (i + 1) % step == 0)


def _hf_nope_layers(d: Mapping[str, Any], arch: str) -> tuple[int, ...] | None:
    """SmolLM3's `no_rope_layers` (1: RoPE, 0: none, per layer) or its every-interval default."""
    if arch != "smollm3":
        return None
    n, flags = d["num_hidden_layers"], d.get("no_rope_layers")
    if flags is None:
        return _nope_every(int(d.get("no_rope_layer_interval") or SMOLLM3_NOPE_STEP), n)
    if not isinstance(flags, list | tuple) or len(flags) != n or any(f not in (0, 1) for f in flags):
        raise ModelLoadError(f"smollm3 no_rope_layers must be {n} flags of 0 / 1, got {flags!r}")
    return tuple(i for i, f in enumerate(flags) if not f)


def _hf_layer_types(d: Mapping[str, Any]) -> list[str] | None:
    """transformers' `layer_types` ("sliding_attention" / "full_attention" per layer) as ours."""
    types = d.get("layer_types")
    if not types:
        return None
    return ["sliding" if t == "sliding_attention" else "full" for t in types]


def _gemma_from_hf(d: Mapping[str, Any], arch: str) -> ModelConfig:
    """Gemma 2 / Gemma 3 text from a transformers config: rope_parameters (per layer type for
    Gemma 3 in transformers 5) or rope_theta / rope_local_base_freq, layer_types or the
    architecture's pattern (Gemma 2: every 2nd layer global, Gemma 3: every 6th). Gemma 2
    soft-caps scores and logits, Gemma 3 norms q and k instead."""
    gemma2 = arch == "gemma2"
    # absent: transformers' Gemma2Config defaults (50, 30); null: none
    caps = [d.get(k, dv if gemma2 else None) for k, dv in GEMMA2_SOFTCAPS.items()]
    if not gemma2 and any(c is not None for c in caps):
        raise UnsupportedModelError("gemma3: attn_logit_softcapping / final_logit_softcapping are not supported")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"{arch}: hidden_activation {act!r} is not supported")
    rope = d.get("rope_parameters") or {}
    if gemma2 or "full_attention" not in rope and "sliding_attention" not in rope:
        full, local = rope, {}  # one RoPE for every layer (Gemma 2, or transformers 4)
    else:
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    if not rope and d.get("rope_scaling"):  # transformers 4: one scaling, the global layers'
        full = d["rope_scaling"]
    full_type = full.get("rope_type", full.get("type", "default"))
    local_type = local.get("rope_type", "default")
    for kind, allowed in ((full_type, ("default",) if gemma2 else ("default", "linear")), (local_type, ("default",))):
        if kind not in allowed:
            raise UnsupportedModelError(f"{arch}: rope scaling {kind!r} is not supported")
    heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // heads
    factors = None  # Gemma 3 4B+: the global layers' RoPE scaled linearly (the local ones never)
    if full_type == "linear":
        factors = _linear(full.get("factor"), head_dim, "gemma3 rope factor")
    n = d["num_hidden_layers"]
    pattern = 2 if gemma2 else d.get("sliding_window_pattern", GEMMA3_PATTERN)
    types = _hf_layer_types(d) or ["sliding" if (i + 1) % pattern else "full" for i in range(n)]
    window = d.get("sliding_window")
    return ModelConfig(
        architecture=arch,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=n,
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rope_theta=float(full.get("rope_theta") or d.get("rope_theta") or (1e4 if gemma2 else 1e6)),
        rope_freq_factors=factors,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        attention_bias=bool(d.get("attention_bias", False)),
        qk_norm=not gemma2,
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_as_id_list(d.get("eos_token_id")),
        sliding_window=window,
        layer_types=types if window else None,
        rope_local_theta=None if gemma2 else float(
            local.get("rope_theta") or d.get("rope_local_base_freq") or GEMMA3_LOCAL_THETA),
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or 256),
        hidden_act="gelu_tanh",
        attn_logit_softcapping=_optional_positive(caps[0], "attn_logit_softcapping"),
        final_logit_softcapping=_optional_positive(caps[1], "final_logit_softcapping"),
    )


def _gemma_from_gguf(metadata: Mapping[str, Any], names: set[str], arch: str) -> ModelConfig:
    """Gemma 2 / Gemma 3 from llama.cpp's keys. The file carries the window, the RoPE base and
    (Gemma 2) the two soft-caps; the layer pattern (Gemma 2: every 2nd layer global, Gemma 3:
    every 6th), Gemma 3's local base (10,000) and the attention scale are the architecture's,
    as llama.cpp and transformers fix them (the 27B models scale by hidden / heads, the others
    by head_dim: Gemma 2 27B has 46 layers, Gemma 3 27B 62)."""
    gemma2 = arch == "gemma2"

    def get(key: str, default: Any = None) -> Any:
        v = metadata.get(f"{arch}.{key}", default)
        if v is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return v

    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in (("none",) if gemma2 else ("none", "linear")):
        raise UnsupportedModelError(f"GGUF {arch} rope scaling {scaling!r} is not supported")
    hidden, heads, n = int(get("embedding_length")), int(get("attention.head_count")), int(get("block_count"))
    head_dim = int(get("attention.key_length", 256))
    factors = None  # Gemma 3 4B+: linear scaling (8) of the global layers' RoPE only
    if scaling == "linear":
        factors = _linear(get("rope.scaling.factor"), head_dim, "gemma3.rope.scaling.factor")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModelError(f"GGUF {arch}: partial rotary embeddings are not supported")
    window = metadata.get(f"{arch}.attention.sliding_window")
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    eos = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    if "<end_of_turn>" in tokens:  # the chat turn's end; the file names it only in the vocabulary
        eos.append(tokens.index("<end_of_turn>"))
    pattern = 2 if gemma2 else GEMMA3_PATTERN
    caps = [metadata.get(f"gemma2.{k}", dv) if gemma2 else None for k, dv in GEMMA2_SOFTCAPS.items()]
    return ModelConfig(
        architecture=arch,
        vocab_size=int(metadata.get(f"{arch}.vocab_size") or len(tokens)),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 1e4 if gemma2 else 1e6)),
        rope_freq_factors=factors,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in names,
        qk_norm=not gemma2,
        max_position_embeddings=int(get("context_length", 8192 if gemma2 else 32768)),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_as_id_list([e for e in eos if e is not None]),
        sliding_window=int(window) if window else None,
        layer_types=None if not window else [
            "full" if (i + 1) % pattern == 0 else "sliding" for i in range(n)
        ],
        rope_local_theta=None if gemma2 else GEMMA3_LOCAL_THETA,
        query_pre_attn_scalar=float(hidden // heads if n == (46 if gemma2 else 62) else head_dim),
        hidden_act="gelu_tanh",
        attn_logit_softcapping=_optional_positive(caps[0], "gemma2.attn_logit_softcapping"),
        final_logit_softcapping=_optional_positive(caps[1], "gemma2.final_logit_softcapping"),
    )


def _rotary_dim(partial: Any, head_dim: int, arch: str) -> int:
    """Head dims a transformers config's partial_rotary_factor rotates (its int(head_dim * f))."""
    f = 1.0 if partial is None else _positive(partial, f"{arch} partial_rotary_factor")
    if f > 1:
        raise ModelLoadError(f"{arch} partial_rotary_factor must be at most 1, got {partial!r}")
    if f != 1 and arch not in PARTIAL_ROTARY:
        raise UnsupportedModelError(f"{arch}: partial rotary embeddings ({partial}) are not supported")
    return int(head_dim * f)


def _yarn(rotary: int, theta: float, factor: Any, orig: int, beta_fast: Any, beta_slow: Any,
          attention: Any, truncate: bool = True) -> tuple[tuple[float, ...], float]:
    """YaRN as per-frequency divisors and an attention factor, as transformers computes them:
    frequencies that turn fewer than beta_slow times over the original context are
    interpolated (divided by the factor), those that turn more than beta_fast times kept, a
    linear ramp between; cos and sin scaled by 0.1 ln(factor) + 1 unless given."""
    factor = _positive(factor, "yarn factor")
    fast, slow = (_positive(v or dv, f"yarn {name}") for v, dv, name in
                  ((beta_fast, 32.0, "beta_fast"), (beta_slow, 1.0, "beta_slow")))

    def dim(rotations: float) -> float:  # the dim that turns `rotations` times over orig tokens
        return rotary * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim(fast), dim(slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary - 1)
    high = high + 0.001 if low == high else high
    out = []
    for i in range(rotary // 2):
        keep = 1 - min(max((i - low) / (high - low), 0.0), 1.0)  # 1: extrapolated (kept as is)
        out.append(1 / ((1 - keep) / factor + keep))
    if attention is None:
        attention = 0.1 * math.log(factor) + 1 if factor > 1 else 1.0
    return tuple(out), _positive(attention, "yarn attention_factor")


def _gguf_yarn(metadata: Mapping[str, Any], arch: str, rotary: int) -> tuple[tuple[float, ...], float]:
    """A GGUF file's yarn keys (llama.cpp's names) -> _yarn, with YaRN's own attention factor.
    Keys that change it (an attention factor of the file, DeepSeek's log multiplier) or the
    extrapolation mix are refused by name: how llama.cpp combines them differs between
    versions and models."""
    key = f"{arch}.rope.scaling."
    neutral = {"attn_factor": (1.0,), "yarn_attn_factor": (1.0,), "yarn_log_multiplier": (),
               "yarn_ext_factor": (1.0, -1.0)}  # (-1: llama.cpp's "not set", 1 for yarn)
    for name, ok in neutral.items():
        v = metadata.get(key + name)
        if v is not None and v not in ok:
            raise UnsupportedModelError(f"GGUF {key}{name} = {v!r} with yarn rope scaling is not supported")
    orig = _context(metadata.get(key + "original_context_length"), key + "original_context_length")
    theta = _positive(metadata.get(f"{arch}.rope.freq_base", 10000.0), f"{arch}.rope.freq_base")
    return _yarn(rotary, theta, metadata.get(key + "factor"), orig, metadata.get(key + "yarn_beta_fast"),
                 metadata.get(key + "yarn_beta_slow"), None)


def _linear(factor: Any, rotary: int, what: str) -> tuple[float, ...]:
    """A linear scaling as RoPE divisors: each of `rotary` / 2 frequencies divided by the factor."""
    return (_positive(factor, what),) * (rotary // 2)


def _longrope(context: Any, orig: Any, attn: Any, names: Sequence[str], short: tuple[float, ...],
              long: tuple[float, ...] | None, served: int | None) -> tuple[tuple[float, ...], float, int]:
    """(factors, attention factor, context) of LongRoPE. `attn` None: the default of
    transformers (and llama.cpp's converter), sqrt(1 + ln(scale) / ln(orig)) for scale =
    context / orig. transformers turns every position by the short factors while a sequence is
    within the original context and by the long ones past it (all positions again: the cache
    would have to be rebuilt), so one set is chosen for the whole run, as llama.cpp chooses it
    for its context: the short factors, the context capped at the original, unless `served`
    (the context asked for) is past it and the long factors are known. `names`: the three
    values' keys, for the errors."""
    context, orig = _context(context, names[0]), _context(orig, names[1])
    if attn is not None:
        attention = _positive(attn, names[2])
    else:
        scale = context / orig
        attention = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
    if served is not None and served > orig and long is not None:
        logger.warning("LongRoPE: the long factors turn every position (a context of %d, past the original "
                       "%d): transformers turns sequences within %d tokens by the short ones, so their "
                       "outputs differ slightly", served, orig, orig)
        return long, attention, context
    if context > orig:
        logger.warning("LongRoPE: the short factors are used, so the context is capped at the original "
                       "%d tokens (of %d; a max_model_len past it takes the long factors)", orig, context)
    return short, attention, min(context, orig)


def _factors(values: Any, what: str) -> tuple[float, ...] | None:
    """A list of finite positive numbers as floats (None: None), or ModelLoadError."""
    if values is None:
        return None
    if not isinstance(values, list | tuple):
        raise ModelLoadError(f"{what} must be a list of numbers, got {type(values).__name__}")
    return tuple(_positive(v, what) for v in values)


def _context(value: Any, what: str) -> int:
    """A context length (an int >= 2: LongRoPE takes its log) from a file, or ModelLoadError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ModelLoadError(f"{what} must be an int of at least 2, got {value!r}")
    return value


def _real(v: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _finite_positive(v: Any) -> bool:
    """A ModelConfig field's check: a finite positive float."""
    return isinstance(v, float) and math.isfinite(v) and v > 0


def _optional_positive(value: Any, what: str) -> float | None:
    """None stays None (a feature turned off); else _positive."""
    return None if value is None else _positive(value, what)


def _positive(value: Any, what: str) -> float:
    """A finite positive float from a file's metadata or config, or ModelLoadError."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise ModelLoadError(f"{what} must be a finite positive number, got {value!r}")
    return v


def normalize_rope_scaling(scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """None for plain RoPE, a checked "llama3" dict, or UnsupportedModelError."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (only 'llama3')")
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ModelLoadError(f"llama3 rope scaling lacks {missing}")
    out: dict[str, Any] = {"rope_type": "llama3"}
    out.update({k: float(scaling[k]) for k in _LLAMA3_KEYS})
    return out


def _hf_architecture(d: Mapping[str, Any]) -> str:
    model_type = d.get("model_type")
    if model_type in SUPPORTED_ARCHITECTURES:
        return SUPPORTED_ARCHITECTURES[model_type]
    for cls_name in d.get("architectures") or []:
        if cls_name in _HF_CLASS_TO_TYPE:
            return _HF_CLASS_TO_TYPE[cls_name]
    raise UnsupportedModelError(
        f"unsupported architecture {model_type or d.get('architectures')!r}; "
        f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
    )


def _as_id_list(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int):
        return [v]
    return list(dict.fromkeys(int(x) for x in v))  # dedupe, keep order
