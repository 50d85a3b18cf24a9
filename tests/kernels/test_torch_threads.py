"""kernels.torch_threads: torch on one thread around the fast path's small steps, the native pool
left at its size, and the runner narrowing exactly those steps."""
from __future__ import annotations

import pytest
import torch

from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.kernels import native
from splitmoe.kernels.expert_kernels import sync_native_threads
from splitmoe.kernels.linear import SMALL_BATCH_ROWS
from splitmoe.kernels.torch_threads import configured_threads, one_torch_thread


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
    sync_native_threads()


def test_one_thread_inside_the_configured_count_outside(two_threads):
    with one_torch_thread():
        assert torch.get_num_threads() == 1 and configured_threads() == 2
        with one_torch_thread():  # re-entrant: the inner one leaves the outer's count alone
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1 and configured_threads() == 2
    assert torch.get_num_threads() == 2 and configured_threads() == 2


def test_the_count_comes_back_after_an_error(two_threads):
    with pytest.raises(RuntimeError), one_torch_thread():
        raise RuntimeError("a failing step")
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels: {native.UNAVAILABLE_REASON}")
def test_the_native_pool_keeps_its_width_inside(two_threads):
    """The experts' fast layers are built lazily, inside a step: sizing the pool there must not
    take torch's narrowed count."""
    sync_native_threads()
    with one_torch_thread():
        sync_native_threads()
        assert native.get_num_threads() == 2


def threads_per_step(demo_gguf, dtype, monkeypatch, rows: list[int]) -> list[int]:
    r = ModelRunner.from_gguf(demo_gguf, RunnerOptions(dtype=dtype, device=torch.device("cpu"), kv_cache_tokens=512))
    seen = []
    real = r.model.forward
    monkeypatch.setattr(r.model, "forward", lambda *a: (seen.append(torch.get_num_threads()), real(*a))[1])
    for i, n in enumerate(rows):
        r.step([Sequence(i, list(range(5, 5 + n)))])
    return seen


def test_the_runner_narrows_the_fast_paths_small_steps_only(demo_gguf, two_threads, monkeypatch):
    small, large = SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1
    want_small = 1 if native.AVAILABLE else 2  # without the library torch does the heavy work
    assert threads_per_step(demo_gguf, torch.bfloat16, monkeypatch, [small, large]) == [want_small, 2]
    # the exact float32 mode computes with torch: never narrowed
    assert threads_per_step(demo_gguf, torch.float32, monkeypatch, [1, small]) == [2, 2]
    assert torch.get_num_threads() == 2
