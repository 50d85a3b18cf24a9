"""The hot experts: (layer, expert) pairs chosen by heat, computed in the attention process.

The services keep hosting them too (a placement covers every expert), so the set can change at
any layer call: a slot whose expert is hot is computed here and sent as -1 ("not wanted") to the
services; the two parts are summed like any two services' parts.
"""
from __future__ import annotations

from typing import Sequence

import torch

from splitmoe.kernels.expert_lora import LoraRows
from splitmoe.kernels.repack_cache import RepackCache
from splitmoe.modelfile.expert_tensors import ExpertKey, ExpertShard
from splitmoe.modelfile.gguf_file import GGUFFile

_NOT_WANTED = -1


class HotExperts:
    """A fixed set of hot pairs and their shard; replaced whole, never changed."""

    def __init__(self, g: GGUFFile, keys: Sequence[ExpertKey], num_layers: int, num_experts: int,
                 repack_cache: RepackCache | None = None, prepare_fast: bool = False):
        self.keys = tuple(sorted(keys))
        by_layer: dict[int, list[int]] = {}
        for key in self.keys:
            by_layer.setdefault(key.layer, []).append(key.expert)
        self.shard = ExpertShard(g, by_layer=by_layer, repack_cache=repack_cache)
        if prepare_fast and self.keys:  # before it is switched in: never at a request's first layer call
            self.shard.prepare_fast(progress=False)
        # [layer, expert + 1]: whether a slot's expert is hot; the last column is what id -1 indexes
        self._mask = torch.zeros(num_layers, num_experts + 1, dtype=torch.bool)
        for key in self.keys:
            self._mask[key.layer, key.expert] = True

    @property
    def num_bytes(self) -> int:
        return self.shard.num_bytes

    def has_layer(self, layer: int) -> bool:
        return layer in self.shard.by_layer

    def split(self, layer: int, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the routing computed here, the routing left for the services): [T, K] each, -1 elsewhere."""
        mine = self._mask[layer][expert_ids]
        return torch.where(mine, expert_ids, _NOT_WANTED), torch.where(mine, _NOT_WANTED, expert_ids)

    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                expert_weights: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        """`lora`: the adapters' rows (kernels/expert_lora.py), as `ExpertShard.forward` takes them."""
        return self.shard.forward(layer, hidden, expert_ids, expert_weights, lora=lora)


class PlusLocal:
    """A layer call's handle whose services' sum gets the hot experts' part added (float32)."""

    __slots__ = ("_handle", "_local")

    def __init__(self, handle, local: torch.Tensor):
        self._handle, self._local = handle, local

    def wait(self) -> torch.Tensor:
        out = self._handle.wait()  # the call's own sum: added to in place (it may be a lent host buffer)
        return out.add_(self._local.float())
