"""One ISA limit for every kernel of the matmul library (isa.h): pagedkv_q.limit_isa(1) caps the
exact kernels, the int8 row kernels and the panel at their AVX2 code; PAGEDKV_MAX_ISA=avx2 does
it for a whole process (with torch's own kernels), as an AVX2-only CPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pagedkv.errors import InvalidArgumentError
from pagedkv.model import qkernel

needs_avx2 = pytest.mark.skipif(not qkernel.load() or qkernel.isa() == qkernel.ISA_NAMES[0],
                                reason="needs the kernel built with AVX2")


@needs_avx2
def test_limit_caps_every_kernel() -> None:
    widest = qkernel.isa()
    try:
        assert torch.ops.pagedkv_q.limit_isa(1) == 2
        assert qkernel.isa() == "AVX2"
        assert not torch.ops.pagedkv_a8.panel_vnni()  # the panel's VNNI code is off too
        assert torch.ops.pagedkv_a8.panel_avx2()  # and its AVX2 code on
    finally:
        torch.ops.pagedkv_q.limit_isa(2)
    assert qkernel.isa() == widest
    assert torch.ops.pagedkv_a8.panel_vnni() == (widest == "AVX-512 VNNI")
    assert torch.ops.pagedkv_a8.panel_avx2() == (widest != "AVX-512 VNNI")


def test_bad_max_isa_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("sse", "avx512f", "2"):
        monkeypatch.setenv("PAGEDKV_MAX_ISA", bad)
        with pytest.raises(InvalidArgumentError, match="PAGEDKV_MAX_ISA"):
            qkernel.max_isa()
    monkeypatch.setenv("PAGEDKV_MAX_ISA", "x" * 100_000)
    with pytest.raises(InvalidArgumentError) as err:
        qkernel.max_isa()
    assert len(str(err.value)) < 200
    for good, want in (("", "avx512"), ("AVX2", "avx2"), (" avx512 ", "avx512")):
        monkeypatch.setenv("PAGEDKV_MAX_ISA", good)
        assert qkernel.max_isa() == want


PROBE = """
import json, pagedkv, torch
from pagedkv.model import qkernel
ok = qkernel.load()
print(json.dumps({"ok": ok, "isa": qkernel.isa(), "panel": qkernel.panel() is not None,
                  "vnni": qkernel.vnni(), "torch": torch.backends.cpu.get_cpu_capability()}))
"""


@needs_avx2
def test_env_caps_a_process() -> None:
    env = {**os.environ, "PAGEDKV_MAX_ISA": "avx2"}
    for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # the panel runs its AVX2 code; torch's kernels are capped too
    assert got == {"ok": True, "isa": "AVX2", "panel": True, "vnni": False, "torch": "AVX2"}


INVARIANT_PROBE = """
import json, torch
from pagedkv.model import qkernel
from pagedkv.startup import _kernels
ok = qkernel.load()
was = torch.ops.pagedkv_q.batch_invariant(False) if ok else None
print(json.dumps({"ok": ok, "info": qkernel.info()["batch_invariant"], "op": was,
                  "said": "PAGEDKV_BATCH_INVARIANT=1" in _kernels()}))
"""


def test_batch_invariant_env_sets_a_process() -> None:
    """PAGEDKV_BATCH_INVARIANT=1 turns the exact gemm's row-kernel order on for the process (the
    op's setting, qkernel.info(), and the start-up line say so); 0 or unset leaves it off."""
    for value, want in (("1", True), ("0", False)):
        env = {**os.environ, "PAGEDKV_BATCH_INVARIANT": value}
        out = subprocess.run([sys.executable, "-c", INVARIANT_PROBE], env=env, capture_output=True, text=True,
                             timeout=300, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        if not got["ok"]:
            pytest.skip("kernel unavailable")
        assert got == {"ok": True, "info": want, "op": want, "said": want}, value
