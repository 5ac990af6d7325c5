"""Incremental detokenization and stop-string search: constant work per new token.

Decoding the whole output again on every token (and searching the whole text for stop strings)
costs O(n^2) over a sequence. Here each step decodes only a short window: the tokens since the
last emitted text (`read`) plus a few before them (`prefix`) as context, so tokenizers that
merge or strip spaces at token boundaries still produce exactly the text a full decode gives;
the new text is the window's decode minus the prefix's decode. A window ending in an incomplete
UTF-8 character (U+FFFD) waits for the next token, at most `_MAX_PENDING` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_MAX_PENDING = 6  # a UTF-8 character is at most 4 bytes; byte-level tokens carry >= 1 byte


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Text of token_ids[start:] as it grows; `start` is the prompt length."""

    prefix: int  # first token of the context window
    read: int  # first token not yet turned into text

    @classmethod
    def at(cls, start: int) -> IncrementalDetokenizer:
        return cls(start, start)

    def step(self, tokenizer: Any, ids: list[int], final: bool = False) -> str:
        """New text for ids[read:] ("" while a character is incomplete, unless `final`)."""
        if tokenizer is None or self.read >= len(ids):
            return ""
        before = tokenizer.decode(ids[self.prefix : self.read], skip_special_tokens=True)
        text = tokenizer.decode(ids[self.prefix :], skip_special_tokens=True)
        incomplete = text.endswith("\ufffd") or len(text) <= len(before)
        if incomplete and not final and len(ids) - self.read < _MAX_PENDING:
            return ""
        self.prefix, self.read = self.read, len(ids)
        return text[len(before) :]


def find_stop(text: str, stops: list[str], new_from: int) -> int | None:
    """Earliest index where a stop string starts, looking only at matches that end in the new
    text (text[new_from:]): the search starts `longest stop - 1` characters before it."""
    if not stops:
        return None
    start = max(0, new_from - max(map(len, stops)) + 1)
    cuts = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(cuts) if cuts else None
