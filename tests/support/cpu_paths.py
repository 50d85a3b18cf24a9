"""The CPU paths the fast mode takes, forced, so one machine tests what the others run.

"best" is what this CPU picks; "avx2+float32" is what an AVX2-only or Skylake-class machine (no
VNNI, no native bfloat16) runs: the AVX2 native kernels and float32 prefill GEMMs. Any "<isa>+<gemm
dtype>" is forced the same way; EVERY_PATH is each ISA this CPU has (down to scalar) with either GEMM
dtype, for the tests that hold a rule on every CPU (Zen 4: avx512vnni+bfloat16; Skylake-SP:
avx512bw+float32). Forced through the same switches users have (SPLITMOE_KERNELS_ISA,
SPLITMOE_GEMM_DTYPE), set in the environment for subprocesses and applied to the already loaded
native library for this process.
"""
from __future__ import annotations

from contextlib import contextmanager

import pytest

from splitmoe.kernels import native
from splitmoe.kernels.cpu_features import GEMM_DTYPE_ENV

LOWER = "avx2+float32"
# Without the native library (or AVX2) there is no lower path to force: only "best" is run.
PATHS = ("best", LOWER) if native.AVAILABLE and native._best_isa() != "scalar" else ("best",)
_ISAS = ("avx512vnni", "avx512bw", "avx2", "scalar")  # best first


def _every_path() -> tuple[str, ...]:
    if not native.AVAILABLE:
        return ("best",)
    isas = _ISAS[_ISAS.index(native._best_isa()):]
    return tuple(f"{isa}+{gemm}" for isa in isas for gemm in ("bfloat16", "float32"))


EVERY_PATH = _every_path()


@contextmanager
def forced_path(name: str):
    if name == "best":
        yield
        return
    isa, gemm = name.split("+")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPLITMOE_KERNELS_ISA", isa)
        mp.setenv(GEMM_DTYPE_ENV, gemm)
        native._set_isa(isa)
        try:
            yield
        finally:
            native._set_isa(native._best_isa())
