"""Every exception pagedkv raises on bad input or exhausted resources.

All derive from `PagedKVError`, so a caller can catch the family at once; each also derives
from the builtin it refines (ValueError, KeyError, ...) so generic handlers keep working.
"""

from __future__ import annotations


class PagedKVError(Exception):
    """Base class of all pagedkv errors."""


# --- cache -----------------------------------------------------------------------------------


class OutOfBlocksError(PagedKVError, MemoryError):
    """Not enough free blocks; nothing was changed."""

    def __init__(self, needed: int, available: int, what: str = "allocation") -> None:
        super().__init__(f"{what} needs {needed} blocks but only {available} are available")
        self.needed = needed
        self.available = available


class DoubleFreeError(PagedKVError, ValueError):
    """A block was freed while its reference count was already zero."""


class InvalidBlockError(PagedKVError, IndexError):
    """A block id outside [0, num_blocks)."""


class UnknownSequenceError(PagedKVError, KeyError):
    """A sequence id the cache does not know."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown sequence"


class DuplicateSequenceError(PagedKVError, ValueError):
    """A sequence id that is already live."""


class PositionError(PagedKVError, IndexError):
    """A token position outside a sequence's length."""


class SlidingWindowError(PositionError):
    """An operation needs K/V a sliding-window group no longer holds: its blocks before the
    window went back to the pool (llama.cpp's `seq_pos_min`). Nothing changed."""


class StorageMismatchError(PagedKVError, ValueError):
    """A tensor whose shape, dtype or device does not fit the KV storage."""


class CacheConfigError(PagedKVError, ValueError):
    """An invalid cache configuration (block size, budget, dtype...)."""


class InvalidArgumentError(PagedKVError, TypeError, ValueError):
    """An argument of the wrong type or shape: an unhashable sequence id, a token id that is not
    an int64, a list whose length does not match its partner list. Derives from both TypeError
    and ValueError because callers used to see either."""


# --- model -----------------------------------------------------------------------------------


class ModelLoadError(PagedKVError, RuntimeError):
    """A model could not be loaded (missing file, bad shapes)."""


class DeviceError(PagedKVError, RuntimeError):
    """A device or attention backend this machine cannot run (`device="cuda"` without a CUDA
    GPU, `attention_backend="triton"` without triton installed): raised at start-up."""


class UnsupportedModelError(ModelLoadError):
    """An architecture pagedkv does not implement."""


# --- engine ----------------------------------------------------------------------------------


class InvalidParamsError(PagedKVError, ValueError):
    """Invalid sampling parameters or request arguments."""


class UnknownOptionError(InvalidParamsError, TypeError):
    """A keyword option that no config field declares (`LLM(num_block=8)`): the message names
    it and the closest field. A TypeError too, as Python's own unexpected-keyword error is."""


class GrammarError(InvalidParamsError):
    """A structured-output constraint (JSON schema, regex, choice, grammar) that cannot be used:
    malformed, an unsupported keyword, over the size cap, or matching nothing. `.param` names
    the request field it came from."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class SpecConfigError(InvalidParamsError):
    """An invalid speculative_config (bad JSON, an unknown method or key, a value out of
    range): the message names the key."""


class RequestTooLongError(PagedKVError, ValueError):
    """A request that can never fit: prompt + max_tokens over the context or the whole cache."""


class RequestFailedError(PagedKVError, RuntimeError):
    """A step failed for some requests only (say a row that cannot be sampled).

    Raised by `LLMEngine.step` after it has dropped `request_ids` (their blocks freed); every
    other request of the batch is intact and continues at the next step.
    """

    def __init__(self, request_ids: list[str] | tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.request_ids = tuple(request_ids)


# --- KV tiers --------------------------------------------------------------------------------


class TierConfigError(PagedKVError, ValueError):
    """An invalid KV tier specification (unknown scheme, bad option)."""


class KVEventsConfigError(PagedKVError, ValueError):
    """An invalid --kv-events-config (unknown key, wrong type, bad endpoint); names the key."""


class TierUnavailableError(PagedKVError, RuntimeError):
    """A KV tier that cannot be used at all (unwritable directory, ...); serve without it."""


class CorruptEntryError(PagedKVError, ValueError):
    """A stored KV block whose checksum, fingerprint, key or shape does not match: never served."""
