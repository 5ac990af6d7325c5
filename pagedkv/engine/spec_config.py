"""SpeculativeConfig: vLLM's `speculative_config` (`{"method": "ngram", ...}`), checked once.

Accepted as a dict, a JSON object string (the CLI's `--speculative-config '{...}'`) or a
SpeculativeConfig. Keys, with vLLM's names and defaults:
- `method`: "ngram" (prompt lookup: drafts copied from the context after the longest matching
  suffix) or "draft_model" (a smaller model with the target's tokenizer proposes them, with
  its own paged KV cache: draft_model.py, draft_proposer.py);
- `num_speculative_tokens`: the most draft tokens verified per step (1..MAX_SPEC_TOKENS);
- `prompt_lookup_max` / `prompt_lookup_min` (ngram): the longest / shortest context suffix
  looked up (defaults 4 and 1, llama.cpp's range: vLLM's 5 and 5 find few matches in short
  prompts); one given alone keeps the other's default unless that would cross it;
- `model`: only with "draft_model" (refused otherwise), and required there: the draft's GGUF
  file or folder ("smollm2": the shipped model); a path that does not exist is refused here,
  before anything loads (its vocabulary is checked against the target's at start-up);
- `adaptive` (pagedkv): choose k per sequence and step from its acceptance and the step's
  measured cost (default True); False always drafts num_speculative_tokens when a match exists.

Invariant: a SpeculativeConfig that exists is valid; every error is a SpecConfigError naming
the key. No heavy imports (the CLI's --help reads EngineConfig).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from pagedkv.errors import SpecConfigError

METHODS = ("ngram", "draft_model")
MAX_SPEC_TOKENS = 15  # verify rows per sequence stay within the exact row kernel's range
_LOOKUP_MAX = 4
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
         "adaptive")


@dataclasses.dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = _LOOKUP_MAX
    prompt_lookup_min: int = 1
    model: str | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpecConfigError(f"speculative_config.method must be one of {', '.join(METHODS)}"
                                  f", got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPEC_TOKENS)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, 64)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpecConfigError(f"speculative_config.prompt_lookup_min "
                                  f"({self.prompt_lookup_min}) is over prompt_lookup_max "
                                  f"({self.prompt_lookup_max})")
        if not isinstance(self.adaptive, bool):
            raise SpecConfigError(f"speculative_config.adaptive is true or false, got "
                                  f"{self.adaptive!r}")
        if self.method == "draft_model":
            if isinstance(self.model, os.PathLike):
                object.__setattr__(self, "model", os.fspath(self.model))
            if not isinstance(self.model, str) or not self.model:
                raise SpecConfigError('speculative_config.model: "draft_model" needs the draft '
                                      "model's path")
            if self.model.lower() != "smollm2" and not Path(self.model).exists():
                raise SpecConfigError(f"speculative_config.model: no draft model at "
                                      f"{self.model!r}")
        elif self.model is not None:
            raise SpecConfigError(f"speculative_config.model only goes with method "
                                  f'"draft_model", not {self.method!r}')

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """A SpeculativeConfig from a dict, a JSON object string or itself; None/"" is off."""
        if value is None or value == "" or isinstance(value, SpeculativeConfig):
            return value or None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise SpecConfigError(f"speculative_config is not valid JSON: {e.msg} at "
                                      f"character {e.pos}") from None
        if not isinstance(value, dict):
            raise SpecConfigError("speculative_config must be a JSON object, e.g. "
                                  '{"method": "ngram", "num_speculative_tokens": 5}')
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise SpecConfigError(f"speculative_config: unknown key {unknown[0]!r} (known: "
                                  f"{', '.join(_KEYS)})")
        opts = dict(value)
        if "method" not in opts:
            raise SpecConfigError('speculative_config.method is required ("ngram" or '
                                  '"draft_model")')
        lo, hi = opts.get("prompt_lookup_min"), opts.get("prompt_lookup_max")
        if lo is None and hi is not None:
            opts["prompt_lookup_min"] = min(hi, 1) if _is_int(hi) else hi
        if hi is None and lo is not None:
            opts["prompt_lookup_max"] = max(lo, _LOOKUP_MAX) if _is_int(lo) else lo
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if opts.get(key) is None:
                opts.pop(key, None)
        return cls(**opts)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _KEYS if getattr(self, k) is not None}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_int(name: str, v: Any, lo: int, hi: int) -> None:
    if not _is_int(v) or not lo <= v <= hi:
        raise SpecConfigError(f"speculative_config.{name} must be an integer in [{lo}, {hi}], "
                              f"got {v!r}")


__all__ = ["MAX_SPEC_TOKENS", "METHODS", "SpeculativeConfig"]
