"""Fake NUMA topologies: sysfs node trees as Linux writes them (these machines have one node)."""

EVERY_CPU = frozenset(range(256))


def make_nodes(root, cpulists, mem_kb=(64 << 20)):
    for i, cpus in enumerate(cpulists):
        node = root / f"node{i}"
        node.mkdir(parents=True)
        (node / "cpulist").write_text(cpus + "\n")
        (node / "meminfo").write_text(f"Node {i} MemTotal:       {mem_kb} kB\nNode {i} MemFree:        1 kB\n")
    (root / "possible").write_text(f"0-{len(cpulists) - 1}\n")  # files beside the node directories are no nodes
    (root / "has_cpu").write_text("0\n")
    return root
