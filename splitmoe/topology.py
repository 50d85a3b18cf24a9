"""The machine's NUMA layout as Linux shows it: how many expert services a host wants by default
(one per NUMA node, each reading its node's memory)."""
from __future__ import annotations

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
