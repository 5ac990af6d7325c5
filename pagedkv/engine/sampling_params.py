"""Per-request sampling parameters (vLLM-compatible names and defaults) and their accepted ranges.

Every field is validated when the object is built; a bad value raises InvalidParamsError naming
the field and its accepted range, and no object exists. Ranges (and why):

- temperature in [0, 100], finite. Below TEMPERATURE_EPS (1e-5, as vLLM) a row is greedy: that is
  the exact limit of softmax(logits / T) as T -> 0 (up to logits closer than ~1e-5), so 1e-40 is
  greedy instead of an overflow. Above 100 the distribution is uniform to float32 precision.
- top_p in (0, 1]. The most likely token always stays, so a top_p below float32 resolution
  (1e-300) keeps exactly that one token.
- top_k: -1 or 0 = off, else >= 1 (values above the vocabulary mean "all tokens").
- min_p in [0, 1]: tokens with p < min_p * p_max are dropped (the most likely always stays).
- presence_penalty, frequency_penalty in [-2, 2] (OpenAI): subtracted from the logits of tokens
  the request has GENERATED so far (presence once, frequency per occurrence); prompt not counted.
- repetition_penalty in [0.01, 100] (vLLM takes any > 0; beyond this range float32 overflows
  while the effect is already saturated): divides positive / multiplies negative logits of every
  token seen in the PROMPT OR OUTPUT (as transformers and vLLM).
- logit_bias: at most MAX_LOGIT_BIAS entries {token id: bias in [-100, 100]} added to the logits
  (OpenAI); ids are checked against the vocabulary when the engine takes the request.
- min_tokens in [0, max_tokens]: EOS (unless ignore_eos) and stop_token_ids cannot be sampled and
  stop strings do not end the request before min_tokens tokens were generated (as vLLM).
- seed: None or any int64 (OpenAI's range, -2**63 .. 2**63-1); the generator seed is a hash of it.
- stop: at most MAX_STOP strings, each 1..MAX_STOP_BYTES bytes of UTF-8.
- stop_token_ids: at most MAX_STOP_TOKEN_IDS ids, each in [0, 2**31).
- structured_outputs: None or a StructuredOutputsParams (a dict of its fields is converted);
  `guided_decoding` is vLLM's older name for the same field (give one of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedkv.engine.structured_params import StructuredOutputsParams
from pagedkv.errors import InvalidParamsError

TEMPERATURE_EPS = 1e-5  # below: greedy
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_PENALTY = 2.0  # presence / frequency: [-2, 2]
MAX_BIAS = 100.0  # logit_bias values: [-100, 100]
MAX_LOGIT_BIAS = 300  # entries
MAX_STOP = 16  # stop strings
MAX_STOP_BYTES = 256  # per stop string, UTF-8
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOKEN_ID_LIMIT = 2**31


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # < TEMPERATURE_EPS: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # top-k logprobs per generated token (the sampled one included)
    structured_outputs: StructuredOutputsParams | None = None  # the output's constraint
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name (an alias)

    def __post_init__(self) -> None:
        self._check_structured()
        self._check_lengths()
        self._check_sampling()
        self._check_penalties()
        self._check_stops()

    def _check_lengths(self) -> None:
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an int >= 1")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", f"an int in [0, max_tokens={self.max_tokens}]")
        _check(_is_int(self.n) and self.n >= 1, "n", "an int >= 1")
        _check(self.logprobs is None or (_is_int(self.logprobs)
                                         and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"None or an int in [0, {MAX_LOGPROBS}]")
        _check(self.seed is None or (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX),
               "seed", "None or an int in [-2**63, 2**63 - 1]")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool")

    def _check_sampling(self) -> None:
        _check(_in(self.temperature, 0, MAX_TEMPERATURE), "temperature",
               f"a number in [0, {MAX_TEMPERATURE:g}]")
        _check(_in(self.top_p, 0, 1) and self.top_p > 0, "top_p", "a number in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k",
               "-1 or 0 (off) or an int >= 1")
        _check(_in(self.min_p, 0, 1), "min_p", "a number in [0, 1]")
        self.temperature, self.top_p, self.min_p = (float(self.temperature), float(self.top_p),
                                                    float(self.min_p))

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            _check(_in(getattr(self, name), -MAX_PENALTY, MAX_PENALTY), name,
                   f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
            setattr(self, name, float(getattr(self, name)))
        _check(_in(self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
               "repetition_penalty",
               f"a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]")
        self.repetition_penalty = float(self.repetition_penalty)
        self.logit_bias = _logit_bias(self.logit_bias)

    def _check_stops(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.stop, list | tuple) or self.stop is None, "stop",
               "a string or a list of strings")
        self.stop = list(self.stop or [])
        _check(len(self.stop) <= MAX_STOP and all(
            isinstance(s, str) and 0 < len(s.encode("utf-8", "surrogatepass")) <= MAX_STOP_BYTES
            for s in self.stop), "stop",
            f"at most {MAX_STOP} non-empty strings of at most {MAX_STOP_BYTES} UTF-8 bytes")
        _check(isinstance(self.stop_token_ids, list | tuple) or self.stop_token_ids is None,
               "stop_token_ids", "a list of token ids")
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS and all(
            _is_int(t) and 0 <= t < TOKEN_ID_LIMIT for t in self.stop_token_ids),
            "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ints in [0, 2**31)")

    def _check_structured(self) -> None:
        so, gd = self.structured_outputs, self.guided_decoding
        _check(so is None or gd is None or so == gd, "structured_outputs",
               "given once (structured_outputs or its older name guided_decoding)")
        spec = so if so is not None else gd
        if isinstance(spec, dict):
            try:
                spec = StructuredOutputsParams(**spec)
            except TypeError as exc:
                _check(False, "structured_outputs", f"StructuredOutputsParams fields ({exc})")
        _check(spec is None or isinstance(spec, StructuredOutputsParams), "structured_outputs",
               "None or a StructuredOutputsParams")
        self.structured_outputs = self.guided_decoding = spec

    def check_vocab(self, vocab_size: int) -> None:
        """Raise unless every logit_bias key is a token id of this vocabulary."""
        bad = [t for t in self.logit_bias if t >= vocab_size]
        _check(not bad, "logit_bias", f"keys that are token ids in [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def _logit_bias(bias: object) -> dict[int, float]:
    """{id: bias} with int (or decimal-string, as JSON object keys arrive) ids."""
    what = (f"a dict of at most {MAX_LOGIT_BIAS} {{token id: number in "
            f"[-{MAX_BIAS:g}, {MAX_BIAS:g}]}}")
    if bias is None:
        return {}
    _check(isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS, "logit_bias", what)
    out: dict[int, float] = {}
    for k, v in bias.items():  # type: ignore[union-attr]
        tok = k if _is_int(k) else int(k) if isinstance(k, str) and k.isascii() and k.isdigit() \
            and len(k) <= 10 else None
        _check(tok is not None and 0 <= tok < TOKEN_ID_LIMIT and _in(v, -MAX_BIAS, MAX_BIAS),
               "logit_bias", what)
        out[tok] = float(v)  # type: ignore[index]
    return out


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _in(v: object, lo: float, hi: float) -> bool:
    """A real finite number in [lo, hi] (bools, NaN and inf fail; huge ints fail by range)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    if isinstance(v, float) and not math.isfinite(v):
        return False
    return lo <= v <= hi


def _check(ok: bool, name: str, accepted: str) -> None:
    """Raise InvalidParamsError naming the field; `.param` carries the field name (an OpenAI
    error body's `param`)."""
    if not ok:
        err = InvalidParamsError(f"{name} must be {accepted}")
        err.param = name  # type: ignore[attr-defined]
        raise err
