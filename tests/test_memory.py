"""splitmoe.runtime.memory: own pages apart from mapped file pages, as the services log and the bench records."""
import mmap
import sys

import numpy as np
import pytest

from splitmoe.runtime.memory import MIB, resident

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/<pid>/status is Linux's")


def test_a_copy_counts_as_own_memory_and_a_mapped_file_as_file_pages(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, 64 * MIB, dtype=np.uint8).tobytes())
    before = resident()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = np.frombuffer(mapped, dtype=np.uint8)
        assert int(view[::4096].sum()) > 0  # touch every page of the mapping
        touched = resident()
        # Into fresh anonymous pages: a malloc'd copy may reuse a free block that earlier tests left
        # resident, and then count nothing new.
        with mmap.mmap(-1, 64 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as anonymous:
            copy = np.frombuffer(anonymous, dtype=np.uint8)
            copy[:] = view
            copied = resident()
            assert int(copy[::4096].sum()) == int(view[::4096].sum())
            del copy
        del view
    assert touched.file_bytes - before.file_bytes > 48 * MIB
    assert touched.own_bytes - before.own_bytes < 16 * MIB
    assert copied.own_bytes - touched.own_bytes > 48 * MIB


def test_a_gone_process_reports_nothing():
    assert resident(2**22 + 12345) is None
    assert "MiB own" in resident().describe()
