"""The LoRA adapters this service serves beside its base model (`--lora-modules`, vLLM's
/v1/load_lora_adapter): loaded and checked here, named by requests, applied by the model
(model/lora.py) row by row.

A request takes its adapter's weights when it is admitted and keeps them to its end: unloading an
adapter stops new requests from naming it, and the running ones finish on what they hold.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

from splitmoe.attention_service.model.lora import AdapterWeights
from splitmoe.modelfile.gguf_file import GGUFError, GGUFFile
from splitmoe.modelfile.lora_adapter import AdapterRef, load_lora_adapter

log = logging.getLogger(__name__)


class LoraLimit(Exception):
    """--max-loras adapters are loaded already (RESOURCE_EXHAUSTED)."""


class UnknownLora(ValueError):
    """No adapter of that name (NOT_FOUND when unloading, INVALID_ARGUMENT when a request names it)."""


@dataclass(frozen=True, slots=True)
class LoraSettings:
    modules: tuple[tuple[str, str], ...] = ()  # (name, path) loaded at start (--lora-modules NAME=PATH)
    max_loras: int = 4  # adapters loaded at once (vLLM's --max-loras)
    max_lora_rank: int = 64  # the largest rank an adapter's tensor may have (vLLM's --max-lora-rank)

    def __post_init__(self):
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be >= 1")
        names = [n for n, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules: a name given twice ({', '.join(sorted(names))})")
        if len(names) > self.max_loras:
            raise ValueError(f"--lora-modules names {len(names)} adapters, more than --max-loras {self.max_loras}")


def parse_lora_module(text: str) -> tuple[str, str]:
    """NAME=PATH (vLLM's --lora-modules form; its JSON form is not taken)."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules {text!r}: want NAME=PATH")
    return name.strip(), path.strip()


class LoraAdapters:
    """Name -> loaded adapter. `remote_experts`: the routed experts run in a backend that does not
    take adapters (`takes_lora`: GPU hot experts, device experts): an adapter with routed-expert
    tensors is refused there. Expert services take them (each loads the file at the same path)."""

    def __init__(self, base: GGUFFile, base_name: str, settings: LoraSettings, remote_experts: bool = False,
                 prepare_experts: Callable[[AdapterRef], None] | None = None):
        self.base, self.base_name, self.settings = base, base_name, settings
        self.remote_experts = remote_experts
        # The expert services' PrepareLora (expert_backends/remote.py): they load and check the file
        # at load time, so that a service that cannot read it fails the load, not a request.
        self.prepare_experts = prepare_experts
        self._adapters: dict[str, AdapterWeights] = {}
        self._lock = threading.Lock()
        for name, path in settings.modules:
            self.load(name, path)

    def load(self, name: str, path: str) -> AdapterWeights:
        """Load and check the adapter file against the base; ValueError (one line) if it is not one
        for this base, LoraLimit when --max-loras are loaded."""
        if not name or name == self.base_name:
            raise ValueError(f"LoRA adapter name {name!r}: must be set and differ from the base model's name")
        with self._lock:
            if name in self._adapters:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")  # vLLM's words
            if len(self._adapters) >= self.settings.max_loras:
                raise LoraLimit(f"{len(self._adapters)} LoRA adapters are loaded, --max-loras {self.settings.max_loras}: "
                                "unload one first")
        try:
            adapter = load_lora_adapter(path, self.base, name, max_rank=self.settings.max_lora_rank)
        except (GGUFError, OSError) as e:
            raise ValueError(str(e).splitlines()[0] if str(e) else f"{path}: cannot read the adapter") from None
        weights = AdapterWeights.of(adapter)
        if weights.experts and self.remote_experts:
            raise ValueError(f"{path}: adapts routed experts, whose backend here (experts on the GPU) does not apply "
                             "adapters yet (adapters on attention, shared experts and the head work)")
        if weights.experts and self.prepare_experts is not None:
            self.prepare_experts(adapter.ref)
        with self._lock:
            if name in self._adapters:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            if len(self._adapters) >= self.settings.max_loras:
                raise LoraLimit(f"--max-loras {self.settings.max_loras} adapters are loaded: unload one first")
            self._adapters[name] = weights
        log.info("LoRA adapter %s loaded from %s (rank %d, %d attention-side tensors, %d expert layers)",
                 name, path, weights.rank, len(weights.tensors), len(weights.experts))
        return weights

    def unload(self, name: str) -> None:
        with self._lock:
            if self._adapters.pop(name, None) is None:
                raise UnknownLora(f"The lora adapter '{name}' cannot be found.")  # vLLM's words
        log.info("LoRA adapter %s unloaded", name)

    def get(self, name: str) -> AdapterWeights | None:
        """The adapter a request names ("" or the base's name: None, the base model)."""
        if not name or name == self.base_name:
            return None
        with self._lock:
            adapter = self._adapters.get(name)
        if adapter is None:
            raise UnknownLora(f"The model `{name}` does not exist.")
        return adapter

    def listed(self) -> list[AdapterWeights]:
        with self._lock:
            return list(self._adapters.values())
