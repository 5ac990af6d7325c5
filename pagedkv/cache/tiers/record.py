"""One stored block: a self-describing, checksummed record.

Layout (little endian):
    b"PKVB" | u16 version | u32 header length | header (JSON) | payload | 16-byte blake2b digest

The header is padded with spaces so the payload starts at a multiple of ALIGN bytes (tensors
read straight out of the buffer are aligned: no slow unaligned copies). The header names the
model fingerprint, the block's chained hash and every part's name, dtype
and shape; the payload is the parts' raw bytes in header order. The digest covers everything
before it. `decode` returns the parts only when the digest, fingerprint, key, and each part's
dtype and shape all match what the reader expects; anything else raises CorruptEntryError, so
a flipped byte, a truncated file or another model's block is never served.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch

from pagedkv.errors import CorruptEntryError

MAGIC = b"PKVB"
VERSION = 1
_HEAD = struct.Struct("<4sHI")
DIGEST = 16
ALIGN = 64

Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]  # part name -> (dtype, per-block shape)
Parts = dict[str, torch.Tensor]


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST).digest()


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def encode(fingerprint: bytes, key: bytes, parts: Parts) -> bytes:
    """Serialize one block's parts (contiguous CPU tensors) under `key`."""
    header = json.dumps({
        "fp": fingerprint.hex(),
        "key": key.hex(),
        "parts": [[n, _dtype_name(t.dtype), list(t.shape)] for n, t in parts.items()],
    }, separators=(",", ":")).encode()
    header += b" " * (-(_HEAD.size + len(header)) % ALIGN)
    chunks = [_HEAD.pack(MAGIC, VERSION, len(header)), header]
    chunks += [t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() for t in parts.values()]
    body = b"".join(chunks)
    return body + _digest(body)


def decode(blob: bytes | bytearray, fingerprint: bytes, key: bytes, layout: Layout) -> Parts:
    """Parts of a record, checked against the expected fingerprint, key and layout."""
    buf = memoryview(blob)
    if len(buf) < _HEAD.size + DIGEST:
        raise CorruptEntryError("record too short")
    if _digest(buf[:-DIGEST]) != bytes(buf[-DIGEST:]):
        raise CorruptEntryError("checksum mismatch")
    magic, version, hlen = _HEAD.unpack_from(buf)
    if magic != MAGIC or version != VERSION:
        raise CorruptEntryError(f"not a version-{VERSION} block record")
    try:
        header = json.loads(bytes(buf[_HEAD.size : _HEAD.size + hlen]))
        names = [(n, d, tuple(s)) for n, d, s in header["parts"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptEntryError(f"bad header: {exc}") from None
    if header.get("fp") != fingerprint.hex() or header.get("key") != key.hex():
        raise CorruptEntryError("record belongs to another model or block")
    want = [(n, _dtype_name(dt), tuple(shape)) for n, (dt, shape) in layout.items()]
    if names != want:
        raise CorruptEntryError(f"layout {names} != expected {want}")
    # tensors alias a writable buffer: the caller's bytearray (no copy), else one copy
    raw = blob if isinstance(blob, bytearray) else bytearray(blob)
    start = off = _HEAD.size + hlen
    end = len(raw) - DIGEST
    out: Parts = {}
    for name, (dt, shape) in layout.items():
        item = torch.empty((), dtype=dt).element_size()
        count = 1
        for s in shape:
            count *= s
        if off + count * item > end:
            raise CorruptEntryError("payload shorter than its layout")
        out[name] = torch.frombuffer(raw, dtype=dt, count=count, offset=off).view(shape)
        off += count * item
    if off != end or start % ALIGN:
        raise CorruptEntryError("payload longer than its layout, or misaligned")
    return out
