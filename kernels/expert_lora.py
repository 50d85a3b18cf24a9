"""LoRA adapters on the routed experts: each adapted row gets its own adapter's delta, never merged.

For a row t of an adapter and each routed expert e of t that this shard hosts (llama.cpp's
`build_lora_mm_id`, peft's per-expert deltas):

    g = gate_e(x) + s_g * B_g[e] (A_g[e] x),   u likewise,   h = act(g, u)   (the base's act and biases)
    y = down_e(h) + s_d * B_d[e] (A_d[e] h),   out[t] += w[t, e] * y

The delta sits inside the activation, so it cannot be added to the base's output afterwards: an adapted
row's experts are computed again here, grouped by expert (each active expert's weights read once per call
whatever the number of adapters), then by adapter (the rank-r products of its rows). Ids not hosted, and
-1, add nothing, as for the base.

The base products of the adapted rows take one of two routes per expert (n: its adapted slots):
* native (bfloat16/float16 hidden, n up to the layer's `native_max_tokens`, a native kernel for every
  matrix): gate and up in one int8 call, then down (`kernels.native.WeightMatmul`), on the GGUF blocks
  in place: the same rounding as the base's decode kernel (activations to int8 per 32 values);
* exact (float32 hidden, more tokens, other types): the expert dequantized to float32 (natively where
  possible, bit-identical to `kernels.quants`) and float32 GEMMs: `kernels.moe`'s reference math.

Cost, beside the base path (which `ExpertCompute` runs for the whole batch when any row uses the base,
so base rows stay bit-identical to a call without adapters; the adapted rows' base answers are dropped):
* native route: per active expert two native calls reading its weights from the file mapping (the base
  kernel may read packed copies, about twice as fast per byte, and released the file's pages after
  packing: these reads map them back in from the page cache, which costs no new memory), plus two small
  torch ops per adapter and matrix: about a base decode of those rows again, plus ~10 torch ops per
  (expert, adapter) of Python overhead;
* exact route: each active expert dequantized per call into a per-thread float32 scratch (3 * ffn * D
  values, 19 MB for Qwen3-30B-A3B, a few ms per expert), then float32 GEMMs: slower than the base's
  prefill route, which dequantizes into its GEMM dtype (bfloat16 where the CPU has it);
* the deltas themselves: 2 * r * (in + out) flops per slot and matrix, negligible beside the experts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from splitmoe.kernels import expert_kernels as ek
from splitmoe.kernels.moe import ACTIVATIONS, ExpertFFN
from splitmoe.kernels.quants import QuantTensor

__all__ = ["AdaptedExperts", "ExpertLayerLora", "LoraPair", "LoraRows", "by_layer", "check_rows"]

_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


@dataclass(frozen=True, eq=False)
class LoraPair:
    """One adapted routed-expert matrix, stacked over every expert of the model (ids are global)."""

    a: torch.Tensor  # float32 [E, r, in]
    b: torch.Tensor  # float32 [E, out, r]
    scale: float

    def __post_init__(self) -> None:
        a, b = self.a, self.b
        if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]:
            raise ValueError(f"LoRA pair of shapes {list(a.shape)} / {list(b.shape)}: want [E, r, in] / [E, out, r]")

    @property
    def in_features(self) -> int:
        return int(self.a.shape[2])

    @property
    def out_features(self) -> int:
        return int(self.b.shape[1])

    def delta(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """scale * B[e] (A[e] x) for rows x [n, in] float32: [n, out] float32."""
        return (x @ self.a[expert].T) @ self.b[expert].T * self.scale


@dataclass(frozen=True, eq=False)
class ExpertLayerLora:
    """One adapter's routed-expert matrices in one layer; None: that matrix is not adapted."""

    gate: LoraPair | None = None
    up: LoraPair | None = None
    down: LoraPair | None = None
    adapter: Any = None  # the file they came from: what a hop names to an expert service

    def __post_init__(self) -> None:
        pairs = [p for p in (self.gate, self.up, self.down) if p is not None]
        if len({int(p.a.shape[0]) for p in pairs}) > 1:
            raise ValueError(f"LoRA expert matrices of one layer stack different expert counts: "
                             f"{[int(p.a.shape[0]) for p in pairs]}")
        for p in (self.gate, self.up):
            if p is not None and self.down is not None and (p.in_features, p.out_features) != (
                    self.down.out_features, self.down.in_features):
                raise ValueError(f"LoRA expert matrices do not fit together: gate/up [{p.out_features}, "
                                 f"{p.in_features}], down [{self.down.out_features}, {self.down.in_features}]")

    @property
    def empty(self) -> bool:
        return self.gate is None and self.up is None and self.down is None


LoraRows = Sequence[tuple[ExpertLayerLora, torch.Tensor]]
"""(an adapter's tensors for this layer, the int64 rows of `hidden` that use it); rows in no entry use the base."""


def by_layer(tensors: Mapping[str, Any], adapter: Any = None) -> dict[int, ExpertLayerLora]:
    """An adapter's routed-expert tensors (`LoraAdapter.expert_side()`: base name -> a LoraTensor, or
    anything with float `a` [E, r, in], `b` [E, out, r] and `scale`) by layer. Only the stacked
    `blk.N.ffn_{gate,up,down}_exps.weight` are applied: any other name is refused, naming it.
    `adapter` (`LoraAdapter.ref`): where they came from, for expert services (RemoteExperts)."""
    parts: dict[int, dict[str, LoraPair]] = {}
    for name, t in tensors.items():
        m = _EXPERT_TENSOR.match(name)
        if m is None:
            raise ValueError(f"tensor '{name}.lora_a': LoRA on it is not applied by SplitMoE yet (on routed "
                             "experts, blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps.weight are)")
        a, b = (v.detach().to("cpu", torch.float32).contiguous() for v in (t.a, t.b))
        parts.setdefault(int(m[1]), {})[m[2]] = LoraPair(a, b, float(t.scale))
    return {layer: ExpertLayerLora(**found, adapter=adapter) for layer, found in sorted(parts.items())}


def check_rows(lora: LoraRows, num_rows: int) -> list[tuple[ExpertLayerLora, torch.Tensor]]:
    """The entries that adapt something, their rows as CPU int64, checked: in range, in one entry at most."""
    groups = []
    for layer_lora, rows in lora:
        if rows.dim() != 1 or rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
            raise ValueError(f"LoRA rows must be a 1-D integer tensor, got {list(rows.shape)} {rows.dtype}")
        rows = rows.to("cpu", torch.int64)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
            raise ValueError(f"LoRA rows outside [0, {num_rows})")
        if not layer_lora.empty and rows.numel():
            groups.append((layer_lora, rows))
    if groups:
        rows = torch.cat([r for _, r in groups])
        if torch.unique(rows).numel() != rows.numel():
            raise ValueError("LoRA rows: a row is listed twice (one adapter per row)")
    return groups


class AdaptedExperts:
    """One layer's hosted experts for the adapted rows (module doc). Holds the native products of
    each expert once made (views of the file mapping: no copy)."""

    def __init__(self, ffns: Mapping[int, ExpertFFN], num_experts: int):
        self.ffns = dict(ffns)
        self.num_experts = int(num_experts)
        hosted = torch.zeros(self.num_experts + 1, dtype=torch.bool)  # the extra last entry: -1 and strays
        hosted[[e for e in self.ffns if 0 <= e < self.num_experts]] = True
        self._hosted = hosted
        self._native: dict[int, tuple[Any, Any] | None] = {}

    def forward(self, hidden: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                groups: Sequence[tuple[ExpertLayerLora, torch.Tensor]], native_max_tokens: int = 0) -> torch.Tensor:
        """float32 [n, D]: the hosted experts' sum for the rows of `groups` (from `check_rows`), in their order.

        `native_max_tokens`: experts with up to this many adapted slots take the native route (0: none)."""
        rows = torch.cat([r for _, r in groups])
        x = hidden.index_select(0, rows).float()
        top_k = expert_ids.shape[1]
        flat = expert_ids.index_select(0, rows).reshape(-1).long()
        flat = torch.where((flat >= 0) & (flat < self.num_experts), flat, torch.full_like(flat, -1))
        slots = self._hosted[flat].nonzero().flatten()  # the flat -1 indexes the "not hosted" entry
        adapter = torch.cat([torch.full_like(r, j) for j, (_, r) in enumerate(groups)]).repeat_interleave(top_k)
        key, perm = (flat[slots] * len(groups) + adapter[slots]).sort(stable=True)  # by expert, then adapter
        order = slots[perm]
        keys, counts = torch.unique_consecutive(key, return_counts=True)
        slot_weights = expert_weights.index_select(0, rows).reshape(-1).float()
        out = torch.zeros(x.shape, dtype=torch.float32)
        start = 0
        for expert, parts in _by_expert(keys.tolist(), counts.tolist(), len(groups)):
            end = start + sum(n for _, n in parts)
            tokens = order[start:end] // top_k
            runs, offset = [], 0
            for j, n in parts:
                runs.append((groups[j][0], offset, offset + n))
                offset += n
            y = self._expert_ffn(expert, x.index_select(0, tokens), runs, native=end - start <= native_max_tokens)
            out.index_add_(0, tokens, y * slot_weights[order[start:end], None])
            start = end
        return out

    def _expert_ffn(self, expert: int, x: torch.Tensor, runs: list[tuple[ExpertLayerLora, int, int]],
                    native: bool) -> torch.Tensor:
        """One expert on its adapted slots x [n, D]; runs: (adapter, first, end) slices of x."""
        ffn = self.ffns[expert]
        products = self._native_products(expert) if native else None
        f = ffn.gate.shape[0]
        gate_up = products[0](x.contiguous()) if products else x @ self._dequantized_gate_up(ffn).T
        gate, up = gate_up[:, :f], gate_up[:, f:]
        for lora, a, b in runs:
            if lora.gate is not None:
                gate[a:b] += lora.gate.delta(x[a:b], expert)
            if lora.up is not None:
                up[a:b] += lora.up.delta(x[a:b], expert)
        h = ACTIVATIONS[ffn.activation](_biased(gate, ffn.gate_bias), _biased(up, ffn.up_bias))
        y = products[1](h.contiguous()) if products else h @ _dequantized(ffn.down, "lora_down").T
        for lora, a, b in runs:
            if lora.down is not None:
                y[a:b] += lora.down.delta(h[a:b], expert)
        return _biased(y, ffn.down_bias)

    def _native_products(self, expert: int) -> tuple[Any, Any] | None:
        """(gate and up side by side, down) as native int8 products, or None where the kernels lack a type."""
        if expert not in self._native:  # a race makes it twice, harmlessly: views, no copies
            ffn = self.ffns[expert]
            self._native[expert] = ((ek.native.WeightMatmul(ffn.gate, ffn.up), ek.native.WeightMatmul(ffn.down))
                                    if ek.native_supports(ffn) else None)
        return self._native[expert]

    @staticmethod
    def _dequantized_gate_up(ffn: ExpertFFN) -> torch.Tensor:
        f = ffn.gate.shape[0]
        w = ek.scratch_buffer("lora_gate_up", (2 * f, ffn.gate.shape[1]), torch.float32)
        _dequantized(ffn.gate, out=w[:f])
        _dequantized(ffn.up, out=w[f:])
        return w


def _by_expert(keys: list[int], counts: list[int], num_groups: int):
    """(expert, [(adapter index, slots), ...]) from the sorted (expert * num_groups + adapter) keys."""
    parts: list[tuple[int, int]] = []
    for i, (key, n) in enumerate(zip(keys, counts)):
        expert, j = divmod(key, num_groups)
        parts.append((j, n))
        if i + 1 == len(keys) or keys[i + 1] // num_groups != expert:
            yield expert, parts
            parts = []


def _dequantized(w: QuantTensor, scratch: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        out = ek.scratch_buffer(scratch, w.shape, torch.float32)
    return ek.dequantize(w, torch.float32, out=out)


def _biased(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.float()
