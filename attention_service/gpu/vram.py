"""How much GPU memory the attention service needs for a model, from its hyper-parameters alone.

Off the CPU every non-expert weight is dense (weight_loader.py: quantized linears are the CPU's
fast mode only): linear weights, the token embedding, the output head and MLA's per-head maps in
the model dtype; norms, router, biases and sinks in float32. The routed experts stay on the expert
services' CPUs and cost no GPU memory. Add the paged KV cache (kv_cache.py), an eager step's
activations (the workspace) and the decode step's (kept in the CUDA graphs' pool), and that is what
a card must hold, known before one is bought: `splitmoe vram` prints it for a GGUF file or for the
shapes users ask about (`SHAPES`); `python -m splitmoe.attention_service.gpu.vram` prints the table.

Not counted: the CUDA context (a few hundred MiB outside torch's allocator), the allocator's
fragmentation, the experts of layers kept on the attention side (`--local-experts`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitmoe.attention_service.model.attention import SCORES_PER_CHUNK
from splitmoe.attention_service.model.device_attention import CONTEXT_CHUNK_TOKENS
from splitmoe.modelfile.architectures import arch_spec, deepseek2, gpt_oss, qwen3moe
from splitmoe.modelfile.architectures.base import (
    ATTENTION_MLA,
    SHARED_EXPERT_GATED,
    SHARED_EXPERT_NONE,
    ArchSpec,
    QkNorm,
)
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.hparams import GATING_SIGMOID, GATING_SOFTMAX, GATING_SOFTMAX_WEIGHT, ModelConfig, RopeScaling

F32_BYTES = 4  # norms, router, biases, sinks; the residual stream and logits
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class OptionalTensors:
    """The non-expert tensors a file may have or lack that neither its hyper-parameters nor its
    ArchSpec decide (weights.py and attention.py load each where the file has it), and the FFN
    widths a file may leave to its tensors' shapes."""

    output_head: bool = True  # False: tied embeddings, the output head is the embedding itself
    rope_freqs: bool = False  # llama3-style per-pair divisors (Llama 4)
    qkv_bias: bool = False  # where the ArchSpec does not require them
    attn_output_bias: bool = False  # gpt-oss
    qk_norm: bool = True  # where the ArchSpec's q/k norm is optional (GLM-4.5-Air lacks it)
    router_bias: bool = False  # gpt-oss
    selection_bias: bool = False  # DeepSeek-V3, GLM-4.5: `exp_probs_b`
    dense_ffn: int = 0  # dense FFN width where the hyper-parameters state none: the file's gate rows
    shared_expert_ffn: int = 0  # the same for the shared expert

    @classmethod
    def of_file(cls, g: GGUFFile, cfg: ModelConfig) -> OptionalTensors:
        """Read off the tensor names (every layer is assumed to have what the first of its kind has)."""
        moe = [i for i in range(cfg.num_layers) if is_moe_layer(cfg, i)]
        dense = [i for i in range(cfg.num_layers) if not is_moe_layer(cfg, i)]
        attn, router = "blk.0.", f"blk.{moe[0] if moe else 0}."
        return cls(
            output_head=g.has("output.weight"), rope_freqs=g.has("rope_freqs.weight"),
            qkv_bias=g.has(attn + "attn_q.bias"), attn_output_bias=g.has(attn + "attn_output.bias"),
            qk_norm=g.has(attn + "attn_q_norm.weight"), router_bias=g.has(router + "ffn_gate_inp.bias"),
            selection_bias=g.has(router + "exp_probs_b.bias"),
            dense_ffn=_gate_rows(g, f"blk.{dense[0]}.ffn_gate.weight") if dense and not cfg.dense_ffn else 0,
            shared_expert_ffn=_gate_rows(g, router + "ffn_gate_shexp.weight")
            if moe and not cfg.shared_expert_ffn else 0,
        )


def _gate_rows(g: GGUFFile, name: str) -> int:
    return g.tensor(name).shape[0] if g.has(name) else 0


@dataclass(frozen=True, slots=True)
class ServingSizes:
    """What the service is started with that sizes its memory (serve-attention's defaults)."""

    dtype: torch.dtype = torch.bfloat16  # the weights' (and, unless kv_dtype, the KV cache's)
    kv_cache_tokens: int = 16384
    kv_block_tokens: int = 16
    max_batch_tokens: int = 512
    max_running_seqs: int = 64
    kv_dtype: torch.dtype | None = None
    # Blocks the cache has beyond kv_cache_tokens: on a GPU the static decode's padded rows write
    # into one that no sequence gets (runner.py).
    scratch_kv_blocks: int = 1

    def __post_init__(self) -> None:
        for name in ("kv_cache_tokens", "kv_block_tokens", "max_batch_tokens", "max_running_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)}")
        if self.scratch_kv_blocks < 0:
            raise ValueError(f"scratch_kv_blocks must be >= 0, not {self.scratch_kv_blocks}")

    @property
    def kv_itemsize(self) -> int:
        return (self.kv_dtype or self.dtype).itemsize

    @property
    def kv_slots(self) -> int:
        """The cache's token slots: whole blocks and the scratch ones, as the runner allocates them."""
        num_blocks = -(-self.kv_cache_tokens // self.kv_block_tokens) + self.scratch_kv_blocks
        return num_blocks * self.kv_block_tokens


@dataclass(frozen=True, slots=True)
class VramEstimate:
    weights_bytes: int
    kv_bytes_per_token: int
    kv_slots: int  # kv_cache_tokens rounded up to whole blocks, and the scratch block
    kv_cache_bytes: int
    workspace_bytes: int  # an eager step's activations (`workspace_bytes`)
    graphs_bytes: int  # the static decode step's, held by the CUDA graphs (`graphs_bytes`)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.workspace_bytes + self.graphs_bytes

    def describe(self) -> str:
        """One line for the logs."""
        return (f"GPU memory estimate: weights {format_bytes(self.weights_bytes)} + KV cache "
                f"{format_bytes(self.kv_cache_bytes)} ({self.kv_slots} slots x {format_bytes(self.kv_bytes_per_token)})"
                f" + workspace {format_bytes(self.workspace_bytes)} + graphs {format_bytes(self.graphs_bytes)} = "
                f"{format_bytes(self.total_bytes)} (the CUDA context not counted)")


def estimate(cfg: ModelConfig, spec: ArchSpec, tensors: OptionalTensors = OptionalTensors(),
             sizes: ServingSizes = ServingSizes()) -> VramEstimate:
    per_token = kv_bytes_per_token(cfg, spec, sizes.kv_itemsize)
    return VramEstimate(
        weights_bytes=weights_bytes(cfg, spec, tensors, sizes.dtype.itemsize),
        kv_bytes_per_token=per_token, kv_slots=sizes.kv_slots, kv_cache_bytes=per_token * sizes.kv_slots,
        workspace_bytes=workspace_bytes(cfg, spec, tensors, sizes), graphs_bytes=graphs_bytes(cfg, spec, sizes),
    )


def estimate_file(g: GGUFFile, sizes: ServingSizes = ServingSizes()) -> VramEstimate:
    """The estimate of a GGUF file, from its metadata and tensor names (no tensor data is read)."""
    spec = arch_spec(g.arch, g.path.name)
    cfg = spec.architecture.config(g)
    return estimate(cfg, spec, OptionalTensors.of_file(g, cfg), sizes)


# ---- weights ------------------------------------------------------------------------------------

def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
    """Whether layer i has a router: past the leading dense layers, every `moe_layer_interval`-th."""
    if not cfg.num_experts or i < cfg.num_leading_dense_layers:
        return False
    return not cfg.moe_layer_interval or (i + 1) % cfg.moe_layer_interval == 0


def weights_bytes(cfg: ModelConfig, spec: ArchSpec, tensors: OptionalTensors, itemsize: int) -> int:
    """Every tensor weights.py loads onto a GPU, `itemsize` bytes per element where the model dtype."""
    D, V = cfg.hidden_size, cfg.vocab_size
    num_moe = sum(is_moe_layer(cfg, i) for i in range(cfg.num_layers))
    num_dense = cfg.num_layers - num_moe
    total = V * D * itemsize * (1 + tensors.output_head)  # embedding (and the output head)
    total += (D + tensors.rope_freqs * cfg.rope_dims // 2) * F32_BYTES  # output norm, rope_freqs
    total += cfg.num_layers * (_attention_bytes(cfg, spec, tensors, itemsize) + 2 * D * F32_BYTES)  # + 2 norms
    if num_dense:
        total += num_dense * 3 * _width(cfg.dense_ffn, tensors.dense_ffn, "dense FFN") * D * itemsize
    return total + num_moe * _moe_bytes(cfg, spec, tensors, itemsize)


def _width(stated: int, from_tensors: int, what: str) -> int:
    if not (stated or from_tensors):
        raise ValueError(f"the {what} width is stated neither by the hyper-parameters nor by OptionalTensors")
    return stated or from_tensors


def _attention_bytes(cfg: ModelConfig, spec: ArchSpec, tensors: OptionalTensors, itemsize: int) -> int:
    if spec.attention == ATTENTION_MLA:
        return _mla_bytes(cfg, itemsize)
    D, H, G, K, Vh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.value_head_dim
    linears = (H * K + G * K + G * Vh) * D + D * H * Vh  # q, k, v, output
    f32 = (H * K + G * K + G * Vh) * (spec.qkv_bias or tensors.qkv_bias) + D * tensors.attn_output_bias
    if spec.qk_norm != QkNorm.NONE and (tensors.qk_norm or not spec.qk_norm_optional):
        f32 += H * K + G * K if spec.qk_norm == QkNorm.FULL else 2 * K
    f32 += H * spec.attention_sinks
    return linears * itemsize + f32 * F32_BYTES


def _mla_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """mla.py's weights: q (through the q LoRA where the file has one), kv_a, the per-head k_b and
    v_b maps (dense in the model dtype), output; the LoRA norms float32."""
    D, H, L, R = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.rope_dims
    K, Vh, Q = cfg.mla_key_head_dim, cfg.mla_value_head_dim, cfg.q_lora_rank
    q = Q * D + H * K * Q if Q else H * K * D
    dense = q + (L + R) * D + H * L * (K - R) + H * Vh * L + D * H * Vh
    return dense * itemsize + (L + Q) * F32_BYTES


def _moe_bytes(cfg: ModelConfig, spec: ArchSpec, tensors: OptionalTensors, itemsize: int) -> int:
    """A MoE layer's attention-side part: router (float32, biases), shared expert (and its gate)."""
    D, E = cfg.hidden_size, cfg.num_experts
    f32 = E * D + E * (tensors.router_bias + tensors.selection_bias) + D * (spec.shared_expert == SHARED_EXPERT_GATED)
    shared = 0
    if spec.shared_expert != SHARED_EXPERT_NONE:
        shared = 3 * _width(cfg.shared_expert_ffn, tensors.shared_expert_ffn, "shared expert") * D * itemsize
    return f32 * F32_BYTES + shared


# ---- KV cache, workspace, graphs ----------------------------------------------------------------

def kv_entry_elems(cfg: ModelConfig, spec: ArchSpec) -> int:
    """Elements one token keeps per layer: k and v of every kv head, or MLA's latent and rope key.
    Sliding-window layers (gpt-oss) keep every position too: the window is a mask when reading."""
    if spec.attention == ATTENTION_MLA:
        return cfg.kv_lora_rank + cfg.rope_dims
    return cfg.num_kv_heads * (cfg.head_dim + cfg.value_head_dim)


def kv_bytes_per_token(cfg: ModelConfig, spec: ArchSpec, kv_itemsize: int) -> int:
    return kv_entry_elems(cfg, spec) * kv_itemsize * cfg.num_layers


def workspace_bytes(cfg: ModelConfig, spec: ArchSpec, tensors: OptionalTensors, sizes: ServingSizes) -> int:
    """A bound on an eager step's live activations, the step of `max_batch_tokens` T prompt tokens
    (float32 where not said: the residual stream and attention are):

    * the residual stream: x, the next x and the normed input, 3 x T x hidden;
    * the widest intermediate of a layer, T x (q, k, v and attention output side by side; MLA's
      query, absorbed query, latent and value outputs; or an FFN's gate, up and product);
    * attention scores and probabilities of one chunk (attention.py SCORES_PER_CHUNK);
    * one sequence's context read from the cache, in its dtype and as float32 (the longest context
      the cache or the model allows);
    * the logits of a row per running sequence, in the model dtype and as float32.
    """
    T = sizes.max_batch_tokens
    residual = 3 * T * cfg.hidden_size
    widest = T * max(_attention_width(cfg, spec), 2 * cfg.num_experts, 3 * _ffn_width(cfg, tensors))
    scores = 2 * SCORES_PER_CHUNK
    context_tokens = min(sizes.kv_cache_tokens, cfg.context_tokens)
    context_bytes = context_tokens * kv_entry_elems(cfg, spec) * (sizes.kv_itemsize + F32_BYTES)
    logits_bytes = min(T, sizes.max_running_seqs) * cfg.vocab_size * (sizes.dtype.itemsize + F32_BYTES)
    return (residual + widest + scores) * F32_BYTES + context_bytes + logits_bytes


def graphs_bytes(cfg: ModelConfig, spec: ArchSpec, sizes: ServingSizes) -> int:
    """A bound on the static decode's memory (model/static_decode.py, gpu/graphs.py), which CUDA
    graphs keep in their own pool, beside the eager steps' workspace, for R = min(max_running_seqs,
    max_batch_tokens) rows:

    * attention (model/device_attention.py): every row's context gathered from the cache at one
      padded width C (the next power of two of the longest context, at most the cache's), read
      CONTEXT_CHUNK_TOKENS positions at a time: one chunk of every row's context in the cache's
      dtype and as float32, and its scores and probabilities [heads, R, chunk];
    * each row bucket's float32 logits buffer (buckets 1, 2, 4, ... R: at most 2R rows in all).
    """
    rows = min(sizes.max_running_seqs, sizes.max_batch_tokens)
    capacity = -(-sizes.kv_cache_tokens // sizes.kv_block_tokens) * sizes.kv_block_tokens
    width = min(capacity, 1 << (min(capacity, cfg.context_tokens) - 1).bit_length(), CONTEXT_CHUNK_TOKENS)
    gathered = rows * width * kv_entry_elems(cfg, spec) * (sizes.kv_itemsize + F32_BYTES)
    scores = 2 * cfg.num_heads * rows * width * F32_BYTES
    return gathered + scores + 2 * rows * cfg.vocab_size * F32_BYTES


def _attention_width(cfg: ModelConfig, spec: ArchSpec) -> int:
    H = cfg.num_heads
    if spec.attention == ATTENTION_MLA:
        L, R = cfg.kv_lora_rank, cfg.rope_dims
        return H * cfg.mla_key_head_dim + H * (L + R) + H * L + H * cfg.mla_value_head_dim + L + R
    G, K, Vh = cfg.num_kv_heads, cfg.head_dim, cfg.value_head_dim
    return H * K + G * K + G * Vh + H * Vh


def _ffn_width(cfg: ModelConfig, tensors: OptionalTensors) -> int:
    """The widest dense FFN or shared expert the attention side computes (0: none)."""
    has_dense = any(not is_moe_layer(cfg, i) for i in range(cfg.num_layers))
    dense = cfg.dense_ffn or tensors.dense_ffn if has_dense else 0
    return max(dense, cfg.shared_expert_ffn or tensors.shared_expert_ffn)


# ---- the shapes users ask about -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class NamedShape:
    """A released model's shape, as llama.cpp's converter would write its GGUF (from config.json)."""

    cfg: ModelConfig
    spec: ArchSpec
    tensors: OptionalTensors = field(default_factory=OptionalTensors)

    def estimate(self, sizes: ServingSizes = ServingSizes()) -> VramEstimate:
        return estimate(self.cfg, self.spec, self.tensors, sizes)


def _yarn(factor: float, original_tokens: int, log_multiplier: float = 0.0) -> RopeScaling:
    return RopeScaling("yarn", factor, original_tokens, yarn_log_multiplier=log_multiplier)


# openai/gpt-oss-120b config.json: 36 layers, hidden 2880, 64 heads x 64, 8 kv heads, attention_bias,
# sinks, 128 local experts top-4 of width 2880 (router with bias), vocab 201088, sliding_window 128 on
# alternate layers, rope_theta 150000 with YaRN x32 over 4096, rms_norm_eps 1e-5, untied.
GPT_OSS_120B = NamedShape(
    ModelConfig(arch="gpt-oss", num_layers=36, hidden_size=2880, num_heads=64, num_kv_heads=8, head_dim=64,
                value_head_dim=64, vocab_size=201088, context_tokens=131072, norm_eps=1e-5, rope_theta=150000.0,
                rope_dims=64, rope_scaling=_yarn(32.0, 4096), dense_ffn=2880, num_experts=128, num_experts_used=4,
                expert_ffn=2880, shared_expert_ffn=0, num_leading_dense_layers=0, expert_gating=GATING_SOFTMAX_WEIGHT,
                expert_weights_norm=False, expert_weights_scale=1.0, sliding_window_tokens=128),
    gpt_oss.SPEC, OptionalTensors(attn_output_bias=True, router_bias=True))
# Qwen/Qwen3-235B-A22B config.json: 94 layers, hidden 4096, 64 heads x 128, 4 kv heads, q/k norm, no
# bias, 128 experts top-8 of width 1536 (intermediate_size 12288 is stated, no layer dense:
# mlp_only_layers is empty), vocab 151936, 40960 positions, rope_theta 1e6, rms_norm_eps 1e-6, untied.
QWEN3_235B_A22B = NamedShape(
    ModelConfig(arch="qwen3moe", num_layers=94, hidden_size=4096, num_heads=64, num_kv_heads=4, head_dim=128,
                value_head_dim=128, vocab_size=151936, context_tokens=40960, norm_eps=1e-6, rope_theta=1e6,
                rope_dims=128, rope_scaling=None, dense_ffn=12288, num_experts=128, num_experts_used=8,
                expert_ffn=1536, shared_expert_ffn=0, num_leading_dense_layers=0, expert_gating=GATING_SOFTMAX,
                expert_weights_norm=True, expert_weights_scale=1.0, sliding_window_tokens=0),
    qwen3moe.SPEC)
# deepseek-ai/DeepSeek-V3 config.json: 61 layers (first_k_dense_replace 3 of width 18432), hidden 7168,
# MLA with 128 heads, q_lora 1536, kv_lora 512, qk nope 128 + rope 64, v 128; 256 routed experts top-8
# of width 2048 in 8 groups (4 used) and 1 shared expert, sigmoid with e_score_correction_bias, scale
# 2.5, vocab 129280, 163840 positions, YaRN x40 over 4096 (mscale_all_dim 1), untied. As the converter
# writes MLA: one kv head, key_length 512 + 64, value_length 512. The MTP layer is not counted (skipped).
DEEPSEEK_V3 = NamedShape(
    ModelConfig(arch="deepseek2", num_layers=61, hidden_size=7168, num_heads=128, num_kv_heads=1, head_dim=576,
                value_head_dim=512, vocab_size=129280, context_tokens=163840, norm_eps=1e-6, rope_theta=10000.0,
                rope_dims=64, rope_scaling=_yarn(40.0, 4096, 0.1), dense_ffn=18432, num_experts=256,
                num_experts_used=8, expert_ffn=2048, shared_expert_ffn=2048, num_leading_dense_layers=3,
                expert_gating=GATING_SIGMOID, expert_weights_norm=True, expert_weights_scale=2.5,
                sliding_window_tokens=0, q_lora_rank=1536, kv_lora_rank=512, mla_key_head_dim=192,
                mla_value_head_dim=128, num_expert_groups=8, num_expert_groups_used=4),
    deepseek2.SPEC, OptionalTensors(selection_bias=True))

SHAPES: dict[str, NamedShape] = {"gpt-oss-120b": GPT_OSS_120B, "qwen3-235b-a22b": QWEN3_235B_A22B,
                                 "deepseek-v3": DEEPSEEK_V3}


# ---- the table ----------------------------------------------------------------------------------

def format_bytes(n: int) -> str:
    """GiB from 1 GiB up, then MiB, KiB, bytes: a table's fixture-sized files stay readable."""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if size > 1024 else f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_table(rows: dict[str, VramEstimate], sizes: ServingSizes) -> str:
    """One line per model: weights, KV per token, the whole cache, workspace, graphs and total."""
    columns = ("weights", "KV/token", f"KV x {sizes.kv_cache_tokens}", "workspace", "graphs", "total")
    lines = [f"{'model':<24}" + "".join(f"{c:>13}" for c in columns)]
    for name, e in rows.items():
        values = (e.weights_bytes, e.kv_bytes_per_token, e.kv_cache_bytes, e.workspace_bytes, e.graphs_bytes,
                  e.total_bytes)
        lines.append(f"{name:<24}" + "".join(f"{format_bytes(v):>13}" for v in values))
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table({name: shape.estimate() for name, shape in SHAPES.items()}, ServingSizes()))
