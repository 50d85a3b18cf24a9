"""Per-thread scratch tensors reused across calls and layers: a fresh tensor of dequantized weights
costs its page faults on every call (the experts' gate/up and down, the linears' many-rows route)."""
from __future__ import annotations

import math
import threading

import torch

_tls = threading.local()


def scratch_buffer(name: str, shape: tuple[int, ...], dtype: torch.dtype, max_bytes: int | None = 64 << 20) -> torch.Tensor:
    """This thread's buffer `name`, grown as needed, viewed as `shape`. Larger than `max_bytes`: a
    fresh tensor per call (None: no limit). One made under inference_mode is made anew outside it:
    it cannot take in-place writes there (a test, a tool)."""
    numel = math.prod(shape)
    if max_bytes is not None and numel * dtype.itemsize > max_bytes:
        return torch.empty(shape, dtype=dtype)
    buf = getattr(_tls, name, None)
    if buf is None or buf.dtype != dtype or buf.numel() < numel \
            or (buf.is_inference() and not torch.is_inference_mode_enabled()):
        buf = torch.empty(numel, dtype=dtype)
        setattr(_tls, name, buf)
    return buf[:numel].view(shape)
