"""The paged KV cache: fixed-size pools of per-token entries, addressed by slot.

A slot is `block * kv_block_tokens + offset`. Which blocks a sequence owns is the block manager's
business; this class only stores and gathers. Entries are named per architecture (`k`/`v` for
multi-head attention; MLA stores its compressed latent instead), so the cache never assumes a
layout.

Each pool keeps the slot axis second to last: an entry of shape [G, D] is stored [G, slots, D],
so that one head's context is contiguous for attention's batched matrix products. `read` returns
[C, *shape] all the same (a transposed view), and costs no copy when the slots are one run of
consecutive slots, which is what a sequence's blocks usually are (the block manager hands out
free blocks in order).

How values are stored is the cache's format (kv_formats.py, `--kv-cache-dtype`): as computed, or
in 8 bits; `dtype` is what reads return. The native attention reads any format in place
(`native_pools`); the GPU's paged attention (`pools`) only a cache stored as computed.
"""
from __future__ import annotations

from typing import Mapping

import torch

from splitmoe.attention_service.model.kv_formats import DenseFormat, KVFormat, check_rows
from splitmoe.kernels.decode_attention import KVPool


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, kv_block_tokens: int,
                 entry_shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                 fmt: KVFormat | None = None):
        self.num_blocks = num_blocks
        self.kv_block_tokens = kv_block_tokens
        self.dtype, self.device = dtype, device
        self.format = fmt or DenseFormat(dtype)
        check_rows(self.format, dict(entry_shapes))
        self.as_computed = self.format.stores_as(dtype)
        num_slots = num_blocks * kv_block_tokens
        self._slot_dims = {name: max(0, len(shape) - 1) for name, shape in entry_shapes.items()}
        self._stored = [
            {name: self.format.allocate((*shape[:-1], num_slots, *shape[-1:]), device)
             for name, shape in entry_shapes.items()}
            for _ in range(num_layers)
        ]
        self._pools = [{name: pools[0] for name, pools in layer.items()} for layer in self._stored]
        self.bytes_per_token = int(sum(
            torch.Size(shape).numel() * self.format.bytes_per_value for shape in entry_shapes.values()) * num_layers)
        self.reserved_bytes = self.bytes_per_token * num_slots  # allocated zeroed: pages arrive as they are written
        # (slots tensor, run start) of the last few slot tensors read: every layer of a step reads
        # the same context tensor, so its check runs once per step. Holding the tensors means an
        # id is never that of a recycled one.
        self._runs: dict[int, tuple[torch.Tensor, int | None]] = {}

    def write(self, layer: int, slots: torch.Tensor, **entries: torch.Tensor) -> None:
        """Each entry [T, *shape] into `slots` [T]."""
        stored = self._stored[layer]
        for name, value in entries.items():
            dim = self._slot_dims[name]
            self.format.write(stored[name], dim, slots, value.movedim(0, dim))

    def pools(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's whole pools ([*shape[:-1], slots, shape[-1]]), for kernels that address
        slots themselves (kernels.decode_attention). Do not write to them."""
        if not self.as_computed:
            raise RuntimeError(f"a {self.format.name} KV cache is read through read(), not its pools")
        return self._pools[layer]

    def native_pools(self, layer: int) -> dict[str, KVPool]:
        """The layer's whole pools in their stored format, for the native attention (kernels.decode_attention,
        kernels.decode_layer), which reads and writes them in place."""
        return {name: self.format.native(pools) for name, pools in self._stored[layer].items()}

    def read(self, layer: int, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each entry at `slots` [C] as [C, *shape]: a view of the pool when the slots run
        consecutively (do not write to it), else a gathered copy."""
        return {name: t.movedim(self._slot_dims[name], 0) for name, t in self.read_pooled(layer, slots).items()}

    def read_pooled(self, layer: int, slots: torch.Tensor, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """`read` in the pool's layout: an entry of shape [G, D] comes as [G, C, D] (in `dtype`, default the cache's)."""
        start = self._run_start(slots)  # as computed and consecutive: views of the pool, no copy
        return {name: self.format.read(pools, self._slot_dims[name], slots, start, dtype or self.dtype)
                for name, pools in self._stored[layer].items()}

    def _run_start(self, slots: torch.Tensor) -> int | None:
        hit = self._runs.get(id(slots))
        if hit is not None and hit[0] is slots:
            return hit[1]
        if len(self._runs) >= 16:
            self._runs.clear()
        start = _run_start(slots)
        self._runs[id(slots)] = (slots, start)
        return start


def _run_start(slots: torch.Tensor) -> int | None:
    """slots[0] when `slots` are consecutive ascending CPU slots (a view can stand for them), else None.

    Checked on the CPU only: on an accelerator the gather is cheap and the check would sync.
    """
    n = slots.numel()
    if n == 0 or slots.device.type != "cpu":
        return None
    first = int(slots[0])
    if n == 1:
        return first
    if int(slots[-1]) - first != n - 1 or not bool((slots[1:] - slots[:-1] == 1).all()):
        return None
    return first
