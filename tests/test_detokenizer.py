"""Incremental detokenization gives the text a full decode gives; stop search sees new text only."""

from __future__ import annotations

import random

import pytest

from pagedkv.engine.detokenizer import IncrementalDetokenizer, find_stop

TEXTS = [
    "Paged attention keeps keys and values in blocks.  Two spaces, tabs\tand\nnew lines.",
    "Unicode: café, naïve, 日本語のテキスト, emoji 🚀🎉 and ∑ ≤ ∞.",
    "Numbers 1234567890 and code: def f(x):\n    return x**2  # square",
]


def _incremental(tok, prompt: list[int], out: list[int]) -> tuple[str, list[str]]:  # noqa: ANN001
    ids = list(prompt)
    d = IncrementalDetokenizer.at(len(ids))
    pieces = []
    for i, t in enumerate(out):
        ids.append(t)
        pieces.append(d.step(tok, ids, final=i == len(out) - 1))
    return "".join(pieces), pieces


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(smollm2_tokenizer, text: str) -> None:  # noqa: ANN001
    tok = smollm2_tokenizer
    out = tok(text, add_special_tokens=False).input_ids
    prompt = tok("Say something:", add_special_tokens=False).input_ids
    got, pieces = _incremental(tok, prompt, out)
    assert got == tok.decode(out, skip_special_tokens=True) == text
    assert all("\ufffd" not in p for p in pieces)  # never a half character on the way


def test_random_ids_and_special_tokens(smollm2_tokenizer) -> None:  # noqa: ANN001
    tok = smollm2_tokenizer
    rng = random.Random(0)
    for _ in range(20):
        out = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        if rng.random() < 0.5:
            out.insert(rng.randrange(len(out)), tok.eos_token_id)
        got, _ = _incremental(tok, [1, 2, 3], out)
        assert got == tok.decode(out, skip_special_tokens=True)


def test_find_stop_looks_at_new_text_only() -> None:
    text = "alpha beta gamma"
    assert find_stop(text, ["beta"], new_from=8) == 6  # "beta" ends in the new part "ta gamma"
    assert find_stop(text, ["alpha"], new_from=8) is None  # ended before the new text
    assert find_stop(text, ["mm", "gam"], new_from=12) == 11
    assert find_stop(text, [], new_from=0) is None
