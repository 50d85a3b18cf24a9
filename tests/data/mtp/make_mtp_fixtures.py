"""Regenerate tests/data/mtp (see its README): two tiny checkpoints with one NextN/MTP block each,
their GGUFs from llama.cpp's own converter, and transformers' float32 reference of the main model and
of the MTP block's draft logits.

    python tests/data/mtp/make_mtp_fixtures.py LLAMA_CPP_DIR [--fixtures DIR] [--keep DIR]

LLAMA_CPP_DIR: a llama.cpp tree (convert_hf_to_gguf.py, conversion/, gguf-py/). Needs transformers
(5.x: glm4_moe, glm4_moe_lite). Not run by the test suite. The reference is plain torch around
transformers' own modules: nothing here imports SplitMoE.
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

# GLM-4.5's layout on the glm4moe fixture's config: 2 main layers (layer 0 dense), layer 2 the MTP block.
GLM4MOE_CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
    "attention_dropout": 0.0, "dtype": "bfloat16", "eos_token_id": 2045, "pad_token_id": 2045,
    "first_k_dense_replace": 1, "head_dim": 32, "hidden_act": "silu", "hidden_size": 128,
    "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 4096,
    "moe_intermediate_size": 32, "n_group": 4, "n_routed_experts": 8, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 6, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000.0, "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False, "topk_group": 2, "use_cache": True, "use_qk_norm": True, "vocab_size": 2048,
}

# GLM-4.7-Flash's layout (MLA as the deepseek3 fixture): 3 main layers (layer 0 dense), layer 3 the
# MTP block. `scoring_func` is not in GLM-4.7-Flash's config (transformers' Glm4MoeLite always uses
# sigmoid): without it the converter writes no `expert_gating_func`, and llama.cpp then takes softmax
# for any deepseek2 file but GLM-4.7-Flash's own shape (47/48 layers, vocab 154880).
# rms_norm_eps 1e-6: transformers' MLA q_a/kv_a norms have 1e-6 whatever the config says, llama.cpp one eps.
GLM4MOE_LITE_CONFIG = {
    "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": None, "dtype": "bfloat16", "eos_token_id": 2045,
    "pad_token_id": 2045, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 128,
    "initializer_range": 0.02, "intermediate_size": 256, "kv_lora_rank": 32, "q_lora_rank": 48,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "max_position_embeddings": 4096,
    "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1, "n_routed_experts": 16, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 4, "num_experts_per_tok": 4, "num_hidden_layers": 3,
    "num_key_value_heads": 4, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-06, "rope_interleave": True,
    "rope_scaling": None, "rope_theta": 1000000.0, "routed_scaling_factor": 1.8, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_method": "noaux_tc", "use_cache": True, "vocab_size": 2048,
}


@dataclass(frozen=True)
class Model:
    name: str          # file stem: <name>.gguf, the references' key prefix
    config: dict
    seed: int
    mtp_own_head: bool  # the MTP block has its own embed_tokens and shared_head.head


MODELS = (
    Model("glm4moe-mtp", GLM4MOE_CONFIG, seed=4242, mtp_own_head=False),
    Model("deepseek2-mtp", GLM4MOE_LITE_CONFIG, seed=4243, mtp_own_head=True),
)


# ---- checkpoint ---------------------------------------------------------------------------------

def _attention_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    D = c["hidden_size"]
    if "kv_lora_rank" not in c:
        q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
        return {"q_proj.weight": (q, D), "q_proj.bias": (q,), "k_proj.weight": (kv, D), "k_proj.bias": (kv,),
                "v_proj.weight": (kv, D), "v_proj.bias": (kv,), "o_proj.weight": (D, q),
                "q_norm.weight": (c["head_dim"],), "k_norm.weight": (c["head_dim"],)}
    H, nope, rope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    ql, kvl = c["q_lora_rank"], c["kv_lora_rank"]
    return {"q_a_proj.weight": (ql, D), "q_a_layernorm.weight": (ql,), "q_b_proj.weight": (H * (nope + rope), ql),
            "kv_a_proj_with_mqa.weight": (kvl + rope, D), "kv_a_layernorm.weight": (kvl,),
            "kv_b_proj.weight": (H * (nope + v), kvl), "o_proj.weight": (D, H * v)}


def _ffn_shapes(c: dict, moe: bool) -> dict[str, tuple[int, ...]]:
    D = c["hidden_size"]
    if not moe:
        F = c["intermediate_size"]
        return {"gate_proj.weight": (F, D), "up_proj.weight": (F, D), "down_proj.weight": (D, F)}
    E, F, S = c["n_routed_experts"], c["moe_intermediate_size"], c["moe_intermediate_size"] * c["n_shared_experts"]
    out = {"gate.weight": (E, D), "gate.e_score_correction_bias": (E,), "shared_experts.gate_proj.weight": (S, D),
           "shared_experts.up_proj.weight": (S, D), "shared_experts.down_proj.weight": (D, S)}
    for e in range(E):
        out |= {f"experts.{e}.gate_proj.weight": (F, D), f"experts.{e}.up_proj.weight": (F, D),
                f"experts.{e}.down_proj.weight": (D, F)}
    return out


def checkpoint_shapes(m: Model) -> dict[str, tuple[int, ...]]:
    """Tensor names and torch shapes of the checkpoint, in the naming real GLM checkpoints use
    (experts one by one; the MTP block's own tensors beside its decoder layer)."""
    c, D, V = m.config, m.config["hidden_size"], m.config["vocab_size"]
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    num_layers = c["num_hidden_layers"] + c["num_nextn_predict_layers"]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,)}
        out |= {p + "self_attn." + k: s for k, s in _attention_shapes(c).items()}
        out |= {p + "mlp." + k: s for k, s in _ffn_shapes(c, moe=i >= c["first_k_dense_replace"]).items()}
        if i >= c["num_hidden_layers"]:
            out |= {p + "eh_proj.weight": (D, 2 * D), p + "enorm.weight": (D,), p + "hnorm.weight": (D,),
                    p + "shared_head.norm.weight": (D,)}
            if m.mtp_own_head:
                out |= {p + "embed_tokens.weight": (V, D), p + "shared_head.head.weight": (V, D)}
    return out


def draw(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """The fixtures' recipe: matrices N(0, 1/fan_in), embeddings N(0, 1), norm weights 1 + 0.1 N,
    biases 0.1 N; rounded to bfloat16, so every value is exact in bf16 and f32."""
    x = torch.randn(shape, generator=g)
    if name.endswith("norm.weight"):
        x = 1 + 0.1 * x
    elif name.endswith("bias"):
        x = 0.1 * x
    elif not name.endswith("embed_tokens.weight"):
        x = x / shape[-1] ** 0.5
    return x.to(torch.bfloat16)


def write_checkpoint(m: Model, out: Path, fixtures: Path) -> None:
    """One torch.Generator for the whole checkpoint, tensor by tensor in sorted name order."""
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(m.seed)
    tensors = {k: draw(k, s, g) for k, s in sorted(checkpoint_shapes(m).items())}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(m.config, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        shutil.copy(fixtures / "glm4moe" / "hf" / f, out / f)


# ---- conversion ---------------------------------------------------------------------------------

# llama.cpp's converter, unmodified but for the fixtures' two pins: the BPE pre-tokenizer is `qwen2`
# (the script does not know this tokenizer's hash), and GLM's vocabulary path (which looks up GLM's
# special tokens, absent here) is the generic GPT-2 one.
CONVERT = """
import sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[1] + "/gguf-py")
from conversion.base import TextModel
from conversion.glm import Glm4MoeLiteModel, Glm4MoeModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
Glm4MoeModel.set_vocab = Glm4MoeLiteModel.set_vocab = TextModel._set_vocab_gpt2
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
convert_hf_to_gguf.main()
"""


def convert(llama_cpp: Path, hf_dir: Path, out: Path) -> None:
    cmd = [sys.executable, "-c", CONVERT, str(llama_cpp), str(hf_dir), "--outtype", "bf16", "--outfile", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)


def check_gguf(llama_cpp: Path, m: Model, path: Path) -> None:
    """The converter wrote the NextN key and block: block_count counts it, its tensors are there."""
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    import gguf

    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    n_main, n_nextn = m.config["num_hidden_layers"], m.config["num_nextn_predict_layers"]
    assert r.fields[f"{arch}.nextn_predict_layers"].contents() == n_nextn
    assert r.fields[f"{arch}.block_count"].contents() == n_main + n_nextn
    names = {t.name for t in r.tensors}
    want = ["eh_proj", "enorm", "hnorm", "shared_head_norm"]
    want += ["embed_tokens", "shared_head_head"] if m.mtp_own_head else []
    missing = [w for w in want if f"blk.{n_main}.nextn.{w}.weight" not in names]
    extra = [n for n in names if ".nextn." in n and n.split(".nextn.")[1].split(".")[0] not in want]
    assert not missing and not extra, (missing, extra)
    assert f"blk.{n_main}.ffn_gate_inp.weight" in names and f"blk.{n_main}.exp_probs_b.bias" in names


# ---- reference ----------------------------------------------------------------------------------

def layer_classes(m: Model):
    if m.config["model_type"] == "glm4_moe":
        from transformers import Glm4MoeForCausalLM
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeRMSNorm
        return Glm4MoeForCausalLM, Glm4MoeDecoderLayer, Glm4MoeRMSNorm
    from transformers import Glm4MoeLiteForCausalLM
    from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import (
        Glm4MoeLiteDecoderLayer,
        Glm4MoeLiteRMSNorm,
    )
    return Glm4MoeLiteForCausalLM, Glm4MoeLiteDecoderLayer, Glm4MoeLiteRMSNorm


def load_hf(m: Model, hf_dir: Path):
    """transformers' model, float32 eager; everything but the MTP block must load from the file."""
    causal_lm, _, _ = layer_classes(m)
    model, info = causal_lm.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager",
                                            output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    n_main = m.config["num_hidden_layers"]
    assert all(k.startswith(f"model.layers.{n_main}.") for k in info["unexpected_keys"]), info
    return model.eval()


def checkpoint(hf_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k).float() for k in f.keys()}


def decoder_layer(model, m: Model, ckpt: dict[str, torch.Tensor], idx: int):
    """transformers' decoder layer class for layer `idx`, built from the config, its weights taken
    from the checkpoint file (the experts fused as transformers holds them: gate_up = [gate; up])."""
    _, layer_cls, _ = layer_classes(m)
    config = copy.deepcopy(model.config)
    config._attn_implementation = "eager"
    if getattr(config, "mlp_layer_types", None) is not None:  # Glm4MoeLite: one entry per main layer
        config.mlp_layer_types = list(config.mlp_layer_types) + ["sparse"] * (idx + 1 - len(config.mlp_layer_types))
    layer = layer_cls(config, layer_idx=idx)
    p, E = f"model.layers.{idx}.", m.config["n_routed_experts"]
    state = {}
    for name in layer.state_dict():
        if name == "mlp.experts.gate_up_proj":
            state[name] = torch.stack([torch.cat([ckpt[f"{p}mlp.experts.{e}.gate_proj.weight"],
                                                  ckpt[f"{p}mlp.experts.{e}.up_proj.weight"]]) for e in range(E)])
        elif name == "mlp.experts.down_proj":
            state[name] = torch.stack([ckpt[f"{p}mlp.experts.{e}.down_proj.weight"] for e in range(E)])
        else:
            state[name] = ckpt[p + name]
    layer.load_state_dict(state, strict=True)
    return layer.eval()


def run_layer(model, layer, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One decoder layer on rows x [T, D] at `positions`: causal attention over the rows before,
    rotary embeddings from the model's own rotary module."""
    T = x.shape[0]
    position_ids = positions[None]
    cos_sin = model.model.rotary_emb(x[None], position_ids)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    return layer(x[None], attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin)[0]


def check_harness(model, m: Model, ckpt: dict[str, torch.Tensor], ids: torch.Tensor, logits: torch.Tensor) -> float:
    """The harness on the main layers, chained from the embedding, must give transformers' own logits."""
    x = model.model.embed_tokens(ids)
    positions = torch.arange(len(ids))
    for i in range(m.config["num_hidden_layers"]):
        x = run_layer(model, decoder_layer(model, m, ckpt, i), x, positions)
    got = model.lm_head(model.model.norm(x))
    return float((got - logits).abs().max())


def mtp_logits(model, m: Model, ckpt: dict[str, torch.Tensor], ids: torch.Tensor, hidden: torch.Tensor):
    """Draft logits of the MTP block at positions 0..T-2: row i reads token i+1 and the main model's
    final-normed hidden state of position i (llama.cpp's h_nextn), in that order."""
    _, _, norm_cls = layer_classes(m)
    idx, D, eps = m.config["num_hidden_layers"], m.config["hidden_size"], m.config["rms_norm_eps"]
    p = f"model.layers.{idx}."

    def norm(name: str) -> torch.nn.Module:
        n = norm_cls(D, eps=eps)
        n.weight.data.copy_(ckpt[p + name])
        return n

    embedding = ckpt.get(p + "embed_tokens.weight", ckpt["model.embed_tokens.weight"])
    head = ckpt.get(p + "shared_head.head.weight", ckpt["lm_head.weight"])
    e = norm("enorm.weight")(embedding[ids[1:]])
    h = norm("hnorm.weight")(hidden[:-1])
    x = torch.cat([e, h], dim=-1) @ ckpt[p + "eh_proj.weight"].T
    out = run_layer(model, decoder_layer(model, m, ckpt, idx), x, torch.arange(len(ids) - 1))
    return norm("shared_head.norm.weight")(out) @ head.T


@torch.no_grad()
def references(m: Model, hf_dir: Path, prompts: list[list[int]]) -> dict[str, np.ndarray]:
    model, ckpt = load_hf(m, hf_dir), checkpoint(hf_dir)
    out = {}
    for i, prompt in enumerate(prompts):
        ids = torch.tensor(prompt)
        hidden = model.model(ids[None]).last_hidden_state[0]
        logits = model(ids[None]).logits[0]
        assert float((model.lm_head(hidden) - logits).abs().max()) == 0.0
        harness_error = check_harness(model, m, ckpt, ids, logits)
        assert harness_error < 1e-5, harness_error
        draft = mtp_logits(model, m, ckpt, ids, hidden)
        k = f"{m.name}/p{i}/"
        out |= {k + "mtp_logits": draft.numpy(), k + "mtp_top1": draft.argmax(-1).numpy().astype(np.int32),
                k + "hidden": hidden.numpy(), k + "hidden_norm": hidden.norm(dim=-1).numpy(),
                k + "main_logits_top1": logits.argmax(-1).numpy().astype(np.int32),
                k + "main_logits_norm": logits.norm(dim=-1).numpy(),
                k + "harness_max_abs": np.float32(harness_error)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("llama_cpp", type=Path)
    ap.add_argument("--fixtures", type=Path, default=HERE.parents[3] / "shared" / "fixtures")
    ap.add_argument("--keep", type=Path, help="keep the HF checkpoints here (default: a temporary folder)")
    args = ap.parse_args()
    prompts = [p["ids"] for p in json.loads((args.fixtures / "prompts.json").read_text())["prompts"]]
    out = {"prompts/p0": np.array(prompts[0], np.int32), "prompts/p1": np.array(prompts[1], np.int32)}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        for m in MODELS:
            hf_dir, gguf_path = work / m.name, HERE / f"{m.name}.gguf"
            write_checkpoint(m, hf_dir, args.fixtures)
            convert(args.llama_cpp, hf_dir, gguf_path)
            check_gguf(args.llama_cpp, m, gguf_path)
            out |= references(m, hf_dir, prompts)
            print(f"{m.name}: {gguf_path.stat().st_size:,} bytes")
    np.savez_compressed(HERE / "references.npz", **out)


if __name__ == "__main__":
    main()
