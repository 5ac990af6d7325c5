"""The tokenizer of a GGUF file, converted once and kept on disk.

transformers builds a GGUF file's tokenizer by reading the whole vocabulary again in Python and
converting it: about 1 s for a 150k-token vocabulary, the larger part of a model's start-up. The
converted tokenizer is saved under `$PAGEDKV_CACHE_DIR/tokenizers/<key>` (default
`~/.cache/pagedkv`), where the key is the sha256 of the metadata items it is built from (every
`tokenizer.*` item, with the architecture: vocabulary, merges, special tokens, chat template) and
of the transformers and tokenizers versions: another vocabulary, or another converter, never
gets it; files that differ only in their weights share it. The entry's tokenizer_config.json
also lists the added tokens, so that loading it reads tokenizer.json once (in Rust).

Invariants:
- A cache entry is written only after it was loaded back and behaved as the tokenizer it came
  from (`same_tokenizer`): a conversion that does not survive the round trip is never cached.
- An entry appears whole or not at all (written to a temporary folder, then renamed).
- An entry that fails to load, or is not what was saved (its files against the sha256 written
  beside them last, `pagedkv-entry.sha256`), is discarded and rebuilt from the file;
  a cache that cannot be written (read-only, full) costs only the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FORMAT = "2"  # bump when what is saved changes
_PROBES = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\nand new lines\r\n  ",
    "numbers 0 12 345 6789 3.14159 -2e10, unicode ünïcödé 日本語 🙂 \u200b",
    "<s></s><|im_start|>user\n<|im_end|><bos><eos><start_of_turn><end_of_turn><|endoftext|>",
    "def f(x):\n    return {'a': [1, 2]}  # code",
)
SUM_FILE = "pagedkv-entry.sha256"  # the sha256 of the entry's other files, as saved
_ATTRS = ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template", "all_special_tokens")


def cache_key(digest: str) -> str:
    import tokenizers
    import transformers

    parts = (FORMAT, transformers.__version__, tokenizers.__version__, digest)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:40]


def cache_dir() -> Path:
    from pagedkv.attention.kernel import cache_root  # the one cache root of the project

    return cache_root() / "tokenizers"


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether b encodes, decodes and templates as a does (on probes covering special tokens,
    whitespace, digits, unicode and code), with the same vocabulary and special tokens."""
    if len(a) != len(b) or a.get_vocab() != b.get_vocab():
        return False
    if any(getattr(a, n, None) != getattr(b, n, None) for n in _ATTRS):
        return False
    for text in _PROBES:
        for special in (True, False):
            ids = a.encode(text, add_special_tokens=special)
            if ids != b.encode(text, add_special_tokens=special):
                return False
            if a.decode(ids) != b.decode(ids) or a.decode(ids, skip_special_tokens=True) != b.decode(
                ids, skip_special_tokens=True
            ):
                return False
    if a.chat_template:
        chat = [{"role": "user", "content": _PROBES[0]}, {"role": "assistant", "content": _PROBES[2]}]
        try:
            want = a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        except Exception:  # a template that refuses this chat: nothing to compare
            return True
        return want == b.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return True


def load_or_build(digest: str, build: Callable[[], Any]) -> Any:
    """The tokenizer cached for a file whose tokenizer digest is `digest`, else build() (None
    when the file has no usable tokenizer), cached for the next start where it round-trips."""
    from transformers import PreTrainedTokenizerFast

    entry = cache_dir() / cache_key(digest)
    if entry.is_dir():
        t0 = time.perf_counter()
        try:
            if not _intact(entry):
                raise ValueError("its files are not the ones saved")
            tok = PreTrainedTokenizerFast.from_pretrained(str(entry))
            logger.info("tokenizer loaded from %s in %.2f s", entry, time.perf_counter() - t0)
            return tok
        except Exception as e:  # a damaged entry: drop it and rebuild
            logger.warning("discarding the cached tokenizer %s (%s)", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    tok = build()
    if tok is not None:
        _save(tok, entry)
    return tok


def _save(tok: Any, entry: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(str(tmp))
        _add_token_table(tok, tmp / "tokenizer_config.json")
        if not same_tokenizer(tok, PreTrainedTokenizerFast.from_pretrained(str(tmp))):
            logger.info("tokenizer does not survive saving; not cached")
            return
        (tmp / SUM_FILE).write_text(_files_digest(tmp), encoding="ascii")
        tmp.rename(entry)  # atomic; fails if another process got there first (that one is as good)
    except Exception as e:  # no cache: only the next start pays
        logger.debug("tokenizer not cached at %s: %s", entry, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _add_token_table(tok: Any, config: Path) -> None:
    """Writes the added tokens into the saved tokenizer_config.json (`added_tokens_decoder`, as
    transformers reads it): without it, loading parses the whole tokenizer.json a second time in
    Python for them (Gemma 3's 33 MB with 6,384 added tokens: 2.65 -> 1.31 s a load)."""
    cfg = json.loads(config.read_text(encoding="utf-8"))
    cfg["added_tokens_decoder"] = {str(i): t.__getstate__() for i, t in tok.added_tokens_decoder.items()}
    config.write_text(json.dumps(cfg, ensure_ascii=False, indent=2), encoding="utf-8")


def _files_digest(entry: Path) -> str:
    """sha256 over the entry's files (names and bytes, in name order), the sum file excepted;
    OSError for anything but a regular file (a folder, a link: never followed)."""
    h = hashlib.sha256()
    for f in sorted(p for p in entry.iterdir() if p.name != SUM_FILE):
        if f.is_symlink() or not f.is_file():
            raise OSError(f"{f.name} is not a regular file")
        h.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def _intact(entry: Path) -> bool:
    """Whether the entry's files are those its sum was written for (a changed, truncated, added
    or missing file, or no sum: not intact)."""
    try:
        return (entry / SUM_FILE).read_text(encoding="ascii").strip() == _files_digest(entry)
    except (OSError, UnicodeDecodeError):
        return False
