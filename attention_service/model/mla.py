"""Multi-head latent attention (DeepSeek-V2/V3, R1, Kimi-K2) in llama.cpp's absorbed layout.

Per token the KV cache holds only what MLA compresses keys and values into: the RMS-normed KV
latent [kv_lora] and the roped key part every head shares [rope], stored side by side as one
entry. Heads never get expanded K/V: the no-rope query is absorbed through `attn_k_b` into the
latent space, every head attends over the one shared latent (MQA), and the latent result goes
through `attn_v_b` into each head's value space, as llama.cpp's deepseek2 graph computes it.

Shape legend: T tokens, H heads, C context tokens, L kv_lora, R rope dims, N no-rope key dims,
V value dims.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from splitmoe.attention_service.model.attention import use_native_attention
from splitmoe.attention_service.model.batch import StepBatch
from splitmoe.attention_service.model.device_attention import paged_latent_decode_attention
from splitmoe.attention_service.model.kv_cache import KVCache
from splitmoe.attention_service.model.layers import Rope, linear, rms_norm, softmax_scale
from splitmoe.attention_service.model.weight_loader import WeightLoader
from splitmoe.kernels.decode_attention import decode_attention
from splitmoe.kernels.linear import LinearWeight, QuantHeads, QuantLinear
from splitmoe.modelfile.architectures.base import ArchSpec
from splitmoe.modelfile.gguf_file import GGUFError
from splitmoe.modelfile.hparams import ModelConfig, RopeScaling

LATENT_ENTRY = "latent"  # the KV cache entry: [normed latent (L) | roped shared key (R)] per token
# At most this many float32 scores [rows, C] at once: queries are taken in chunks of rows.
SCORES_PER_CHUNK = 1 << 22


@dataclass
class MLAWeights:
    q: LinearWeight  # attn_q_b [H*(N+R), q_lora], or attn_q [H*(N+R), hidden] without q LoRA (V2-Lite)
    kv_a: LinearWeight  # attn_kv_a_mqa [L+R, hidden]
    kv_a_norm: torch.Tensor  # [L] float32
    # The per-head maps, 3-D: dense in the model's dtype, or kept quantized in the fast mode (QuantHeads).
    k_b: torch.Tensor | QuantHeads  # [H, L, N]: per head, the latent -> no-rope key map, transposed
    v_b: torch.Tensor | QuantHeads  # [H, V, L]: per head, the latent -> value map
    out: LinearWeight  # [hidden, H*V]
    q_a: LinearWeight | None = None  # [q_lora, hidden]
    q_a_norm: torch.Tensor | None = None  # [q_lora] float32


def latent_attention(q: torch.Tensor, ctx: torch.Tensor, q_positions: torch.Tensor, scale: float,
                     latent_dims: int) -> torch.Tensor:
    """Causal MQA of absorbed queries over the cached latents, computed in float32.

    q [T, H, L+R] at absolute `q_positions`; ctx [C, L+R] holds positions 0..C-1, and its first
    L dims are also the values. Returns [T, H, L] in q's dtype.
    """
    T, H, _ = q.shape
    C = ctx.shape[0]
    qf, kf = q.float(), ctx.float()
    out = torch.empty(T, H, latent_dims, dtype=torch.float32, device=q.device)
    context = torch.arange(C, device=ctx.device)
    step = max(1, SCORES_PER_CHUNK // max(1, H * C))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        scores = (qf[t0:t1].reshape(-1, qf.shape[-1]) @ kf.T).mul_(scale).view(t1 - t0, H, C)
        future = context[None, :] > q_positions[t0:t1, None]
        probs = torch.softmax(scores.masked_fill_(future[:, None, :], float("-inf")), dim=-1)
        torch.matmul(probs.view(-1, C), kf[:, :latent_dims], out=out[t0:t1].view(-1, latent_dims))
    return out.to(q.dtype)


def per_head(x: torch.Tensor, maps: torch.Tensor | QuantHeads) -> torch.Tensor:
    """x [T, H, k] through each head's own map [H, rows, k] -> [T, H, rows]."""
    if isinstance(maps, QuantHeads):
        return maps(x)
    return torch.einsum("thk,hrk->thr", x.to(maps.dtype), maps)


def _check_config(cfg: ModelConfig, file_name: str) -> None:
    if cfg.kv_lora_rank <= 0 or cfg.mla_key_head_dim <= cfg.rope_dims or cfg.mla_value_head_dim <= 0:
        raise GGUFError(f"{file_name}: MLA needs {cfg.arch}.attention.kv_lora_rank, .key_length_mla (above "
                        f"rope.dimension_count) and .value_length_mla (files from llama.cpp's converter since the "
                        "MLA split have them)")


def yarn_mscales(scaling: RopeScaling | None) -> tuple[float | None, float]:
    """(cos/sin magnitude, or None for Rope's own; softmax-scale factor) of DeepSeek's YaRN.

    DeepSeek scales the attention logits by mscale² with mscale = 0.1·mscale_all_dim·ln(factor) + 1.
    The file keeps mscale_all_dim as `yarn_log_multiplier` = 0.1·mscale_all_dim, and llama.cpp
    takes the config's `mscale` to equal it (true of every DeepSeek/Kimi release), so cos/sin keep
    magnitude mscale/mscale_all_dim = 1. A YaRN file without the key gets plain YaRN's
    1 + 0.1·ln(factor), on cos/sin and (squared) on the logits, as llama.cpp's deepseek2 graph does.
    """
    if scaling is None or scaling.kind != "yarn" or scaling.factor <= 1:
        return None, 1.0
    log_factor = math.log(scaling.factor)
    if scaling.yarn_log_multiplier == 0:
        return None, (1 + 0.1 * log_factor) ** 2
    return 1.0, (1 + scaling.yarn_log_multiplier * log_factor) ** 2


class MultiLatentAttention:
    def __init__(self, cfg: ModelConfig, spec: ArchSpec, device: torch.device, rope_freqs: torch.Tensor | None = None):
        self.cfg, self.spec = cfg, spec
        self.rope_dims = cfg.rope_dims
        self.nope_dims = cfg.mla_key_head_dim - cfg.rope_dims
        magnitude, logit_factor = yarn_mscales(cfg.rope_scaling)
        self.rope = Rope(cfg.rope_dims, cfg.rope_theta, spec.rope_interleaved, cfg.rope_scaling, device=device,
                         magnitude=magnitude, freq_factors=rope_freqs)
        self.scale = softmax_scale(cfg.mla_key_head_dim) * logit_factor

    @staticmethod
    def load_weights(load: WeightLoader, spec: ArchSpec, cfg: ModelConfig, p: str) -> MLAWeights:
        _check_config(cfg, load.g.path.name)
        if load.g.has(p + "attn_kv_b.weight"):
            raise GGUFError(f"{load.g.path.name}: tensor {p}attn_kv_b.weight is the pre-MLA-split layout; "
                            "re-convert with a current llama.cpp convert_hf_to_gguf.py (attn_k_b/attn_v_b)")
        D, H, L, R = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.rope_dims
        K, V, Q = cfg.mla_key_head_dim, cfg.mla_value_head_dim, cfg.q_lora_rank
        q_a = load.linear_optional(p + "attn_q_a.weight", (Q, D))
        return MLAWeights(
            q=load.linear(p + "attn_q_b.weight", (H * K, Q)) if q_a is not None
            else load.linear(p + "attn_q.weight", (H * K, D)),
            kv_a=load.linear(p + "attn_kv_a_mqa.weight", (L + R, D)),
            kv_a_norm=load.norm(p + "attn_kv_a_norm.weight", (L,)),
            k_b=load.heads(p + "attn_k_b.weight", (H, L, K - R)), v_b=load.heads(p + "attn_v_b.weight", (H, V, L)),
            out=load.linear(p + "attn_output.weight", (D, H * V)),
            q_a=q_a, q_a_norm=load.norm(p + "attn_q_a_norm.weight", (Q,)) if q_a is not None else None,
        )

    def kv_entry_shapes(self) -> dict[str, tuple[int, ...]]:
        return {LATENT_ENTRY: (self.cfg.kv_lora_rank + self.rope_dims,)}

    def __call__(self, i: int, w: MLAWeights, h: torch.Tensor, batch: StepBatch,
                 kv: KVCache) -> torch.Tensor:
        """h [T, hidden] -> attention output [T, hidden]; writes this step's latents to the cache."""
        c = self.cfg
        if isinstance(w.kv_a, QuantLinear):
            h = h.float()  # what the quantized routes take: converted once
        q_nope, q_rope = self._query(i, w, h, batch).split([self.nope_dims, self.rope_dims], dim=-1)
        latent, k_rope = linear(h, w.kv_a).split([c.kv_lora_rank, self.rope_dims], dim=-1)
        latent = rms_norm(latent, w.kv_a_norm, c.norm_eps)
        k_rope = self.rope(k_rope[:, None, :], batch.positions)[:, 0]
        kv.write(i, batch.new_slots, **{LATENT_ENTRY: torch.cat((latent, k_rope), dim=-1)})
        # q_nope·(W_k c) = (W_kᵀ q_nope)·c: the query moves into latent space, the cache stays small.
        q_latent = per_head(q_nope, w.k_b).to(w.k_b.dtype)
        q = torch.cat((q_latent, self.rope(q_rope, batch.positions).to(q_latent.dtype)), dim=-1)
        if batch.paged is not None:  # decode on a GPU: every row at once, shapes fixed by the table
            out = paged_latent_decode_attention(q, kv.pools(i)[LATENT_ENTRY], batch.paged.slot_table,
                                                batch.paged.context_lens, batch.positions, self.scale,
                                                c.kv_lora_rank)
            return self._output(i, w, out, batch)
        if use_native_attention(kv):  # prompts too, in tiles, as the other attention kinds
            out = decode_attention(batch.attention_context, q, kv.native_pools(i)[LATENT_ENTRY], None, self.scale,
                                   value_dims=c.kv_lora_rank).to(q.dtype)
            return self._output(i, w, out, batch)
        out = torch.empty(q.shape[0], c.num_heads, c.kv_lora_rank, dtype=q.dtype, device=q.device)
        for s in batch.seqs:
            ctx = kv.read(i, s.context_slots)[LATENT_ENTRY]
            out[s.start : s.end] = latent_attention(q[s.start : s.end], ctx, batch.positions[s.start : s.end],
                                                    self.scale, c.kv_lora_rank)
        return self._output(i, w, out, batch)

    def _output(self, i: int, w: MLAWeights, out: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """[T, hidden] from each head's latent attention sum [T, H, L]."""
        # Σ p·(W_v c) = W_v (Σ p·c): each head's value map applied once, after the attention sum.
        a = per_head(out, w.v_b).flatten(1)
        y = linear(a, w.out)
        return y if batch.lora is None else batch.lora.add(f"blk.{i}.attn_output.weight", a, y)

    def _query(self, i: int, w: MLAWeights, h: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """[T, H, N+R]: through the q LoRA (down, RMSNorm, up) when the file has one."""
        if w.q_a is not None:
            h = rms_norm(linear(h, w.q_a), w.q_a_norm, self.cfg.norm_eps)
        q = linear(h, w.q)
        if batch.lora is not None and w.q_a is None:  # attn_q.weight: no q LoRA (adapters on attn_q_b are refused)
            q = batch.lora.add(f"blk.{i}.attn_q.weight", h, q)
        return q.view(h.shape[0], self.cfg.num_heads, self.cfg.mla_key_head_dim)
