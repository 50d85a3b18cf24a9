"""The machine as Linux shows it: its NUMA layout (a host wants one expert service per node by
default, each reading its node's memory) and the CPUs this process may use."""
from __future__ import annotations

import os
import re
from pathlib import Path

SYSFS_NODES = Path("/sys/devices/system/node")


def numa_nodes(root: Path = SYSFS_NODES) -> int:
    """NUMA nodes with CPUs under `root` (a parameter, so tests can fake a topology); 1 where the
    directory is missing (containers without sysfs, other systems)."""
    try:
        nodes = [p for p in root.iterdir() if re.fullmatch(r"node\d+", p.name)]
    except OSError:
        return 1
    with_cpus = [p for p in nodes if (p / "cpulist").exists() and (p / "cpulist").read_text().strip()]
    return max(1, len(with_cpus))


def usable_cpus() -> int:
    """The CPUs this process may run on: taskset's and the container's CPU sets respected."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
