"""The seam between the attention side's transformer and wherever the routed experts run.

Every backend computes `kernels.moe`'s interface for one MoE layer: hidden [T, D], expert ids
[T, K] and weights [T, K] in, the weighted sum of the routed experts' outputs [T, D] out.
`submit` is the asynchronous form: it sends and returns a handle whose `wait()` gives what
`forward` would have, so two layer calls may be in flight (the transformer's micro-batches).
`InProcessExperts` runs them here; `experts.remote.RemoteExperts` on expert services.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch

from splitmoe.attention_service.expert_backends.heat import ExpertHeat, HeatSnapshot
from splitmoe.attention_service.expert_backends.placement import ServiceShard
from splitmoe.attention_service.gpu.hop_copies import CopiesByDevice
from splitmoe.attention_service.gpu.send_ahead import SendAhead
from splitmoe.kernels import native
from splitmoe.kernels.repack_cache import RepackCache
from splitmoe.modelfile.expert_tensors import ExpertKey, ExpertShard, expert_count, moe_layers
from splitmoe.modelfile.gguf_file import GGUFFile


class ExpertsHandle(Protocol):
    def wait(self) -> torch.Tensor:
        """The submitted layer call's summed expert output [T, D] (or its error, raised)."""
        ...


class ExpertBackend(Protocol):
    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                expert_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, D], expert_ids [T, K], expert_weights [T, K] -> summed expert output [T, D]."""
        ...

    def submit(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
               expert_weights: torch.Tensor) -> ExpertsHandle:
        """`forward`, started. The inputs must stay unchanged until `wait()` returns (a part that
        failed is sent again, to a replica). Up to two submitted calls may be unwaited."""
        ...

    def health(self) -> dict[str, "ServiceHealth"]:
        """Per expert service address; empty when no service is involved."""
        ...

    def stats(self) -> dict[str, "HopStats"]:
        ...

    def expert_token_counts(self) -> dict[ExpertKey, int]:
        ...

    def expert_heat(self) -> "HeatSnapshot":
        """Tokens the router sent each (layer, expert), and their decayed rate (expert_backends/heat.py)."""
        ...

    def placement_view(self) -> dict[ExpertKey, tuple[str, ...]]:
        """Where each (layer, expert) is computed now: service addresses, or ("local",); empty
        when every expert is computed in this process."""
        ...

    def imbalance_meter(self) -> tuple[float, float, int]:
        """(busiest services' routed tokens, mean per service, layer calls measured), summed since
        the last rebalance; zeros without services."""
        ...

    def uncovered_layers(self) -> list[int]:
        """MoE layers some routed expert of which no healthy expert service hosts now."""
        ...

    def device_layers(self) -> frozenset[int]:
        """MoE layers computed entirely on the attention device, with no host wait: the static
        decode runs them inside a segment (model/static_decode.py); empty but with GPU experts."""
        ...

    def device_bytes(self) -> tuple[int, int]:
        """(device bytes of experts kept on the attention device, page-locked host bytes the hops
        hold), for the GPU memory report (gpu/memory.py)."""
        ...

    def close(self) -> None:
        ...


class Ready:
    """A handle whose result is already there: backends that compute on the caller's thread."""

    __slots__ = ("_out",)

    def __init__(self, out: torch.Tensor):
        self._out = out

    def wait(self) -> torch.Tensor:
        return self._out


class InProcessExperts:
    """All routed experts of the file, computed in this process (eagerly: nothing to overlap).

    Attention on a GPU: the layer call's tensors come to the host together and the answer goes
    back asynchronously (gpu/hop_copies.py), as for expert services."""

    # LoRA adapters on routed experts (kernels/expert_lora.py): `forward` takes each adapter's rows
    takes_lora = True

    def __init__(self, g: GGUFFile, repack_cache: RepackCache | None = None, nextn: bool = False):
        """`nextn`: the NextN/MTP layers' experts too (the MTP drafter's, engine/mtp.py)."""
        self.shard = ExpertShard(g, layers=moe_layers(g, nextn=nextn), repack_cache=repack_cache)
        self.heat = ExpertHeat(max(self.shard.layers, default=-1) + 1, expert_count(g))
        self.copies = CopiesByDevice()
        self._ahead = SendAhead()

    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                expert_weights: torch.Tensor, lora: list | None = None) -> torch.Tensor:
        """`lora`: (an adapter's tensors for this layer, its rows) pairs (model/lora.py StepLora.expert_rows)."""
        return self.submit(layer, hidden, expert_ids, expert_weights, lora).wait()

    def submit(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
               expert_weights: torch.Tensor, lora: list | None = None) -> ExpertsHandle:
        compute = self._compute if lora is None else functools.partial(self._compute, lora=lora)
        if hidden.device.type == "cpu":  # the one device check: on a GPU the copies come first
            return compute(layer, hidden, expert_ids, expert_weights)
        return self.copies.submit(compute, layer, hidden, expert_ids, expert_weights)

    def submit_ahead(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                     expert_weights: torch.Tensor) -> ExpertsHandle:
        """`submit` that returns at once: the send-ahead thread computes the experts while the
        GPU queues the other micro-batch (gpu/send_ahead.py)."""
        return self.copies.submit_ahead(self._ahead, self._compute, layer, hidden, expert_ids, expert_weights)

    def _compute(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                 new_output=None, lora: list | None = None) -> Ready:
        """On host tensors (the shard makes its own output tensor: `new_output` is not needed)."""
        if lora is None:
            out = self.shard.forward(layer, hidden, expert_ids, expert_weights)
        else:
            out = self.shard.forward(layer, hidden, expert_ids, expert_weights, lora=lora)
        self.heat.add(layer, expert_ids)
        return Ready(out)

    def local_layer(self, layer: int) -> LocalExperts | None:
        """The layer's experts for a caller that computes them itself, in one native call with its
        attention (model/transformer.py's fused decode layers; kernels/decode_moe_layer.py): where
        every expert of the layer has a native kernel here. That call counts its tokens into this
        backend's heat itself."""
        fast = self.shard.prepare_fast().get(layer)
        moe = fast and fast.native_layer()
        if moe is None or moe.hidden_size is None:
            return None
        return LocalExperts(moe, fast.native_max_tokens, self.heat.counts_row(layer))

    def health(self) -> dict[str, "ServiceHealth"]:
        return {}

    def stats(self) -> dict[str, "HopStats"]:
        return {}

    def expert_token_counts(self) -> dict[ExpertKey, int]:
        tokens = self.heat.snapshot().tokens - self.heat.counted_elsewhere  # what this shard computed
        return {ExpertKey(layer, expert): int(tokens[layer, expert])
                for layer, expert in tokens.nonzero().tolist() if self.shard.holds(ExpertKey(layer, expert))}

    def expert_heat(self) -> HeatSnapshot:
        return self.heat.snapshot()

    def placement_view(self) -> dict[ExpertKey, tuple[str, ...]]:
        return {}

    def imbalance_meter(self) -> tuple[float, float, int]:
        return 0.0, 0.0, 0

    def uncovered_layers(self) -> list[int]:
        return []

    def device_layers(self) -> frozenset[int]:
        return frozenset()

    def device_bytes(self) -> tuple[int, int]:
        return 0, self.copies.host_buffer_bytes()

    def close(self) -> None:
        self._ahead.close()


@dataclass(frozen=True, slots=True)
class LocalExperts:
    """`InProcessExperts.local_layer`'s answer: one layer's native experts, the most tokens one call
    of them may take, and the heat's row its tokens are counted into ([experts] int64)."""
    experts: native.MoELayer
    max_tokens: int
    counts: torch.Tensor


@dataclass(frozen=True, slots=True)
class ServiceHealth:
    healthy: bool
    shard: ServiceShard
    transport: str       # "grpc" | "shm" | "" while disconnected
    last_error: str


@dataclass(frozen=True, slots=True)
class HopStats:
    num_hops: int
    hop_s_total: float       # request sent -> answer received, per hop, summed
    compute_s_total: float   # time inside the service's expert kernels
    sent_bytes: int
    received_bytes: int
    overhead_us_median: float = 0.0  # per hop, over the last 1024: round trip minus compute (and queueing)
    overhead_us_mean: float = 0.0    # per hop, since start
    transport: str = ""              # "grpc" | "shm" | "" while disconnected
