"""The draft model of speculative decoding (vLLM's "draft_model" method): a smaller model with
the target's tokenizer, loaded in the same engine, with its own paged KV cache.

`DraftModel.load(spec, target, config, num_blocks, max_model_len)` loads `spec.model` (a GGUF
path, a folder, or "smollm2"; the target's own file is not loaded twice: its weights are
shared) and checks, before anything runs, that it can draft for the target: the same
vocabulary (every token string at the same id, the same logits width). Every failure, a missing
or unreadable file included, is a SpecConfigError naming `speculative_config.model`.

Its cache is a `PagedKVCache` of its own (pool, block tables, prefix index) over a `KVStorage`
shaped by the draft's layers, KV heads and head size, with the target's block count, block
size and prefix-caching setting: anything the target holds, the draft can hold. It is one KV
group always (a draft with sliding-window layers keeps their whole context). The draft's
sequences use the target's sequence ids and hash chains; `DraftProposer` is its only client.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.cache import KVStorage, PagedKVCache
from pagedkv.cache.groups import kv_groups
from pagedkv.cache.quant import resolve_kv_cache_dtype
from pagedkv.engine.model_runner import ModelRunner
from pagedkv.errors import PagedKVError, SpecConfigError
from pagedkv.options import invalid


@dataclass(slots=True)
class DraftModel:
    """A loaded draft: its model (`loaded`), its own cache and storage, and a runner."""

    loaded: Any  # a LoadedModel
    cache: PagedKVCache
    storage: KVStorage
    runner: ModelRunner
    shared: bool  # the target's own weights (self-drafting)

    @classmethod
    def load(cls, spec: Any, target: Any, config: Any, num_blocks: int,
             max_model_len: int) -> DraftModel:
        """The draft of `spec` (a SpeculativeConfig, method "draft_model") for the `target`
        LoadedModel, under the engine's `config` (dtype, weights, device, KV dtype, block size,
        prefix caching) with `num_blocks` blocks."""
        loaded, shared = _load(spec.model, target, config)
        check_vocabulary(loaded, target)
        cfg = loaded.config
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype)
        if kv_dtype is None:
            kv_dtype = next(loaded.model.parameters()).dtype
        groups = kv_groups([cfg.layer_window(i) for i in range(cfg.num_layers)], hybrid=False)
        storage = KVStorage(groups.layers_per_group, num_blocks, config.block_size,
                            cfg.num_kv_heads, cfg.head_dim, kv_dtype, config.device)
        storage.bind_groups(groups)
        cache = PagedKVCache(num_blocks, config.block_size, storage=storage,
                             enable_prefix_caching=config.enable_prefix_caching,
                             max_seq_len=max_model_len, groups=groups)
        runner = ModelRunner(loaded.model, storage, config.attention_backend)
        return cls(loaded, cache, storage, runner, shared)


def _load(source: str, target: Any, config: Any) -> tuple[Any, bool]:
    """(the draft's LoadedModel, whether it is the target's own)."""
    from pagedkv.model.loader import DEFAULT_MODEL, default_model_path, load_model

    path = default_model_path() if source.lower() == DEFAULT_MODEL else Path(source)
    own = getattr(target, "path", None)
    try:
        if own is not None and path.exists() and path.resolve() == Path(own).resolve():
            return target, True
    except OSError:
        pass
    if not path.exists():
        raise _error(f"speculative_config.model: no draft model at {str(path)!r}")
    weights = config.weights if config.device == "cpu" or config.weights is not None else "float32"
    try:
        loaded = load_model(path, dtype=config.dtype, weights=weights,
                            activations=config.activations, batch_weights=config.batch_weights)
    except (PagedKVError, OSError, ValueError, KeyError) as e:
        raise _error(f"speculative_config.model: cannot load the draft model {str(path)!r}: "
                     f"{e}") from None
    if config.device != "cpu":
        loaded.model.to_device(config.device)
    return loaded, False


def check_vocabulary(draft: Any, target: Any) -> None:
    """SpecConfigError unless `draft` drafts in `target`'s token ids: the same logits width and,
    token by token, the same vocabulary (string -> id) in both tokenizers (two models without
    a tokenizer: the width alone; one without: refused)."""
    dv, tv = draft.config.vocab_size, target.config.vocab_size
    if dv != tv:
        raise _error(f"speculative_config.model: the draft's vocabulary has {dv} tokens, the "
                     f"target's {tv}: a draft model needs the target's tokenizer")
    if draft is target:
        return
    dt, tt = draft.tokenizer, target.tokenizer
    if dt is None and tt is None:
        return  # models of token ids alone: the logits width is all there is to compare
    if dt is None or tt is None:
        raise _error("speculative_config.model: the draft's and the target's tokenizers cannot "
                     "be compared (one has none)")
    dvocab, tvocab = dt.get_vocab(), tt.get_vocab()
    if dvocab == tvocab:
        return
    by_id = {i: t for t, i in dvocab.items()}
    for tok, i in sorted(tvocab.items(), key=lambda kv: kv[1]):
        if by_id.get(i) != tok:
            raise _error(f"speculative_config.model: the draft's tokenizer differs from the "
                         f"target's: token id {i} is {tok!r} in the target, "
                         f"{by_id.get(i)!r} in the draft")
    extra = sorted(set(dvocab) - set(tvocab))
    raise _error(f"speculative_config.model: the draft's tokenizer differs from the target's: "
                 f"it has {len(extra)} more tokens (first {extra[0]!r})")


def _error(message: str) -> SpecConfigError:
    return invalid(SpecConfigError, message, "speculative_config")  # type: ignore[return-value]


__all__ = ["DraftModel", "check_vocabulary"]
