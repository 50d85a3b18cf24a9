"""--pin-threads: the native pool's worker i on the plan's CPU i, a thread that calls the pool on
the first, and OpenMP's threads for that thread's torch ops left free. Run in a child process:
pinning is for the whole life of the threads it touches."""
import json
import os
import subprocess
import sys

import pytest

from splitmoe.kernels import kernel_settings as settings
from tests.support.processes import REPO

pytestmark = pytest.mark.stack  # the pinning is checked in a child interpreter

CHILD = """
import json, os, threading
import numpy as np, torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gq
from splitmoe.kernels import native
from splitmoe.kernels.quants import QuantTensor

def affinities(idle=False):  # the compute threads' CPU lists, or (idle) the keep-awake spinners
    out = {}
    for tid in os.listdir("/proc/self/task"):
        if (os.sched_getscheduler(int(tid)) == os.SCHED_IDLE) != idle:
            continue
        with open(f"/proc/self/task/{tid}/status") as f:
            out[int(tid)] = next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))
    return out

first, second = sorted(os.sched_getaffinity(0))[:2]
torch.set_num_threads(2)
native.set_num_threads(2)
native.pin_compute([second, first])  # reversed: the caller on the second CPU, the worker on the first
w = QuantTensor("w", T.Q8_0, (64, 256), np.frombuffer(gq.quantize(np.ones((64, 256), np.float32), T.Q8_0).tobytes(), np.uint8).reshape(64, -1))
result = {}

def caller():
    before = set(affinities())
    native.pin_caller()  # makes this thread's OpenMP team first, then pins the thread
    result["caller"] = sorted(os.sched_getaffinity(0))
    torch.randn(512, 512) @ torch.randn(512, 512)
    native.matmul(torch.randn(4, 256), w)  # the native pool's worker, made now
    result["new"] = {tid: a for tid, a in affinities().items() if tid not in before}
    result["spinners"] = sorted(affinities(idle=True).values())

t = threading.Thread(target=caller)
t.start()
t.join()
print(json.dumps({"first": first, "second": second, **result}))
"""


def test_workers_and_caller_are_pinned_in_plan_order():
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to pin to")
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    first, second = got["first"], got["second"]
    assert got["caller"] == [second]
    new = list(got["new"].values())
    assert new.count(str(first)) == 1, got  # the pool's worker, on the plan's second CPU
    assert len(new) >= 2 and str(second) not in new, got  # OpenMP's threads did not inherit the caller's pin
    if settings.awake_ms():  # the keep-awake spinners: one on each CPU of the plan
        assert got["spinners"] == sorted([str(first), str(second)]), got
