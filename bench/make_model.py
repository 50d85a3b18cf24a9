"""Synthetic GGUFs of real MoE shapes, with random weights, for benchmarks; no llama.cpp needed.

No float weights are ever made and quantized: each quantized tensor is random bytes (valid
nibbles, grid indices, sign bits and sub-block scales) whose block scales are set so that the
dequantized values have std 1/sqrt(fan_in) (token embeddings: 1). Every tensor draws from its own
generator, seeded by (seed, tensor name), so the same seed gives the same bytes. Tensors are
written one at a time: memory stays at one tensor (the largest: one layer's down experts).

Three families of layers: Qwen3/OLMoE (GQA with q/k norms), gpt-oss (GQA with biases, attention
sinks and a sliding window on even layers) and DeepSeek-V3 (MLA in llama.cpp's absorbed layout,
leading dense layers, a shared expert, grouped sigmoid routing).
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGML_QUANT_VERSION,
    ExpertGatingFuncType,
    GGUFWriter,
    LlamaFileType,
    RopeScalingType,
    TokenType,
)
from gguf import GGMLQuantizationType as T

from splitmoe.demo_model import CHATML_TEMPLATE, MERGES, SPECIAL_TOKENS, byte_level_vocab
from splitmoe.kernels import iq_grids
from splitmoe.kernels.decode_layer import QkNorm

# A benchmark file keeps one of the real model's leading dense layers (DeepSeek-V3 has 3), so that
# a file of 2-3 layers is one dense layer followed by MoE layers: what the experts' side measures.
BENCH_DENSE_LAYERS = 1
# Biases (gpt-oss's q/k/v/o, router and expert biases, DeepSeek's selection bias) are small next
# to what they are added to; sinks are logits that join the attention scores (of order 1).
BIAS_STD = 0.02
SINK_STD = 1.0


@dataclass(frozen=True)
class Yarn:
    factor: float
    original_context: int
    # DeepSeek's 0.1 * mscale_all_dim (`rope.scaling.yarn_log_multiplier`); 0: the key is not written.
    log_multiplier: float = 0.0


@dataclass(frozen=True)
class MLA:
    """DeepSeek's multi-head latent attention dims (config.json's q/kv_lora_rank, qk_nope/rope, v)."""

    q_lora: int
    kv_lora: int
    nope_dims: int
    rope_dims: int
    value_dims: int


@dataclass(frozen=True)
class Shape:
    arch: str
    full_layers: int  # the real model's depth; a benchmark model takes only its first --layers
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_used: int
    expert_ffn: int
    dense_ffn: int  # feed_forward_length as the real file states it (the width of leading dense layers)
    vocab: int
    context: int
    rope_theta: float
    norm_eps: float
    qk_norm: QkNorm  # per head (Qwen3), over the whole projection (OLMoE), or none
    tokenizer_pre: str
    leading_dense: int = 0  # the real model's leading dense layers (a file keeps BENCH_DENSE_LAYERS)
    shared_experts: int = 0  # each as wide as a routed one (DeepSeek's expert_shared_count)
    expert_groups: int = 0  # grouped top-k: only the best expert_groups_used groups compete
    expert_groups_used: int = 0
    sigmoid_gating: bool = False  # with a selection bias `exp_probs_b` (DeepSeek-V3)
    expert_weights_norm: bool = False  # the key is written only where true, as the converter does
    expert_weights_scale: float = 0.0  # 0: no key
    biases: bool = False  # q/k/v/o, router and expert biases (gpt-oss)
    sinks: bool = False  # per-head attention sink logits (gpt-oss)
    sliding_window: int = 0  # gpt-oss: on even layers (llama.cpp's swa pattern 2, fixed for the arch)
    ffn_norm: str = "ffn_norm"  # gpt-oss names it post_attention_norm
    rope_scaling: Yarn | None = None
    mla: MLA | None = None


SHAPES = {
    "qwen3-30b-a3b": Shape("qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 768, 6144, 151936, 40960, 1e6, 1e-6,
                           QkNorm.PER_HEAD, "qwen2"),
    # Qwen3-235B-A22B's config.json (94 layers; 12288 is stated though no layer is dense).
    "qwen3-235b-a22b": Shape("qwen3moe", 94, 4096, 64, 4, 128, 128, 8, 1536, 12288, 151936, 40960, 1e6, 1e-6,
                             QkNorm.PER_HEAD, "qwen2"),
    "olmoe-1b-7b": Shape("olmoe", 16, 2048, 16, 16, 128, 64, 8, 1024, 1024, 50304, 4096, 1e4, 1e-5,
                         QkNorm.FULL, "olmo"),
    # openai/gpt-oss-120b's config.json, as llama.cpp's converter writes it (attention/vram.py's
    # GPT_OSS_120B): 64 heads of 64 over a hidden 2880, YaRN x32 over 4096 with betas 32/1.
    "gpt-oss-120b": Shape("gpt-oss", 36, 2880, 64, 8, 64, 128, 4, 2880, 2880, 201088, 131072, 150000.0, 1e-5,
                          QkNorm.NONE, "gpt-4o", biases=True, sinks=True, sliding_window=128,
                          ffn_norm="post_attention_norm", rope_scaling=Yarn(32.0, 4096)),
    # deepseek-ai/DeepSeek-V3's config.json (R1 has the same shape); head_dim is MLA's absorbed key
    # (kv_lora + rope) and one kv head, as the converter writes MLA. The MTP layer is not written.
    "deepseek-v3": Shape("deepseek2", 61, 7168, 128, 1, 576, 256, 8, 2048, 18432, 129280, 163840, 10000.0, 1e-6,
                         QkNorm.NONE, "deepseek-v3", leading_dense=3, shared_experts=1, expert_groups=8,
                         expert_groups_used=4, sigmoid_gating=True, expert_weights_norm=True,
                         expert_weights_scale=2.5, rope_scaling=Yarn(40.0, 4096, 0.1), mla=MLA(1536, 512, 128, 64, 128)),
}
# ud_iq1_s: after Unsloth's DeepSeek-R1-UD-IQ1_S (see `_ud_iq1_s_type`).
QUANTS = {"q4_k_m": LlamaFileType.MOSTLY_Q4_K_M, "q4_0": LlamaFileType.MOSTLY_Q4_0,
          "q8_0": LlamaFileType.MOSTLY_Q8_0, "mxfp4_moe": LlamaFileType.MOSTLY_MXFP4_MOE,
          "ud_iq1_s": LlamaFileType.MOSTLY_IQ1_S}


def bench_shape(name: str, dense_layers: int | None = None, experts: int | None = None) -> Shape:
    """SHAPES[name] as a benchmark file has it: BENCH_DENSE_LAYERS leading dense layers (or
    `dense_layers`) where the real model has some, and optionally fewer routed experts (small test
    files: hidden and FFN widths stay real, so one layer of all experts is gigabytes)."""
    s = SHAPES[name]
    if dense_layers is None:
        dense_layers = min(s.leading_dense, BENCH_DENSE_LAYERS)
    elif dense_layers and not s.leading_dense:
        raise ValueError(f"--dense-layers: {name} has no dense layers (its files have a router in every layer)")
    if dense_layers < 0:
        raise ValueError(f"--dense-layers must be at least 0, got {dense_layers}")
    s = replace(s, leading_dense=dense_layers)
    if experts is None or experts == s.experts:
        return s
    groups_hold = not s.expert_groups or (experts % s.expert_groups == 0 and
                                          experts // s.expert_groups * s.expert_groups_used >= s.experts_used)
    if not s.experts_used <= experts <= s.experts or not groups_hold:
        raise ValueError(f"--experts {experts}: {name} needs {s.experts_used} to {s.experts} experts"
                         + (f", a multiple of its {s.expert_groups} groups leaving {s.experts_used} to choose from"
                            if s.expert_groups else ""))
    return replace(s, experts=experts)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # torch order: [..., rows, fan_in]
    ggml_type: T
    std: float  # of the dequantized values
    mean: float = 0.0  # F32 tensors only (norm weights: 1); quantized blocks are zero-mean

    @property
    def nbytes(self) -> int:
        elems, block_bytes = GGML_QUANT_SIZES[self.ggml_type]
        return int(np.prod(self.shape)) // elems * block_bytes


# ---- which type each tensor gets ----------------------------------------------------------------

def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's llama-quant.cpp: the layers where Q4_K_M spends Q6_K on attn_v and ffn_down."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


@dataclass(frozen=True)
class MixContext:
    """What a mix reads besides the tensor's name: where the layer sits in the file and the model."""

    layer: int
    n_layers: int  # in the file, as llama-quantize run on that file counts them
    first_moe_layer: int
    model_layers: int  # the real model's depth


def _q4_k_m_type(name: str, ndim: int, c: MixContext) -> T:
    if name == "output.weight":
        return T.Q6_K
    if ("attn_v.weight" in name or "ffn_down" in name) and use_more_bits(c.layer, c.n_layers):
        return T.Q6_K
    return T.Q4_K


def _mxfp4_moe_type(name: str, ndim: int, c: MixContext) -> T:
    """llama-quantize MXFP4_MOE: every 3-D weight MXFP4 (DeepSeek's per-head attn_k_b/attn_v_b
    too, as llama.cpp does), all other matrices Q8_0, token embedding and output included."""
    return T.MXFP4 if ndim == 3 else T.Q8_0


def _ud_iq1_s_type(name: str, ndim: int, c: MixContext) -> T:
    """After Unsloth's DeepSeek-R1-UD-IQ1_S (unsloth.ai/blog/deepseekr1-dynamic, Jan 2025): routed
    experts at 1.56 bits (IQ1_S) except down_proj, "a mixture of 2.06/1.56bit" (IQ2_XXS in the
    first layers, IQ1_S after); dense layers, shared experts and MLA attention "4 or 6bit";
    embedding Q4_K and output Q6_K. One step added: the first MoE layer's down_proj is IQ3_XXS, so
    that a 3-layer file (a dense layer, then two MoE layers) holds all three grid formats."""
    if name == "token_embd.weight":
        return T.Q4_K
    if name == "output.weight":
        return T.Q6_K
    if "ffn_gate_exps" in name or "ffn_up_exps" in name:
        return T.IQ1_S
    if "ffn_down_exps" in name:
        if c.layer == c.first_moe_layer:
            return T.IQ3_XXS
        return T.IQ2_XXS if c.layer < c.model_layers // 8 else T.IQ1_S
    if "shexp" in name or "ffn_down" in name:
        return T.Q6_K  # shared experts 6-bit; dense layers' down_proj 6, gate/up 4
    six_bit = ("attn_kv_a_mqa", "attn_k_b", "attn_v_b", "attn_v.", "attn_output")
    return T.Q6_K if any(k in name for k in six_bit) else T.Q4_K


def _uniform_type(quant: T) -> Callable[[str, int, MixContext], T]:
    return lambda name, ndim, c: quant


_MIXES: dict[str, Callable[[str, int, MixContext], T]] = {
    "q4_k_m": _q4_k_m_type, "q4_0": _uniform_type(T.Q4_0), "q8_0": _uniform_type(T.Q8_0),
    "mxfp4_moe": _mxfp4_moe_type, "ud_iq1_s": _ud_iq1_s_type,
}
# llama-quant.cpp's tensor_type_fallback: a type whose blocks do not fit the row (gpt-oss's 2880,
# DeepSeek's 128-wide attn_k_b rows under 256-element K- and I-quant blocks) gives way to this one.
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0, T.IQ1_S: T.IQ4_NL, T.IQ2_XXS: T.IQ4_NL, T.IQ3_XXS: T.IQ4_NL}


def tensor_type(name: str, dims: tuple[int, ...], c: MixContext, quant: str) -> T:
    """As llama-quantize picks (llama_tensor_get_type), fallback included; q4_0/q8_0 are uniform
    (llama.cpp would make `output` Q6_K in q4_0). Vectors, biases and the router stay F32 in every mix."""
    if len(dims) < 2 or not name.endswith(".weight") or "ffn_gate_inp" in name:
        return T.F32
    t = _MIXES[quant](name, len(dims), c)
    if dims[-1] % GGML_QUANT_SIZES[t][0]:
        t = _FALLBACK.get(t, t)
    if dims[-1] % GGML_QUANT_SIZES[t][0]:
        raise ValueError(f"{name}: rows of {dims[-1]} do not split into {t.name} blocks")
    return t


# ---- every tensor of the file -------------------------------------------------------------------

Spec = Callable[..., TensorSpec]  # spec(name, *dims, std=..., mean=...)


def plan(shape: Shape, layers: int, quant: str, vocab: int | None = None, nextn: int = 0) -> list[TensorSpec]:
    """Every tensor of the file, in llama.cpp's order. `shape` as bench_shape gives it: its
    leading_dense is the file's. `nextn`: NextN/MTP blocks after the main layers (GLM-4.5's and
    DeepSeek-V3's multi-token prediction: a MoE layer with `nextn.*` projections and norms)."""
    s, v, d = shape, vocab or shape.vocab, shape.hidden
    specs = [_spec(s, layers, quant, 0)("token_embd.weight", v, d, std=1.0)]
    for i in range(layers):
        spec = _spec(s, layers, quant, i)
        p = f"blk.{i}."
        attention = _mla(s, p, spec) if s.mla else _gqa(s, p, spec)
        ffn = _dense_ffn(s, p, spec) if i < s.leading_dense else _moe(s, p, spec)
        specs += [_norm(spec, p + "attn_norm.weight", d), *attention, _norm(spec, f"{p}{s.ffn_norm}.weight", d), *ffn]
    last = _spec(s, layers, quant, layers - 1)
    specs += [_norm(last, "output_norm.weight", d), last("output.weight", v, d)]
    for i in range(layers, layers + nextn):
        p = f"blk.{i}."
        attention = _mla(s, p, last) if s.mla else _gqa(s, p, last)
        specs += [_norm(last, p + "attn_norm.weight", d), *attention, _norm(last, f"{p}{s.ffn_norm}.weight", d),
                  *_moe(s, p, last), last(p + "nextn.eh_proj.weight", d, 2 * d),
                  *(_norm(last, f"{p}nextn.{name}.weight", d) for name in ("enorm", "hnorm", "shared_head_norm"))]
    return specs


def _spec(s: Shape, layers: int, quant: str, layer: int) -> Spec:
    c = MixContext(layer, layers, s.leading_dense, s.full_layers)

    def spec(name: str, *dims: int, std: float | None = None, mean: float = 0.0) -> TensorSpec:
        return TensorSpec(name, dims, tensor_type(name, dims, c, quant),
                          std if std is not None else 1.0 / np.sqrt(dims[-1]), mean)

    return spec


def _norm(spec: Spec, name: str, width: int) -> TensorSpec:
    return spec(name, width, std=0.1, mean=1.0)


def _gqa(s: Shape, p: str, spec: Spec) -> list[TensorSpec]:
    d, hd = s.hidden, s.head_dim
    q, kv = s.heads * hd, s.kv_heads * hd
    out = []
    for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
        out.append(spec(f"{p}{name}.weight", rows, d))
        if s.biases:
            out.append(spec(f"{p}{name}.bias", rows, std=BIAS_STD))
    if s.qk_norm != QkNorm.NONE:
        q_norm, k_norm = (q, kv) if s.qk_norm == QkNorm.FULL else (hd, hd)
        out += [_norm(spec, p + "attn_q_norm.weight", q_norm), _norm(spec, p + "attn_k_norm.weight", k_norm)]
    out.append(spec(p + "attn_output.weight", d, q))
    if s.biases:
        out.append(spec(p + "attn_output.bias", d, std=BIAS_STD))
    if s.sinks:
        out.append(spec(p + "attn_sinks.weight", s.heads, std=SINK_STD))
    return out


def _mla(s: Shape, p: str, spec: Spec) -> list[TensorSpec]:
    """llama.cpp's absorbed layout: attn_k_b [H, kv_lora, nope] maps the latent to each head's
    no-rope key (stored transposed: its fan-in is kv_lora), attn_v_b [H, v, kv_lora] to its value."""
    m, d, h = s.mla, s.hidden, s.heads
    return [_norm(spec, p + "attn_q_a_norm.weight", m.q_lora), _norm(spec, p + "attn_kv_a_norm.weight", m.kv_lora),
            spec(p + "attn_q_a.weight", m.q_lora, d),
            spec(p + "attn_q_b.weight", h * (m.nope_dims + m.rope_dims), m.q_lora),
            spec(p + "attn_kv_a_mqa.weight", m.kv_lora + m.rope_dims, d),
            spec(p + "attn_k_b.weight", h, m.kv_lora, m.nope_dims, std=1.0 / np.sqrt(m.kv_lora)),
            spec(p + "attn_v_b.weight", h, m.value_dims, m.kv_lora),
            spec(p + "attn_output.weight", d, h * m.value_dims)]


def _dense_ffn(s: Shape, p: str, spec: Spec) -> list[TensorSpec]:
    d, f = s.hidden, s.dense_ffn
    return [spec(p + "ffn_gate.weight", f, d), spec(p + "ffn_up.weight", f, d), spec(p + "ffn_down.weight", d, f)]


def _moe(s: Shape, p: str, spec: Spec) -> list[TensorSpec]:
    d, e, f = s.hidden, s.experts, s.expert_ffn
    out = [spec(p + "ffn_gate_inp.weight", e, d)]
    if s.biases:
        out.append(spec(p + "ffn_gate_inp.bias", e, std=BIAS_STD))
    if s.sigmoid_gating:
        out.append(spec(p + "exp_probs_b.bias", e, std=BIAS_STD))
    for name, rows, fan_in in (("gate", f, d), ("up", f, d), ("down", d, f)):
        out.append(spec(f"{p}ffn_{name}_exps.weight", e, rows, fan_in))
        if s.biases:
            out.append(spec(f"{p}ffn_{name}_exps.bias", e, rows, std=BIAS_STD))
    if s.shared_experts:
        w = s.shared_experts * f
        out += [spec(p + "ffn_gate_shexp.weight", w, d), spec(p + "ffn_up_shexp.weight", w, d),
                spec(p + "ffn_down_shexp.weight", d, w)]
    return out


# ---- random valid blocks ------------------------------------------------------------------------
# Each maker takes random bytes [n_blocks, block_bytes], overwrites the fields that need structure
# (scales, sub-block scales) in place, and knows E[x^2] / d^2 of what it makes, so the block scale
# d can be chosen for the wanted std. Quant bits, grid indices and signs stay uniformly random.

def _f16_bytes(x: float) -> np.ndarray:
    return np.array([x], dtype=np.float16).view(np.uint8)


def _signed_scale(blocks: np.ndarray, d: float) -> None:
    """fp16 d at bytes 0-1, its sign random (kept from the random sign bit): zero-mean blocks."""
    lo, hi = _f16_bytes(d)
    blocks[:, 0] = lo
    blocks[:, 1] = (blocks[:, 1] & 0x80) | hi


def _q4_k_scales(sc: np.ndarray) -> np.ndarray:
    """Each sub-block's min, as close to sc * 7.5 / 8 (the mean nibble, with dmin = 8 d) as 6 bits go."""
    return ((sc.astype(np.uint16) * 15 + 8) // 16).astype(np.uint8)


def _q4_k_ms() -> float:
    sc = np.arange(32, 64, dtype=np.float64)[:, None]
    q = np.arange(16, dtype=np.float64)[None, :]
    return float(np.mean((sc * q - 8 * _q4_k_scales(sc.astype(np.uint8)).astype(np.float64)) ** 2))


def _fill_q4_k(blocks: np.ndarray, d: float) -> None:
    # Layout: d, dmin (fp16), 12 bytes of 8 (scale, min) 6-bit pairs, 128 bytes of nibbles.
    sc = 32 | (blocks[:, 4:12] & 31)  # 32..63, as a real block's scales mostly sit near the top
    m = _q4_k_scales(sc)
    blocks[:, 0:2] = _f16_bytes(d)
    blocks[:, 2:4] = _f16_bytes(8 * d)
    blocks[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    blocks[:, 8:12] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    blocks[:, 12:16] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)


def _fill_q6_k(blocks: np.ndarray, d: float) -> None:
    # Layout: 128 bytes low nibbles, 64 bytes high crumbs, 16 int8 scales, fp16 d.
    raw = blocks[:, 192:208]
    mag = (64 | (raw & 63)).astype(np.int16)  # |scale| in 64..127, sign random: zero mean
    blocks[:, 192:208] = np.where(raw & 128, -mag, mag).astype(np.int8).view(np.uint8)
    blocks[:, 208:210] = _f16_bytes(d)


def _fill_mxfp4(blocks: np.ndarray, d: float) -> None:
    """Byte 0 is the shared scale 2**(e - 127), a power of two: each block takes the one below d
    or the one above, the latter with the probability that makes E[scale^2] = d^2."""
    k = int(np.floor(np.log2(d)))
    p_above = (4.0 ** (np.log2(d) - k) - 1) / 3
    above = blocks[:, 0] < round(p_above * 256)  # the random byte it replaces decides
    blocks[:, 0] = 127 + k + above


# IQ1_S: d, 32 low index bytes, 8 uint16 of (4 3-bit index tops, a 3-bit scale s, the delta's sign):
# values d (2s + 1) (grid + -1/8). Setting bit 14 keeps s in 4..7. IQ2_XXS / IQ3_XXS: d, then per 32
# values a uint32 whose top nibble is s (values d (0.5 + s) mult grid sign); setting its top bit
# keeps s in 8..15. The byte holding that bit, per block: [first, stop, step].
_IQ_SCALE_BYTE = {T.IQ1_S: (35, 50, 2, 0x40), T.IQ2_XXS: (9, 66, 8, 0x80), T.IQ3_XXS: (69, 98, 4, 0x80)}


def _fill_iq(ggml_type: T) -> Callable[[np.ndarray, float], None]:
    first, stop, step, bit = _IQ_SCALE_BYTE[ggml_type]

    def fill(blocks: np.ndarray, d: float) -> None:
        blocks[:, first:stop:step] |= bit
        blocks[:, 0:2] = _f16_bytes(d)  # positive as a real block's: the grid and signs are symmetric

    return fill


def _grid_ms(name: str) -> float:
    """E[g^2] over a grid's entries, each index equally likely."""
    return float((iq_grids.grid(name).double() ** 2).mean())


def _iq_ms(scale_factors: np.ndarray, mult: float, grid: str, delta: float = 0.0) -> float:
    return float(np.mean(scale_factors ** 2)) * mult ** 2 * (_grid_ms(grid) + delta ** 2)


def _mean_square(values) -> float:
    return float(np.mean(np.asarray(values, dtype=np.float64) ** 2))


_Q6_K_SCALE_MS = _mean_square(np.arange(64, 128))
_E2M1 = (0, 0.5, 1, 1.5, 2, 3, 4, 6)
# ggml type -> (fill, E[x^2] / d^2 of the values it makes)
_BLOCKS = {
    T.Q4_0: (_signed_scale, _mean_square(np.arange(16) - 8.0)),
    T.Q5_0: (_signed_scale, _mean_square(np.arange(32) - 16.0)),
    T.Q8_0: (_signed_scale, _mean_square(np.arange(-128, 128))),
    T.IQ4_NL: (_signed_scale, _mean_square(iq_grids.KVALUES_IQ4NL)),
    T.Q4_K: (_fill_q4_k, _q4_k_ms()),
    T.Q6_K: (_fill_q6_k, _Q6_K_SCALE_MS * _mean_square(np.arange(64) - 32.0)),
    T.MXFP4: (_fill_mxfp4, _mean_square(_E2M1)),
    T.IQ1_S: (_fill_iq(T.IQ1_S), _iq_ms(2 * np.arange(4, 8.0) + 1, 1.0, "iq1s", delta=0.125)),
    T.IQ2_XXS: (_fill_iq(T.IQ2_XXS), _iq_ms(np.arange(8, 16.0) + 0.5, 0.25, "iq2xxs")),
    T.IQ3_XXS: (_fill_iq(T.IQ3_XXS), _iq_ms(np.arange(8, 16.0) + 0.5, 0.5, "iq3xxs")),
}


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode())])))


def make_tensor(spec: TensorSpec, seed: int) -> np.ndarray:
    """The tensor's bytes as the file stores them: uint8 [..., rows, row_bytes] (F32 as float32)."""
    rng = tensor_rng(seed, spec.name)
    if spec.ggml_type == T.F32:
        return (spec.mean + spec.std * rng.standard_normal(spec.shape)).astype(np.float32)
    elems, block_bytes = GGML_QUANT_SIZES[spec.ggml_type]
    n_blocks = int(np.prod(spec.shape)) // elems
    raw = rng.bit_generator.random_raw(-(-n_blocks * block_bytes // 8)).view(np.uint8)
    blocks = raw[: n_blocks * block_bytes].reshape(n_blocks, block_bytes)
    fill, mean_square = _BLOCKS[spec.ggml_type]
    fill(blocks, spec.std / np.sqrt(mean_square))
    return blocks.reshape(*spec.shape[:-1], spec.shape[-1] // elems * block_bytes)


# ---- the file -----------------------------------------------------------------------------------

def placeholder_vocab(vocab: int) -> tuple[list[str], list[int]]:
    """Byte-level tokens, a few merges, unused placeholders up to `vocab`, the specials last."""
    tokens = byte_level_vocab() + [a + b for a, b in MERGES]
    pad = vocab - len(tokens) - len(SPECIAL_TOKENS)
    if pad < 0:
        raise ValueError(f"vocab {vocab} is too small: the tokenizer alone needs {vocab - pad}")
    types = [TokenType.NORMAL] * len(tokens) + [TokenType.UNUSED] * pad + [TokenType.CONTROL] * len(SPECIAL_TOKENS)
    return tokens + [f"[PAD{i}]" for i in range(pad)] + list(SPECIAL_TOKENS), types


def write_model(path: str | os.PathLike, shape: str, layers: int, quant: str = "q4_k_m", seed: int = 0,
                vocab: int | None = None, dense_layers: int | None = None, experts: int | None = None,
                nextn: int = 0) -> Path:
    """Write the model to `path` (via a temporary file beside it, renamed at the end).
    `dense_layers`, `experts`: see bench_shape; `nextn`: see plan."""
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r} (choose from {', '.join(QUANTS)})")
    if not 1 <= layers:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    s = bench_shape(shape, dense_layers, experts)
    s = replace(s, leading_dense=min(s.leading_dense, layers))  # a file's dense layers are within its depth
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    specs = plan(s, layers, quant, vocab, nextn)
    w = GGUFWriter(str(tmp), s.arch)
    _write_metadata(w, s, shape, layers, quant, vocab or s.vocab, nextn)
    _write_tokenizer(w, s, vocab or s.vocab)
    for t in specs:
        is_f32 = t.ggml_type == T.F32
        byte_shape = t.shape if is_f32 else (*t.shape[:-1], t.nbytes // int(np.prod(t.shape[:-1])))
        w.add_tensor_info(t.name, byte_shape, np.dtype(np.float32 if is_f32 else np.uint8), t.nbytes,
                          raw_dtype=None if is_f32 else t.ggml_type)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in specs:
            w.write_tensor_data(make_tensor(t, seed))
        w.close()
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _describe(s: Shape, shape: str, layers: int, quant: str) -> str:
    real = SHAPES[shape]
    changed = [f"{s.leading_dense} dense"] if real.leading_dense else []
    if s.experts != real.experts:
        changed.append(f"{s.experts}/{real.experts} experts")
    extra = f" ({', '.join(changed)})" if changed else ""
    return f"SplitMoE bench {shape} {layers}/{s.full_layers} layers{extra} {quant} (random weights)"


def _write_metadata(w: GGUFWriter, s: Shape, shape: str, layers: int, quant: str, vocab: int, nextn: int = 0) -> None:
    w.add_name(_describe(s, shape, layers, quant))
    w.add_file_type(QUANTS[quant])
    w.add_quantization_version(GGML_QUANT_VERSION)
    m = s.mla
    key, value = (m.kv_lora + m.rope_dims, m.kv_lora) if m else (s.head_dim, s.head_dim)
    if nextn:
        w.add_nextn_predict_layers(nextn)
    for add, value_ in ((w.add_block_count, layers + nextn), (w.add_context_length, s.context),
                        (w.add_embedding_length, s.hidden), (w.add_feed_forward_length, s.dense_ffn),
                        (w.add_head_count, s.heads), (w.add_head_count_kv, s.kv_heads),
                        (w.add_key_length, key), (w.add_value_length, value),
                        (w.add_rope_freq_base, s.rope_theta), (w.add_layer_norm_rms_eps, s.norm_eps),
                        (w.add_expert_count, s.experts), (w.add_expert_used_count, s.experts_used),
                        (w.add_expert_feed_forward_length, s.expert_ffn), (w.add_vocab_size, vocab)):
        add(value_)
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
    if s.rope_scaling:
        _write_yarn(w, s.rope_scaling)
    if m:
        _write_mla(w, s, m)


def _write_yarn(w: GGUFWriter, y: Yarn) -> None:
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(y.factor)
    w.add_rope_scaling_orig_ctx_len(y.original_context)
    w.add_rope_scaling_yarn_beta_fast(32.0)  # both real configs state llama.cpp's defaults
    w.add_rope_scaling_yarn_beta_slow(1.0)
    if y.log_multiplier:
        w.add_rope_scaling_yarn_log_mul(y.log_multiplier)


def _write_mla(w: GGUFWriter, s: Shape, m: MLA) -> None:
    """The rest of the keys llama.cpp's converter writes for DeepSeek-V3 (conversion/deepseek.py)."""
    w.add_leading_dense_block_count(s.leading_dense)
    w.add_q_lora_rank(m.q_lora)
    w.add_kv_lora_rank(m.kv_lora)
    w.add_key_length_mla(m.nope_dims + m.rope_dims)
    w.add_value_length_mla(m.value_dims)
    w.add_rope_dimension_count(m.rope_dims)
    w.add_expert_shared_count(s.shared_experts)
    w.add_expert_group_count(s.expert_groups)
    w.add_expert_group_used_count(s.expert_groups_used)
    if s.sigmoid_gating:
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    if s.expert_weights_scale:
        w.add_expert_weights_scale(s.expert_weights_scale)
    if s.expert_weights_norm:
        w.add_expert_weights_norm(True)


def _write_tokenizer(w: GGUFWriter, s: Shape, vocab: int) -> None:
    tokens, types = placeholder_vocab(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(s.tokenizer_pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
