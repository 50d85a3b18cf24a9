"""splitmoe.runtime.topology against fake sysfs trees (these machines have one NUMA node)."""
from splitmoe.runtime.topology import numa_nodes


def make_nodes(root, cpulists):
    for i, cpus in enumerate(cpulists):
        node = root / f"node{i}"
        node.mkdir(parents=True)
        (node / "cpulist").write_text(cpus + "\n")
    (root / "possible").write_text("0-3\n")  # files beside the node directories are no nodes


def test_counts_the_nodes_that_have_cpus(tmp_path):
    make_nodes(tmp_path, ["0-15", "16-31", ""])  # a memory-only node (CXL, HBM) hosts no service
    assert numa_nodes(tmp_path) == 2


def test_no_sysfs_means_one_node(tmp_path):
    assert numa_nodes(tmp_path / "absent") == 1
    assert numa_nodes(tmp_path) == 1  # an empty tree too


def test_this_machine_has_at_least_one():
    assert numa_nodes() >= 1
