"""Tiny qwen3moe models whose GGUF stores chosen tensors in any GGML type, IQ types included.

No converter here makes IQ blocks (gguf-py has no IQ quantizers), and none is needed: random
blocks (random grid indices, signs and sub-scales, with fp16 scales chosen so the weights keep
activations O(1)) are valid weights. gguf-py's dequantizer gives their exact values, which go
into the transformers model, so transformers and the GGUF compute with the same weights.
F16/BF16/Q8_0 tensors are the transformers weights rounded as a converter would store them.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from tests.kernels.test_quants import FP16_FIELDS, iq1_m_d, set_iq1_m_d
from tests.support.hf_reference import build_model
from tests.support.hf_to_gguf import convert, gguf_tensors

TypeChoice = Callable[[str], "T | None"]
"""GGUF tensor name -> the type to store it in; None: as the converter writes it (F32)."""

ROUNDED = (T.F16, T.BF16, T.Q8_0)  # stored by rounding the transformers weights


def scaled_blocks(qtype: T, shape: tuple[int, ...], rng: np.random.Generator, std: float) -> np.ndarray:
    """Random uint8 blocks for a tensor of torch-order `shape` whose values have about `std`.

    Every format is linear in its fp16 scale(s), so they are drawn, the result measured, and the
    scales multiplied by the gain that gives `std`.
    """
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // elems
    blocks = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    scales = rng.uniform(0.5, 1.0, n_blocks) * rng.choice([-1.0, 1.0], n_blocks) * 1e-2
    _set_scales(qtype, blocks, scales)
    gain = std / float(gq.dequantize(blocks, qtype).std())
    _set_scales(qtype, blocks, _scales(qtype, blocks) * gain)
    return blocks.reshape(*shape[:-1], shape[-1] // elems * nbytes)


def _set_scales(qtype: T, blocks: np.ndarray, d: np.ndarray) -> None:
    if qtype == T.IQ1_M:
        set_iq1_m_d(blocks, d)
    for off in FP16_FIELDS[qtype]:
        blocks[:, off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _scales(qtype: T, blocks: np.ndarray) -> np.ndarray:
    """The first fp16 scale of each block (a second one, as Q4_K's dmin, was set equal to it)."""
    if qtype == T.IQ1_M:
        return iq1_m_d(blocks)
    off = FP16_FIELDS[qtype][0]
    return blocks[:, off:off + 2].copy().view(np.float16).astype(np.float32).reshape(-1)


def encode(tensor: torch.Tensor, qtype: T, rng: np.random.Generator) -> tuple[np.ndarray, torch.Tensor]:
    """(the stored data, its exact float32 values) for one tensor stored as `qtype`."""
    data = tensor.numpy().astype(np.float32)
    if qtype in ROUNDED:
        stored = data.astype(np.float16) if qtype == T.F16 else gq.quantize(data, qtype)
    else:
        stored = scaled_blocks(qtype, tuple(data.shape), rng, float(data.std()))
    values = stored.astype(np.float32) if qtype == T.F16 else gq.dequantize(stored, qtype)
    return stored, torch.from_numpy(values.reshape(data.shape))


def quantized_model(config, seed: int, path: Path, choose: TypeChoice) -> torch.nn.Module:
    """Write the GGUF at `path` with each tensor in its chosen type; return the transformers model
    holding exactly the values the GGUF's tensors dequantize to."""
    model = build_model(config, seed)
    rng = np.random.default_rng(seed)
    tensors = gguf_tensors(model)
    raw = {}
    for name, tensor in tensors.items():
        qtype = choose(name)
        if qtype is not None:
            stored, tensors[name] = encode(tensor, qtype, rng)
            raw[name] = (stored, qtype)
    convert(model, path, raw_tensors=raw)
    model.load_state_dict(qwen3moe_state(tensors), strict=True)
    return model


_TOP = {"token_embd": "model.embed_tokens.weight", "output": "lm_head.weight", "output_norm": "model.norm.weight"}
_LAYER = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
          "attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight",
          "attn_v": "self_attn.v_proj.weight", "attn_output": "self_attn.o_proj.weight",
          "attn_q_norm": "self_attn.q_norm.weight", "attn_k_norm": "self_attn.k_norm.weight",
          "ffn_gate_inp": "mlp.gate.weight", "ffn_down_exps": "mlp.experts.down_proj"}


def qwen3moe_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GGUF name -> tensor back to a transformers-5 Qwen3Moe state dict (the converter's inverse:
    qwen3moe permutes nothing, gate and up rows are fused back into gate_up_proj)."""
    state, gate_up = {}, {}
    for name, t in tensors.items():
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
        if m is None:
            state[_TOP[name.removesuffix(".weight")]] = t
        elif m[2] in ("ffn_gate_exps", "ffn_up_exps"):
            gate_up.setdefault(int(m[1]), {})[m[2]] = t
        else:
            state[f"model.layers.{m[1]}.{_LAYER[m[2]]}"] = t
    for layer, parts in gate_up.items():
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat(
            [parts["ffn_gate_exps"], parts["ffn_up_exps"]], dim=1)
    return state


def qwen3moe_config(num_hidden_layers: int):
    """Every matrix's input a multiple of 256, the k-quants' and most IQ types' block."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=300, hidden_size=256, num_hidden_layers=num_hidden_layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                          moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                          rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=256,
                          tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
