"""Hot experts on the GPU (`--gpu-experts N|SIZE`): a fixed set of (layer, expert) pairs, dequantized
once into device memory, computed where the attention runs; the rest stay on the CPU expert services.

Like KTransformers' --kt-num-gpu-experts and llama.cpp's partial --n-cpu-moe, but chosen by heat
(load_plan.choose_hot). The services keep hosting every expert, so the caller splits each layer's
routing (`split`): this part's output and the services' part are summed in float32, as any two
services' parts are.

`forward` can be captured in a CUDA graph: shapes are static, nothing reads a tensor's value on the
host, and the path taken depends on the slot count and hosted expert count only:
- few slots (decode): each slot's expert weights are gathered by index, then batched matmuls; a
  gathered expert is read, written and read again, so this pays only when the slots are few beside
  the experts hosted (_GATHER_TRAFFIC);
- many slots (prefill): every hosted expert of the layer over every row, the routing weight a
  per-row scale (zero where not routed). Each hosted expert is read once, and the experts' down
  projections reduce in one matmul; rows beyond what they route are computed and zeroed.

Rounding as kernels.moe's float32 reference wherever `dtype` allows: the matmuls take `dtype` inputs
(hidden, weights, activation) and give float32 products (mm/bmm `out_dtype` on CUDA; elsewhere the
product is rounded to `dtype` once); biases, activation, routing weights and the sum are float32.

Stacks per layer, n hosted experts, D hidden, F expert FFN:
    gate_up [n, 2F, D] (gate rows, then up rows)   down_t [n, F, D] (down transposed)
    gate_up_bias [n, 2F], down_bias [n, D]: float32, gpt-oss only
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from splitmoe.attention_service.expert_backends.load_plan import HeatBudget, choose_hot
from splitmoe.kernels.expert_kernels import format_ranges
from splitmoe.kernels.moe import ACTIVATIONS, ExpertFFN
from splitmoe.kernels.quants import dequantize
from splitmoe.modelfile.expert_tensors import ExpertKey, expert_count, load_layer_experts, moe_layers
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.hparams import ModelConfig

_NOT_HERE = -1
# A gathered expert's bytes cross device memory three times (read, copied, read by the matmul); the
# dense path reads each hosted expert once. Gather while slots * this <= hosted experts.
_GATHER_TRAFFIC = 3
# The dense path's float32 intermediates per group of experts ([T, G, 3F]): bounds prefill's memory.
_DENSE_WORK_BYTES = 256 << 20


@dataclass(frozen=True)
class _LayerStack:
    """One layer's hosted experts, stacked in the order of `experts`."""

    experts: tuple[int, ...]
    gate_up: torch.Tensor
    down_t: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    activation: str

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    @property
    def ffn(self) -> int:
        return self.down_t.shape[1]

    @property
    def num_bytes(self) -> int:
        tensors = (self.gate_up, self.down_t, self.gate_up_bias, self.down_bias)
        return sum(t.nbytes for t in tensors if t is not None)


class DeviceExperts:
    """A fixed set of (layer, expert) pairs in device memory; replaced whole, never changed."""

    def __init__(self, g: GGUFFile, keys: Sequence[ExpertKey], device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16):
        """Reads only these experts' bytes, one expert at a time (a whole layer may be GBs)."""
        self.keys = tuple(sorted(set(keys)))
        self.device, self.dtype = _resolved(torch.device(device)), dtype
        num_layers, num_experts = ModelConfig.from_gguf(g).num_blocks, expert_count(g)
        by_layer = _by_layer(self.keys, set(moe_layers(g)), num_experts)
        self._stacks = {layer: _load_stack(g, layer, experts, self.device, dtype)
                        for layer, experts in by_layer.items()}
        # [layer, expert + 1]: a routed expert's index in its layer's stack, -1 where not here; the
        # last column is what a -1 ("not wanted") slot looks up. On the host too, for host routing.
        slot_of = torch.full((num_layers, num_experts + 1), _NOT_HERE, dtype=torch.int64)
        for layer, stack in self._stacks.items():
            slot_of[layer, list(stack.experts)] = torch.arange(stack.num_experts)
        self._slot_of = {self.device: slot_of.to(self.device), torch.device("cpu"): slot_of}
        self._float32_products = _float32_products(self.device, dtype)

    @property
    def num_bytes(self) -> int:
        """Device bytes of the weights (and biases) held."""
        return sum(stack.num_bytes for stack in self._stacks.values())

    @property
    def layers(self) -> list[int]:
        return list(self._stacks)

    def has_layer(self, layer: int) -> bool:
        return layer in self._stacks

    def split(self, layer: int, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the routing computed here, the routing left for the services): [T, K] each on the ids'
        device, -1 where the other side computes. Every wanted slot is on exactly one side."""
        here = self._slots(layer, expert_ids) >= 0
        return torch.where(here, expert_ids, _NOT_HERE), torch.where(here, _NOT_HERE, expert_ids)

    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                gather: bool | None = None) -> torch.Tensor:
        """float32 [T, D]: sum over the slots whose expert is here of weight * FFN(hidden row); rows
        with none are zero. Ids not hosted here (or -1) add nothing.

        hidden [T, D] any float dtype, expert_ids [T, K] int64, expert_weights [T, K]: on the device.
        `gather`: force a strategy (benchmarks, tests); None chooses by the static sizes.
        """
        stack = self._stacks.get(layer)
        if stack is None:
            raise KeyError(f"layer {layer} has no experts on {self.device} ({format_ranges('layers', self.layers)})")
        slots = self._slots(layer, expert_ids)
        if gather is None:
            gather = gathers(expert_ids.numel(), stack.num_experts)
        compute = _gathered if gather else _dense
        return compute(stack, hidden.to(self.dtype), slots, expert_weights.float(), self._float32_products)

    def _slots(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        """[T, K] each slot's index in the layer's stack, -1 where its expert is not here."""
        table = self._slot_of.get(expert_ids.device)
        if table is None:
            raise ValueError(f"expert ids on {expert_ids.device}: want them on {self.device} or the cpu")
        row = table[layer]
        wanted = torch.where(expert_ids < 0, row.shape[0] - 1, expert_ids)  # -1: the last column
        return row.index_select(0, wanted.reshape(-1)).view(expert_ids.shape)


def gathers(num_slots: int, num_hosted: int) -> bool:
    """Whether a layer call of `num_slots` (T * K) slots gathers its experts' weights (else dense)."""
    return num_slots * _GATHER_TRAFFIC <= num_hosted


def expert_device_bytes(g: GGUFFile, layer: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Device bytes one expert of `layer` takes in DeviceExperts: its matrices in `dtype`, its
    biases (gpt-oss) in float32."""
    ffn = load_layer_experts(g, layer, [0])[0]
    weights = sum(math.prod(m.shape) for m in (ffn.gate, ffn.up, ffn.down)) * dtype.itemsize
    return weights + sum(b.numel() * 4 for b in (ffn.gate_bias, ffn.up_bias, ffn.down_bias) if b is not None)


def choose_device_experts(g: GGUFFile, tokens_per_s: torch.Tensor, budget: HeatBudget,
                          dtype: torch.dtype = torch.bfloat16, layers: Iterable[int] | None = None) -> list[ExpertKey]:
    """The hottest pairs (tokens_per_s [layer, expert]) whose device bytes in `dtype` fit `budget`."""
    layers = moe_layers(g) if layers is None else sorted(layers)
    sizes = {layer: expert_device_bytes(g, layer, dtype) for layer in layers}
    return choose_hot(tokens_per_s, layers, budget, sizes.__getitem__)


def _by_layer(keys: Sequence[ExpertKey], layers: set[int], num_experts: int) -> dict[int, tuple[int, ...]]:
    by_layer: dict[int, list[int]] = {}
    for key in keys:
        if key.layer not in layers or not 0 <= key.expert < num_experts:
            raise ValueError(f"expert {key.label()}: not a routed expert of this model "
                             f"({format_ranges('MoE layers', layers)}, {num_experts} experts)")
        by_layer.setdefault(key.layer, []).append(key.expert)
    return {layer: tuple(experts) for layer, experts in by_layer.items()}


def _load_stack(g: GGUFFile, layer: int, experts: tuple[int, ...], device: torch.device,
                dtype: torch.dtype) -> _LayerStack:
    """Dequantizes expert by expert straight into the device stacks: the host holds one matrix."""
    ffns = load_layer_experts(g, layer, experts)
    first = ffns[experts[0]]
    ffn, hidden = first.gate.shape
    gate_up = torch.empty(len(experts), 2 * ffn, hidden, dtype=dtype, device=device)
    down_t = torch.empty(len(experts), ffn, hidden, dtype=dtype, device=device)
    for i, e in enumerate(experts):
        gate_up[i, :ffn].copy_(dequantize(ffns[e].gate))
        gate_up[i, ffn:].copy_(dequantize(ffns[e].up))
        down_t[i].copy_(dequantize(ffns[e].down).T)
    biases = _gate_up_bias(ffns, experts, device), _down_bias(ffns, experts, device)
    return _LayerStack(experts, gate_up, down_t, *biases, first.activation)


def _gate_up_bias(ffns: dict[int, ExpertFFN], experts: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    if ffns[experts[0]].gate_bias is None and ffns[experts[0]].up_bias is None:
        return None
    ffn = ffns[experts[0]].gate.shape[0]
    zeros = torch.zeros(ffn)
    rows = [torch.cat([_or(ffns[e].gate_bias, zeros), _or(ffns[e].up_bias, zeros)]) for e in experts]
    return torch.stack(rows).float().to(device)


def _down_bias(ffns: dict[int, ExpertFFN], experts: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    if ffns[experts[0]].down_bias is None:
        return None
    return torch.stack([ffns[e].down_bias for e in experts]).float().to(device)


def _or(bias: torch.Tensor | None, zeros: torch.Tensor) -> torch.Tensor:
    return zeros if bias is None else bias.float()


def _resolved(device: torch.device) -> torch.device:
    """'cuda' as 'cuda:N': tensors report their device with its index, and ids are looked up by it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _float32_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch returns a float32 product of `dtype` matrices without rounding it to `dtype`
    first (mm/bmm `out_dtype`: CUDA builds of recent torch). Elsewhere the product is rounded once."""
    if dtype == torch.float32 or device.type != "cuda":
        return False
    a = torch.zeros(1, 8, 8, dtype=dtype, device=device)
    try:
        torch.bmm(a, a, out_dtype=torch.float32)
        torch.mm(a[0], a[0].T, out_dtype=torch.float32)  # transposed, as the dense path's first product
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _mm(a: torch.Tensor, b: torch.Tensor, float32_products: bool) -> torch.Tensor:
    return torch.mm(a, b, out_dtype=torch.float32) if float32_products else torch.mm(a, b).float()


def _bmm(a: torch.Tensor, b: torch.Tensor, float32_products: bool) -> torch.Tensor:
    return torch.bmm(a, b, out_dtype=torch.float32) if float32_products else torch.bmm(a, b).float()


def _gathered(stack: _LayerStack, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
              float32_products: bool) -> torch.Tensor:
    """Per slot (T * K of them): its expert's weights gathered, one batched matmul per projection.

    Rounding as kernels.moe's reference: products, biases, activation and the weighting in float32.
    """
    num_tokens, top_k = slots.shape
    here = (slots >= 0).reshape(-1)
    index = slots.clamp(min=0).reshape(-1)  # not-here slots compute expert 0's output, then drop it
    xs = x.unsqueeze(1).expand(num_tokens, top_k, x.shape[1]).reshape(-1, x.shape[1], 1)
    gate_up = _bmm(stack.gate_up.index_select(0, index), xs, float32_products).squeeze(2)  # [S, 2F]
    if stack.gate_up_bias is not None:
        gate_up = gate_up + stack.gate_up_bias.index_select(0, index)
    act = ACTIVATIONS[stack.activation](gate_up[:, :stack.ffn], gate_up[:, stack.ffn:])
    y = _bmm(act.to(x.dtype).unsqueeze(1), stack.down_t.index_select(0, index), float32_products).squeeze(1)
    if stack.down_bias is not None:
        y = y + stack.down_bias.index_select(0, index)
    # where, not a zero weight: a not-here slot of a padding row may hold inf/nan, and 0 * nan is nan
    y = torch.where(here[:, None], y * weights.reshape(-1, 1), 0.0)
    return y.view(num_tokens, top_k, x.shape[1]).sum(1)


def _dense(stack: _LayerStack, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
           float32_products: bool) -> torch.Tensor:
    """Every hosted expert over every row, a group of experts at a time (static: the sizes decide)."""
    num_tokens, num_hosted = x.shape[0], stack.num_experts
    route, routed = _dense_routing(slots, weights, num_hosted)
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    group = max(1, _DENSE_WORK_BYTES // max(1, num_tokens * 3 * stack.ffn * 4))
    for start in range(0, num_hosted, group):
        experts = slice(start, min(num_hosted, start + group))
        out += _dense_group(stack, experts, x, route[:, experts], routed[:, experts], float32_products)
    return out


def _dense_group(stack: _LayerStack, experts: slice, x: torch.Tensor, route: torch.Tensor, routed: torch.Tensor,
                 float32_products: bool) -> torch.Tensor:
    """One matmul for the group's gates and ups, the activation scaled by each row's routing weight (0
    where not routed), one matmul summing the group's down projections.

    Scaling before the down product, not after as the reference does: in float32 the same sum; in a
    narrower dtype the weight is rounded in with the activation, one rounding either way.
    """
    num_tokens, hidden, ffn = x.shape[0], x.shape[1], stack.ffn
    gate_up = _mm(x, stack.gate_up[experts].reshape(-1, hidden).T, float32_products)
    gate_up = gate_up.view(num_tokens, route.shape[1], 2 * ffn)
    if stack.gate_up_bias is not None:
        gate_up = gate_up + stack.gate_up_bias[experts]
    act = ACTIVATIONS[stack.activation](gate_up[..., :ffn], gate_up[..., ffn:])
    # where, not only the zero weight: rows not routed here may hold inf/nan (padding), and 0 * nan is nan
    act = torch.where(routed[..., None], act * route[..., None], 0.0).to(x.dtype)
    out = _mm(act.reshape(num_tokens, route.shape[1] * ffn), stack.down_t[experts].reshape(-1, hidden),
              float32_products)
    return out if stack.down_bias is None else out + route @ stack.down_bias[experts]


def _dense_routing(slots: torch.Tensor, weights: torch.Tensor, num_hosted: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, n] float32 each hosted expert's routing weight per row, [T, n] whether it is routed)."""
    column = torch.where(slots >= 0, slots, num_hosted)  # not-here slots land in a column dropped after
    shape = (slots.shape[0], num_hosted + 1)
    route = torch.zeros(shape, dtype=torch.float32, device=slots.device).scatter_add_(1, column, weights)
    routed = torch.zeros(shape, dtype=torch.bool, device=slots.device).scatter_(1, column, True)
    return route[:, :num_hosted], routed[:, :num_hosted]
