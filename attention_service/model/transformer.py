"""The decoder stack every supported architecture shares, wired by its ArchSpec.

Per layer: norm -> attention over the paged KV cache -> residual -> norm -> FFN -> residual,
where the FFN is either dense SwiGLU or MoE (router here, routed experts through the
ExpertBackend once per layer, shared expert here).

Micro-batches (MegaScale-Infer's ping-pong): with `micro_batches=2` a step of several sequences
is cut in two by sequence, and the layers interleave so that the attention of one micro-batch
runs while the routed experts of the other are computed remotely:

    attn(mb0, L) submit(mb0, L) | attn(mb1, L) submit(mb1, L) | wait(mb0, L) attn(mb0, L+1) ...

Every row sees the same operations in the same order as unsplit; only the batch sizes of the
matrix products change (see test_micro_batches for what that means for the last bits).
"""
from __future__ import annotations

import torch

from splitmoe.attention_service.expert_backends.backend import ExpertBackend, ExpertsHandle
from splitmoe.attention_service.model.attention import use_native_decode
from splitmoe.attention_service.model.attention_kinds import attention_class
from splitmoe.attention_service.model.batch import StepBatch
from splitmoe.attention_service.model.fused_layers import fused_layers
from splitmoe.attention_service.model.kv_cache import KVCache
from splitmoe.attention_service.model.layers import NORMS, linear, swiglu
from splitmoe.attention_service.model.lora import StepLora
from splitmoe.attention_service.model.routing import limit_experts, route, sums_to_one
from splitmoe.attention_service.model.weights import LayerWeights, ModelWeights
from splitmoe.kernels.linear import single_sequence_step
from splitmoe.modelfile.architectures.base import ArchSpec
from splitmoe.modelfile.hparams import ModelConfig


class _PendingFFN:
    """A MoE FFN whose routed experts are still being computed: `finish()` adds the shared part."""

    __slots__ = ("_handle", "_shared", "_value", "_tokens")

    def __init__(self, handle: ExpertsHandle | None, shared: torch.Tensor | None, value: torch.Tensor | None = None,
                 tokens: int = 0):
        self._handle, self._shared, self._value, self._tokens = handle, shared, value, tokens

    def finish(self) -> torch.Tensor:
        if self._handle is None:
            return self._value
        return FFNStart.finish(self._handle.wait(), self._shared, self._tokens)


def input_weighted(h: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Experts whose router weight scales their input (Llama 4) as plain weighted experts: each
    (token, chosen expert) becomes a row of its own, the token's input times the weight, with weight
    1. Any expert backend, remote ones included, then computes expert(w·x); `per_token` sums each
    token's rows. With Llama 4's one expert per token there is one row per token, as before."""
    T, K = ids.shape
    rows = (h.float()[:, None, :] * weights[..., None].float()).to(h.dtype).reshape(T * K, -1)
    return rows, ids.reshape(T * K, 1), torch.ones(T * K, 1, dtype=weights.dtype, device=weights.device)


def per_token(out: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`input_weighted`'s rows summed back to their tokens (num_tokens 0: rows are tokens already)."""
    if not num_tokens or out.shape[0] == num_tokens:
        return out
    return out.view(num_tokens, -1, out.shape[-1]).sum(dim=1)


class FFNStart:
    """A MoE FFN up to its routed experts: what goes to the expert backend (`hidden`, `ids`,
    `weights`; `tokens`: the rows the answer sums to, 0 when its rows are the tokens). `finish`
    adds the shared expert to the experts' answer. The static decode step keeps these in fixed
    buffers between two segments (model/static_decode.py)."""

    __slots__ = ("hidden", "ids", "weights", "tokens")

    def __init__(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, tokens: int):
        self.hidden, self.ids, self.weights, self.tokens = hidden, ids, weights, tokens

    @staticmethod
    def finish(experts_out: torch.Tensor, shared: torch.Tensor | None, tokens: int) -> torch.Tensor:
        """The FFN's output from the routed experts' float32 sum, exactly as `MoETransformer.ffn` adds."""
        out = per_token(experts_out.float(), tokens)
        return out if shared is None else out + shared


class MoETransformer:
    def __init__(self, cfg: ModelConfig, spec: ArchSpec, weights: ModelWeights, experts: ExpertBackend,
                 micro_batches: int = 1):
        self.cfg, self.spec, self.weights, self.experts = cfg, spec, weights, experts
        self.attention = attention_class(spec)(cfg, spec, weights.token_embedding.device, weights.rope_freqs)
        self.dtype = weights.token_embedding.dtype
        self.norm = NORMS[cfg.norm]
        if micro_batches not in (1, 2):
            raise ValueError(f"micro_batches must be 1 or 2, not {micro_batches}")
        self.micro_batches = micro_batches
        # Micro-batches on a GPU: the backend's send-ahead thread waits for a half's rows and sends
        # them, so that the engine queues the other half's attention meanwhile (gpu/send_ahead.py).
        # On the CPU both halves share the cores: the engine thread sends itself.
        self.send_ahead = weights.output_norm.device.type != "cpu"
        # Per layer, its attention half as one native call (decode steps in the fast mode), made
        # on the first decode step: None until then, [] where some layer cannot take it.
        self._fronts: list | None = None
        self._fronts_kv: KVCache | None = None
        self._fused: list = []  # per layer with a front: its fused call with the experts, or None (fused_layers)
        # The MTP drafter reads every row's final-normed hidden state (model/nextn.py): kept when set.
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None

    def kv_entry_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.attention.kv_entry_shapes()

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        """Float32 logits [len(batch.logits_rows), vocab]."""
        w, eps = self.weights, self.cfg.norm_eps
        single_sequence_step(len(batch.seqs) == 1)  # the attention projections' int8 rows in two terms then
        # The residual stream stays float32 whatever the weights' dtype: in bfloat16 its rounding
        # is what flips near-tied routing decisions.
        x = w.token_embedding[batch.token_ids].float()
        per_token = batch.experts_per_token
        top_k = self.cfg.num_experts_used if per_token is None else int(per_token.max())  # of the whole step
        lora = batch.lora
        parts = batch.split(self.micro_batches) if self.micro_batches > 1 and lora is None else []
        fronts = self._native_fronts(kv) if use_native_decode(batch, kv) and len(parts) <= 1 else []
        front_lora = lora.front if lora is not None and lora.attention_side else None  # deltas inside the call
        if len(parts) > 1:
            x = self._pipelined(x, parts, kv, top_k)
        elif fronts:
            step = self.attention.decode_step(batch)
            x = x.contiguous()
            # Layers whose experts are here too: one native call each (model/fused_layers.py), unless
            # the backend must see every layer call (the benchmark's recorder, while it records).
            fused = self._fused if lora is None and per_token is None and \
                not getattr(self.experts, "must_see_calls", False) else ()
            for i, (layer, front) in enumerate(zip(w.layers, fronts)):
                if fused and fused[i] is not None and x.shape[0] <= fused[i].max_tokens and fused[i](step, x):
                    continue  # x += attention, + routed experts, in place
                h32, logits = front(step, x, front_lora and front_lora(i))  # x += attention, in place
                x += self.ffn(i, layer, h32, batch, top_k, logits)
        else:
            for i, layer in enumerate(w.layers):
                x = x + self.attention(i, layer.attn, self.norm(x, layer.attn_norm, eps).to(self.dtype), batch, kv)
                x = x + self.ffn(i, layer, self.norm(x, layer.ffn_norm, eps), batch, top_k)
        head_lora = lora and lora.of_rows_subset(batch.logits_rows)
        if self.keep_hidden:
            self.last_hidden = self.norm(x, w.output_norm, eps)  # row by row: the same rows as head() norms
            return self._output(self.last_hidden[batch.logits_rows].to(self.dtype), head_lora)
        return self.head(x[batch.logits_rows], head_lora)

    def head(self, x: torch.Tensor, lora: StepLora | None = None) -> torch.Tensor:
        """Float32 logits of residual rows x: the output norm and the output head."""
        w = self.weights
        return self._output(self.norm(x, w.output_norm, self.cfg.norm_eps).to(self.dtype), lora)

    def _output(self, h: torch.Tensor, lora: StepLora | None) -> torch.Tensor:
        logits = linear(h, self.weights.output).float()
        return logits if lora is None else lora.add("output.weight", h, logits)

    def _pipelined(self, x: torch.Tensor, parts: list[tuple[StepBatch, slice]], kv: KVCache,
                   top_k: int) -> torch.Tensor:
        """The layers over micro-batches in turn: a micro-batch's FFN is finished (its experts
        waited for) only when its next attention needs it, after the other's attention ran."""
        w, eps = self.weights, self.cfg.norm_eps
        xs = [x[rows] for _, rows in parts]
        pending: list[_PendingFFN | None] = [None] * len(parts)
        for i, layer in enumerate(w.layers):
            for m, (mb, _) in enumerate(parts):
                if pending[m] is not None:
                    xs[m] = xs[m] + pending[m].finish()
                h = self.norm(xs[m], layer.attn_norm, eps).to(self.dtype)
                xs[m] = xs[m] + self.attention(i, layer.attn, h, mb, kv)
                pending[m] = self._start_ffn(i, layer, self.norm(xs[m], layer.ffn_norm, eps), mb, top_k)
        for m in range(len(parts)):
            xs[m] = xs[m] + pending[m].finish()
        return torch.cat(xs)

    def _native_fronts(self, kv: KVCache) -> list:
        """Every layer's native attention front for this cache, or [] when some layer has none."""
        if self._fronts is None or self._fronts_kv is not kv:
            make = getattr(self.attention, "native_front", None)
            fronts = []
            for i, layer in enumerate(self.weights.layers):
                moe = layer.moe
                front = make(i, layer.attn, layer.attn_norm, layer.ffn_norm, moe and moe.router,
                             moe and moe.router_bias, kv) if make else None
                if front is None:
                    fronts = []
                    break
                fronts.append(front)
            self._fronts, self._fronts_kv = fronts, kv
            self._fused = fused_layers(self.cfg, self.spec, self.weights.layers, fronts, self.experts, self.dtype) \
                if fronts else []
        return self._fronts

    def attention_block(self, i: int, layer: LayerWeights, x: torch.Tensor, batch: StepBatch,
                        kv: KVCache) -> torch.Tensor:
        """x + layer i's attention of the normed x (writes the step's KV)."""
        h = self.norm(x, layer.attn_norm, self.cfg.norm_eps).to(self.dtype)
        return x + self.attention(i, layer.attn, h, batch, kv)

    def ffn_norm(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, layer.ffn_norm, self.cfg.norm_eps)

    def start_ffn(self, layer: LayerWeights, h: torch.Tensor, h32: torch.Tensor, batch: StepBatch, top_k: int,
                  router_logits: torch.Tensor | None = None) -> FFNStart:
        """A MoE layer's FFN up to its routed experts: the router and the experts' inputs.
        h32: the normed input in float32 (the router reads it), h: the same in the model's dtype."""
        ids, weights = self._route(layer, h32, batch, top_k, router_logits)
        hidden, ids, weights = self._expert_inputs(h, ids, weights)
        return FFNStart(hidden, ids, weights, h.shape[0])

    def shared_ffn(self, layer: LayerWeights, h: torch.Tensor, h32: torch.Tensor,
                   lora: tuple[StepLora, str] | None = None) -> torch.Tensor | None:
        """The MoE layer's shared expert (gated where the architecture gates it), float32; None without one."""
        w = layer.moe
        if w.shared is None:
            return None
        shared = swiglu(h, w.shared, lora and (lora[0], lora[1], "_shexp")).float()
        if w.shared_gate is not None:
            shared = shared * torch.sigmoid(linear(h32, w.shared_gate))
        return shared

    def ffn(self, i: int, layer: LayerWeights, h32: torch.Tensor, batch: StepBatch, top_k: int,
             router_logits: torch.Tensor | None = None) -> torch.Tensor:
        """h32: the normed input in float32; the router and gates read it before rounding.
        `router_logits`: the router's product of h32 when the caller computed it already."""
        h = h32.to(self.dtype)
        lora = batch.lora and (batch.lora, f"blk.{i}.")
        if layer.moe is None:
            return swiglu(h, layer.dense_ffn, lora and (*lora, ""))
        start = self.start_ffn(layer, h, h32, batch, top_k, router_logits)
        expert_lora = batch.lora and batch.lora.expert_rows(i)
        if expert_lora and start.hidden.shape[0] != h.shape[0]:  # input-weighted: K rows a token, token-major
            k = start.hidden.shape[0] // h.shape[0]
            expert_lora = [(a, (rows[:, None] * k + torch.arange(k)).flatten()) for a, rows in expert_lora]
        if expert_lora:  # only then: the backends without adapters keep their signature
            routed = self.experts.forward(i, start.hidden, start.ids, start.weights, lora=expert_lora)
        else:
            routed = self.experts.forward(i, start.hidden, start.ids, start.weights)
        return FFNStart.finish(routed, self.shared_ffn(layer, h, h32, lora), start.tokens)

    def _start_ffn(self, i: int, layer: LayerWeights, h32: torch.Tensor, batch: StepBatch,
                   top_k: int) -> _PendingFFN:
        """`_ffn` with the routed experts submitted, not waited for; the shared expert runs meanwhile."""
        h = h32.to(self.dtype)
        if layer.moe is None:
            return _PendingFFN(None, None, swiglu(h, layer.dense_ffn))
        start = self.start_ffn(layer, h, h32, batch, top_k)
        ahead = getattr(self.experts, "submit_ahead", None) if self.send_ahead else None
        handle = (ahead or self.experts.submit)(i, start.hidden, start.ids, start.weights)
        return _PendingFFN(handle, self.shared_ffn(layer, h, h32), tokens=start.tokens)

    def _expert_inputs(self, h: torch.Tensor, ids: torch.Tensor,
                       weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden, ids, weights) as the expert backend takes them."""
        return input_weighted(h, ids, weights) if self.spec.expert_input_weighted else (h, ids, weights)

    def _route(self, layer: LayerWeights, h32: torch.Tensor, batch: StepBatch, top_k: int,
               router_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        w, c = layer.moe, self.cfg
        per_token = batch.experts_per_token
        if router_logits is None:
            router_logits = linear(h32, w.router, w.router_bias)
        ids, weights = route(router_logits, top_k, c.expert_gating,
                             c.expert_weights_norm, c.expert_weights_scale, selection_bias=w.selection_bias,
                             num_groups=c.num_expert_groups, num_groups_used=c.num_expert_groups_used)
        if per_token is not None:
            renormalized = sums_to_one(c.expert_gating, c.expert_weights_norm)
            ids, weights = limit_experts(ids, weights, per_token, renormalized)
        return ids, weights
