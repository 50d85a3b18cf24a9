"""A function captured as a CUDA graph the way torch's documentation does it, for tests."""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def captured(step: Callable[[], T], warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, T]:
    """(the graph, what the capture returned: tensors that each replay rewrites). Warmed up on a
    side stream first, so that lazy initialisations stay out of the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
