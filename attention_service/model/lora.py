"""LoRA adapters in a step: each row gets its own adapter's delta, grouped by adapter, never merged.

An adapted linear's output gains `scale * (x @ A^T) @ B^T` for the rows of that adapter's requests
(llama.cpp's `build_lora_mm`, vLLM's punica kernels). The base product runs once for every row as
without adapters; each adapter then adds a rank-r correction to its own rows only, so one batch
mixes requests of several adapters and of the base model. What an adapter touches on this side:
multi-head attention's q, k, v and output, the dense FFN and the shared experts, the output head
(`ATTENTION_SIDE`); its routed experts' tensors go with the hop to whoever computes the experts
(kernels/expert_lora.py). A tensor elsewhere (MLA's projections, a fused qkv) is refused at load,
in one line, rather than loaded and silently left out.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from splitmoe.modelfile.lora_adapter import LoraAdapter, LoraTensor

if TYPE_CHECKING:
    from splitmoe.kernels.expert_lora import ExpertLayerLora

# The base tensors whose adapters the attention side applies (their outputs' call sites say so).
ATTENTION_SIDE = re.compile(r"^(blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down)(_shexp)?)\.weight|output\.weight)$")


@dataclass(frozen=True, eq=False)
class AdapterWeights:
    """One loaded adapter as the model applies it."""

    name: str
    path: str
    rank: int
    key: int  # from the file's identity: prefix-cache blocks of two adapters never meet
    tensors: dict[str, LoraTensor]  # attention side, by base tensor name
    experts: dict[int, ExpertLayerLora]  # routed experts, by layer

    @classmethod
    def of(cls, adapter: LoraAdapter) -> "AdapterWeights":
        tensors = adapter.attention_side()
        for name in tensors:
            if not ATTENTION_SIDE.match(name):
                raise ValueError(f"{adapter.path}: tensor '{name}.lora_a': LoRA on it is not applied by SplitMoE yet "
                                 "(attention q/k/v/output, dense and shared FFNs, the output head and routed experts are)")
        experts = {}
        if expert_side := adapter.expert_side():
            from splitmoe.kernels.expert_lora import by_layer

            try:
                experts = by_layer(expert_side, adapter.ref)
            except ValueError as e:
                raise ValueError(f"{adapter.path}: {e}") from None
        key = int.from_bytes(hashlib.sha256(adapter.identity.encode()).digest()[:8], "little") >> 1
        return cls(adapter.name, str(adapter.path), adapter.rank, key, tensors, experts)


class StepLora:
    """Which rows of one step use which adapter; rows in no group use the base model."""

    def __init__(self, groups: list[tuple[AdapterWeights, torch.Tensor]]):
        self.groups = groups  # (adapter, int64 row indices), one entry per adapter
        self.attention_side = any(a.tensors for a, _ in groups)

    @classmethod
    def of_rows(cls, adapters: list[AdapterWeights | None]) -> "StepLora | None":
        """From each row's adapter (None: the base); None when no row has one."""
        rows: dict[int, tuple[AdapterWeights, list[int]]] = {}
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].append(row)
        if not rows:
            return None
        return cls([(a, torch.tensor(r, dtype=torch.long)) for a, r in rows.values()])

    def add(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] (the base product of x [T, in] with tensor `name`) with each adapted row's delta, in place."""
        for adapter, rows in self.groups:
            t = adapter.tensors.get(name)
            if t is None:
                continue
            if rows.numel() == y.shape[0]:  # every row (rows are distinct): no gather, no scatter
                y += ((x.to(t.a.device, torch.float32) @ t.a.T) * t.scale @ t.b.T).to(y.dtype)
                continue
            rows = rows.to(y.device)
            xr = x.index_select(0, rows).to(t.a.device, torch.float32)
            y.index_add_(0, rows, ((xr @ t.a.T) * t.scale @ t.b.T).to(y.dtype))
        return y

    def add_parts(self, names: tuple[str, ...], x: torch.Tensor, ys: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """`add` for several products of the same input (q, k, v; gate, up)."""
        return tuple(self.add(n, x, y) for n, y in zip(names, ys))

    def front(self, layer: int) -> "FrontDeltas":
        """Layer `layer`'s q/k/v and output deltas as its native attention front takes them (kernels/decode_layer.py)."""
        return FrontDeltas(self, f"blk.{layer}.")

    def of_rows_subset(self, picked: torch.Tensor) -> "StepLora | None":
        """The same adapters for rows `picked` of this step, renumbered 0.. (the logits rows for the head)."""
        groups = []
        for adapter, rows in self.groups:
            where = torch.isin(picked.cpu(), rows).nonzero().flatten()
            if where.numel():
                groups.append((adapter, where))
        return StepLora(groups) if groups else None

    def expert_rows(self, layer: int) -> list[tuple[ExpertLayerLora, torch.Tensor]] | None:
        """The adapters with tensors on this layer's routed experts, and their rows (None: none)."""
        found = [(a.experts[layer], rows) for a, rows in self.groups if layer in a.experts]
        return found or None


class FrontDeltas:
    """`kernels.decode_layer.FrontLora` for one layer of a step: the same deltas as `Attention`'s torch path."""

    __slots__ = ("step", "prefix")

    def __init__(self, step: StepLora, prefix: str):
        self.step, self.prefix = step, prefix

    def qkv(self, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.step.add_parts(tuple(f"{self.prefix}attn_{n}.weight" for n in "qkv"), h, (q, k, v))

    def output(self, a: torch.Tensor, o: torch.Tensor) -> None:
        self.step.add(f"{self.prefix}attn_output.weight", a, o)
