"""The on-disk cache of GGUF tokenizers: a cached tokenizer is the one built from the file, a
damaged or foreign entry is never used, and a cache that cannot be written costs nothing else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.model import loader, tokenizer_cache
from pagedkv.model.gguf_file import GGUFFile
from pagedkv.model.loader import default_model_path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tokenizer_cache, "cache_dir", lambda: tmp_path / "tokenizers")
    (tmp_path / "tokenizers").mkdir()
    return tmp_path / "tokenizers"


def _digest() -> str:
    return GGUFFile(default_model_path()).tokenizer_digest()


def _never() -> Any:
    raise AssertionError("built although cached")


def _build_counted(calls: list[int]) -> Any:
    calls.append(1)
    return loader._gguf_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def cached_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(built, loaded back from the cache) for the default model: one build for the module."""
    root = tmp_path_factory.mktemp("tokc") / "tokenizers"
    root.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokenizer_cache, "cache_dir", lambda: root)
        built = tokenizer_cache.load_or_build(_digest(), lambda: loader._gguf_tokenizer(default_model_path()))
        assert len(list(root.iterdir())) == 1  # one entry, no temporary folder left
        return built, tokenizer_cache.load_or_build(_digest(), _never)


def test_second_start_loads_the_cached_tokenizer(cached_pair: tuple[Any, Any]) -> None:
    built, cached = cached_pair
    assert tokenizer_cache.same_tokenizer(built, cached)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <|im_end|>"}]
    assert built.apply_chat_template(chat, add_generation_prompt=True) == cached.apply_chat_template(
        chat, add_generation_prompt=True
    )


def test_entry_lists_the_added_tokens(cache: Path) -> None:
    # loading then never parses tokenizer.json in Python for them (transformers' legacy path)
    built = tokenizer_cache.load_or_build(_digest(), lambda: loader._gguf_tokenizer(default_model_path()))
    (entry,) = cache.iterdir()
    table = json.loads((entry / "tokenizer_config.json").read_text(encoding="utf-8"))["added_tokens_decoder"]
    assert table == {str(i): t.__getstate__() for i, t in built.added_tokens_decoder.items()}
    assert table  # SmolLM2 has added (special) tokens
    cached = tokenizer_cache.load_or_build(_digest(), _never)
    assert cached.added_tokens_decoder == built.added_tokens_decoder


@pytest.mark.parametrize("change", ["table", "tokens", "sum", "extra", "link"])
def test_entry_changed_after_saving_is_rebuilt(cache: Path, change: str) -> None:
    calls: list[int] = []
    first = tokenizer_cache.load_or_build(_digest(), lambda: _build_counted(calls))
    (entry,) = cache.iterdir()
    cfg_path = entry / "tokenizer_config.json"
    if change == "table":  # well-formed, loads, but says another token is the eos
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        first_id = next(iter(cfg["added_tokens_decoder"]))
        cfg["added_tokens_decoder"][first_id]["content"] = "<evil>"
        cfg_path.write_text(json.dumps(cfg), encoding="utf-8")
    elif change == "tokens":
        tj = entry / "tokenizer.json"
        tj.write_bytes(tj.read_bytes().replace(b'"hello"', b'"hellp"', 1))
    elif change == "sum":
        (entry / tokenizer_cache.SUM_FILE).unlink()
    elif change == "extra":
        (entry / "special_tokens_map.json").write_text("{}")
    else:  # a link in place of a file (never followed: /dev/zero would never end)
        (entry / "tokenizer.json").unlink()
        (entry / "tokenizer.json").symlink_to("/dev/zero")
    again = tokenizer_cache.load_or_build(_digest(), lambda: _build_counted(calls))
    assert calls == [1, 1]
    assert tokenizer_cache.same_tokenizer(first, again)
    assert tokenizer_cache.same_tokenizer(first, tokenizer_cache.load_or_build(_digest(), _never))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_cached_tokenizer_encodes_any_text_alike(cached_pair: tuple[Any, Any], text: str) -> None:
    built, cached = cached_pair
    ids = built.encode(text)
    assert cached.encode(text) == ids
    assert cached.decode(ids) == built.decode(ids)


def test_damaged_entry_is_discarded_and_rebuilt(cache: Path) -> None:
    calls: list[int] = []
    first = tokenizer_cache.load_or_build(_digest(), lambda: _build_counted(calls))
    (entry,) = cache.iterdir()
    (entry / "tokenizer.json").write_text('{"truncated": ')
    again = tokenizer_cache.load_or_build(_digest(), lambda: _build_counted(calls))
    assert calls == [1, 1]
    assert tokenizer_cache.same_tokenizer(first, again)
    assert tokenizer_cache.same_tokenizer(first, tokenizer_cache.load_or_build(_digest(), _never))


def test_unwritable_cache_still_gives_the_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setattr(tokenizer_cache, "cache_dir", lambda: blocker)
    calls: list[int] = []
    tok = tokenizer_cache.load_or_build(_digest(), lambda: _build_counted(calls))
    assert tok is not None and tok.encode("hello") and calls == [1]
    assert blocker.read_text() == "x"


def test_a_tokenizer_that_does_not_round_trip_is_not_cached(cache: Path) -> None:
    built = loader._gguf_tokenizer(default_model_path())
    inner = built.encode

    def odd_encode(text: str, **kw: Any) -> list[int]:  # behaviour that saving cannot keep
        return [0, *inner(text, **kw)]

    built.encode = odd_encode
    tokenizer_cache.load_or_build(_digest(), lambda: built)
    assert list(cache.iterdir()) == []


def test_no_tokenizer_is_not_cached(cache: Path) -> None:
    assert tokenizer_cache.load_or_build("0" * 64, lambda: None) is None
    assert list(cache.iterdir()) == []


def test_key_follows_the_metadata_bytes(tmp_path: Path) -> None:
    src = default_model_path().read_bytes()
    g = GGUFFile(default_model_path())
    assert g.tokenizer_digest() == _digest()
    # one byte of the chat template changed: another key; of the model's name or of the
    # weights: the same key
    name = g.metadata["general.name"].encode()
    edits = {"template": src.index(b"{%") + 1, "name": src.index(name, src.index(b"general.name")),
             "weights": len(src) - 1}
    digests = {}
    for what, at in edits.items():
        b = bytearray(src)
        b[at] = ord("#") if b[at] != ord("#") else ord("@")
        (tmp_path / f"{what}.gguf").write_bytes(b)
        digests[what] = GGUFFile(tmp_path / f"{what}.gguf").tokenizer_digest()
    assert digests["template"] != g.tokenizer_digest()
    assert digests["name"] == digests["weights"] == g.tokenizer_digest()
    assert tokenizer_cache.cache_key("a" * 64) != tokenizer_cache.cache_key("b" * 64)
