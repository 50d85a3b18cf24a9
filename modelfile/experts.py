"""Routed experts in a GGUF file, and a shard of them: what both services agree an expert is.

Two file layouts exist: one 3-D tensor per matrix and layer (`blk.N.ffn_gate_exps.weight`,
[n_expert, out, in] in torch order), and the older Mixtral files with one 2-D tensor per expert
(`blk.N.ffn_gate.E.weight`). Both become per-expert `ExpertFFN` views of the mmap: building a
shard copies nothing and touches only the pages its experts' bytes live in, when they are used.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

import torch

from kernels.moe import ACT_SILU, ACT_SWIGLU_OAI, ExpertFFN, moe_forward
from kernels.quants import dequantize
from modelfile.gguf_file import GGUFError, GGUFFile

_MATRICES = ("gate", "up", "down")
# The expert activation is fixed by the architecture's code, not stored in the file (as in
# llama.cpp's graphs); every architecture not named here uses SiLU-gated experts.
_ACTIVATION_BY_ARCH = {"gpt-oss": ACT_SWIGLU_OAI}


class ExpertKey(NamedTuple):
    layer: int
    expert: int

    def label(self) -> str:
        """The one rendering of an expert id, for logs and metric labels."""
        return f"L{self.layer}.E{self.expert}"


def moe_layers(g: GGUFFile) -> list[int]:
    """Layers that have a router, in order."""
    num_layers = int(g.arch_require("block_count"))
    return [i for i in range(num_layers) if g.has(f"blk.{i}.ffn_gate_inp.weight")]


def expert_count(g: GGUFFile) -> int:
    return int(g.arch_require("expert_count"))


def load_layer_experts(g: GGUFFile, layer: int, experts: Iterable[int]) -> dict[int, ExpertFFN]:
    if g.has(f"blk.{layer}.ffn_gate_exps.weight"):
        stacked = [g.tensor(f"blk.{layer}.ffn_{m}_exps.weight") for m in _MATRICES]
        _check_stacked(g, layer, stacked)
        biases = _stacked_biases(g, layer, stacked)
        activation = _ACTIVATION_BY_ARCH.get(g.arch, ACT_SILU)
        return {e: ExpertFFN(*(t[e] for t in stacked), *(None if b is None else b[e] for b in biases),
                             activation=activation) for e in experts}
    if g.has(f"blk.{layer}.ffn_gate.0.weight"):
        return {e: ExpertFFN(*(g.tensor(f"blk.{layer}.ffn_{m}.{e}.weight") for m in _MATRICES)) for e in experts}
    raise GGUFError(f"{g.path.name}: missing tensor 'blk.{layer}.ffn_gate_exps.weight' (layer {layer} has a router)")


def _check_stacked(g: GGUFFile, layer: int, stacked) -> None:
    n = expert_count(g)
    for t in stacked:
        if len(t.shape) != 3 or t.shape[0] != n:
            raise GGUFError(f"{g.path.name}: tensor {t.name!r} has shape {list(t.shape)}, expected [{n}, *, *]")


def _stacked_biases(g: GGUFFile, layer: int, stacked) -> list[torch.Tensor | None]:
    """gpt-oss's `ffn_{gate,up,down}_exps.bias` [n_expert, out] as float32, or None where absent.

    Copied at load: they are tiny beside the matrices, and a view would be dequantized per call.
    """
    biases = []
    for m, weight in zip(_MATRICES, stacked):
        name = f"blk.{layer}.ffn_{m}_exps.bias"
        bias = dequantize(g.tensor(name)) if g.has(name) else None
        if bias is not None and tuple(bias.shape) != tuple(weight.shape[:2]):
            raise GGUFError(f"{g.path.name}: tensor {name!r} has shape {list(bias.shape)}, "
                            f"expected {list(weight.shape[:2])}")
        biases.append(bias)
    return biases


class ExpertShard:
    """The (layer, expert) pairs one process hosts, and the expert FFN over them."""

    def __init__(self, g: GGUFFile, layers: Iterable[int] | None = None, experts: Iterable[int] | None = None):
        self.layers = sorted(moe_layers(g) if layers is None else layers)
        self.experts = sorted(range(expert_count(g)) if experts is None else experts)
        self._ffns = {layer: load_layer_experts(g, layer, self.experts) for layer in self.layers}

    def holds(self, key: ExpertKey) -> bool:
        return key.layer in self._ffns and key.expert in self._ffns[key.layer]

    @property
    def num_bytes(self) -> int:
        return sum(f.num_bytes for layer in self._ffns.values() for f in layer.values())

    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                expert_weights: torch.Tensor) -> torch.Tensor:
        """This shard's part of the layer's expert sum; ids it does not host add nothing."""
        ffns = self._ffns.get(layer)
        if ffns is None:
            raise KeyError(f"layer {layer} is not in this shard ({format_ranges('layers', self.layers)})")
        return moe_forward(hidden, expert_ids, expert_weights, ffns)


def format_ranges(what: str, values: Iterable[int]) -> str:
    """'layers 0-3,7': compact, for one-line messages."""
    values = sorted(values)
    if not values:
        return f"no {what}"
    spans, start = [], values[0]
    for prev, cur in zip(values, [*values[1:], None]):
        if cur is None or cur != prev + 1:
            spans.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = cur
    return f"{what} {','.join(spans)}"
