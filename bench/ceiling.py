"""The memory-bandwidth ceilings of decode: how fast it could go if reading the routed experts'
weights were all it did.

A decode step must read every expert it routes to at least once; at the machine's read bandwidth
B that bounds the step at bytes/B, so a step producing n tokens caps decode at n * B / bytes.
One stream touches experts_used experts per MoE layer; n streams touch the distinct experts of
their n tokens, which the in-process run counts (`RecordingExperts`), or which, without that run,
is estimated for uniform routing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from splitmoe.modelfile.expert_tensors import expert_count, load_layer_experts, moe_layers
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.hparams import ModelConfig


def read_bandwidth_gb_s(threads: int, buffer_mb: int = 1024, repeats: int = 5) -> float:
    """Best of `repeats` sums over a float32 buffer far larger than any cache, with `threads`
    torch threads: the memory-read bandwidth those threads get (GB/s, 10^9 bytes)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(buffer_mb * (1 << 20) // 4, dtype=torch.float32)  # written: every page is real
        buf.sum()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - start)
        return buf.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(previous)


@dataclass(frozen=True, slots=True)
class ExpertBytes:
    """Bytes of one routed expert (gate + up + down, as stored in the file) per MoE layer."""
    per_expert: dict[int, int]   # MoE layer -> bytes of one of its experts
    experts_used: int            # routed experts per token
    num_experts: int

    @classmethod
    def of(cls, g: GGUFFile) -> "ExpertBytes":
        per_expert = {layer: load_layer_experts(g, layer, [0])[0].num_bytes for layer in moe_layers(g)}
        return cls(per_expert, ModelConfig.from_gguf(g).num_experts_used, expert_count(g))

    @property
    def per_token(self) -> int:
        """One token's routed experts over all MoE layers."""
        return self.experts_used * sum(self.per_expert.values())

    def uniform_estimate_per_step(self, tokens: int) -> float:
        """Expected distinct experts of `tokens` tokens routed uniformly at random, in bytes."""
        distinct = self.num_experts * (1.0 - (1.0 - self.experts_used / self.num_experts) ** tokens)
        return distinct * sum(self.per_expert.values())


def dense_bytes_per_token(g: GGUFFile) -> int:
    """Bytes of every other weight a decode step reads once (attention, norms, routers, shared
    experts, the output head), as stored in the file. The token embedding is a row lookup, unless
    it doubles as the output head (tied). Context for the ceilings, which count only the experts."""
    tied = not g.has("output.weight")
    return sum(g.tensor(n).num_bytes for n in g.tensor_names
               if not _is_routed_expert(n) and (tied or not n.startswith("token_embd.")))


def _is_routed_expert(name: str) -> bool:
    """blk.N.ffn_{gate,up,down}_exps.*, or old Mixtral files' blk.N.ffn_{gate,up,down}.E.weight."""
    parts = name.split(".")
    mixtral = len(parts) == 5 and parts[2] in ("ffn_gate", "ffn_up", "ffn_down") and parts[3].isdigit()
    return "_exps." in name or mixtral


def ceiling_tok_s(bandwidth_gb_s: float, bytes_per_step: float, tokens_per_step: int) -> float:
    return bandwidth_gb_s * 1e9 / bytes_per_step * tokens_per_step


@dataclass
class RecordingExperts:
    """Wraps an ExpertBackend and, while `recording`, notes for every layer call its token count
    and how many distinct experts it routed to; everything else passes through unchanged."""
    inner: object
    recording: bool = False
    calls: list[tuple[int, int, int]] = field(default_factory=list)  # (layer, tokens, distinct experts)

    def forward(self, layer, hidden, expert_ids, expert_weights):
        self._record(layer, hidden, expert_ids)
        return self.inner.forward(layer, hidden, expert_ids, expert_weights)

    def submit(self, layer, hidden, expert_ids, expert_weights):  # the asynchronous form, where backends have it
        self._record(layer, hidden, expert_ids)
        return self.inner.submit(layer, hidden, expert_ids, expert_weights)

    def submit_ahead(self, layer, hidden, expert_ids, expert_weights):  # a GPU's micro-batches
        self._record(layer, hidden, expert_ids)
        return self.inner.submit_ahead(layer, hidden, expert_ids, expert_weights)

    @property
    def must_see_calls(self) -> bool:
        """While recording, every layer call comes here: no decode layer fused with its experts
        (model/fused_layers.py), whose calls would bypass this wrapper."""
        return self.recording

    def _record(self, layer, hidden, expert_ids) -> None:
        if self.recording:
            ids = expert_ids[expert_ids >= 0]  # -1: a dropped slot
            self.calls.append((layer, int(hidden.shape[0]), int(torch.unique(ids).numel())))

    def __getattr__(self, name):  # health, stats, expert_token_counts, close, ...
        if name == "inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def touched_bytes_per_step(self, expert_bytes: ExpertBytes, tokens: int) -> float | None:
        """Mean bytes of distinct experts one step of exactly `tokens` tokens read, summed over
        layers; None when no such step was recorded."""
        by_layer: dict[int, list[int]] = {}
        for layer, n, distinct in self.calls:
            if n == tokens:
                by_layer.setdefault(layer, []).append(distinct)
        if not by_layer:
            return None
        return sum(sum(d) / len(d) * expert_bytes.per_expert[layer] for layer, d in by_layer.items())
