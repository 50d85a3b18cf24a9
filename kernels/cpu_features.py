"""What this CPU computes natively, and the switch that forces the lower GEMM path.

The prefill routes (`kernels.linear`'s many-rows route, `kernels.expert_kernels`' dequantize-once
route) multiply in bfloat16 where the CPU does so in hardware (AVX512-BF16, AMX; Arm BF16) and in
float32 elsewhere: oneDNN emulates bfloat16 on plain AVX-512, 2-3x slower than float32.

SPLITMOE_GEMM_DTYPE=float32 (or bfloat16) overrides that choice for a process, so that a machine
with native bfloat16 also runs, and tests, the float32 path a machine without it takes (as
SPLITMOE_KERNELS_ISA lowers the native kernels' instruction set). `python -m splitmoe.kernels.cpu_features`
prints what this machine has and which paths it takes.
"""
from __future__ import annotations

import functools
import os

import torch

GEMM_DTYPE_ENV = "SPLITMOE_GEMM_DTYPE"
_GEMM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The flags that decide our paths, as /proc/cpuinfo names them.
FLAGS_THAT_MATTER = ("avx2", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return model_from_cpuinfo(f.read())
    except OSError:
        return "unknown CPU"


def model_from_cpuinfo(text: str) -> str:
    """The first processor's model name with its x86 family and model numbers: a virtual machine's
    name can be just "AMD EPYC" on Zen 4 and Zen 5 alike, whose kernels choose differently
    (kernels.tuning keys its choices by this)."""
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "unknown CPU")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX-BF16 (x86), or BF16 (aarch64): where torch's bf16 GEMM is fast.

    Not `torch.ops.mkldnn._is_mkldnn_bf16_supported()`: that is also true on plain AVX-512BW,
    where oneDNN emulates bf16 more slowly than float32.
    """
    get_caps = getattr(getattr(torch, "cpu", None), "get_capabilities", None)
    if get_caps is not None:
        try:
            caps = get_caps()
        except Exception:  # noqa: BLE001 - any failure: fall back to /proc
            caps = {}
        if any(k in caps for k in ("avx512_bf16", "amx_bf16")):
            return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})


def gemm_dtype() -> torch.dtype:
    """The dtype of the prefill routes' dequantized weights and GEMMs (see the module doc)."""
    forced = os.environ.get(GEMM_DTYPE_ENV, "").strip().lower()
    if forced in ("", "auto"):
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if forced not in _GEMM_DTYPES:
        raise ValueError(f"{GEMM_DTYPE_ENV}={forced!r}: want one of auto, {', '.join(_GEMM_DTYPES)}")
    return _GEMM_DTYPES[forced]


def describe() -> str:
    """One line per fact: the CPU, its flags that matter, the paths this process takes."""
    flags = cpu_flags()
    lines = [f"cpu: {cpu_model()} ({os.cpu_count()} logical cores)",
             "flags: " + " ".join(f"{name}={'yes' if name in flags else 'no'}" for name in FLAGS_THAT_MATTER)]
    try:
        from splitmoe.kernels import native
        isa = native.isa() if native.AVAILABLE else f"unavailable ({native.UNAVAILABLE_REASON})"
    except Exception as e:  # noqa: BLE001 - a report, not a check
        isa = f"unavailable ({e})"
    lines.append(f"native kernels isa: {isa}")
    try:
        from splitmoe.kernels import tuning

        chosen = tuning.cached_choices() if native.AVAILABLE else {}
    except Exception as e:  # noqa: BLE001 - a report, not a check
        chosen = {"?": str(e)}
    lines.append("kernels chosen by calibration (kernels.tuning): "
                 + (", ".join(f"{t} {label}" for t, label in sorted(chosen.items())) or "none yet"))
    lines.append(f"prefill gemm dtype: {str(gemm_dtype()).removeprefix('torch.')}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe())
