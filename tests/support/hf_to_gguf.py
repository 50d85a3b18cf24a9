"""Test helper: write a GGUF from an in-memory transformers MoE model as llama.cpp would.

It mirrors `convert_hf_to_gguf.py` (and, for Q8_0, `llama-quantize`) for the architectures the
runtime serves, so tests can make GGUFs of any size and config without llama.cpp:

    Qwen3MoeForCausalLM -> qwen3moe     Qwen2MoeForCausalLM -> qwen2moe
    MixtralForCausalLM  -> llama        OlmoeForCausalLM    -> olmoe
    GptOssForCausalLM   -> gpt-oss        DbrxForCausalLM     -> dbrx
    DeepseekV2ForCausalLM, DeepseekV3ForCausalLM -> deepseek2
    DeepseekForCausalLM (DeepSeek-MoE, a `Checkpoint`: transformers has no class) -> deepseek
    Glm4MoeForCausalLM  -> glm4moe      Llama4ForCausalLM   -> llama4 (hf_to_gguf_glm_llama4.py)

What the converter does, and this helper too (see ../shared/fixtures/README.md):
* tensors keep torch order here; GGUFWriter lists the dims fastest-first;
* experts are stacked into [n_expert, out, in] `ffn_{gate,up,down}_exps` tensors (or, for the
  old Mixtral files, one `ffn_{gate,up,down}.E` tensor per expert);
* Mixtral's q/k rows are permuted from HF's rotate-half order into interleaved pairs;
* DBRX's experts [E·F, H] are viewed per expert, `w2` transposed (HF computes x @ w2 with it);
* only the hyper-parameter keys llama.cpp writes for the architecture are written.

transformers 5 fuses each layer's experts into 3-D `gate_up_proj` / `down_proj` parameters;
transformers 4 kept one nn.Linear per expert. Both state-dict layouts are accepted.
"""
from __future__ import annotations

import json
import re
from os import PathLike
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from tests.support import hf_to_gguf_glm_llama4 as more

F32, Q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0

ARCH_BY_CLASS = {
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "MixtralForCausalLM": "llama",
    "OlmoeForCausalLM": "olmoe",
    "GptOssForCausalLM": "gpt-oss",
    "DeepseekV2ForCausalLM": "deepseek2",
    "DeepseekV3ForCausalLM": "deepseek2",
    "DbrxForCausalLM": "dbrx",
    "DeepseekForCausalLM": "deepseek",
    "Glm4MoeForCausalLM": "glm4moe",  # hf_to_gguf_glm_llama4.py
    "Llama4ForCausalLM": "llama4",
}

_FILE_TYPE = {F32: gguf.LlamaFileType.ALL_F32, Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}


def convert(model: torch.nn.Module, path: str | PathLike, tensor_type: GGMLQuantizationType = F32, *,
            per_expert_tensors: bool = False, tokenizer_from: str | PathLike | None = None,
            raw_tensors: Mapping[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None) -> Path:
    """Write `model` as a GGUF at `path` and return the path.

    tensor_type: F32, or Q8_0 for the matrices (norms, router and other 1-D tensors stay F32).
    per_expert_tensors: the old Mixtral layout, one 2-D tensor per expert (llama arch only).
    tokenizer_from: a GGUF whose `tokenizer.ggml.*` fields are copied; default a byte-level vocab.
    raw_tensors: GGUF name -> (stored data, type) written as given instead of the model's tensor
    (blocks of types no converter here makes, e.g. random IQ blocks: tests/support/quant_model.py).
    """
    arch = arch_of(model)
    if per_expert_tensors and arch != "llama":
        raise ValueError("per-expert tensors exist only in the old Mixtral (llama) layout")
    if tensor_type not in _FILE_TYPE:
        raise ValueError(f"tensor_type must be F32 or Q8_0, not {tensor_type!r}")
    hp = hparams(model.config)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(type(model).__name__)
    _write_hparams(writer, arch, hp)
    writer.add_file_type(_FILE_TYPE[tensor_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tokenizer_from is not None:
        _copy_tokenizer(writer, Path(tokenizer_from))
    else:
        _write_byte_level_tokenizer(writer, int(hp["vocab_size"]))
    for name, tensor in gguf_tensors(model, per_expert_tensors).items():
        data, raw_dtype = (raw_tensors or {}).get(name) or _encode(name, tensor, tensor_type)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


class Checkpoint:
    """A checkpoint directory whose class transformers lacks (DeepSeek-MoE's is remote code), standing
    in for the model where `convert` reads one: its class name, config and state dict."""

    def __init__(self, directory: str | PathLike):
        from safetensors.torch import load_file

        directory = Path(directory)
        config = json.loads((directory / "config.json").read_text())
        self.class_name = config["architectures"][0]
        self.config = SimpleNamespace(to_dict=lambda: dict(config))
        self._state = load_file(directory / "model.safetensors")

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state


def load_checkpoint(directory: str | PathLike) -> torch.nn.Module | Checkpoint:
    """A checkpoint directory's model in float32: transformers', or a `Checkpoint` where it has no class."""
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(directory) / "config.json").read_text())
    if config["architectures"][0] == "DeepseekForCausalLM":
        return Checkpoint(directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def arch_of(model: torch.nn.Module | Checkpoint) -> str:
    name = getattr(model, "class_name", type(model).__name__)
    if name not in ARCH_BY_CLASS:
        raise ValueError(f"{name} is not supported (supported: {', '.join(ARCH_BY_CLASS)})")
    return ARCH_BY_CLASS[name]


def hparams(config) -> dict[str, Any]:
    """The config as llama.cpp reads config.json: a plain dict, with null values treated as absent."""
    return {k: v for k, v in config.to_dict().items() if v is not None}


# ---- metadata --------------------------------------------------------------------------------


def _write_hparams(w: gguf.GGUFWriter, arch: str, hp: dict[str, Any]) -> None:
    if arch == "dbrx":  # its config names its own keys
        _write_dbrx_hparams(w, hp)
        return
    if arch == "deepseek2":
        hp = _deepseek2_view(hp)
    if arch == "deepseek":
        hp = {**hp, "num_experts": hp["n_routed_experts"]}
    if arch in ("glm4moe", "llama4"):
        hp = (more.glm4moe_view if arch == "glm4moe" else more.llama4_view)(hp)
    # TextModel.set_gguf_parameters: the keys every architecture gets.
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp.get("num_key_value_heads", hp["num_attention_heads"]))
    rope = _rope_parameters(hp)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_expert_count(hp.get("num_local_experts", hp.get("num_experts")))
    w.add_expert_used_count(hp["num_experts_per_tok"])
    if "head_dim" in hp:  # only when config.json states it
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    _write_rope_scaling(w, rope)
    # The architecture classes' additions.
    if arch in ("qwen2moe", "qwen3moe"):
        if "moe_intermediate_size" in hp:
            w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        if "shared_expert_intermediate_size" in hp:
            w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    if arch == "llama":
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp.get("head_dim", hp["hidden_size"] // hp["num_attention_heads"]))
    if arch == "gpt-oss":
        _write_gpt_oss_hparams(w, hp)
    if arch == "deepseek2":
        _write_deepseek2_hparams(w, hp)
    if arch == "deepseek":
        _write_deepseek_hparams(w, hp)
    if arch == "glm4moe":
        more.write_glm4moe_hparams(w, hp, rope)
    if arch == "llama4":
        more.write_llama4_hparams(w, hp)


def _rope_parameters(hp: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 keeps theta and scaling in `rope_parameters`; 4.x had `rope_theta`/`rope_scaling`."""
    if "rope_parameters" in hp:
        return dict(hp["rope_parameters"])
    return {"rope_theta": hp.get("rope_theta", 10000.0), **(hp.get("rope_scaling") or {})}


def _write_rope_scaling(w: gguf.GGUFWriter, rope: dict[str, Any]) -> None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        # transformers' defaults when the config leaves them out (as ggml's are too).
        w.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast") or 32.0))
        w.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow") or 1.0))
        if rope.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
    elif kind not in ("default", "llama3"):  # llama3: the `rope_freqs` tensor, no keys
        raise ValueError(f"rope scaling {kind!r} is not supported by this helper")


# ---- tokenizer -------------------------------------------------------------------------------


def _copy_tokenizer(w: gguf.GGUFWriter, source: Path) -> None:
    reader = gguf.GGUFReader(source)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type)


def _write_byte_level_tokenizer(w: gguf.GGUFWriter, vocab_size: int) -> None:
    """GPT-2 byte alphabet (ids 0-255), some two-character merges, [PADn] fill, then an EOS last."""
    if vocab_size < 257:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for a byte-level vocab and an EOS")
    alphabet = _byte_alphabet()
    merges = _merge_pairs(alphabet)[: vocab_size - 257]
    merged = ["".join(m.split(" ")) for m in merges]
    # llama.cpp's converter names ids the tokenizer lacks [PADn] and marks them unused.
    pads = [f"[PAD{i}]" for i in range(256 + len(merges), vocab_size - 1)]
    tokens = alphabet + merged + pads + ["<|endoftext|>"]
    types = ([gguf.TokenType.NORMAL] * (256 + len(merges)) + [gguf.TokenType.UNUSED] * len(pads)
             + [gguf.TokenType.CONTROL])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges:  # gguf-py cannot type an empty array
        w.add_token_merges(merges)
    w.add_eos_token_id(vocab_size - 1)
    w.add_pad_token_id(vocab_size - 1)


def _byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to chr(256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _merge_pairs(alphabet: list[str]) -> list[str]:
    """' x' and 'xy' over common letters: a small, valid BPE merge list (all parts are in the alphabet)."""
    letters = [alphabet[ord(c)] for c in "etaoinshrdlcu"]
    return [f"{alphabet[ord(' ')]} {c}" for c in letters] + [f"{a} {b}" for a in letters for b in letters]


# ---- tensors ---------------------------------------------------------------------------------

_LAYER = r"model\.layers\.(?P<i>\d+)\."
_NAME_MAP = [(re.compile(pattern), gguf_name) for pattern, gguf_name in [
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (_LAYER + r"input_layernorm\.weight", "blk.{i}.attn_norm.weight"),
    (_LAYER + r"post_attention_layernorm\.weight", "blk.{i}.ffn_norm.weight"),
    (_LAYER + r"self_attn\.(?P<p>[qkv])_proj\.(?P<kind>weight|bias)", "blk.{i}.attn_{p}.{kind}"),
    (_LAYER + r"self_attn\.o_proj\.weight", "blk.{i}.attn_output.weight"),
    (_LAYER + r"self_attn\.(?P<p>[qk])_norm\.weight", "blk.{i}.attn_{p}_norm.weight"),
    (_LAYER + r"mlp\.gate\.weight", "blk.{i}.ffn_gate_inp.weight"),
    (_LAYER + r"mlp\.experts\.(?P<m>gate|up|down)", "blk.{i}.ffn_{m}_exps.weight"),
    (_LAYER + r"mlp\.shared_expert\.(?P<m>gate|up|down)_proj\.weight", "blk.{i}.ffn_{m}_shexp.weight"),
    (_LAYER + r"mlp\.shared_expert_gate\.weight", "blk.{i}.ffn_gate_inp_shexp.weight"),
]]


def gguf_tensors(model: torch.nn.Module, per_expert_tensors: bool = False) -> dict[str, torch.Tensor]:
    """GGUF name -> float32 tensor in torch order, laid out as llama.cpp's converter writes it."""
    arch = arch_of(model)
    if arch == "gpt-oss":
        return gpt_oss_tensors(model)
    if arch == "deepseek2":
        return deepseek2_tensors(model)
    if arch == "dbrx":
        return dbrx_tensors(model)
    if arch == "deepseek":  # deepseek2's names, with Llama's q/k permutation for its MHA
        hp = hparams(model.config)
        return {name: _permute_for_interleaved_rope(name, t, hp) for name, t in deepseek2_tensors(model).items()}
    if arch == "llama4":
        hp = hparams(model.config)
        return more.llama4_tensors(model, hp, _rope_parameters(hp), _gguf_name)
    if arch == "glm4moe":
        return more.glm4moe_tensors(_stack_experts(_split_state(model, hparams(model.config))), _gguf_name)
    hp = hparams(model.config)
    state = _stack_experts(_split_state(model, hp))
    out: dict[str, torch.Tensor] = {}
    for hf_name, tensor in state.items():
        name = _gguf_name(hf_name)
        if arch == "llama":
            tensor = _permute_for_interleaved_rope(name, tensor, hp)
        if per_expert_tensors and name.endswith("_exps.weight"):
            out.update(_split_experts(name, tensor))
        else:
            out[name] = tensor
    return out


def _split_state(model: torch.nn.Module, hp: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state dict in float32 with per-expert or fused gate_up experts as separate matrices.

    Expert matrices become `...mlp.experts.E.{gate,up,down}` (stacked afterwards); Mixtral's
    transformers-4 `block_sparse_moe.*.w1/w3/w2` names are normalised to the same.
    """
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().to(torch.float32).cpu()
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if name == "lm_head.weight" and hp.get("tie_word_embeddings", False):
            continue  # tied: the checkpoint has no lm_head, llama.cpp writes no output.weight
        if name.endswith("mlp.experts.gate_up_proj"):
            state.update(_split_gate_up(name.removesuffix("gate_up_proj"), tensor, hp["hidden_size"]))
        elif name.endswith("mlp.experts.down_proj"):
            state.update({f"{name.removesuffix('down_proj')}{e}.down": t for e, t in enumerate(tensor)})
        elif m := re.search(r"mlp\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$", name):
            matrix = {"w1": "gate", "w3": "up", "w2": "down"}.get(m[1], m[1].removesuffix("_proj"))
            state[name[: m.start(1)] + matrix] = tensor
        else:
            state[name] = tensor
    return state


def _split_gate_up(prefix: str, gate_up: torch.Tensor, hidden: int) -> dict[str, torch.Tensor]:
    # transformers 5: [E, 2F, H], gate rows first (the forward does linear(x, W).chunk(2)).
    if gate_up.ndim != 3 or gate_up.shape[-1] != hidden or gate_up.shape[1] % 2:
        raise ValueError(f"{prefix}gate_up_proj has shape {tuple(gate_up.shape)}, expected [E, 2F, {hidden}]")
    gate, up = gate_up.chunk(2, dim=1)
    out = {}
    for e in range(gate_up.shape[0]):
        out[f"{prefix}{e}.gate"], out[f"{prefix}{e}.up"] = gate[e], up[e]
    return out


def _stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`...experts.E.m` for every E -> one `...experts.m` tensor [n_expert, out, in]."""
    groups: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        m = re.fullmatch(r"(.*mlp\.experts\.)(\d+)\.(gate|up|down)", name)
        if m is None:
            out[name] = tensor
        else:
            groups.setdefault(m[1] + m[3], {})[int(m[2])] = tensor
    for name, by_expert in groups.items():
        out[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def _gguf_name(hf_name: str) -> str:
    for pattern, gguf_name in _NAME_MAP:
        if m := pattern.fullmatch(hf_name):
            return gguf_name.format(**m.groupdict())
    raise KeyError(f"no GGUF name for transformers tensor {hf_name!r}")


def _permute_for_interleaved_rope(name: str, tensor: torch.Tensor, hp: dict[str, Any]) -> torch.Tensor:
    """LlamaModel.permute: per head, rows (t*hd/2 + j) -> (2j + t), so ggml's rope pairs (2j, 2j+1)."""
    heads = hp["num_attention_heads"]
    if re.fullmatch(r"blk\.\d+\.attn_k\.(weight|bias)", name):
        heads = hp.get("num_key_value_heads", heads)
    elif not re.fullmatch(r"blk\.\d+\.attn_q\.(weight|bias)", name):
        return tensor
    rows = tensor.shape[0]
    return tensor.reshape(heads, 2, rows // heads // 2, *tensor.shape[1:]).swapaxes(1, 2).reshape(tensor.shape)


def _split_experts(name: str, stacked: torch.Tensor) -> dict[str, torch.Tensor]:
    base = name.removesuffix("_exps.weight")  # blk.N.ffn_gate
    return {f"{base}.{e}.weight": t for e, t in enumerate(stacked)}


def _encode(name: str, tensor: torch.Tensor, tensor_type: GGMLQuantizationType) -> tuple[np.ndarray, Any]:
    """(data, raw_dtype for GGUFWriter) as convert_hf_to_gguf (F32) or llama-quantize (Q8_0) store it."""
    data = tensor.numpy().astype(np.float32)
    if tensor_type == F32:
        return data, None
    # llama-quantize writes ggml_n_dims dims, dropping trailing (ggml-order) 1s: [1, D] -> [D].
    while data.ndim > 1 and data.shape[0] == 1:
        data = data[0]
    # Only ".weight" matrices are quantized; the router stays F32 (llama-quantize's own rule).
    if data.ndim < 2 or not name.endswith(".weight") or name.endswith("ffn_gate_inp.weight"):
        return data, None
    if data.shape[-1] % gguf.GGML_QUANT_SIZES[Q8_0][0]:
        return data.astype(np.float16), None  # llama-quantize's fallback for rows no block divides
    return gguf.quants.quantize(data, Q8_0), Q8_0


# ---- gpt-oss (GptOssModel in convert_hf_to_gguf.py) ------------------------------------------

_GPT_OSS_NAMES = [(re.compile(pattern), gguf_name) for pattern, gguf_name in [
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (_LAYER + r"input_layernorm\.weight", "blk.{i}.attn_norm.weight"),
    (_LAYER + r"post_attention_layernorm\.weight", "blk.{i}.post_attention_norm.weight"),
    (_LAYER + r"self_attn\.(?P<p>[qkv])_proj\.(?P<kind>weight|bias)", "blk.{i}.attn_{p}.{kind}"),
    (_LAYER + r"self_attn\.o_proj\.(?P<kind>weight|bias)", "blk.{i}.attn_output.{kind}"),
    (_LAYER + r"self_attn\.sinks", "blk.{i}.attn_sinks.weight"),
    (_LAYER + r"mlp\.router\.(?P<kind>weight|bias)", "blk.{i}.ffn_gate_inp.{kind}"),
]]
_GPT_OSS_EXPERTS = re.compile(_LAYER + r"mlp\.experts\.(?P<p>gate_up_proj|down_proj)(?P<bias>_bias)?")


def _write_gpt_oss_hparams(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    w.add_sliding_window(hp["sliding_window"])
    w.add_expert_feed_forward_length(hp["intermediate_size"])


def gpt_oss_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """GGUF name -> float32 tensor in torch order for a GptOssForCausalLM (unquantized experts)."""
    hp = hparams(model.config)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().to(torch.float32).cpu()
        if name == "lm_head.weight" and hp.get("tie_word_embeddings", False):
            continue
        if m := _GPT_OSS_EXPERTS.fullmatch(name):
            out.update(_gpt_oss_experts(f"blk.{m['i']}.", m["p"], bool(m["bias"]), tensor, hp))
            continue
        for pattern, gguf_name in _GPT_OSS_NAMES:
            if m := pattern.fullmatch(name):
                out[gguf_name.format(**m.groupdict())] = tensor
                break
        else:
            raise KeyError(f"no GGUF name for transformers tensor {name!r}")
    return out


def _gpt_oss_experts(p: str, matrix: str, is_bias: bool, t: torch.Tensor,
                     hp: dict[str, Any]) -> dict[str, torch.Tensor]:
    """gate_up_proj [E, H, 2F] has gate in the even columns, up in the odd ones; down_proj is
    [E, F, H]. Both are stored input-major, so the matrices are transposed to [E, out, in]."""
    e, h, f = hp["num_local_experts"], hp["hidden_size"], hp["intermediate_size"]
    expected = {("gate_up_proj", False): (e, h, 2 * f), ("gate_up_proj", True): (e, 2 * f),
                ("down_proj", False): (e, f, h), ("down_proj", True): (e, h)}[(matrix, is_bias)]
    if tuple(t.shape) != expected:
        raise ValueError(f"{p}{matrix}{'_bias' if is_bias else ''} has shape {tuple(t.shape)}, expected {expected}")
    kind = "bias" if is_bias else "weight"
    if not is_bias:
        t = t.transpose(1, 2)
    if matrix == "down_proj":
        return {f"{p}ffn_down_exps.{kind}": t.contiguous()}
    gate, up = (t[..., 0::2], t[..., 1::2]) if is_bias else (t[:, 0::2], t[:, 1::2])
    return {f"{p}ffn_gate_exps.{kind}": gate.contiguous(), f"{p}ffn_up_exps.{kind}": up.contiguous()}


# ---- deepseek2 (DeepseekV2Model in convert_hf_to_gguf.py; DeepSeek-V2 and V3 configs) --------

_DEEPSEEK2_NAMES = [(re.compile(pattern), gguf_name) for pattern, gguf_name in [
    (_LAYER + r"self_attn\.q_a_proj\.weight", "blk.{i}.attn_q_a.weight"),
    (_LAYER + r"self_attn\.q_a_layernorm\.weight", "blk.{i}.attn_q_a_norm.weight"),
    (_LAYER + r"self_attn\.q_b_proj\.weight", "blk.{i}.attn_q_b.weight"),
    (_LAYER + r"self_attn\.kv_a_proj_with_mqa\.weight", "blk.{i}.attn_kv_a_mqa.weight"),
    (_LAYER + r"self_attn\.kv_a_layernorm\.weight", "blk.{i}.attn_kv_a_norm.weight"),
    (_LAYER + r"mlp\.gate\.e_score_correction_bias", "blk.{i}.exp_probs_b.bias"),
    (_LAYER + r"mlp\.shared_experts\.(?P<m>gate|up|down)_proj\.weight", "blk.{i}.ffn_{m}_shexp.weight"),
    (_LAYER + r"mlp\.(?P<m>gate|up|down)_proj\.weight", "blk.{i}.ffn_{m}.weight"),  # leading dense layers
]]
_GATING_FUNC = {"softmax": gguf.ExpertGatingFuncType.SOFTMAX, "sigmoid": gguf.ExpertGatingFuncType.SIGMOID}


def _deepseek2_view(hp: dict[str, Any]) -> dict[str, Any]:
    """What the generic keys see: MLA stored absorbed is MQA (one kv head), experts counted under
    `n_routed_experts`, and config.json's `head_dim` (the rope dims) not written as key_length."""
    hp = {k: v for k, v in hp.items() if k != "head_dim"}
    return {**hp, "num_key_value_heads": 1, "num_experts": hp["n_routed_experts"]}


def _write_deepseek2_hparams(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    if "n_group" in hp:
        w.add_expert_group_count(hp["n_group"])
    if "topk_group" in hp:
        w.add_expert_group_used_count(hp["topk_group"])
    if "scoring_func" in hp:  # DeepSeek-V3's config class drops it unless given (fixtures README)
        w.add_expert_gating_func(_GATING_FUNC[hp["scoring_func"]])
    kv_lora, rope_dims = hp["kv_lora_rank"], hp["qk_rope_head_dim"]
    w.add_leading_dense_block_count(hp.get("first_k_dense_replace", 0))
    w.add_vocab_size(hp["vocab_size"])
    if "q_lora_rank" in hp:
        w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(kv_lora)
    # The absorbed MQA view (key = latent + rope, value = latent), then the per-head sizes.
    w.add_key_length(kv_lora + rope_dims)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(hp["qk_nope_head_dim"] + rope_dims)
    w.add_value_length_mla(hp["v_head_dim"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp.get("n_shared_experts", 0))
    if "routed_scaling_factor" in hp:
        w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope_dims)
    mscale_all_dim = _rope_parameters(hp).get("mscale_all_dim")
    if mscale_all_dim is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * mscale_all_dim)  # the converter's 0.1 factor, undone by readers


def _write_deepseek_hparams(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """DeepseekModel's keys (DeepSeek-MoE): no key for `norm_topk_prob` or `moe_layer_freq`."""
    if "scoring_func" in hp:
        w.add_expert_gating_func(_GATING_FUNC[hp["scoring_func"]])
    w.add_rope_dimension_count(hp.get("head_dim", hp["hidden_size"] // hp["num_attention_heads"]))
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_vocab_size(hp["vocab_size"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_weights_scale(1.0)
    w.add_expert_shared_count(hp["n_shared_experts"])


def deepseek2_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """GGUF name -> float32 tensor in torch order, with kv_b_proj split for absorbed MLA."""
    hp = hparams(model.config)
    out: dict[str, torch.Tensor] = {}
    for hf_name, tensor in _stack_experts(_split_state(model, hp)).items():
        if m := re.fullmatch(_LAYER + r"self_attn\.kv_b_proj\.weight", hf_name):
            out.update(_split_kv_b(f"blk.{m['i']}.", tensor, hp))
            continue
        for pattern, gguf_name in _DEEPSEEK2_NAMES:
            if m := pattern.fullmatch(hf_name):
                out[gguf_name.format(**m.groupdict())] = tensor
                break
        else:
            out[_gguf_name(hf_name)] = tensor
    return out


def _split_kv_b(p: str, kv_b: torch.Tensor, hp: dict[str, Any]) -> dict[str, torch.Tensor]:
    """kv_b_proj [H·(nope+v), kv_lora] -> attn_k_b [H, kv_lora, nope] (transposed), attn_v_b [H, v, kv_lora]."""
    nope, v = hp["qk_nope_head_dim"], hp["v_head_dim"]
    per_head = kv_b.view(hp["num_attention_heads"], nope + v, kv_b.shape[-1])
    k_b, v_b = per_head.split([nope, v], dim=1)
    return {f"{p}attn_k_b.weight": k_b.transpose(1, 2).contiguous(), f"{p}attn_v_b.weight": v_b.contiguous()}


# ---- dbrx (DbrxModel in convert_hf_to_gguf.py) -----------------------------------------------

_DBRX_BLOCK = r"transformer\.blocks\.(?P<i>\d+)\."
_DBRX_NAMES = [(re.compile(pattern), gguf_name) for pattern, gguf_name in [
    (r"transformer\.wte\.weight", "token_embd.weight"),
    (r"transformer\.norm_f\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (_DBRX_BLOCK + r"norm_attn_norm\.norm_1\.weight", "blk.{i}.attn_norm.weight"),
    (_DBRX_BLOCK + r"norm_attn_norm\.attn\.Wqkv\.weight", "blk.{i}.attn_qkv.weight"),
    (_DBRX_BLOCK + r"norm_attn_norm\.attn\.out_proj\.weight", "blk.{i}.attn_output.weight"),
    (_DBRX_BLOCK + r"norm_attn_norm\.norm_2\.weight", "blk.{i}.attn_output_norm.weight"),
    (_DBRX_BLOCK + r"ffn\.router\.layer\.weight", "blk.{i}.ffn_gate_inp.weight"),
    (_DBRX_BLOCK + r"ffn\.experts\.mlp\.w1", "blk.{i}.ffn_gate_exps.weight"),
    (_DBRX_BLOCK + r"ffn\.experts\.mlp\.v1", "blk.{i}.ffn_up_exps.weight"),
    (_DBRX_BLOCK + r"ffn\.experts\.mlp\.w2", "blk.{i}.ffn_down_exps.weight"),
]]


def _write_dbrx_hparams(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    attn, ffn = hp["attn_config"], hp["ffn_config"]
    if attn.get("clip_qkv") is None:
        raise ValueError("llama.cpp's converter needs attn_config.clip_qkv (it writes clamp_kqv unconditionally)")
    w.add_block_count(hp["n_layers"])
    w.add_context_length(hp["max_seq_len"])
    w.add_embedding_length(hp["d_model"])
    w.add_feed_forward_length(ffn["ffn_hidden_size"])
    w.add_head_count(hp["n_heads"])
    w.add_head_count_kv(attn["kv_n_heads"])
    w.add_rope_freq_base(attn["rope_theta"])
    w.add_clamp_kqv(attn["clip_qkv"])
    w.add_expert_count(ffn["moe_num_experts"])
    w.add_expert_used_count(ffn["moe_top_k"])
    w.add_layer_norm_eps(1e-5)  # whatever the config says: also transformers' LayerNorm default


def dbrx_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """GGUF name -> float32 tensor in torch order: experts [E·F, H] as [E, F, H], `w2` as [E, H, F]."""
    hp = hparams(model.config)
    ffn = hp["ffn_config"]
    experts, width = ffn["moe_num_experts"], ffn["ffn_hidden_size"]
    out: dict[str, torch.Tensor] = {}
    for hf_name, tensor in model.state_dict().items():
        tensor = tensor.detach().to(torch.float32).cpu()
        for pattern, gguf_name in _DBRX_NAMES:
            if m := pattern.fullmatch(hf_name):
                name = gguf_name.format(**m.groupdict())
                break
        else:
            raise KeyError(f"no GGUF name for transformers tensor {hf_name!r}")
        if name.endswith("_exps.weight"):
            tensor = tensor.view(experts, width, hp["d_model"])
            if "ffn_down" in name:
                tensor = tensor.transpose(1, 2).contiguous()
        out[name] = tensor
    return out
