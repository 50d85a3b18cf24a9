"""Torch's intra-op pool narrowed to one thread around steps whose heavy work is native.

A fast-path step of a few rows (decode) runs its matmuls, attention and experts in the native
library's own pool; what torch does between them (the router's softmax and top-k, norms, casts)
is small, yet torch splits some of it across its OpenMP threads. Those threads sleep between
ops (OMP_WAIT_POLICY=PASSIVE, splitmoe/__init__.py), so each split op paid their wake-up: the
router's softmax over 16 x 128 logits took 43 µs on 2 threads and 1.9 µs on one, and a
16-stream decode step of the 6-layer bench model went from 43.7 to 42.2 ms with torch on one
thread (single-stream steps: no change). Switching costs well under a microsecond.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

_outside: int | None = None  # torch's thread count outside the narrowed region, while in one


def configured_threads() -> int:
    """Torch's thread count as configured (`--threads`), also from inside a narrowed region."""
    return _outside if _outside is not None else torch.get_num_threads()


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread inside; the native pool keeps its size. Re-entrant."""
    global _outside
    n = torch.get_num_threads()
    if _outside is not None or n == 1:
        yield
        return
    _outside = n
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _outside = None
