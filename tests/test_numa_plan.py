"""splitmoe/numa_plan.py: one expert service per NUMA node, planned on fake topologies of 1, 2 and
4 nodes (these machines have one), and `splitmoe up --numa` / `serve-experts --numa-node` from it."""
import os
import subprocess
import sys

import pytest

from splitmoe.cli import build_parser
from splitmoe.local_stack import UpSettings, expert_specs, num_expert_services
from splitmoe.numa_plan import plan_numa_services
from splitmoe.runtime.topology import NumaNode, numa_nodes, read_numa_nodes, usable_cpu_set
from tests.support.processes import REPO, free_port, grpc_service
from tests.support.topology import EVERY_CPU, make_nodes

TOPOLOGIES = {  # as Linux numbers them: each node's cores, then their SMT siblings
    1: ["0-15"],
    2: ["0-15,32-47", "16-31,48-63"],
    4: ["0-7,32-39", "8-15,40-47", "16-23,48-55", "24-31,56-63"],
}


@pytest.mark.parametrize("num_nodes", [1, 2, 4])
def test_one_service_per_node_on_its_cpus_and_memory_the_experts_split_never_copied(tmp_path, num_nodes):
    nodes = read_numa_nodes(make_nodes(tmp_path, TOPOLOGIES[num_nodes]), EVERY_CPU)
    plan = plan_numa_services(nodes, num_experts=128)
    assert [s.node for s in plan] == list(range(num_nodes))
    assert [s.memory_node for s in plan] == [s.node for s in plan]  # pages first-touched by pinned threads
    assert [s.cpus for s in plan] == [n.cpus for n in nodes]
    assert [s.num_threads for s in plan] == [len(n.cpus) for n in nodes]  # one per CPU of the node
    hosted = [e for s in plan for e in range(s.experts[0], s.experts[1] + 1)]
    assert sorted(hosted) == list(range(128))  # every expert on exactly one node
    sizes = {s.experts[1] - s.experts[0] + 1 for s in plan}
    assert sizes == {128 // num_nodes}
    assert all(not set(a.cpus) & set(b.cpus) for a in plan for b in plan if a is not b)


def test_threads_asked_for_are_split_between_the_nodes_at_most_one_per_cpu():
    nodes = [NumaNode(0, frozenset(range(0, 8))), NumaNode(1, frozenset(range(8, 12)))]
    assert [s.num_threads for s in plan_numa_services(nodes, 8, threads=12)] == [6, 4]
    assert [s.num_threads for s in plan_numa_services(nodes, 8, threads=3)] == [2, 1]


def test_more_nodes_than_experts_leaves_nodes_idle_and_no_node_is_an_error():
    nodes = [NumaNode(i, frozenset({i})) for i in range(4)]
    assert [(s.node, s.experts) for s in plan_numa_services(nodes, 2)] == [(0, (0, 0)), (1, (1, 1))]
    with pytest.raises(ValueError, match="no NUMA node"):
        plan_numa_services([], 8)


def test_up_numa_starts_serve_experts_per_node(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))  # the fake host's CPUs are ours
    root = make_nodes(tmp_path, TOPOLOGIES[2])
    settings = UpSettings(model_path="/m/x.gguf", numa=True, sysfs_nodes=str(root))
    assert num_expert_services(settings, 8) == 2
    specs = expert_specs(settings, 8, [5001, 5002])
    args = [build_parser().parse_args(s.argv[4:]) for s in specs]
    assert [(a.numa_node, a.experts, a.threads, a.cpus) for a in args] == [
        (0, (0, 1, 2, 3), 32, None), (1, (4, 5, 6, 7), 32, None)]
    assert "CPUs 0-15,32-47, memory node 0" in specs[0].detail


def test_up_numa_without_a_topology_runs_one_service_on_our_cpus(tmp_path):
    settings = UpSettings(model_path="/m/x.gguf", numa=True, sysfs_nodes=str(tmp_path / "absent"))
    (spec,) = expert_specs(settings, 8, [5001])
    assert build_parser().parse_args(spec.argv[4:]).threads == len(usable_cpu_set())


@pytest.mark.stack
def test_serve_experts_on_a_numa_node_pins_every_thread_to_its_cpus(demo_gguf, tmp_path):
    node = read_numa_nodes()[0] if read_numa_nodes() else None
    if node is None:
        pytest.skip("this system reports no NUMA topology")
    port = free_port()
    log = tmp_path / "expert.log"
    with grpc_service(["serve-experts", str(demo_gguf), "--port", str(port), "--numa-node", str(node.index)],
                      port, log) as proc:
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert len(tids) > 3 and {frozenset(os.sched_getaffinity(t)) for t in tids} == {node.cpus}
    placement = f"NUMA node {node.index}: {'100' if numa_nodes() == 1 else ''}"  # one node: all of it there
    assert placement in log.read_text() and "of this process's pages are on its memory" in log.read_text()


@pytest.mark.stack
def test_serve_experts_on_a_node_that_is_not_there_says_which_are():
    done = subprocess.run([sys.executable, "-m", "splitmoe", "serve-experts", "x.gguf", "--port", "0",
                           "--numa-node", "99"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "NUMA node 99: no such node" in done.stderr and "(nodes: " in done.stderr
