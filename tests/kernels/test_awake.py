"""The native pool's keep-awake spinners (kernels/csrc/runtime.cpp, Awake): one thread per pool
thread, only ever at idle priority (SCHED_IDLE: they must never take a CPU from real work), spinning
for SPLITMOE_AWAKE_MS after the last job and asleep after it; a process that parks (the services,
at every hop) stops them for good. Each case runs in a fresh process: the pool is process-wide."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from splitmoe.kernels import kernel_settings as settings
from splitmoe.kernels import native

pytestmark = [
    pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels unavailable: {native.UNAVAILABLE_REASON}"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE and /proc are Linux's"),
]

# Runs a few 2-thread matmuls, then prints the scheduling class and state of each of its threads
# other than the main one (the pool's worker and the spinners), after `pause_s` idle: R (running or
# runnable: spinning, even where busy CPUs leave an idle-priority thread no time) or asleep.
PROBE = """
import os, sys, time, torch
import splitmoe
from splitmoe.kernels import native
from tests.kernels.test_native import qt
from gguf import GGMLQuantizationType as T
native.set_num_threads(2)
mm = native.WeightMatmul(qt(T.Q4_K, (256, 1024), seed=1), pack=True)
x = torch.randn(1, 1024)
for _ in range(20):
    mm(x)
if sys.argv[1] == "park":
    native.park()
print("awake_ms", native.get_awake_ms())
time.sleep(float(sys.argv[2]))
def state(tid):
    return open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0]
def threads():
    tids = sorted(int(t) for t in os.listdir("/proc/self/task") if int(t) != os.getpid())
    return [("idle" if os.sched_getscheduler(t) == os.SCHED_IDLE else "normal", state(t)) for t in tids]
# "settle": on CPUs busy with other work an idle-priority spinner past its window may not yet have
# had a moment to see it and sleep (it is starved, harming no one): give it a few seconds to.
deadline = time.monotonic() + (5.0 if sys.argv[3] == "settle" else 0.0)
while any(kind == "idle" and st == "R" for kind, st in threads()) and time.monotonic() < deadline:
    time.sleep(0.05)
for kind, st in threads():
    print("thread", kind, st)
"""


def probe(mode: str, pause_s: float, awake_ms: str | None = None,
          settle: bool = False) -> tuple[int, list[tuple[str, str]]]:
    env = {k: v for k, v in os.environ.items() if k != settings.AWAKE_MS_ENV}
    if awake_ms is not None:
        env[settings.AWAKE_MS_ENV] = awake_ms
    argv = [sys.executable, "-c", PROBE, mode, str(pause_s), "settle" if settle else "now"]
    out = subprocess.run(argv, capture_output=True, text=True,
                         timeout=120, check=True, env=env, cwd=os.getcwd()).stdout.split("\n")
    ms = int(next(line for line in out if line.startswith("awake_ms")).split()[1])
    threads = [(line.split()[1], line.split()[2]) for line in out if line.startswith("thread")]
    return ms, threads


@pytest.mark.stack
def test_spinners_run_at_idle_priority_and_only_while_jobs_are_recent():
    # right after the jobs, with a 10 s window: the spinners spin
    ms, threads = probe("run", 0.0, "10000")
    idle = [state for kind, state in threads if kind == "idle"]
    assert ms == 10000 and idle == ["R", "R"], threads  # one per pool thread: the caller's and the worker's
    # with the default 20 ms window, after a 0.2 s pause they sleep
    ms, threads = probe("run", 0.2, settle=True)
    assert ms == settings.AWAKE_MS_DEFAULT
    assert [state for kind, state in threads if kind == "idle"] == ["S", "S"], threads


@pytest.mark.stack
def test_parking_stops_them_and_zero_makes_none():
    ms, threads = probe("park", 0.05, "10000", settle=True)
    assert ms == 0 and [state for kind, state in threads if kind == "idle"] == ["S", "S"], threads
    ms, threads = probe("run", 0.0, "0")
    assert ms == 0 and all(kind == "normal" for kind, _ in threads), threads


def test_the_setting_is_checked(monkeypatch):
    monkeypatch.setenv(settings.AWAKE_MS_ENV, "soon")
    with pytest.raises(ValueError, match="SPLITMOE_AWAKE_MS='soon'"):
        settings.awake_ms()
    monkeypatch.setenv(settings.AWAKE_MS_ENV, "-1")
    with pytest.raises(ValueError, match=">= 0"):
        settings.awake_ms()
    monkeypatch.setenv(settings.AWAKE_MS_ENV, "5")
    assert settings.awake_ms() == 5
