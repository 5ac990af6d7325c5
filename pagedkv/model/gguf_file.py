"""A lean GGUF reader: metadata as Python values, tensors as zero-copy views of one mmap.

Why not `gguf.GGUFReader`: it builds several numpy views for every element of every metadata
array, and a tokenizer stores ~100k strings (SmolLM2: ~5 s of parsing). GGUF's header is a
simple little-endian record stream, so walking it with `struct` takes ~0.1 s. The tensor data
itself is dequantized with the `gguf` package (`gguf.quants.dequantize`), never by hand.

The file is mapped copy-on-write (MAP_PRIVATE, as llama.cpp maps it): `raw`/`tensor_bytes`
views are writable without ever changing the file, their pages are the page cache's own until
written, and a view keeps the mapping alive. Nothing is read at open beyond the header; the
kernel is asked to read the rest ahead in the background (MADV_WILLNEED), so the first steps
do not wait on page faults of a cold file.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from pagedkv.errors import ModelLoadError, UnsupportedModelError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
# scalar value types -> struct format (little endian)
_SCALAR = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
# numeric arrays are read in one np.frombuffer call
_NUMPY = {
    GGUFValueType.UINT8: np.uint8,
    GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32,
    GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32,
    GGUFValueType.BOOL: np.bool_,
    GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT64: np.float64,
}


def _map(fd: int) -> tuple[mmap.mmap, bool]:
    """(the whole file mapped, writable?): copy-on-write; read-only where a private writable
    mapping is refused (strict overcommit accounting charges one for the file's size)."""
    try:
        return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY), True
    except OSError:
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ), False


@dataclass(slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order (GGUF stores dims innermost-first)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Metadata (`.metadata`: key -> value) and tensor infos (`.tensors`: name -> info)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"GGUF file not found: {self.path}")
        with open(self.path, "rb") as f:
            try:
                self._buf, self._writable = _map(f.fileno())
            except ValueError as e:  # empty file
                raise ModelLoadError(f"{self.path} is not a GGUF file ({e})") from e
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensorInfo] = {}
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, ValueError, IndexError, OverflowError) as e:
            raise ModelLoadError(f"{self.path} is not a valid GGUF file ({e})") from e
        if hasattr(self._buf, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
            self._buf.madvise(mmap.MADV_WILLNEED)  # read-ahead only: never blocks, never fails

    # --- header ---------------------------------------------------------------------------------

    def _parse(self) -> None:
        buf = self._buf
        if buf[:4] != _MAGIC:
            raise ModelLoadError(f"{self.path} is not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):  # a byte-swapped (big-endian) file also lands here
            raise ModelLoadError(f"{self.path}: unsupported GGUF version {version}")
        pos = 24
        self._tokenizer_spans: list[tuple[int, int]] = []  # the items the tokenizer is built from
        for _ in range(n_kv):
            start = pos
            key, pos = self._str(pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            self.metadata[key], pos = self._value(GGUFValueType(vtype), pos)
            if key.startswith("tokenizer.") or key == "general.architecture":
                self._tokenizer_spans.append((start, pos))
        infos = []
        for _ in range(n_tensors):
            name, pos = self._str(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            if not 1 <= n_dims <= _MAX_DIMS:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS})")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, GGMLQuantizationType(qtype), offset))
        align = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if isinstance(align, bool) or not isinstance(align, int) or not 0 < align <= 1 << 20 or align & (align - 1):
            raise ModelLoadError(f"{self.path}: general.alignment must be a power of two, got {align!r}")
        data_start = -(-pos // align) * align
        for name, dims, qtype, offset in infos:
            self.tensors[name] = self._tensor(name, dims, qtype, offset, align, data_start)
        if len(self.tensors) != len(infos):
            raise ModelLoadError(f"{self.path}: a tensor name appears twice")

    def _tensor(self, name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType, offset: int, align: int,
                data_start: int) -> GGUFTensorInfo:
        """One tensor's info, checked as llama.cpp checks it: whole blocks per row, an aligned
        offset, its bytes inside the file (every size in Python integers: no overflow)."""
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise ModelLoadError(f"{self.path}: tensor {name!r}: rows of {dims[0]} elements are not whole "
                                 f"{qtype.name} blocks of {block}")
        if offset % align:
            raise ModelLoadError(f"{self.path}: tensor {name!r}: offset {offset} is not a multiple of the "
                                 f"alignment {align}")
        n = 1
        for d in dims:
            n *= d
        nbytes = n // block * type_size
        if data_start + offset + nbytes > len(self._buf):
            raise ModelLoadError(f"{self.path}: tensor {name} runs past the end of the file")
        return GGUFTensorInfo(name, tuple(reversed(dims)), qtype, data_start + offset, nbytes)

    def _str(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, pos)
        end = pos + 8 + n
        return self._buf[pos + 8 : end].decode("utf-8"), end

    def _value(self, vtype: GGUFValueType, pos: int) -> tuple[Any, int]:
        if vtype == GGUFValueType.STRING:
            return self._str(pos)
        if vtype == GGUFValueType.ARRAY:
            etype, count = struct.unpack_from("<IQ", self._buf, pos)
            return self._array(GGUFValueType(etype), count, pos + 12)
        fmt = _SCALAR[vtype]
        return struct.unpack_from(fmt, self._buf, pos)[0], pos + struct.calcsize(fmt)

    def _array(self, etype: GGUFValueType, count: int, pos: int) -> tuple[Any, int]:
        if etype in _NUMPY:  # numbers: one vectorized read, kept as a numpy array
            arr = np.frombuffer(self._buf, dtype=_NUMPY[etype], count=count, offset=pos)
            return arr.copy(), pos + arr.nbytes
        out = []
        for _ in range(count):  # strings (or nested arrays): the ~100k-item loop that matters
            v, pos = self._value(etype, pos)
            out.append(v)
        return out, pos

    # --- tensors --------------------------------------------------------------------------------

    def tokenizer_digest(self) -> str:
        """sha256 of the metadata items a tokenizer is built from (every `tokenizer.*` item, with
        the architecture), as stored: files with equal vocabularies, merges, special tokens and
        chat templates have equal digests, whatever their weights."""
        h = hashlib.sha256()
        for start, end in self._tokenizer_spans:
            h.update(self._buf[start:end])
        return h.hexdigest()

    def raw(self, name: str) -> np.ndarray:
        """Undecoded bytes of a tensor, shaped as `gguf.quants.dequantize` expects (no copy)."""
        info = self._info(name)
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        byte_shape = (*info.shape[:-1], info.shape[-1] // block * type_size)
        flat = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return flat.reshape(byte_shape)

    def tensor_bytes(self, name: str) -> torch.Tensor:
        """The same bytes as a torch uint8 tensor [..., row_bytes] viewing the mapping (no copy;
        writes stay in this process's private pages)."""
        info = self._info(name)
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        byte_shape = (*info.shape[:-1], info.shape[-1] // block * type_size)
        if info.nbytes == 0:
            return torch.empty(byte_shape, dtype=torch.uint8)
        if not self.copy_on_write:  # a read-only mapping: torch needs writable memory
            return torch.from_numpy(np.array(self.raw(name)))
        flat = torch.frombuffer(self._buf, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
        return flat.view(byte_shape)

    @property
    def copy_on_write(self) -> bool:
        """True when views are writable (the usual case); False when only a read-only mapping
        could be made, and tensor_bytes copies."""
        return self._writable

    def dequantize(self, name: str) -> np.ndarray:
        """A tensor as float32, in PyTorch shape order."""
        info = self._info(name)
        try:
            out = dequantize(self.raw(name), info.qtype)
        except NotImplementedError as e:
            raise UnsupportedModelError(f"{name}: quantization {info.qtype.name} unsupported") from e
        return out.reshape(info.shape)

    def _info(self, name: str) -> GGUFTensorInfo:
        if name not in self.tensors:
            raise ModelLoadError(f"{self.path}: tensor {name!r} missing")
        return self.tensors[name]
