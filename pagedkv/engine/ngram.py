"""Prompt lookup (vLLM's "ngram" method): draft the tokens that followed the latest earlier
occurrence of the context's longest suffix of prompt_lookup_min..prompt_lookup_max tokens.

`NgramIndex` keeps, for every n-gram of those lengths, where its latest occurrence ends; it is
built once over the prompt and then extended by the tokens appended since the last call, so a
proposal costs O(prompt_lookup_max) per new token and per lookup, never a scan of the context.
"""

from __future__ import annotations


class NgramIndex:
    """Invariant: `ends[ngram]` is the end (exclusive) of the latest occurrence of `ngram` that
    ends before the last indexed token list's end, i.e. at most len - 1 (so a match of the
    list's own suffix is always an earlier occurrence, with at least one token after it)."""

    __slots__ = ("ends", "hi", "lo", "done", "matched")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.ends: dict[tuple[int, ...], int] = {}
        self.done = 0  # n-grams ending at positions <= done are indexed
        self.matched = 0  # the last proposal's suffix length

    def _extend(self, toks: list[int]) -> None:
        ends, lo, hi = self.ends, self.lo, self.hi
        for e in range(self.done + 1, len(toks)):
            for n in range(lo, min(hi, e) + 1):
                ends[tuple(toks[e - n : e])] = e
        self.done = max(self.done, len(toks) - 1)

    def propose(self, toks: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching
        suffix of `toks` (which must extend the list of earlier calls); [] without a match.
        `matched` then holds that suffix's length (0 without a match)."""
        if len(toks) <= self.done:  # not an extension (never happens in the engine): rebuild
            self.ends.clear()
            self.done = 0
        self._extend(toks)
        L = len(toks)
        get = self.ends.get
        for n in range(min(self.hi, L - 1), self.lo - 1, -1):
            e = get(tuple(toks[L - n :]))
            if e is not None:
                self.matched = n
                return toks[e : e + k]
        self.matched = 0
        return []


__all__ = ["NgramIndex"]
