"""Lazy build and load of compiled CPU kernels; the decode kernel (paged_decode.cpp) is one.

`CompiledOp` is the generic piece: a C++ source file registering ops with TORCH_LIBRARY is
compiled on first use with torch.utils.cpp_extension.load_inline (light headers, no pybind11)
and loaded into `torch.ops.<namespace>`. The build goes to `$PAGEDKV_CACHE_DIR` (default
`$XDG_CACHE_HOME/pagedkv` or `~/.cache/pagedkv`) under `kernels/<name>`, where the name encodes
the instruction-set flags and a hash of the source, flags, torch and Python versions, so a cache
shared between machines of different CPU kinds, or after an upgrade, never loads a stale or
illegal-instruction build.

Any failure (no compiler, no ninja, read-only cache dir...) is logged once as a warning and the
callers use their pure-torch fallback. Configuration is read once, at import:
`PAGEDKV_NO_KERNEL=1` forces the fallback for the whole process (`CONFIG.use_kernel`);
`set_use_kernel` changes it afterwards (tests, benchmarks).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_DECODE_SOURCE = Path(__file__).with_name("paged_decode.cpp")


# --- configuration (read once) ----------------------------------------------------------------


def _env_flag(name: str) -> bool:
    value = os.environ.get(name)
    return bool(value) and value.strip().lower() not in ("", "0", "false", "no")


@dataclass(slots=True)
class AttentionConfig:
    """Process-wide attention settings, read from the environment once at import."""

    use_kernel: bool = True  # False: always the pure-torch fallback (PAGEDKV_NO_KERNEL=1)

    @classmethod
    def from_env(cls) -> AttentionConfig:
        return cls(use_kernel=not _env_flag("PAGEDKV_NO_KERNEL"))


CONFIG = AttentionConfig.from_env()


def set_use_kernel(enabled: bool) -> None:
    """Switch between the compiled kernel and the fallback for this process."""
    CONFIG.use_kernel = bool(enabled)


def kernel_disabled() -> bool:
    """True when the pure-torch fallback is forced (PAGEDKV_NO_KERNEL at start, or set_use_kernel)."""
    return not CONFIG.use_kernel


# --- build helpers (shared by every compiled kernel) ------------------------------------------


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_flags() -> list[str]:
    """Compiler flags for this machine.

    Not -march=native: the build cache may be reused by another machine of the same family whose
    CPU differs in some extension, so only AVX2/FMA/F16C are enabled, each only if this CPU has
    it at runtime (kernels keep a scalar path for the rest).
    """
    flags = ["-O3", "-fopenmp"]
    cpu = _cpu_flags()
    if {"avx2", "fma"} <= cpu:
        flags += ["-mavx2", "-mfma"]
        if "f16c" in cpu:
            flags.append("-mf16c")
    return flags


def cache_root() -> Path:
    env = os.environ.get("PAGEDKV_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagedkv"


def _build_name(source: str, flags: list[str], prefix: str = "pagedkv_decode") -> str:
    isa = "-".join(f[2:] for f in flags if f.startswith("-m")) or "generic"
    key = "\n".join([source, " ".join(flags), torch.__version__, sys.version, sys.platform])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    # the name is also the shared-library name, so it must be a valid identifier
    return f"{prefix}_{isa.replace('-', '_')}_{digest}"


def _ninja_on_path() -> None:
    """pip installs `ninja` next to the interpreter (.venv/bin), which is not on PATH unless
    the venv is activated; cpp_extension looks for it on PATH."""
    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if bindir not in path.split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + path


SIMD_PRELUDE = Path(__file__).with_name("simd.inc")  # helpers every kernel source may use


def kernel_source(sources: Path | Sequence[Path]) -> str:
    """The text one library is built from: simd.inc, then `sources` in order."""
    paths = [Path(sources)] if isinstance(sources, str | Path) else [Path(p) for p in sources]
    return "\n".join(p.read_text() for p in [SIMD_PRELUDE, *paths])


def _cached_build(key: str, flags: list[str], prefix: str) -> tuple[str | None, Path]:
    """The library name and build folder for `key` + `flags`; the name is None when a cached
    build of them was found and loaded (a warm start skips ninja's up-to-date check: the name
    already pins the sources)."""
    name = _build_name(key, flags, prefix)
    build_dir = cache_root() / "kernels" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    lib = build_dir / f"{name}.so"
    if lib.exists():
        try:
            torch.ops.load_library(str(lib))
            return None, build_dir
        except Exception:  # half-written or foreign file: rebuild
            logger.debug("cached kernel %s did not load; rebuilding", lib, exc_info=True)
    return name, build_dir


def build_and_load(sources: Path | Sequence[Path], prefix: str,
                   extra_flags: Sequence[str] = ()) -> None:
    """Compile `sources` (one library, cached by content, flags and versions) and load it into
    torch.ops, with `build_flags()` plus `extra_flags`.

    The sources must register their ops with TORCH_LIBRARY; raises on any build or load failure.
    """
    from torch.utils import cpp_extension

    source = kernel_source(sources)
    flags = [*build_flags(), *extra_flags]
    name, build_dir = _cached_build(source, flags, prefix)
    if name is None:
        return
    _ninja_on_path()
    cpp_extension.load_inline(
        name=name,
        cpp_sources=[source],
        functions=None,
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
        # torch/extension.h would pull in pybind11 and all of the C++ frontend: slower to build
        no_implicit_headers=True,
        verbose=False,
    )


def _headers(include_dirs: Sequence[Path]) -> list[Path]:
    return sorted(p for d in include_dirs for p in Path(d).iterdir() if p.suffix in (".h", ".inc"))


def build_and_load_units(sources: Sequence[Path], prefix: str, extra_flags: Sequence[str] = (),
                         include_dirs: Sequence[Path] = ()) -> None:
    """Compile each of `sources` as its own translation unit (they `#include` what they use from
    `include_dirs`, simd.inc's folder always among them) into one library, cached by the text of
    the sources and of every header in those folders, the flags and the versions, and load it
    into torch.ops. Raises on any build or load failure."""
    from torch.utils import cpp_extension

    dirs = [SIMD_PRELUDE.parent, *(Path(d) for d in include_dirs)]
    key = "\n".join(p.read_text() for p in [*sources, *_headers(dirs)])
    flags = [*build_flags(), *extra_flags]
    name, build_dir = _cached_build(key, flags, prefix)
    if name is None:
        return
    _ninja_on_path()
    cpp_extension.load(
        name=name,
        sources=[str(p) for p in sources],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(d) for d in dirs],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )


@dataclass(slots=True)
class KernelState:
    """What happened to one kernel in this process."""

    tried: bool = False
    ok: bool = False
    error: str | None = None
    load_s: float | None = None
    op: object | None = None  # the op's default overload once loaded


@dataclass
class CompiledOp:
    """One op of a C++ source, built and loaded lazily, once per process, thread-safely.

    `load()` is True when `torch.ops.<namespace>.<op_name>` is usable (then `op` is its default
    overload); a failure is remembered and warned about once.
    """

    source: Path
    prefix: str  # build/library name prefix
    namespace: str
    op_name: str
    state: KernelState = field(default_factory=KernelState)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def load(self) -> bool:
        if self.state.tried:
            return self.state.ok
        with self._lock:
            if self.state.tried:
                return self.state.ok
            t0 = time.perf_counter()
            try:
                _load_op(self)
                ns = getattr(torch.ops, self.namespace)
                if not hasattr(ns, self.op_name):
                    raise RuntimeError(f"the library loaded but did not register {self.op_name}")
                self.state.op = getattr(ns, self.op_name).default
                self.state.ok = True
            except Exception as e:  # any build problem means "use the fallback"
                self.state.error = f"{type(e).__name__}: {e}"
                logger.warning(
                    "pagedkv: compiled %s kernel unavailable (%s); using the pure-torch fallback",
                    self.op_name,
                    self.state.error,
                )
            self.state.load_s = time.perf_counter() - t0
            self.state.tried = True
            return self.state.ok

    @property
    def op(self):
        return self.state.op

    def info(self) -> dict[str, object]:
        """Loaded?, seconds to build/load, error, compiler flags."""
        s = self.state
        return {"loaded": s.ok, "load_s": s.load_s, "error": s.error, "flags": build_flags()}


def _load_op(op: CompiledOp) -> None:
    """Build hook (tests replace it to simulate a broken toolchain)."""
    build_and_load(op.source, op.prefix)


# --- the decode kernel ------------------------------------------------------------------------

DECODE = CompiledOp(_DECODE_SOURCE, "pagedkv_decode", "pagedkv_attn", "paged_decode")


def load_kernel() -> bool:
    """Build (first time) and load the decode kernel; True when it is usable."""
    return DECODE.load()


def kernel_info() -> dict[str, object]:
    """What happened to the decode kernel in this process: loaded?, seconds, error, flags."""
    return DECODE.info()


def decode_op():
    """The registered decode op's overload (only valid after load_kernel() returned True).

    Called as op(q, k_cache, v_cache, block_tables, seq_lens, scale, out, k_scale, v_scale)
    -> None; the scales ([N, bs, Hkv] float32) are None for float caches.
    """
    return DECODE.op


def write_decode_op():
    """The fused write + decode op's builtin (paged_decode.cpp's write_decode; only valid after
    load_kernel() returned True): op(q, k_new, v_new, slots, k_cache, v_cache, block_tables,
    seq_lens, scale, out, window, softcap) -> None, float caches only."""
    op = torch.ops.pagedkv_attn.write_decode.default
    return getattr(op, "_op", op)
