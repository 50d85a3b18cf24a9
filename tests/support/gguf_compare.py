"""Reading GGUF files independently of our loader (gguf-py), to compare two files' layouts."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np

NAMING_KEYS = {"general.name", "general.size_label"}


class Parsed(NamedTuple):
    """One GGUF read once (gguf-py's reader takes a while over a 2048-token vocab)."""

    tensors: dict[str, gguf.ReaderTensor]
    metadata: dict


def parse(path: Path) -> Parsed:
    reader = gguf.GGUFReader(path)
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return Parsed({t.name: t for t in reader.tensors}, metadata)


def torch_shape(t: gguf.ReaderTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape))


def values(t: gguf.ReaderTensor) -> np.ndarray:
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(torch_shape(t))


def q8_0_error_bound(x: np.ndarray) -> np.ndarray:
    """Per element: d/2 for the block's scale d = amax/127, plus the fp16 rounding of d (≤ 127·d·2⁻¹¹)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / 127
    return np.broadcast_to(d * (0.5 + 127 * 2.0**-11) + 1e-12, blocks.shape).reshape(x.shape)
