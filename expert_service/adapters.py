"""The LoRA adapters hops name: loaded from this host's files on first use, checked, kept by identity.

A hop names each adapter its rows use by name, path and identity (modelfile/lora_adapter.py
`AdapterRef`): the attention service loaded the file at that path on its host; this service reads
the path on its own, against its own base model, and computes with it only if the file it read has
the same identity (a stale copy, or another file under the same name, would otherwise give wrong
answers silently). Only the routed experts' matrices are kept (kernels/expert_lora.py `by_layer`);
an adapter's attention-side tensors are dropped once read.

The cache is small and least-recently-used: an attention service serves up to --max-loras adapters
at once, and an adapter it unloaded is left here until others push it out (its file is never
re-read while it stays).
"""
from __future__ import annotations

import collections
import threading

import torch

from splitmoe.kernels.expert_lora import ExpertLayerLora, by_layer
from splitmoe.modelfile.gguf_file import GGUFError, GGUFFile
from splitmoe.modelfile.lora_adapter import AdapterRef, load_lora_adapter

MAX_ADAPTERS = 8

HopLora = list[tuple[AdapterRef, torch.Tensor]]
"""The adapters some rows of one hop use, and those rows (int64, numbered as the hop's rows)."""


class AdapterError(ValueError):
    """A hop names an adapter this service cannot apply: the hop fails, naming it (one line)."""


class ExpertAdapters:
    """The adapters' routed-expert tensors by identity, loaded against `base` when a hop first names them."""

    def __init__(self, base: GGUFFile, max_adapters: int = MAX_ADAPTERS):
        self._base = base
        self._max_adapters = max_adapters
        self._loaded: collections.OrderedDict[str, dict[int, ExpertLayerLora]] = collections.OrderedDict()
        # One load at a time: a hop naming a new adapter waits for it (the file is read once),
        # hops of loaded adapters and of the base never take this lock for long.
        self._lock = threading.Lock()

    def for_layer(self, layer: int, lora: HopLora) -> list[tuple[ExpertLayerLora, torch.Tensor]] | None:
        """What `HostedShard.forward` takes for these rows on `layer` (None: no adapter adapts it)."""
        found = []
        for ref, rows in lora:
            layer_lora = self.layers(ref).get(layer)
            if layer_lora is not None and rows.numel():
                found.append((layer_lora, rows))
        return found or None

    def layers(self, ref: AdapterRef) -> dict[int, ExpertLayerLora]:
        """The adapter's routed-expert tensors by layer; AdapterError when its file here cannot be
        read, is not an adapter of this base, or is not the file the attention service read."""
        with self._lock:
            loaded = self._loaded.get(ref.identity)
            if loaded is None:
                loaded = self._load(ref)
                self._loaded[ref.identity] = loaded
                while len(self._loaded) > self._max_adapters:
                    self._loaded.popitem(last=False)
            else:
                self._loaded.move_to_end(ref.identity)
            return loaded

    def _load(self, ref: AdapterRef) -> dict[int, ExpertLayerLora]:
        try:
            adapter = load_lora_adapter(ref.path, self._base, ref.name)
        except (GGUFError, OSError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise AdapterError(f"LoRA adapter {ref.name!r}: cannot load {ref.path} on the expert service: {why}") from None
        if adapter.identity != ref.identity:
            raise AdapterError(f"LoRA adapter {ref.name!r}: {ref.path} on the expert service is {adapter.identity}, "
                               f"the attention service's is {ref.identity}: the two must read the same file")
        try:
            return by_layer(adapter.expert_side(), adapter.ref)
        except ValueError as e:
            raise AdapterError(f"LoRA adapter {ref.name!r}: {ref.path}: {e}") from None
