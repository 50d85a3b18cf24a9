"""proto/shm.py: regions map across processes, grow, reject foreign names, and leave nothing behind."""
import os
import subprocess
import sys

import pytest
import torch

from proto.shm import SHM_DIR, ShmArena, ShmMappings, ShmRegion

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")


def our_regions() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"splitmoe-{os.getpid()}-")}


def test_another_process_reads_and_writes_the_region():
    arena = ShmArena(1 << 16)
    try:
        arena.reset(1 << 16)
        data, data_offset = arena.alloc((4, 8), torch.float32)
        out, out_offset = arena.alloc((4, 8), torch.float32)
        data.copy_(torch.arange(32, dtype=torch.float32).view(4, 8))
        peer = (f"import torch; from proto.shm import ShmMappings; m = ShmMappings(); r = m.get({arena.name!r}); "
                f"r.view({out_offset}, (4, 8), torch.float32).copy_(r.view({data_offset}, (4, 8), torch.float32) * 2); "
                f"m.close()")
        subprocess.run([sys.executable, "-c", peer], check=True, cwd=os.getcwd(), timeout=60)
        assert torch.equal(out, data * 2)
    finally:
        arena.close()


def test_slots_are_aligned_and_disjoint():
    arena = ShmArena(4096)
    try:
        arena.reset(4096)
        a, a_offset = arena.alloc((3,), torch.bfloat16)
        b, b_offset = arena.alloc((5,), torch.int64)
        assert a_offset == 0 and b_offset == 64
        a.fill_(1)
        b.fill_(-1)
        assert torch.equal(a, torch.ones(3, dtype=torch.bfloat16))
    finally:
        arena.close()


def test_arena_grows_to_the_request_and_unlinks_the_old_region():
    arena = ShmArena(1024)
    first = arena.name
    arena.reset(10_000)
    assert arena.name != first and our_regions() == {arena.name}
    view, _ = arena.alloc((2500,), torch.float32)
    view.fill_(3)
    arena.close()
    assert our_regions() == set()


def mapped(name: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(name in line for line in maps)


def test_peer_keeps_a_bounded_number_of_mappings():
    arenas = [ShmArena(1024) for _ in range(3)]
    peer = ShmMappings(max_regions=2)
    try:
        for a in arenas:
            peer.get(a.name)
        assert [mapped(a.name) for a in arenas] == [True, True, True]  # the arenas map their own
        arenas[0].close()
        assert not mapped(arenas[0].name)  # the peer dropped its mapping of the oldest
        peer.close()
        arenas[1].close()
        assert not mapped(arenas[1].name)
    finally:
        peer.close()
        for a in arenas:
            a.close()


@pytest.mark.parametrize("name", ["../etc/passwd", "splitmoe-1-../../x", "other-1-ab", ""])
def test_attach_rejects_names_that_are_not_ours(name):
    with pytest.raises(ValueError, match="not a SplitMoE region name"):
        ShmRegion.attach(name)


def test_attach_to_a_missing_region_is_an_os_error():
    with pytest.raises(FileNotFoundError):
        ShmRegion.attach("splitmoe-1-deadbeef")


def test_region_is_unlinked_when_dropped_without_close():
    region = ShmRegion.create(4096)
    name = region.name
    del region
    assert name not in os.listdir(SHM_DIR)
