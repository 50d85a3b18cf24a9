"""Heat: how many tokens the router sends each (layer, expert), as a rate decayed over time.

Counted on the attention side, from the routing of every layer call (before any split between
this process and the services), so it is whole even while a service is down and costs no RPC to
read. The rate is an exponential moving average of tokens per second with a half-life: the
placement by load follows what the traffic does now, not what it did an hour ago.

A heat file (JSON) keeps the rates across restarts: `--heat-file` is read at start, so the first
placement (the hot experts kept in this process) follows the previous run's traffic, and written
at every rebalance and at shutdown.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from splitmoe.modelfile.expert_tensors import ExpertTokenCounts


@dataclass(frozen=True, slots=True)
class HeatSnapshot:
    tokens: torch.Tensor          # [layers, experts] int64: tokens routed since start
    tokens_per_s: torch.Tensor    # [layers, experts] float64: the decayed rate


class ExpertHeat:
    """Tokens per (layer, expert) since start, and their decayed rate (tokens per second).

    `add` is the data path's (one thread); `snapshot` may be called from any thread: it folds the
    tokens counted since the last call into the rate.
    """

    def __init__(self, num_layers: int, num_experts: int, half_life_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        if half_life_s <= 0:
            raise ValueError(f"heat half-life {half_life_s} s: must be positive")
        self.half_life_s = half_life_s
        self._counts = ExpertTokenCounts(num_layers, num_experts)
        self._clock = clock
        self._lock = threading.Lock()
        self._folded = torch.zeros(num_layers, num_experts, dtype=torch.int64)  # counts already in the rate
        self._rate = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self._folded_s = clock()
        self.counted_elsewhere = torch.zeros(num_layers, num_experts, dtype=torch.int64)  # see add_table

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self._counts.table.shape)

    def add(self, layer: int, expert_ids: torch.Tensor) -> None:
        """Count one layer call's routing [T, K] (on the CPU; -1: no expert)."""
        self._counts.add(layer, expert_ids)

    def counts_row(self, layer: int) -> torch.Tensor:
        """The layer's tokens-so-far row ([experts] int64, a view): native code on the data path adds
        to it in place of `add` (kernels/decode_moe_layer.py)."""
        return self._counts.table[layer]

    def add_table(self, tokens: torch.Tensor) -> None:
        """Add tokens counted elsewhere ([layers, experts] int64: the GPU's hot experts'): they
        are routed tokens, though not computed by the backend this heat belongs to."""
        self._counts.table += tokens
        self.counted_elsewhere += tokens

    def seed(self, tokens_per_s: torch.Tensor) -> None:
        """Start from rates measured before (a heat file), as if they had been measured just now."""
        if tuple(tokens_per_s.shape) != self.shape:
            raise ValueError(f"heat of shape {list(tokens_per_s.shape)}, this model's is {list(self.shape)}")
        with self._lock:
            self._rate = tokens_per_s.to(torch.float64).clone()

    def snapshot(self) -> HeatSnapshot:
        with self._lock:
            now_s = self._clock()
            counts = self._counts.table.clone()  # a row torn by a concurrent add is one call off
            elapsed_s = now_s - self._folded_s
            if elapsed_s > 0:
                # The EMA of irregularly spaced samples: the new interval's own rate weighs
                # 1 - 2^(-elapsed / half-life), whatever the spacing of the calls.
                keep = math.pow(0.5, elapsed_s / self.half_life_s)
                self._rate = self._rate * keep + (counts - self._folded).double() / elapsed_s * (1 - keep)
                self._folded, self._folded_s = counts, now_s
            return HeatSnapshot(counts, self._rate.clone())


# ---- heat files ----------------------------------------------------------------------------

def save_heat(path: str | os.PathLike, file_id: str, tokens_per_s: torch.Tensor) -> None:
    """Write atomically (a reader never sees half a file)."""
    path = Path(path)
    body = {"file_id": file_id, "tokens_per_s": [[round(x, 6) for x in row] for row in tokens_per_s.tolist()]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body) + "\n")
    tmp.replace(path)


def load_heat(path: str | os.PathLike, file_id: str, shape: tuple[int, int]) -> torch.Tensor | None:
    """The rates a heat file holds for this model; None when there is no file yet. A file of
    another model, or of another shape, is an error: its experts are not these."""
    try:
        body = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    if body.get("file_id") != file_id:
        raise ValueError(f"heat file {path} is of model {body.get('file_id')!r}, not {file_id!r}")
    rates = torch.tensor(body["tokens_per_s"], dtype=torch.float64)
    if tuple(rates.shape) != tuple(shape):
        raise ValueError(f"heat file {path}: shape {list(rates.shape)}, this model's is {list(shape)}")
    return rates
