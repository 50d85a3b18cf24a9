"""splitmoe sets its runtime defaults on import, leaves a user's own values alone, and can give a
peer (the llama.cpp baseline) the environment as the user had it."""
import json
import os
import subprocess
import sys

import pytest

from tests.support.processes import REPO

pytestmark = pytest.mark.stack  # each check runs in a fresh interpreter

PROBE = ("import json, os, splitmoe; print(json.dumps([os.environ.get('OMP_WAIT_POLICY'), "
         "os.environ.get('MKL_CBWR'), splitmoe.user_environment().get('OMP_WAIT_POLICY'), "
         "splitmoe.user_environment().get('MKL_CBWR')]))")


def probe(**env) -> list:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "MKL_CBWR")}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**base, **env}, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def test_defaults_are_set_and_the_users_environment_is_kept_apart():
    assert probe() == ["PASSIVE", "AUTO,STRICT", None, None]


def test_a_users_own_values_win():
    assert probe(OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", "AUTO,STRICT", "ACTIVE", None]


FAULTS = """
import resource
import numpy as np
import splitmoe
def layer():  # transient tensors of several sizes, alive together, as a prompt's layer makes them
    a = np.ones(2 << 20, dtype=np.float32)
    b = np.ones(6 << 20, dtype=np.float32)
    del a
    c = np.ones(4 << 20, dtype=np.float32)
    del b, c
layer()  # the first time, the pages are new either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    layer()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(**env) -> int:
    out = subprocess.run([sys.executable, "-c", FAULTS], cwd=REPO, env={**os.environ, **env}, capture_output=True,
                         text=True, check=True)
    return int(out.stdout)


def test_freed_blocks_are_reused_not_faulted_in_again():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's allocator settings: Linux only")
    kept, returned = page_faults(), page_faults(SPLITMOE_RUNTIME_DEFAULTS="0")
    # Returned to the kernel, the blocks are new pages each time (24 MiB alone is 6144 of them);
    # kept, the heap serves them again.
    assert returned > 20 * 1000, returned
    assert kept < 1000, kept
