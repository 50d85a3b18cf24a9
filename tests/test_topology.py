"""splitmoe.runtime.topology against fake sysfs trees (these machines have one NUMA node), and the
pinning and page placement it reports on this one."""
import os
import threading

import pytest

from splitmoe.runtime.topology import (
    format_cpu_list,
    memory_by_node,
    numa_nodes,
    parse_cpu_list,
    pin_process,
    read_numa_nodes,
    usable_cpu_set,
)
from tests.support.topology import EVERY_CPU, make_nodes


def test_counts_the_nodes_that_have_cpus(tmp_path):
    make_nodes(tmp_path, ["0-15", "16-31", ""])  # a memory-only node (CXL, HBM) hosts no service
    assert numa_nodes(tmp_path) == 2


def test_no_sysfs_means_one_node(tmp_path):
    assert numa_nodes(tmp_path / "absent") == 1
    assert numa_nodes(tmp_path) == 1  # an empty tree too
    assert read_numa_nodes(tmp_path / "absent", EVERY_CPU) == []


def test_this_machine_has_at_least_one():
    assert numa_nodes() >= 1


def test_nodes_read_with_their_cpus_and_memory_in_index_order(tmp_path):
    # a two-socket host with SMT siblings numbered after the cores, as Linux numbers them; node10 sorts after node2
    make_nodes(tmp_path, ["0-7,16-23", "8-15,24-31"])
    (tmp_path / "node10").mkdir()
    (tmp_path / "node10" / "cpulist").write_text("32-33\n")
    nodes = read_numa_nodes(tmp_path, EVERY_CPU)
    assert [n.index for n in nodes] == [0, 1, 10]
    assert nodes[0].cpus == frozenset([*range(0, 8), *range(16, 24)])
    assert nodes[0].memory_bytes == 64 << 30 and nodes[2].memory_bytes == 0  # no meminfo: not reported


def test_cpus_this_process_may_not_use_are_left_out_and_so_are_nodes_without_any(tmp_path):
    make_nodes(tmp_path, ["0-3", "4-7", "8-11"])  # a container's cpuset: 2-5
    nodes = read_numa_nodes(tmp_path, frozenset(range(2, 6)))
    assert [(n.index, sorted(n.cpus)) for n in nodes] == [(0, [2, 3]), (1, [4, 5])]


def test_cpu_lists_parse_and_format_as_the_kernel_writes_them():
    assert parse_cpu_list("0-3,8,10-11\n") == frozenset({0, 1, 2, 3, 8, 10, 11})
    assert parse_cpu_list("") == frozenset()
    assert format_cpu_list(frozenset({0, 1, 2, 3, 8, 10, 11})) == "0-3,8,10-11"
    with pytest.raises(ValueError, match="empty or negative"):
        parse_cpu_list("5-2")


def test_page_placement_is_summed_per_node_from_numa_maps(tmp_path):
    maps = tmp_path / "numa_maps"
    maps.write_text("7f00 default file=/m/x.gguf mapped=300 N0=100 N1=200 kernelpagesize_kB=4\n"
                    "7f10 default anon=2 dirty=2 N1=2 kernelpagesize_kB=2048\n"
                    "7f20 default\n")
    assert memory_by_node(maps) == {0: 100 * 4096, 1: 200 * 4096 + 2 * (2 << 20)}
    assert memory_by_node(tmp_path / "absent") == {}
    assert sum(memory_by_node().values()) > 0 or not os.path.exists("/proc/self/numa_maps")


def test_pinning_moves_every_thread_and_threads_started_later_inherit_it():
    before = usable_cpu_set()
    target = frozenset({min(before)})
    started = threading.Event()
    stop = threading.Event()
    running = threading.Thread(target=lambda: (started.set(), stop.wait()), daemon=True)
    running.start()
    started.wait()
    try:
        pin_process(target)
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        assert all(os.sched_getaffinity(tid) == target for tid in tids)
        seen = []
        later = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        later.start()
        later.join()
        assert seen == [target]
    finally:
        stop.set()
        pin_process(before)
