"""The machine as Linux shows it: its NUMA layout (a host wants one expert service per node by
default, each reading its node's memory), the CPUs this process may use, and where its pages are.

Every reader takes its root as a parameter, so tests fake a topology (these machines have one
node): `/sys/devices/system/node` for the nodes, `/proc/self/numa_maps` for page placement.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

SYSFS_NODES = Path("/sys/devices/system/node")
NUMA_MAPS = Path("/proc/self/numa_maps")


@dataclass(frozen=True, slots=True)
class NumaNode:
    index: int
    cpus: frozenset[int]     # the node's CPUs that this process may use
    memory_bytes: int = 0    # MemTotal of the node (0: not reported)


def parse_cpu_list(text: str) -> frozenset[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}: the kernel's cpulist format, taskset's and docker's."""
    cpus = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last or first)
        if lo < 0 or hi < lo:
            raise ValueError(f"{part!r} is an empty or negative CPU range")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int]) -> str:
    """The inverse of parse_cpu_list: {0, 1, 2, 3, 8} -> '0-3,8'."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{lo}-{hi}" if hi > lo else f"{lo}" for lo, hi in runs)


def read_numa_nodes(root: Path = SYSFS_NODES, allowed_cpus: frozenset[int] | None = None) -> list[NumaNode]:
    """The NUMA nodes under `root` that have CPUs this process may use (`allowed_cpus`, default:
    its affinity), by index; [] where the directory is missing (containers without sysfs, other
    systems). A memory-only node (CXL, HBM) hosts no service."""
    allowed = usable_cpu_set() if allowed_cpus is None else allowed_cpus
    nodes = []
    for index, cpus, path in _node_cpus(root):
        if cpus & allowed:
            nodes.append(NumaNode(index, cpus & allowed, _mem_total_bytes(path / "meminfo")))
    return nodes


def numa_nodes(root: Path = SYSFS_NODES) -> int:
    """How many NUMA nodes have CPUs; 1 where none is reported."""
    return max(1, sum(1 for _, cpus, _ in _node_cpus(root) if cpus))


def _node_cpus(root: Path) -> list[tuple[int, frozenset[int], Path]]:
    """(index, CPUs, directory) of every node directory under `root`, by index."""
    try:
        dirs = [p for p in root.iterdir() if re.fullmatch(r"node\d+", p.name)]
    except OSError:
        return []
    found = []
    for path in sorted(dirs, key=lambda p: int(p.name[4:])):
        try:
            found.append((int(path.name[4:]), parse_cpu_list((path / "cpulist").read_text()), path))
        except (OSError, ValueError):
            continue  # no cpulist: not a node we can run on
    return found


def node_of(index: int, root: Path = SYSFS_NODES) -> NumaNode:
    """Node `index`, with the CPUs of it this process may use; ValueError naming the nodes there are."""
    nodes = read_numa_nodes(root)
    for node in nodes:
        if node.index == index:
            return node
    there = ", ".join(str(n.index) for n in nodes) or "none reported"
    raise ValueError(f"NUMA node {index}: no such node with CPUs this process may use (nodes: {there})")


def usable_cpus() -> int:
    """The CPUs this process may run on: taskset's and the container's CPU sets respected."""
    return len(usable_cpu_set())


def usable_cpu_set() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:
        return _all_cpus()


def pin_process(cpus: frozenset[int], tasks: Path = Path("/proc/self/task")) -> None:
    """Every thread of this process onto `cpus`; threads started later inherit it (the native
    pool's, gRPC's). sched_setaffinity(0) alone would move the calling thread only."""
    tids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            pass  # the thread ended meanwhile


def memory_by_node(numa_maps: Path = NUMA_MAPS) -> dict[int, int]:
    """Bytes of this process's resident pages per NUMA node, from numa_maps ({} where absent)."""
    try:
        text = numa_maps.read_text()
    except OSError:
        return {}
    by_node: dict[int, int] = {}
    for line in text.splitlines():
        page_kb = re.search(r"kernelpagesize_kB=(\d+)", line)
        page_bytes = int(page_kb.group(1)) * 1024 if page_kb else 4096
        for node, pages in re.findall(r"\bN(\d+)=(\d+)", line):
            by_node[int(node)] = by_node.get(int(node), 0) + int(pages) * page_bytes
    return by_node


def _mem_total_bytes(meminfo: Path) -> int:
    try:
        found = re.search(r"MemTotal:\s+(\d+) kB", meminfo.read_text())
    except OSError:
        return 0
    return int(found.group(1)) * 1024 if found else 0


def _all_cpus() -> frozenset[int]:
    return frozenset(range(os.cpu_count() or 1))


def compute_cpus(num_threads: int) -> list[int]:
    """The CPUs a process's `num_threads` compute threads are pinned to, one each (`--pin-threads`):
    the first of the CPUs it may use, in order (fewer when it may use fewer)."""
    return sorted(usable_cpu_set())[:max(1, num_threads)]
