"""Process-wide settings read from the environment: the one place that reads os.environ."""
from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path


def otlp_endpoint() -> str:
    """The OTLP collector to send traces to; empty means tracing exports nothing."""
    return os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")


CLUSTER_TOKEN_ENV = "SPLITMOE_CLUSTER_TOKEN"


def cluster_token() -> str:
    """The cluster secret every RPC between the services carries; empty when none is set."""
    return os.environ.get(CLUSTER_TOKEN_ENV, "")


def new_cluster_token() -> str:
    """A fresh random cluster secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def cache_dir() -> Path:
    """Where SplitMoE keeps what it makes (the demo model, run directories)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "splitmoe"


def repack_cache_dir() -> Path:
    """Where experts int4-repacked for torch's kernels are kept (only when the native ones cannot run)."""
    return cache_dir() / "int4pack"


def kernel_tuning_path() -> Path:
    """Where the native kernels' calibration is kept, per CPU model and library build (kernels.tuning)."""
    return cache_dir() / "kernel-tuning.json"


def kernel_tuning_enabled() -> bool:
    """SPLITMOE_KERNELS_TUNE=0 turns the calibration off (every type then runs the ISA's own kernels,
    packed where they pack); a forced SPLITMOE_KERNELS_ISA means exactly that ISA's kernels too."""
    return os.environ.get("SPLITMOE_KERNELS_TUNE", "1") != "0" and not os.environ.get("SPLITMOE_KERNELS_ISA")


AWAKE_MS_ENV = "SPLITMOE_AWAKE_MS"
AWAKE_MS_DEFAULT = 20


def awake_ms() -> int:
    """How long after its last job the native pool keeps its CPUs from halting, with one spinner of
    idle priority per CPU (kernels/csrc/runtime.cpp, Awake): a halted vCPU takes ~150 µs to wake on
    a VM without halt polling. SPLITMOE_AWAKE_MS=0 turns it off."""
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


def log_level() -> str:
    return os.environ.get("SPLITMOE_LOG_LEVEL", "INFO").upper()


def setup_logging() -> None:
    logging.basicConfig(level=log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


_PARENT_PID = "SPLITMOE_DIE_WITH_PARENT_PID"


def child_env(die_with_parent_pid: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a supervised child: ours, `extra` (its secrets: never on a command
    line), and who it must not outlive."""
    return {**os.environ, **(extra or {}), _PARENT_PID: str(die_with_parent_pid)}


def die_with_parent_pid() -> int | None:
    value = os.environ.get(_PARENT_PID)
    return int(value) if value else None


# The peers' build directories (their bin/, holding llama-bench and llama-batched-bench) for
# `splitmoe bench run --baseline`, when its --llama-cpp-dir / --ik-llama-cpp-dir are not given.
LLAMA_CPP_BIN_ENV, IK_LLAMA_CPP_BIN_ENV = "SPLITMOE_LLAMA_CPP_BIN", "SPLITMOE_IK_LLAMA_CPP_BIN"


def llama_cpp_bin_dir() -> str:
    return os.environ.get(LLAMA_CPP_BIN_ENV, "")


def ik_llama_cpp_bin_dir() -> str:
    return os.environ.get(IK_LLAMA_CPP_BIN_ENV, "")
