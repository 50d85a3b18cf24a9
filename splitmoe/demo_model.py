"""The random-weights demo model: a tiny qwen3moe-layout GGUF, made on first use.

It needs no download and is byte-for-byte reproducible from its seed, so tests and benchmarks can
make it anywhere, in any shape or quantization. Its weights are random: it exercises every code
path but writes gibberish. What `splitmoe up` serves by default is the trained one (splitmoe/demo/),
which reuses this file's vocabulary pieces, chat template and tensor writer.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize

from splitmoe.runtime import settings

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# A few English merges so that BPE has work to do ("Ġ" is the byte-level space).
MERGES = (("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġ", "a"), ("r", "e"), ("o", "n"), ("Ġt", "he"), ("e", "r"),
          ("Ġ", "s"), ("a", "t"), ("Ġ", "w"), ("o", "r"), ("e", "n"), ("Ġ", "c"), ("i", "s"), ("in", "g"))


@dataclass(frozen=True)
class DemoShape:
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_experts: int = 8
    num_experts_used: int = 2
    expert_ffn: int = 32
    context_tokens: int = 2048
    seed: int = 0
    quant: str = "q8_0"  # or "f32"


def demo_model_path(cache_dir: Path | None = None, shape: DemoShape = DemoShape()) -> Path:
    """The demo GGUF, written once into the cache directory."""
    path = (cache_dir or settings.cache_dir()) / f"demo-qwen3moe-s{shape.seed}-{shape.quant}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        write_demo_model(tmp, shape)
        tmp.replace(path)  # atomic: concurrent starters never see half a file
    return path


def byte_level_vocab() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: every byte is one printable token."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_demo_model(path: str | os.PathLike, shape: DemoShape = DemoShape()) -> None:
    rng = np.random.default_rng(shape.seed)
    tokens = byte_level_vocab() + [a + b for a, b in MERGES] + list(SPECIAL_TOKENS)
    w = GGUFWriter(str(path), "qwen3moe")
    _write_metadata(w, shape, len(tokens))
    _write_tokenizer(w, tokens)
    for name, array in _tensors(shape, len(tokens), rng):
        add_tensor(w, name, array, shape.quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_metadata(w: GGUFWriter, s: DemoShape, vocab: int) -> None:
    w.add_name("SplitMoE demo (random weights)")
    w.add_block_count(s.num_layers)
    w.add_context_length(s.context_tokens)
    w.add_embedding_length(s.hidden_size)
    w.add_feed_forward_length(4 * s.hidden_size)
    w.add_head_count(s.num_heads)
    w.add_head_count_kv(s.num_kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(s.num_experts)
    w.add_expert_used_count(s.num_experts_used)
    w.add_expert_feed_forward_length(s.expert_ffn)
    w.add_vocab_size(vocab)


def _write_tokenizer(w: GGUFWriter, tokens: list[str]) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.NORMAL] * (len(tokens) - len(SPECIAL_TOKENS)) + [TokenType.CONTROL] * len(SPECIAL_TOKENS))
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)


def _tensors(s: DemoShape, vocab: int, rng: np.random.Generator):
    def matrix(rows: int, cols: int, *lead: int) -> np.ndarray:
        return (rng.standard_normal((*lead, rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    d, hd, e, f = s.hidden_size, s.head_dim, s.num_experts, s.expert_ffn
    yield "token_embd.weight", rng.standard_normal((vocab, d)).astype(np.float32)
    for i in range(s.num_layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", norm(d)
        yield p + "attn_q.weight", matrix(s.num_heads * hd, d)
        yield p + "attn_k.weight", matrix(s.num_kv_heads * hd, d)
        yield p + "attn_v.weight", matrix(s.num_kv_heads * hd, d)
        yield p + "attn_q_norm.weight", norm(hd)
        yield p + "attn_k_norm.weight", norm(hd)
        yield p + "attn_output.weight", matrix(d, s.num_heads * hd)
        yield p + "ffn_norm.weight", norm(d)
        yield p + "ffn_gate_inp.weight", matrix(e, d)
        yield p + "ffn_gate_exps.weight", matrix(f, d, e)
        yield p + "ffn_up_exps.weight", matrix(f, d, e)
        yield p + "ffn_down_exps.weight", matrix(d, f, e)
    yield "output_norm.weight", norm(d)
    yield "output.weight", matrix(vocab, d)


def add_tensor(w: GGUFWriter, name: str, array: np.ndarray, quant: str) -> None:
    # As llama-quantize does: vectors and the router stay F32.
    if quant == "q8_0" and array.ndim >= 2 and "ffn_gate_inp" not in name:
        w.add_tensor(name, quantize(array, GGMLQuantizationType.Q8_0),
                     raw_dtype=GGMLQuantizationType.Q8_0)
    else:
        w.add_tensor(name, array)
