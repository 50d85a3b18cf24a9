"""SplitMoE: Mixture-of-Experts serving split across an attention service and expert services.

One namespace: the product's packages are `splitmoe.kernels`, `splitmoe.proto`,
`splitmoe.modelfile`, `splitmoe.attention_service`, `splitmoe.expert_service`, `splitmoe.gateway`
and `splitmoe.bench`. Installed, setuptools maps them there from the repository's top-level folders
(setup.py); in a source checkout this package's path takes in the checkout, so the same names
resolve to the same folders wherever the code runs from (a worktree, a clone, CI).

Importing this package also sets two defaults of the runtimes torch links, for this process and
its children, unless the environment already sets them (or SPLITMOE_RUNTIME_DEFAULTS=0). Both are
read when those runtimes load or first run, and every module of ours is imported through this
package, so they are in place before torch. With the same switch it tells glibc's allocator to
keep freed memory for reuse (see `_keep_freed_memory`).
"""
import os
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "kernels" / "__init__.py").is_file() and (_CHECKOUT / "setup.py").is_file():
    __path__.append(str(_CHECKOUT))  # noqa: F821 - a package's __path__, set by the import system

RUNTIME_DEFAULTS = {
    # MKL's float32 GEMM picks its kernel by thread count on some CPUs (seen on AMD Zen 5: a 9x64
    # by 64x32 product differs in the last bit between 1 and 2 threads), so the exact float32 path
    # would give other bits in a 1-thread expert service than in-process. Strict conditional
    # numerical reproducibility makes it independent of the thread count (up to the cores;
    # oversubscribed counts still differ), at no measured cost. Read at MKL's first BLAS call.
    "MKL_CBWR": "AUTO,STRICT",
    # torch's OpenMP threads run only small ops here; the native pool (kernels/csrc) does the heavy
    # parallel work. OpenMP workers spinning after each small op take the cores from the native
    # pool's: a 16-stream decode step took 88 ms with spinning workers, 52 ms with sleeping ones
    # (single-stream decode and prefill unchanged). Read when torch loads libgomp.
    "OMP_WAIT_POLICY": "PASSIVE",
}
_OFF = "SPLITMOE_RUNTIME_DEFAULTS"
# What the environment said before this import: a peer run for comparison (bench/llamacpp.py,
# whose OpenMP threads must spin at every graph barrier) gets the user's environment, not ours.
USER_ENV = {name: os.environ.get(name) for name in RUNTIME_DEFAULTS}


def _keep_freed_memory() -> None:
    """glibc hands every freed block over 128 KiB back to the kernel (an mmap per allocation), so
    the tensors a prompt makes and drops in every layer, tens of MB each, were faulted in and
    zeroed anew each time: 15-20% of a 512-token prefill here. Every block now comes from the heap
    (no mmap at all: glibc's largest threshold, 32 MiB, still left a DeepSeek-V3 layer's 50-150 MB
    prompt tensors to the kernel, ~7% of that prefill in page faults; without them 10% faster for
    +2.5% peak memory), and the heap is not trimmed: the process keeps its high-water mark of
    transient memory instead of paying for it again at every layer. A no-op where the C library is
    not glibc."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    m_trim_threshold, m_mmap_threshold, m_mmap_max = -1, -3, -4  # malloc.h
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_mmap_max, 0)
    mallopt(m_trim_threshold, 2**31 - 1)


if os.environ.get(_OFF) != "0":
    for _name, _value in RUNTIME_DEFAULTS.items():
        os.environ.setdefault(_name, _value)
    _keep_freed_memory()


def user_environment() -> dict[str, str]:
    """This process's environment as the user gave it, for a process that must not get our
    runtime defaults even though it imports this package."""
    env = dict(os.environ)
    for name, value in USER_ENV.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    env[_OFF] = "0"
    return env
