"""The trained demo's GGUF: qwen3moe metadata, its byte-level BPE vocabulary and its weights."""
from __future__ import annotations

import os

from gguf import GGUFWriter

from splitmoe.demo.net import TinyQwen3Moe
from splitmoe.demo_model import add_tensor


def write_trained_gguf(path: str | os.PathLike, model: TinyQwen3Moe, meta: dict, quant: str, name: str,
                       context_tokens: int = 2048) -> None:
    """`quant`: q8_0 quantizes the matrices as llama-quantize would (router and vectors stay F32)."""
    s = model.s
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_name(name)
    w.add_block_count(s.num_layers)
    w.add_context_length(context_tokens)
    w.add_embedding_length(s.hidden_size)
    w.add_feed_forward_length(4 * s.hidden_size)  # no dense FFN layers: required by the format only
    w.add_head_count(s.num_heads)
    w.add_head_count_kv(s.num_kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_expert_count(s.num_experts)
    w.add_expert_used_count(s.num_experts_used)
    w.add_expert_feed_forward_length(s.expert_ffn)
    w.add_vocab_size(s.vocab_size)
    _write_tokenizer(w, meta)
    for tensor_name, array in model.gguf_tensors():
        add_tensor(w, tensor_name, array, quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_tokenizer(w: GGUFWriter, meta: dict) -> None:
    k = "tokenizer.ggml."
    w.add_tokenizer_model(meta[k + "model"])
    w.add_tokenizer_pre(meta[k + "pre"])
    w.add_token_list(meta[k + "tokens"])
    w.add_token_types(meta[k + "token_type"])
    w.add_token_merges(meta[k + "merges"])
    w.add_eos_token_id(meta[k + "eos_token_id"])
    w.add_pad_token_id(meta[k + "padding_token_id"])
    w.add_add_bos_token(meta[k + "add_bos_token"])
    w.add_chat_template(meta["tokenizer.chat_template"])
