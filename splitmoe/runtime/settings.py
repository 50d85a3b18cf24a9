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
