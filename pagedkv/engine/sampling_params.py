"""Per-request sampling parameters (vLLM-compatible names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.errors import InvalidParamsError


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # top-k logprobs per generated token (the sampled one included)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens must be an int >= 1")
        _check(_is_num(self.temperature) and 0 <= self.temperature, "temperature must be >= 0")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]")
        _check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 0),
               "top_k must be -1 (off), 0 (off) or a positive int")
        _check(self.seed is None or _is_int(self.seed), "seed must be an int or None")
        _check(_is_int(self.n) and self.n >= 1, "n must be an int >= 1")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative ints")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               "logprobs must be None or an int in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v  # NaN fails


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise InvalidParamsError(msg)
