"""SamplingParams accepted ranges: every bad value is an InvalidParamsError naming its field."""

from __future__ import annotations

import pytest

from pagedkv.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_STOP,
    MAX_STOP_BYTES,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from pagedkv.errors import InvalidParamsError

BAD = [
    ("max_tokens", 0), ("max_tokens", "3"), ("max_tokens", 2.0), ("max_tokens", True),
    ("temperature", -1), ("temperature", -1e-40), ("temperature", float("nan")),
    ("temperature", float("inf")), ("temperature", 101), ("temperature", "1"),
    ("temperature", True),
    ("top_p", 0), ("top_p", 0.0), ("top_p", -1e-300), ("top_p", 1.0000001),
    ("top_p", float("nan")), ("top_k", -2), ("top_k", 1.5), ("top_k", False),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("nan")),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", 3),
    ("frequency_penalty", float("-inf")),
    ("repetition_penalty", 0), ("repetition_penalty", -1), ("repetition_penalty", 1e-40),
    ("repetition_penalty", 1e300), ("repetition_penalty", float("nan")),
    ("logit_bias", {5: 101}), ("logit_bias", {5: float("nan")}), ("logit_bias", {-1: 1}),
    ("logit_bias", {"x": 1}), ("logit_bias", {"-3": 1}), ("logit_bias", {1.5: 1}),
    ("logit_bias", {2**40: 1}), ("logit_bias", [1, 2]), ("logit_bias", {True: 1}),
    ("logit_bias", {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.0),
    ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", 1e30), ("seed", 3.0), ("seed", True),
    ("seed", "7"),
    ("n", 0), ("logprobs", 21), ("logprobs", -1), ("ignore_eos", 1),
    ("stop", [""]), ("stop", [3]), ("stop", ["x"] * (MAX_STOP + 1)),
    ("stop", ["é" * (MAX_STOP_BYTES // 2 + 1)]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", [2**31]), ("stop_token_ids", [True]),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))), ("stop_token_ids", "12"),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={str(v)[:20]}" for f, v in BAD])
def test_rejected_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidParamsError, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


GOOD = [
    ("temperature", 0), ("temperature", 1e-40), ("temperature", 2), ("temperature", 100),
    ("top_p", 1e-300), ("top_p", 1), ("top_k", 0), ("top_k", 10**9), ("min_p", 0),
    ("min_p", 1), ("presence_penalty", -2), ("frequency_penalty", 2),
    ("repetition_penalty", 0.01), ("repetition_penalty", 100),
    ("logit_bias", {i: 100.0 for i in range(MAX_LOGIT_BIAS)}), ("logit_bias", None),
    ("min_tokens", 16), ("seed", 2**63 - 1), ("seed", -(2**63)), ("seed", 0),
    ("stop", "x" * MAX_STOP_BYTES), ("stop", ["a"] * MAX_STOP), ("stop", None),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS))), ("stop_token_ids", None),
]


@pytest.mark.parametrize(("field", "value"), GOOD, ids=[f"{f}={str(v)[:20]}" for f, v in GOOD])
def test_accepted(field: str, value: object) -> None:
    SamplingParams(**{field: value})


def test_normalized() -> None:
    p = SamplingParams(logit_bias={"50": -100, 7: 1}, stop="end", temperature=1, top_p=1)
    assert p.logit_bias == {50: -100.0, 7: 1.0}
    assert p.stop == ["end"]
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)


def test_tiny_temperature_is_greedy() -> None:
    assert SamplingParams(temperature=1e-40).greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=1e-3).greedy


def test_logit_bias_checked_against_the_vocabulary() -> None:
    p = SamplingParams(logit_bias={99: 1.0})
    p.check_vocab(100)
    with pytest.raises(InvalidParamsError, match="logit_bias"):
        p.check_vocab(99)
