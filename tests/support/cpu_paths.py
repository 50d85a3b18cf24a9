"""The CPU paths the fast mode takes, forced, so one machine tests what the others run.

"best" is what this CPU picks; "avx2+float32" is what an AVX2-only or Skylake-class machine (no
VNNI, no native bfloat16) runs: the AVX2 native kernels and float32 prefill GEMMs. Forced through
the same switches users have (SPLITMOE_KERNELS_ISA, SPLITMOE_GEMM_DTYPE), set in the environment
for subprocesses and applied to the already loaded native library for this process.
"""
from __future__ import annotations

from contextlib import contextmanager

import pytest

from splitmoe.kernels import native
from splitmoe.kernels.cpu_features import GEMM_DTYPE_ENV

LOWER = "avx2+float32"
_FORCED = {LOWER: {"SPLITMOE_KERNELS_ISA": "avx2", GEMM_DTYPE_ENV: "float32"}}
# Without the native library (or AVX2) there is no lower path to force: only "best" is run.
PATHS = ("best", LOWER) if native.AVAILABLE and native._best_isa() != "scalar" else ("best",)


@contextmanager
def forced_path(name: str):
    if name == "best":
        yield
        return
    env = _FORCED[name]
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        native._set_isa(env["SPLITMOE_KERNELS_ISA"])
        try:
            yield
        finally:
            native._set_isa(native._best_isa())
