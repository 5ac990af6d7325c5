"""Bad arguments to PagedKVCache raise a PagedKVError and change nothing (issue 8, defect 12)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from cache_snapshot import same_state, snapshot

from pagedkv.cache import PagedKVCache
from pagedkv.errors import InvalidArgumentError, PagedKVError


def _cache() -> PagedKVCache:
    c = PagedKVCache(num_blocks=16, block_size=4)
    c.create("a", [1, 2, 3, 4, 5, 6])
    c.create("b", [1, 2, 3, 4, 9])
    c.fork("a", "a2")
    return c


BAD_CALLS: list[tuple[str, Callable[[PagedKVCache], Any]]] = [
    ("append int64 overflow", lambda c: c.append("a", [2**63])),
    ("append below int64", lambda c: c.append("a", [7, -(2**63) - 1])),
    ("append to full block overflow", lambda c: c.append("b", [1, 2, 3, 2**64])),
    ("append a string", lambda c: c.append("a", "abc")),
    ("append floats", lambda c: c.append("a", [1.5])),
    ("append bools", lambda c: c.append("a", [True])),
    ("append None", lambda c: c.append("a", None)),
    ("create int64 overflow", lambda c: c.create("x", [1, 2, 3, 4, 5, 2**63])),
    ("create unhashable id", lambda c: c.create(["x"], [1])),
    ("create nested ids", lambda c: c.create("x", [[1, 2]])),
    ("fork unhashable dst", lambda c: c.fork("a", ["y"])),
    ("append_one_each overflow", lambda c: c.append_one_each(["a", "b"], [1, 2**63])),
    ("append_one_each not a list", lambda c: c.append_one_each("ab", [1, 2])),
    ("append_one_each strings", lambda c: c.append_one_each(["a"], ["1"])),
    ("slot_mapping length", lambda c: c.slot_mapping(["a", "b"], [1])),
    ("slot_mapping counts", lambda c: c.slot_mapping(["a"], ["1"])),
    ("block_tables of an int", lambda c: c.block_tables(5)),
    ("lookup overflow", lambda c: c.lookup([2**63] * 8)),
    ("lookup a dict", lambda c: c.lookup({1: 2})),
    ("truncate to a string", lambda c: c.truncate("a", "3")),
    ("truncate to a float", lambda c: c.truncate("a", 2.5)),
    ("mark_computed None", lambda c: c.mark_computed("a", None)),
    ("slots string end", lambda c: c.slots("a", 0, "2")),
    ("slot float", lambda c: c.slot("a", 1.0)),
    ("blocks_needed string", lambda c: c.blocks_needed("x")),
]


@pytest.mark.parametrize(("name", "call"), BAD_CALLS, ids=[n for n, _ in BAD_CALLS])
def test_bad_arguments_raise_typed_and_change_nothing(name: str, call: Callable) -> None:
    c = _cache()
    before = snapshot(c)
    with pytest.raises(PagedKVError):
        call(c)
    assert same_state(before, snapshot(c)), name
    c.check_invariants()
    c.append("a", [7, 8])  # still fully usable
    assert c.num_tokens("a") == 8


def test_the_reported_cases() -> None:
    c = PagedKVCache(num_blocks=8, block_size=4)
    c.create("a", [1, 2, 3])
    with pytest.raises(InvalidArgumentError):
        c.append("a", [2**63])
    assert c.num_tokens("a") == 3
    with pytest.raises(InvalidArgumentError):
        c.create(["x"], [1])
    with pytest.raises(InvalidArgumentError):
        c.fork("a", ["y"])
    c.create("b", [4])
    with pytest.raises(InvalidArgumentError):
        c.slot_mapping(["a", "b"], [1])
    # they stay what callers used to catch, too
    assert issubclass(InvalidArgumentError, TypeError) and issubclass(InvalidArgumentError, ValueError)


def test_int64_bounds_and_numpy_ints_accepted() -> None:
    import numpy as np

    c = PagedKVCache(num_blocks=8, block_size=4)
    c.create("a", [2**63 - 1, -(2**63), 0, 1, 2])
    c.append("a", [np.int64(5), np.int32(6)])
    c.append_one_each(["a"], [np.int64(7)])
    assert c.num_tokens("a") == 8
    c.check_invariants()
