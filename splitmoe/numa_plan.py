"""One expert service per NUMA node: which cores, which memory node and which experts each gets.

Pure: the nodes come from splitmoe.runtime.topology (a fake sysfs tree in tests). The experts are
split into contiguous ranges, one per node, so each expert's weights live on exactly one node:
split, never copied. Each service is pinned to its node's cores and its pages are first-touched
there by its own (pinned) threads, so its memory node is its node (see docs/deploy.md, NUMA).
"""
from __future__ import annotations

from dataclasses import dataclass

from splitmoe.local_stack import expert_ranges
from splitmoe.runtime.topology import NumaNode, format_cpu_list


@dataclass(frozen=True, slots=True)
class NodeService:
    node: int                # the NUMA node: `serve-experts --numa-node`
    cpus: frozenset[int]     # pinned to these (the node's CPUs this process may use)
    memory_node: int         # where its pages land
    experts: tuple[int, int]  # first and last expert id, inclusive
    num_threads: int         # at most one per CPU

    def describe(self) -> str:
        return (f"node {self.node}: CPUs {format_cpu_list(self.cpus)}, memory node {self.memory_node}, "
                f"experts {self.experts[0]}-{self.experts[1]}, {self.num_threads} threads")


def plan_numa_services(nodes: list[NumaNode], num_experts: int, threads: int = 0) -> list[NodeService]:
    """One service per node (at most one per expert), the experts split evenly in node order;
    `threads`: the total to split between them (0: one per CPU of each node)."""
    if not nodes:
        raise ValueError("no NUMA node with usable CPUs")
    if num_experts < 1:
        raise ValueError(f"the model has {num_experts} routed experts: nothing to place")
    used = nodes[:num_experts]
    ranges = expert_ranges(num_experts, len(used))
    shares = [max(1, threads // len(used) + (i < threads % len(used))) for i in range(len(used))]
    return [NodeService(node.index, node.cpus, node.index, span,
                        min(shares[i], len(node.cpus)) if threads else len(node.cpus))
            for i, (node, span) in enumerate(zip(used, ranges))]

