"""One stored block: a self-describing record, checksummed (no key) or sealed (with a key).

Body (little endian):
    b"PKVB" | u16 1 | u32 header length | header (JSON) | payload

Plain record (no tier key; unauthenticated: anyone who can write the store can forge one):
    body | 16-byte blake2b digest of the body
Sealed record (a TierKey, see seal.py):
    b"PKVB" | u16 2 | nonce | AES-256-GCM(body) | tag, associated data = magic, version,
    model fingerprint and block hash; the AES key is derived per tenant.

The header is padded with spaces so the payload starts at a multiple of ALIGN bytes from the
body's start (tensors read straight out of the buffer are aligned). The header names the model
fingerprint, the block's chained hash and every part's name, dtype and shape; the payload is the
parts' raw bytes in header order. `decode` returns the parts only when the digest (or the tag),
fingerprint, key, and each part's dtype and shape all match what the reader expects. A record
is input from outside the process: every failure to decode it (any exception, a header over
MAX_HEADER bytes or MAX_DEPTH levels, a number that is not a small whole number, a sealed record
without a key or a plain one with a key) raises CorruptEntryError and nothing else.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from typing import TYPE_CHECKING

import torch

from pagedkv.errors import CorruptEntryError

if TYPE_CHECKING:
    from pagedkv.cache.tiers.seal import TierKey

MAGIC = b"PKVB"
VERSION = 1  # the body, and a plain record
SEALED = 2
_HEAD = struct.Struct("<4sHI")
_SEALED_HEAD = struct.Struct("<4sH")
DIGEST = 16
ALIGN = 64
MAX_HEADER = 16 * 1024  # bytes; a real header is a few hundred
MAX_DEPTH = 8  # JSON nesting; a real header has 4
MAX_DIM = 1 << 31

Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]  # part name -> (dtype, per-block shape)
Parts = dict[str, torch.Tensor]


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST).digest()


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _aad(fingerprint: bytes, key: bytes) -> bytes:
    return _SEALED_HEAD.pack(MAGIC, SEALED) + fingerprint + key


def max_size(layout: Layout) -> int:
    """An upper bound on the size of a valid record of `layout` (larger entries are corrupt)."""
    payload = sum(torch.empty((), dtype=dt).element_size() * _numel(shape)
                  for dt, shape in layout.values())
    return _HEAD.size + MAX_HEADER + ALIGN + payload + DIGEST + 64


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _body(fingerprint: bytes, key: bytes, parts: Parts) -> bytes:
    header = json.dumps({
        "fp": fingerprint.hex(),
        "key": key.hex(),
        "parts": [[n, _dtype_name(t.dtype), list(t.shape)] for n, t in parts.items()],
    }, separators=(",", ":")).encode()
    header += b" " * (-(_HEAD.size + len(header)) % ALIGN)
    chunks = [_HEAD.pack(MAGIC, VERSION, len(header)), header]
    chunks += [t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() for t in parts.values()]
    return b"".join(chunks)


def encode(fingerprint: bytes, key: bytes, parts: Parts, tier_key: TierKey | None = None,
           tenant: object = None) -> bytes:
    """Serialize one block's parts (contiguous CPU tensors) under `key`: plain without a
    tier key, else sealed for `tenant`."""
    body = _body(fingerprint, key, parts)
    if tier_key is None:
        return body + _digest(body)
    return _SEALED_HEAD.pack(MAGIC, SEALED) + tier_key.seal(body, _aad(fingerprint, key), tenant)


def decode(blob: bytes | bytearray, fingerprint: bytes, key: bytes, layout: Layout,
           tier_key: TierKey | None = None, tenant: object = None) -> Parts:
    """Parts of a record, checked against the expected fingerprint, key, layout and (with a
    tier key) its tag for `tenant`. Raises CorruptEntryError only."""
    try:
        return _decode(blob, fingerprint, key, layout, tier_key, tenant)
    except CorruptEntryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a record is outside input: any failure is corruption
        raise CorruptEntryError(f"undecodable record ({type(exc).__name__}: {exc})") from None


def _decode(blob: bytes | bytearray, fingerprint: bytes, key: bytes, layout: Layout,
            tier_key: TierKey | None, tenant: object) -> Parts:
    buf = memoryview(blob)
    if len(buf) < _HEAD.size + DIGEST:
        raise CorruptEntryError("record too short")
    magic, version = _SEALED_HEAD.unpack_from(buf)
    if magic != MAGIC or version not in (VERSION, SEALED):
        raise CorruptEntryError(f"not a version-{VERSION} or -{SEALED} block record")
    if tier_key is not None:
        if version != SEALED:
            raise CorruptEntryError("an unauthenticated record where a key is set")
        raw = tier_key.open(buf[_SEALED_HEAD.size:], _aad(fingerprint, key), tenant)
    else:
        if version != VERSION:
            raise CorruptEntryError("a sealed record, and no key is set")
        if _digest(buf[:-DIGEST]) != bytes(buf[-DIGEST:]):
            raise CorruptEntryError("checksum mismatch")
        # tensors alias a writable buffer: the caller's bytearray (no copy), else one copy
        raw = memoryview(blob if isinstance(blob, bytearray) else bytearray(blob))[:-DIGEST]
    return _parts(raw, fingerprint, key, layout)


def _parts(raw: bytearray | memoryview, fingerprint: bytes, key: bytes, layout: Layout) -> Parts:
    """The tensors of a body (checked); they alias `raw`."""
    if len(raw) < _HEAD.size:
        raise CorruptEntryError("record too short")
    magic, version, hlen = _HEAD.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise CorruptEntryError("bad record body")
    if hlen > MAX_HEADER or _HEAD.size + hlen > len(raw):
        raise CorruptEntryError(f"header of {hlen} bytes (limit {MAX_HEADER}, or past the end)")
    header = _header(bytes(raw[_HEAD.size : _HEAD.size + hlen]))
    if header["fp"] != fingerprint.hex() or header["key"] != key.hex():
        raise CorruptEntryError("record belongs to another model or block")
    want = [(n, _dtype_name(dt), tuple(shape)) for n, (dt, shape) in layout.items()]
    if header["parts"] != want:
        raise CorruptEntryError(f"layout {header['parts']} != expected {want}")
    start = off = _HEAD.size + hlen
    end = len(raw)
    out: Parts = {}
    for name, (dt, shape) in layout.items():
        count = _numel(shape)
        nbytes = count * torch.empty((), dtype=dt).element_size()
        if off + nbytes > end:
            raise CorruptEntryError("payload shorter than its layout")
        out[name] = torch.frombuffer(raw, dtype=dt, count=count, offset=off).view(shape)
        off += nbytes
    if off != end or start % ALIGN:
        raise CorruptEntryError("payload longer than its layout, or misaligned")
    return out


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_BRACKETS = re.compile(rb"[\[\]{}]")


def _reject(text: str) -> None:
    raise CorruptEntryError(f"header holds a number that is not a whole number ({text[:20]})")


def _header(raw: bytes) -> dict:
    """The checked header: {"fp": str, "key": str, "parts": [(name, dtype, shape), ...]}."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(_STRINGS.sub(b'""', raw)):
        depth += 1 if m.group() in b"[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_DEPTH:
        raise CorruptEntryError(f"header nested {deepest} deep (limit {MAX_DEPTH})")
    doc = json.loads(raw, parse_constant=_reject, parse_float=_reject)
    if not isinstance(doc, dict) or not isinstance(doc.get("fp"), str) or not isinstance(
            doc.get("key"), str) or not isinstance(doc.get("parts"), list):
        raise CorruptEntryError("header is not {fp, key, parts}")
    parts = []
    for p in doc["parts"]:
        if not (isinstance(p, list) and len(p) == 3 and isinstance(p[0], str)
                and isinstance(p[1], str) and isinstance(p[2], list)
                and all(type(s) is int and 0 <= s < MAX_DIM for s in p[2])):
            raise CorruptEntryError("header part is not [name, dtype, shape]")
        parts.append((p[0], p[1], tuple(p[2])))
    return {"fp": doc["fp"], "key": doc["key"], "parts": parts}
