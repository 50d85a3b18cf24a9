"""Routed experts in a GGUF file, and a shard of them: what both services agree an expert is.

Two file layouts exist: one 3-D tensor per matrix and layer (`blk.N.ffn_gate_exps.weight`,
[n_expert, out, in] in torch order), and the older Mixtral files with one 2-D tensor per expert
(`blk.N.ffn_gate.E.weight`). Both become per-expert `ExpertFFN` views of the mmap: building a
shard copies nothing and touches only the pages its experts' bytes live in, when they are used.

A shard computes float32 hidden states on the exact reference path (`kernels.moe.moe_forward`)
and bfloat16 / float16 ones on the fast path (`kernels.expert_kernels`), prepared once per shard:
at the first such call, or up front with `ExpertShard.prepare_fast()`.
"""
from __future__ import annotations

import logging
import threading
from typing import Iterable, Mapping, NamedTuple

import torch

from splitmoe.kernels import expert_kernels as ek
from splitmoe.kernels.cpu_features import gemm_dtype
from splitmoe.kernels.int4pack import can_repack
from splitmoe.kernels.moe import ExpertFFN, moe_forward
from splitmoe.kernels.quants import QuantTensor, dequantize
from splitmoe.kernels.repack_cache import RepackCache, load_or_repack, tensor_digest
from splitmoe.modelfile.architectures import architecture
from splitmoe.modelfile.gguf_file import GGUFError, GGUFFile
from splitmoe.modelfile.hparams import ModelConfig

log = logging.getLogger("splitmoe.experts")
_FAST_DTYPES = (torch.bfloat16, torch.float16)

_MATRICES = ("gate", "up", "down")


class ExpertKey(NamedTuple):
    layer: int
    expert: int

    def label(self) -> str:
        """The one rendering of an expert id, for logs and metric labels."""
        return f"L{self.layer}.E{self.expert}"


def moe_layers(g: GGUFFile) -> list[int]:
    """Layers that have a router, in order."""
    return [i for i in range(ModelConfig.from_gguf(g).num_layers) if g.has(f"blk.{i}.ffn_gate_inp.weight")]


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


def build_fast_layers(g: GGUFFile, ffns_by_layer: Mapping[int, Mapping[int, ExpertFFN]], *,
                      use_native: bool = True, cache: RepackCache | None = None,
                      progress: bool | None = None) -> dict[int, ek.FastMoELayer]:
    """Every layer's `FastMoELayer`: native where the kernels can run the expert, else int4-repacked
    (Q4_0/Q4_1/Q4_K, from/into `cache`; None: no disk cache) or dequantized per call."""
    ek.sync_native_threads()
    use_native = use_native and ek.native_available()
    num_experts = expert_count(g)
    native_ok = {layer: {e for e, f in ffns.items() if use_native and ek.native_supports(f)}
                 for layer, ffns in ffns_by_layer.items()}
    to_repack = {layer: {e: f for e, f in ffns.items() if e not in native_ok[layer] and can_repack(f)}
                 for layer, ffns in ffns_by_layer.items()}
    int4: dict[int, dict] = {}
    if any(to_repack.values()):
        identities = {layer: f"{g.file_id}|{tensor_digest(_layer_tensors(g, layer, fs))}"
                      for layer, fs in to_repack.items() if fs}
        int4 = load_or_repack({layer: fs for layer, fs in to_repack.items() if fs}, identities, g.path.name,
                              cache, progress)
    fast = {layer: ek.FastMoELayer(ffns, num_experts, int4=int4.get(layer), use_native=use_native)
            for layer, ffns in ffns_by_layer.items()}
    _log_fast_path(fast, ffns_by_layer, use_native)
    return fast


def _log_fast_path(fast: Mapping[int, ek.FastMoELayer], ffns_by_layer: Mapping[int, Mapping[int, ExpertFFN]],
                   use_native: bool) -> None:
    total = sum(len(f) for f in ffns_by_layer.values())
    if not total:
        return
    n_native = sum(layer.native_experts for layer in fast.values())
    n_int4 = sum(len(layer.int4) for layer in fast.values())
    n_dense = total - n_native - n_int4
    dtype = gemm_dtype()
    if use_native:
        how = (f"native kernels ({ek.native.isa()}, {ek.native.get_num_threads()} threads) on {n_native} experts, "
               f"read in place from the GGUF, nothing repacked, up to {ek.NATIVE_MAX_TOKENS.get(dtype, 0)} "
               f"tokens per expert")
    else:
        how = (f"pure torch, native kernels unavailable ({ek.native_unavailable_reason() or 'disabled'}): "
               f"{n_int4} Q4 experts int4-repacked, torch's int4 kernel up to {ek.INT4_MAX_TOKENS} tokens per expert")
    others = f"; {n_dense} experts of other types dequantized per call" if n_dense else ""
    log.info("expert fast path (bfloat16/float16 requests), %d experts in %s: %s%s; more tokens per expert: "
             "dequantize once to %s, gate+up fused GEMM", total, format_ranges("layers", fast), how, others,
             str(dtype).removeprefix("torch."))


class ExpertShard:
    """The (layer, expert) pairs one process hosts, and the expert FFN over them."""

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
        self._ffns = {layer: load_layer_experts(g, layer, es) for layer, es in self.by_layer.items()}
        self._g, self.repack_cache = g, repack_cache
        self._fast: dict[int, ek.FastMoELayer] | None = None
        self._fast_lock = threading.Lock()

    def prepare_fast(self, progress: bool | None = None) -> dict[int, ek.FastMoELayer]:
        """Build the fast path of every hosted layer now (once; later calls return it).

        `progress`: the int4 repack's progress bar on stderr (None: when stderr is a terminal).
        """
        fast = self._fast
        if fast is None:
            with self._fast_lock:
                if self._fast is None:
                    self._fast = build_fast_layers(self._g, self._ffns, cache=self.repack_cache, progress=progress)
                fast = self._fast
        return fast

    def keys(self) -> list[ExpertKey]:
        return [ExpertKey(layer, e) for layer, es in self.by_layer.items() for e in es]

    def holds(self, key: ExpertKey) -> bool:
        return key.layer in self._ffns and key.expert in self._ffns[key.layer]

    @property
    def num_bytes(self) -> int:
        return sum(f.num_bytes for layer in self._ffns.values() for f in layer.values())

    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                expert_weights: torch.Tensor) -> torch.Tensor:
        """This shard's part of the layer's expert sum; ids it does not host add nothing.

        bfloat16/float16 `hidden` take the fast path, any other dtype the exact float32 reference.
        """
        ffns = self._ffns.get(layer)
        if ffns is None:
            raise KeyError(f"layer {layer} is not in this shard ({format_ranges('layers', self.layers)})")
        if hidden.dtype in _FAST_DTYPES:
            return self.prepare_fast()[layer].forward(hidden, expert_ids, expert_weights)
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
