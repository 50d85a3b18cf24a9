"""The native kernels' settings from the environment: the one place in `kernels` that reads it
(`kernels` imports nothing else of ours, so not splitmoe.runtime.settings)."""
from __future__ import annotations

import os
from pathlib import Path

AWAKE_MS_ENV = "SPLITMOE_AWAKE_MS"
AWAKE_MS_DEFAULT = 20


def kernel_tuning_path() -> Path:
    """Where the kernels' calibration is kept, per CPU model, ISA and library build (kernels.tuning),
    beside the rest of SplitMoE's cache (splitmoe.runtime.settings.cache_dir)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "splitmoe" / "kernel-tuning.json"


def kernel_tuning_enabled() -> bool:
    """SPLITMOE_KERNELS_TUNE=0 turns the calibration off (every type then runs the ISA's own kernels,
    packed where they pack); a forced SPLITMOE_KERNELS_ISA means exactly that ISA's kernels too."""
    return os.environ.get("SPLITMOE_KERNELS_TUNE", "1") != "0" and not os.environ.get("SPLITMOE_KERNELS_ISA")


def awake_ms() -> int:
    """How long after its last job the native pool keeps its CPUs from halting, with one spinner of
    idle priority per CPU (kernels/csrc/runtime.cpp, Awake): a halted vCPU took ~150 µs to wake on
    this project's VMs (no halt polling). SPLITMOE_AWAKE_MS=0 turns it off."""
    value = os.environ.get(AWAKE_MS_ENV, "").strip()
    if not value:
        return AWAKE_MS_DEFAULT
    try:
        ms = int(value)
    except ValueError:
        raise ValueError(f"{AWAKE_MS_ENV}={value!r}: want a whole number of milliseconds") from None
    if ms < 0:
        raise ValueError(f"{AWAKE_MS_ENV}={value!r}: want >= 0")
    return ms
