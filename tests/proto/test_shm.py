"""proto/shm.py: regions map across processes, only for their creator, and leave nothing behind."""
import os
import subprocess
import sys

import pytest
import torch

from splitmoe.proto.shm import SHM_DIR, Peer, ShmRegion

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")
US = Peer(os.getpid(), os.getuid())


@pytest.fixture
def region():
    r = ShmRegion.create(4096)
    yield r
    r.close()


@pytest.mark.stack
def test_another_process_maps_our_region_and_writes_into_it(region):
    data, out = region.view(0, (4, 8), torch.float32), region.view(128, (4, 8), torch.float32)
    data.copy_(torch.arange(32, dtype=torch.float32).view(4, 8))
    peer = (f"import torch; from proto.shm import Peer, ShmRegion; "
            f"r = ShmRegion.attach({region.name!r}, {region.num_bytes}, Peer({US.pid}, {US.uid})); "
            f"r.view(128, (4, 8), torch.float32).copy_(r.view(0, (4, 8), torch.float32) * 2); r.close()")
    subprocess.run([sys.executable, "-c", peer], check=True, cwd=os.getcwd(), timeout=60)
    assert torch.equal(out, data * 2)


def test_views_are_bounds_and_alignment_checked(region):
    assert region.view(64, (3,), torch.bfloat16).shape == (3,)
    with pytest.raises(ValueError, match="outside the region"):
        region.view(4096 - 4, (2,), torch.float32)
    with pytest.raises(ValueError, match="not aligned"):
        region.view(2, (1,), torch.float32)


@pytest.mark.parametrize("name", ["../etc/passwd", "splitmoe-1-../../x", "other-1-ab", "splitmoe-x-ab", ""])
def test_attach_refuses_names_that_are_not_ours(name):
    with pytest.raises(ValueError, match="not a SplitMoE region name"):
        ShmRegion.attach(name, 4096, US)


def test_attach_refuses_a_region_another_process_created(region):
    with pytest.raises(ValueError, match=f"not created by the peer \\(pid {US.pid + 1}\\)"):
        ShmRegion.attach(region.name, region.num_bytes, Peer(US.pid + 1, US.uid))


def test_attach_refuses_a_size_other_than_announced(region):
    with pytest.raises(ValueError, match="4096 bytes, the peer announced 8192"):
        ShmRegion.attach(region.name, 8192, US)
    with pytest.raises(ValueError, match="empty"):
        ShmRegion.attach(region.name, 0, US)


def test_attach_refuses_a_region_others_may_write(region):
    os.chmod(SHM_DIR / region.name, 0o620)
    with pytest.raises(ValueError, match="writable by group or others"):
        ShmRegion.attach(region.name, region.num_bytes, US)


def test_attach_refuses_a_symlink_even_to_a_region_of_the_peer(region):
    link = SHM_DIR / f"splitmoe-{US.pid}-5ca1ab1e"
    link.symlink_to(SHM_DIR / region.name)
    try:
        with pytest.raises(ValueError, match="symbolic link"):
            ShmRegion.attach(link.name, region.num_bytes, US)
    finally:
        link.unlink()


def test_attach_refuses_what_is_not_a_regular_file():
    fifo = SHM_DIR / f"splitmoe-{US.pid}-f1f0"
    os.mkfifo(fifo, 0o600)
    try:  # and does not hang opening it
        with pytest.raises(ValueError, match="not a regular file"):
            ShmRegion.attach(fifo.name, 4096, US)
    finally:
        fifo.unlink()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another uid needs root")
def test_attach_refuses_a_region_owned_by_another_uid(region):
    os.chown(SHM_DIR / region.name, 65534, -1)
    with pytest.raises(ValueError, match="owned by uid 65534, not by the peer"):
        ShmRegion.attach(region.name, region.num_bytes, US)


def test_attach_to_a_missing_region_is_an_os_error():
    with pytest.raises(FileNotFoundError):
        ShmRegion.attach(f"splitmoe-{US.pid}-deadbeef", 4096, US)


def test_region_is_unlinked_when_dropped_without_close():
    region = ShmRegion.create(4096)
    name = region.name
    assert (os.stat(SHM_DIR / name).st_mode & 0o777) == 0o600
    del region
    assert name not in os.listdir(SHM_DIR)
