"""Lazy build and load of the compiled CPU decode kernel (paged_decode.cpp).

The kernel is compiled on first use with torch.utils.cpp_extension.load_inline and registered as
`torch.ops.pagedkv_attn.paged_decode`. The build goes to
`$PAGEDKV_CACHE_DIR` (default `$XDG_CACHE_HOME/pagedkv` or `~/.cache/pagedkv`) under
`kernels/<name>`, where the name encodes the instruction-set flags and a hash of the source,
flags, torch and Python versions, so a cache shared between machines of different CPU kinds, or
after an upgrade, never loads a stale or illegal-instruction build.

Any failure (no compiler, no ninja, read-only cache dir...) is logged once as a warning and the
callers use the pure-torch fallback. `PAGEDKV_NO_KERNEL=1` forces the fallback.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode.cpp")
_OP_NAMESPACE = "pagedkv_attn"

_lock = threading.Lock()
_state: dict[str, object] = {
    "tried": False,
    "ok": False,
    "error": None,
    "load_s": None,
    "op": None,
}


def kernel_disabled() -> bool:
    """True when PAGEDKV_NO_KERNEL asks for the pure-torch fallback (read on every call)."""
    value = os.environ.get("PAGEDKV_NO_KERNEL")
    return bool(value) and value.strip().lower() not in ("", "0", "false", "no")


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
    it at runtime (the kernel has a scalar path for the rest).
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


def _build_name(source: str, flags: list[str]) -> str:
    isa = "-".join(f[2:] for f in flags if f.startswith("-m")) or "generic"
    key = "\n".join([source, " ".join(flags), torch.__version__, sys.version, sys.platform])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    # the name is also the shared-library name, so it must be a valid identifier
    return f"pagedkv_decode_{isa.replace('-', '_')}_{digest}"


def _ninja_on_path() -> None:
    """pip installs `ninja` next to the interpreter (.venv/bin), which is not on PATH unless
    the venv is activated; cpp_extension looks for it on PATH."""
    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if bindir not in path.split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + path


def _load() -> None:
    from torch.utils import cpp_extension

    source = _SOURCE.read_text()
    flags = build_flags()
    name = _build_name(source, flags)
    build_dir = cache_root() / "kernels" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    lib = build_dir / f"{name}.so"
    if lib.exists():
        # warm start: skip the ninja up-to-date check (the name already pins the source)
        try:
            torch.ops.load_library(str(lib))
            return
        except Exception:  # half-written or foreign file: rebuild below
            logger.debug("cached kernel %s did not load; rebuilding", lib, exc_info=True)
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


def load_kernel() -> bool:
    """Build (first time) and load the kernel; True when torch.ops.pagedkv_attn is usable.

    Thread-safe and attempted once per process: a failure is remembered and warned about once.
    """
    if _state["tried"]:
        return _state["ok"]  # type: ignore[return-value]
    with _lock:
        if _state["tried"]:
            return bool(_state["ok"])
        t0 = time.perf_counter()
        try:
            _load()
            if not hasattr(getattr(torch.ops, _OP_NAMESPACE), "paged_decode"):
                raise RuntimeError("the library loaded but did not register paged_decode")
            _state["op"] = getattr(torch.ops, _OP_NAMESPACE).paged_decode.default
            _state["ok"] = True
        except Exception as e:  # any build problem means "use the fallback"
            _state["error"] = f"{type(e).__name__}: {e}"
            logger.warning(
                "pagedkv: compiled decode kernel unavailable (%s); using the pure-torch fallback",
                _state["error"],
            )
        _state["load_s"] = time.perf_counter() - t0
        _state["tried"] = True
        return bool(_state["ok"])


def kernel_info() -> dict[str, object]:
    """What happened to the kernel in this process: loaded?, seconds to build/load, error."""
    return {
        "loaded": bool(_state["ok"]),
        "load_s": _state["load_s"],
        "error": _state["error"],
        "flags": build_flags(),
    }


def decode_op():
    """The registered op's overload (only valid after load_kernel() returned True).

    Called as op(q, k_cache, v_cache, block_tables, seq_lens, scale, out) -> None.
    """
    return _state["op"]
