"""Synthetic GGUFs of real MoE shapes, with random weights, for benchmarks; no llama.cpp needed.

No float weights are ever made and quantized: each quantized tensor is random bytes (valid
nibbles, 6-bit quants and sub-block scales) whose fp16 block scales are set so that the
dequantized values have std 1/sqrt(fan_in) (token embeddings: 1). Every tensor draws from its own
generator, seeded by (seed, tensor name), so the same seed gives the same bytes. Tensors are
written one at a time: memory stays at one tensor (the largest: one layer's down experts).
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGUFWriter, LlamaFileType, TokenType
from gguf import GGMLQuantizationType as T

from splitmoe.demo_model import CHATML_TEMPLATE, MERGES, SPECIAL_TOKENS, byte_level_vocab


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
    dense_ffn: int  # feed_forward_length as the real file states it
    vocab: int
    context: int
    rope_theta: float
    norm_eps: float
    qk_norm_full: bool  # q/k norm over the whole projection (OLMoE) rather than per head (Qwen3)
    tokenizer_pre: str


SHAPES = {
    "qwen3-30b-a3b": Shape("qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 768, 6144, 151936, 40960, 1e6, 1e-6,
                           False, "qwen2"),
    # Qwen3-235B-A22B's config.json (94 layers; 12288 is stated though no layer is dense).
    "qwen3-235b-a22b": Shape("qwen3moe", 94, 4096, 64, 4, 128, 128, 8, 1536, 12288, 151936, 40960, 1e6, 1e-6,
                             False, "qwen2"),
    "olmoe-1b-7b": Shape("olmoe", 16, 2048, 16, 16, 128, 64, 8, 1024, 1024, 50304, 4096, 1e4, 1e-5,
                         True, "olmo"),
}
QUANTS = {"q4_k_m": LlamaFileType.MOSTLY_Q4_K_M, "q4_0": LlamaFileType.MOSTLY_Q4_0,
          "q8_0": LlamaFileType.MOSTLY_Q8_0}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # torch order: [..., rows, fan_in]
    ggml_type: T
    std: float  # of the dequantized values (norm weights: around 1.0)

    @property
    def nbytes(self) -> int:
        elems, block_bytes = GGML_QUANT_SIZES[self.ggml_type]
        return int(np.prod(self.shape)) // elems * block_bytes


# ---- which type each tensor gets ----------------------------------------------------------------

def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's llama-quant.cpp: the layers where Q4_K_M spends Q6_K on attn_v and ffn_down."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_type(name: str, ndim: int, layer: int, n_layers: int, quant: str) -> T:
    """As llama-quantize picks (llama_tensor_get_type) for the shapes here, none of which needs its
    fallback for rows not a multiple of 256; q4_0/q8_0 are uniform (llama.cpp would make `output`
    Q6_K in q4_0). Vectors and the router stay F32 in every mix."""
    if ndim < 2 or "ffn_gate_inp" in name:
        return T.F32
    if quant != "q4_k_m":
        return T.Q4_0 if quant == "q4_0" else T.Q8_0
    if name == "output.weight":
        return T.Q6_K
    if ("attn_v" in name or "ffn_down" in name) and use_more_bits(layer, n_layers):
        return T.Q6_K
    return T.Q4_K


def plan(shape: Shape, layers: int, quant: str, vocab: int | None = None) -> list[TensorSpec]:
    """Every tensor of the file, in llama.cpp's order."""
    s, v = shape, vocab or shape.vocab
    d, hd, e, f = s.hidden, s.head_dim, s.experts, s.expert_ffn
    q_norm, k_norm = (s.heads * hd, s.kv_heads * hd) if s.qk_norm_full else (hd, hd)

    def spec(name: str, *dims: int, layer: int = 0, std: float | None = None) -> TensorSpec:
        t = tensor_type(name, len(dims), layer, layers, quant)
        return TensorSpec(name, dims, t, std if std is not None else 1.0 / np.sqrt(dims[-1]))

    specs = [spec("token_embd.weight", v, d, std=1.0)]
    for i in range(layers):
        p = f"blk.{i}."
        specs += [spec(p + "attn_norm.weight", d, std=1.0),
                  spec(p + "attn_q.weight", s.heads * hd, d, layer=i),
                  spec(p + "attn_k.weight", s.kv_heads * hd, d, layer=i),
                  spec(p + "attn_v.weight", s.kv_heads * hd, d, layer=i),
                  spec(p + "attn_q_norm.weight", q_norm, std=1.0),
                  spec(p + "attn_k_norm.weight", k_norm, std=1.0),
                  spec(p + "attn_output.weight", d, s.heads * hd, layer=i),
                  spec(p + "ffn_norm.weight", d, std=1.0),
                  spec(p + "ffn_gate_inp.weight", e, d, layer=i),
                  spec(p + "ffn_gate_exps.weight", e, f, d, layer=i),
                  spec(p + "ffn_up_exps.weight", e, f, d, layer=i),
                  spec(p + "ffn_down_exps.weight", e, d, f, layer=i)]
    return specs + [spec("output_norm.weight", d, std=1.0), spec("output.weight", v, d)]


# ---- random valid blocks ------------------------------------------------------------------------
# Each maker takes random bytes [n_blocks, block_bytes], overwrites the fields that need structure
# (fp16 scales, sub-block scales) in place, and knows E[x^2] / d^2 of what it makes, so the
# super-block scale d can be chosen for the wanted std. Quant bits stay uniformly random.

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


_Q6_K_SCALE_MS = float(np.mean(np.arange(64, 128, dtype=np.float64) ** 2))
# ggml type -> (fill, E[x^2] / d^2 of the values it makes)
_BLOCKS = {
    T.Q4_0: (_signed_scale, float(np.mean((np.arange(16) - 8.0) ** 2))),
    T.Q8_0: (_signed_scale, float(np.mean(np.arange(-128, 128, dtype=np.float64) ** 2))),
    T.Q4_K: (_fill_q4_k, _q4_k_ms()),
    T.Q6_K: (_fill_q6_k, _Q6_K_SCALE_MS * float(np.mean((np.arange(64) - 32.0) ** 2))),
}


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode())])))


def make_tensor(spec: TensorSpec, seed: int) -> np.ndarray:
    """The tensor's bytes as the file stores them: uint8 [..., rows, row_bytes] (F32 as float32)."""
    rng = tensor_rng(seed, spec.name)
    if spec.ggml_type == T.F32:
        if "ffn_gate_inp" in spec.name:
            return (rng.standard_normal(spec.shape) * spec.std).astype(np.float32)
        return (1.0 + 0.1 * rng.standard_normal(spec.shape)).astype(np.float32)
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
                vocab: int | None = None) -> Path:
    """Write the model to `path` (via a temporary file beside it, renamed at the end)."""
    s = SHAPES[shape]
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r} (choose from {', '.join(QUANTS)})")
    if not 1 <= layers:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    specs = plan(s, layers, quant, vocab)
    w = GGUFWriter(str(tmp), s.arch)
    _write_metadata(w, s, shape, layers, quant, vocab or s.vocab)
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


def _write_metadata(w: GGUFWriter, s: Shape, shape: str, layers: int, quant: str, vocab: int) -> None:
    w.add_name(f"SplitMoE bench {shape} {layers}/{s.full_layers} layers {quant} (random weights)")
    w.add_file_type(QUANTS[quant])
    w.add_quantization_version(GGML_QUANT_VERSION)
    for add, value in ((w.add_block_count, layers), (w.add_context_length, s.context),
                       (w.add_embedding_length, s.hidden), (w.add_feed_forward_length, s.dense_ffn),
                       (w.add_head_count, s.heads), (w.add_head_count_kv, s.kv_heads),
                       (w.add_key_length, s.head_dim), (w.add_value_length, s.head_dim),
                       (w.add_rope_freq_base, s.rope_theta), (w.add_layer_norm_rms_eps, s.norm_eps),
                       (w.add_expert_count, s.experts), (w.add_expert_used_count, s.experts_used),
                       (w.add_expert_feed_forward_length, s.expert_ffn), (w.add_vocab_size, vocab)):
        add(value)


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
