"""Routed experts in a GGUF file, and a shard of them: what both services agree an expert is.

Two file layouts exist: one 3-D tensor per matrix and layer (`blk.N.ffn_gate_exps.weight`,
[n_expert, out, in] in torch order), and the older Mixtral files with one 2-D tensor per expert
(`blk.N.ffn_gate.E.weight`). Both become per-expert `ExpertFFN` views of the mmap: building a
shard copies nothing and touches only the pages its experts' bytes live in, when they are used.

This package only reads: how a shard computes (float32 on the exact reference path, bfloat16 /
float16 on the fast path, prepared once) is `kernels.expert_kernels.ExpertCompute`, which
`ExpertShard` builds on, for both services.
"""
from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple

import torch

from splitmoe.kernels.expert_kernels import ExpertCompute
from splitmoe.kernels.moe import ExpertFFN
from splitmoe.kernels.quants import QuantTensor, dequantize
from splitmoe.kernels.repack_cache import RepackCache, tensor_digest
from splitmoe.modelfile.architectures import architecture
from splitmoe.modelfile.gguf_file import GGUFError, GGUFFile
from splitmoe.modelfile.hparams import ModelConfig

__all__ = ["ExpertKey", "ExpertShard", "ExpertTokenCounts", "expert_count", "expert_tensor_names",
           "load_layer_experts", "moe_layers", "repack_identity"]
_MATRICES = ("gate", "up", "down")


class ExpertKey(NamedTuple):
    layer: int
    expert: int

    def label(self) -> str:
        """The one rendering of an expert id, for logs and metric labels."""
        return f"L{self.layer}.E{self.expert}"


def moe_layers(g: GGUFFile, nextn: bool = False) -> list[int]:
    """Layers that have a router, in order; `nextn`: the NextN/MTP layers after the main ones too
    (their experts are computed only for the MTP drafter: engine/mtp.py)."""
    cfg = ModelConfig.from_gguf(g)
    num_layers = cfg.num_blocks if nextn else cfg.num_layers
    return [i for i in range(num_layers) if g.has(f"blk.{i}.ffn_gate_inp.weight")]


def expert_count(g: GGUFFile) -> int:
    num_experts = ModelConfig.from_gguf(g).num_experts
    if num_experts == 0:
        raise GGUFError(f"{g.path.name}: missing metadata key '{g.arch}.expert_count' (not an MoE model?)")
    return num_experts


def expert_tensor_names(g: GGUFFile, layer: int) -> set[str]:
    """The tensors that hold a MoE layer's routed experts, in whichever layout the file has."""
    if g.has(f"blk.{layer}.ffn_gate_exps.weight"):
        names = {f"blk.{layer}.ffn_{m}_exps.{kind}" for m in _MATRICES for kind in ("weight", "bias")}
    else:
        names = {f"blk.{layer}.ffn_{m}.{e}.weight" for m in _MATRICES for e in range(expert_count(g))}
    return {name for name in names if g.has(name)}


def load_layer_experts(g: GGUFFile, layer: int, experts: Iterable[int]) -> dict[int, ExpertFFN]:
    """Views of the experts' matrices, each checked against the hyper-parameters' shapes."""
    cfg = ModelConfig.from_gguf(g)
    E, D, F = expert_count(g), cfg.hidden_size, cfg.expert_ffn
    shapes = {"gate": (F, D), "up": (F, D), "down": (D, F)}  # per expert, torch order [out, in]
    activation = architecture(g.arch).expert_activation  # the file does not say; its architecture does
    if g.has(f"blk.{layer}.ffn_gate_exps.weight"):
        stacked = [g.tensor(f"blk.{layer}.ffn_{m}_exps.weight", (E, *shapes[m])) for m in _MATRICES]
        biases = [_stacked_bias(g, f"blk.{layer}.ffn_{m}_exps.bias", (E, shapes[m][0])) for m in _MATRICES]
        return {e: ExpertFFN(*(t[e] for t in stacked), *(None if b is None else b[e] for b in biases),
                             activation=activation) for e in experts}
    if g.has(f"blk.{layer}.ffn_gate.0.weight"):
        return {e: ExpertFFN(*(g.tensor(f"blk.{layer}.ffn_{m}.{e}.weight", shapes[m]) for m in _MATRICES),
                             activation=activation) for e in experts}
    raise GGUFError(f"{g.path.name}: missing tensor 'blk.{layer}.ffn_gate_exps.weight' (layer {layer} has a router)")


def _stacked_bias(g: GGUFFile, name: str, shape: tuple[int, int]) -> torch.Tensor | None:
    """gpt-oss's `ffn_{gate,up,down}_exps.bias` [n_expert, out] as float32, or None where absent.

    Copied at load: they are tiny beside the matrices, and a view would be dequantized per call.
    """
    return dequantize(g.tensor(name, shape)) if g.has(name) else None


def _layer_tensors(g: GGUFFile, layer: int, experts: Iterable[int]) -> list[QuantTensor]:
    """The tensors a layer's expert weights are views of (for the repack cache's fingerprint)."""
    if g.has(f"blk.{layer}.ffn_gate_exps.weight"):
        return [g.tensor(f"blk.{layer}.ffn_{m}_exps.weight") for m in _MATRICES]
    return [g.tensor(f"blk.{layer}.ffn_{m}.{e}.weight") for e in sorted(experts) for m in _MATRICES]


class ExpertShard(ExpertCompute):
    """The (layer, expert) pairs one process hosts, read from the file; computing them (the choice
    between the float32 reference and the fast path) is `kernels.expert_kernels.ExpertCompute`'s."""

    def __init__(self, g: GGUFFile, layers: Iterable[int] | None = None, experts: Iterable[int] | None = None, *,
                 repack_cache: RepackCache | None = None, by_layer: Mapping[int, Iterable[int]] | None = None):
        """Every one of `experts` in every one of `layers`; or, given `by_layer` (layer -> experts),
        exactly those pairs: a placement by load hosts different experts in different layers."""
        if by_layer is None:
            layers = sorted(moe_layers(g) if layers is None else layers)
            experts = sorted(range(expert_count(g)) if experts is None else experts)
            by_layer = {layer: experts for layer in layers}
        self.by_layer = {layer: tuple(sorted(set(es))) for layer, es in sorted(by_layer.items()) if es}
        self.layers = list(self.by_layer)
        self.experts = sorted({e for es in self.by_layer.values() for e in es})  # their union
        ffns = {layer: load_layer_experts(g, layer, es) for layer, es in self.by_layer.items()}
        super().__init__(ffns, expert_count(g), lambda layer, es: repack_identity(g, layer, es), g.path.name,
                         repack_cache)

    def keys(self) -> list[ExpertKey]:
        return [ExpertKey(layer, e) for layer, es in self.by_layer.items() for e in es]

    def holds(self, key: ExpertKey) -> bool:
        return key.layer in self._ffns and key.expert in self._ffns[key.layer]

    @property
    def num_bytes(self) -> int:
        return sum(f.num_bytes for layer in self._ffns.values() for f in layer.values())


def repack_identity(g: GGUFFile, layer: int, experts: Iterable[int]) -> str:
    """What the repack cache knows a layer's repacked experts by: the file and its bytes' fingerprint."""
    return f"{g.file_id}|{tensor_digest(_layer_tensors(g, layer, experts))}"


class ExpertTokenCounts:
    """Tokens routed to each (layer, expert), for load statistics: both services count this way."""

    def __init__(self, num_layers: int, num_experts: int):
        self.table = torch.zeros(num_layers, num_experts, dtype=torch.int64)  # [layer, expert]

    def add(self, layer: int, expert_ids: torch.Tensor, hosted: torch.Tensor | None = None) -> None:
        """Count one layer call's routing; `hosted` ([num_experts] 0/1): only those experts count."""
        num_experts = self.table.shape[1]
        # Shifted by one so the -1 slots (dropped, or computed elsewhere) land in bin 0 and drop out.
        counts = torch.bincount(expert_ids.reshape(-1).long() + 1, minlength=num_experts + 1)[1:num_experts + 1]
        self.table[layer] += counts if hosted is None else counts * hosted

    def read(self, layers: Iterable[int], experts: Iterable[int],
             plus: torch.Tensor | None = None) -> dict[ExpertKey, int]:
        """The counts of these (layer, expert) pairs, with `plus` (a table counted elsewhere) added."""
        layers, experts = list(layers), list(experts)
        table = self.table if plus is None else self.table + plus
        rows = table[layers][:, experts].tolist() if layers and experts else []
        return {ExpertKey(layer, expert): n for layer, row in zip(layers, rows) for expert, n in zip(experts, row)}
