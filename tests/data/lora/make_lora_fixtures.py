"""Regenerate tests/data/lora (see its README): a tiny qwen3moe base GGUF, two random LoRA adapters made
with peft and converted by llama.cpp's own `convert_lora_to_gguf.py`, and transformers + peft float32
reference logits.

    python tests/data/lora/make_lora_fixtures.py LLAMA_CPP_DIR [--fixtures DIR] [--keep DIR] [--probe BIN]

LLAMA_CPP_DIR: a llama.cpp tree (convert_hf_to_gguf.py, convert_lora_to_gguf.py, conversion/, gguf-py/).
--probe: a built `llamacpp_lora_probe` (its header says how): also run llama.cpp with each adapter on an
F32 copy of the base and print its distance from the references. Needs transformers 5.x and peft (with
`target_parameters`). Not run by the test suite; nothing here imports SplitMoE.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
BASE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "generation_config.json")
PROMPT_TOKENS = (25, 24)  # prompt 0 whole, the first 24 ids of prompt 1


@dataclass(frozen=True)
class Adapter:
    name: str             # file stem: <name>-lora.gguf, the references' key
    seed: int
    r: int
    alpha: float
    target_modules: list[str]
    target_parameters: list[str] = field(default_factory=list)
    rank_pattern: dict[str, int] = field(default_factory=dict)
    b_std: float = 0.05   # B ~ N(0, b_std^2 / r), A ~ N(0, 1 / in): the delta is a visible fraction of W


ADAPTERS = (
    # lm_head at rank 4 while the rest are rank 8: llama.cpp scales each tensor by alpha / its own rank.
    Adapter("attn", seed=3101, r=8, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"],
            rank_pattern={"lm_head": 4}),
    # transformers 5 holds Qwen3-MoE's experts as 3-D parameters; peft adapts them with target_parameters.
    Adapter("experts", seed=3102, r=4, alpha=6.0, target_modules=[],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], b_std=0.1),
)

# The converter, unmodified but for the fixtures' pin: the BPE pre-tokenizer is `qwen2` (the script does
# not know this tokenizer's hash).
CONVERT_BASE = """
import sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[1] + "/gguf-py")
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
convert_hf_to_gguf.main()
"""


# ---- base ---------------------------------------------------------------------------------------

def write_base(fixtures: Path, out: Path) -> None:
    """The qwen3moe fixture's own checkpoint (seed 2234, bf16-exact weights, experts one by one)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in BASE_FILES:
        shutil.copy(fixtures / "qwen3moe" / "hf" / f, out / f)


def convert_base(llama_cpp: Path, hf_dir: Path, out: Path, outtype: str) -> None:
    cmd = [sys.executable, "-c", CONVERT_BASE, str(llama_cpp), str(hf_dir), "--outtype", outtype, "--outfile", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)


def gguf_reader(llama_cpp: Path, path: Path):
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    import gguf
    return gguf.GGUFReader(path)


def tensors_f32(llama_cpp: Path, path: Path) -> dict[str, np.ndarray]:
    """Every tensor of an F32 / BF16 GGUF as float32, in numpy (torch) order."""
    out = {}
    for t in gguf_reader(llama_cpp, path).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        data = np.asarray(t.data)
        if t.tensor_type.name == "BF16":
            data = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        out[t.name] = data.astype(np.float32).reshape(shape)
    return out


def check_base_lossless(llama_cpp: Path, bf16: Path, f32: Path) -> None:
    """The BF16 base holds exactly the values of the F32 one: every weight is bf16-exact."""
    a, b = tensors_f32(llama_cpp, bf16), tensors_f32(llama_cpp, f32)
    assert a.keys() == b.keys()
    bad = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not bad, bad


# ---- adapters -----------------------------------------------------------------------------------

def load_model(hf_dir: Path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def make_peft(a: Adapter, hf_dir: Path):
    """peft's model with the adapter, its A and B drawn from one generator in sorted parameter order."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=a.r, lora_alpha=a.alpha, target_modules=a.target_modules,
                        target_parameters=a.target_parameters or None, rank_pattern=a.rank_pattern,
                        lora_dropout=0.0, init_lora_weights=False)
    model = get_peft_model(load_model(hf_dir), config).eval()
    g = torch.Generator().manual_seed(a.seed)
    params = {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    with torch.no_grad():
        for name, p in sorted(params.items()):
            x = torch.randn(p.shape, generator=g)
            if ".lora_A." in name:
                p.copy_(x / p.shape[1] ** 0.5)
            else:
                rank = p.shape[1] // getattr(_owner(model, name), "num_experts", 1)
                p.copy_(x * a.b_std / rank ** 0.5)
    return model


def save_peft(model, out: Path) -> None:
    """peft's files, less its model card: the card names the base by its (temporary) path, which the
    converter would copy into the GGUF's general.base_model keys."""
    model.save_pretrained(out)
    (out / "README.md").unlink()


def _owner(model, param_name: str):
    """The LoRA layer a `...lora_B.default.weight` parameter belongs to."""
    return model.get_submodule(param_name.split(".lora_B.")[0])


def param_wrappers(model) -> list[tuple[str, object]]:
    from peft.tuners.lora.layer import ParamWrapper
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ParamWrapper)]


def per_expert_adapter(model, peft_dir: Path, out: Path) -> None:
    """peft's parameter-LoRA re-expressed, exactly, in the per-expert module layout the checkpoint itself
    has (`mlp.experts.<e>.{gate,up,down}_proj`), which is what peft writes for a transformers 4 model and
    what the converter's MoE code stacks. For expert e, peft keeps A as [E*r, in] with rows e*r..e*r+r-1,
    and B as [out, r*E] with column k*E + e for rank k (get_delta_weight's reshapes). gate_up_proj's
    delta is [gate; up] along out, so gate and up share A_e and split B_e's rows."""
    tensors = {}
    for name, m in param_wrappers(model):
        A, B = m.lora_A["default"].weight.detach(), m.lora_B["default"].weight.detach()
        E = m.num_experts
        a_e = A.reshape(E, -1, A.shape[-1])                         # [E, r, in]
        b_e = B.reshape(B.shape[0], -1, E).permute(2, 0, 1)         # [E, out, r]
        delta = torch.einsum("eor,eri->eoi", b_e, a_e) * m.scaling["default"]
        assert torch.allclose(delta, m.get_delta_weight("default"), rtol=0, atol=1e-6)
        prefix = name.removeprefix("base_model.model.").split(".mlp.experts")[0] + ".mlp.experts"
        halves = {"gate_proj": b_e[:, :b_e.shape[1] // 2], "up_proj": b_e[:, b_e.shape[1] // 2:]} \
            if m.parameter_name == "gate_up_proj" else {"down_proj": b_e}
        for proj, b in halves.items():
            for e in range(E):
                key = f"base_model.model.{prefix}.{e}.{proj}"
                tensors[f"{key}.lora_A.weight"] = a_e[e].clone()  # gate and up: one copy each
                tensors[f"{key}.lora_B.weight"] = b[e].clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    config |= {"target_modules": ["gate_proj", "up_proj", "down_proj"], "target_parameters": None}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def convert_lora(llama_cpp: Path, base_dir: Path, lora_dir: Path, out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(llama_cpp / "convert_lora_to_gguf.py"), "--base", str(base_dir),
           "--outtype", "f32", "--outfile", str(out), str(lora_dir)]
    return subprocess.run(cmd, capture_output=True, text=True)


def check_direct_conversion_fails(llama_cpp: Path, base_dir: Path, peft_dir: Path, work: Path) -> str:
    """The converter does not take peft's parameter-LoRA: its keys (`...experts.lora_A.weight`,
    `...experts.base_layer.lora_A.weight`) name no parameter, and its MoE code waits for per-expert names."""
    done = convert_lora(llama_cpp, base_dir, peft_dir, work / "experts-direct.gguf")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and "Unprocessed experts" in last, done.stderr[-2000:]
    return last


def check_adapter_gguf(llama_cpp: Path, a: Adapter, path: Path) -> dict[str, tuple[int, ...]]:
    r = gguf_reader(llama_cpp, path)
    assert r.fields["general.type"].contents() == "adapter"
    assert r.fields["adapter.type"].contents() == "lora"
    assert r.fields["general.architecture"].contents() == "qwen3moe"
    assert r.fields["adapter.lora.alpha"].contents() == a.alpha
    return {t.name: tuple(int(d) for d in reversed(t.shape)) for t in r.tensors}


# ---- reference ----------------------------------------------------------------------------------

def hf_param(gguf_name: str) -> tuple[str, slice | None]:
    """The HF parameter (transformers 5 layout) a base GGUF tensor is, and the part of its out dim."""
    if gguf_name == "output.weight":
        return "lm_head.weight", None
    blk, layer, what = gguf_name.split(".")[:3]
    p = f"model.layers.{layer}."
    attn = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}
    if what in attn:
        return p + f"self_attn.{attn[what]}.weight", None
    return {"ffn_gate_exps": (p + "mlp.experts.gate_up_proj", slice(0, 1)),
            "ffn_up_exps": (p + "mlp.experts.gate_up_proj", slice(1, 2)),
            "ffn_down_exps": (p + "mlp.experts.down_proj", None)}[what]


@torch.no_grad()
def merged_logits(hf_dir: Path, lora: dict[str, np.ndarray], alpha: float, prompts: list[torch.Tensor]):
    """transformers' model with W + alpha / rank * B @ A added for every pair in the adapter GGUF, as
    llama.cpp computes it: an independent check of the names, shapes and scale the converter wrote."""
    model = load_model(hf_dir)
    params = dict(model.named_parameters())
    for name in sorted(n.removesuffix(".lora_a") for n in lora if n.endswith(".lora_a")):
        A, B = torch.from_numpy(lora[name + ".lora_a"]), torch.from_numpy(lora[name + ".lora_b"])
        delta = alpha / B.shape[-1] * (B @ A)
        hf, half = hf_param(name)
        w = params[hf]
        if half is None:
            w += delta
        else:
            n = w.shape[-2] // 2
            w[..., half.start * n:half.stop * n, :] += delta
    return [model(ids[None]).logits[0] for ids in prompts]


@torch.no_grad()
def peft_logits(model, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [model(ids[None]).logits[0] for ids in prompts]


@torch.no_grad()
def sample_deltas(model, a: Adapter) -> dict[str, np.ndarray]:
    """A few of peft's own delta weights (scale * B @ A, [out, in]), for the loader's per-tensor check."""
    out = {}
    if a.name == "attn":
        layers = dict(model.named_modules())
        for hf, key in (("model.layers.0.self_attn.q_proj", "blk.0.attn_q.weight"),
                        ("model.layers.1.self_attn.k_proj", "blk.1.attn_k.weight"),
                        ("lm_head", "output.weight")):
            delta = layers["base_model.model." + hf].get_delta_weight("default")
            out[key] = (delta[:64] if hf == "lm_head" else delta).numpy()  # output: its first 64 rows
        return out
    for name, m in param_wrappers(model):
        layer = name.split(".layers.")[1].split(".")[0]
        delta = m.get_delta_weight("default")[[0, 5]]  # experts 0 and 5
        if m.parameter_name == "gate_up_proj":
            F = delta.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = delta[:, :F].numpy()
            out[f"blk.{layer}.ffn_up_exps.weight"] = delta[:, F:].numpy()
        else:
            out[f"blk.{layer}.ffn_down_exps.weight"] = delta.numpy()
    return out


def rel_l2(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / y.norm())


# ---- llama.cpp cross-check (optional) -----------------------------------------------------------

def llamacpp_logits(probe: Path, model: Path, lora: Path | None, ids: list[int]) -> np.ndarray:
    with tempfile.NamedTemporaryFile(suffix=".bin") as f:
        cmd = [str(probe), str(model), f.name, str(lora) if lora else "-", *map(str, ids)]
        subprocess.run(cmd, check=True, capture_output=True)
        raw = Path(f.name).read_bytes()
    T, V = np.frombuffer(raw[:8], np.int32)
    return np.frombuffer(raw[8:], np.float32).reshape(T, V)


def cross_check(probe: Path, base_f32: Path, prompts: list[list[int]], refs: dict[str, np.ndarray]) -> None:
    for name in ("base", *(a.name for a in ADAPTERS)):
        lora = None if name == "base" else HERE / f"{name}-lora.gguf"
        for i, ids in enumerate(prompts):
            got, want = llamacpp_logits(probe, base_f32, lora, ids), refs[f"{name}/p{i}/logits"]
            print(f"llama.cpp {name} p{i}: max-abs {np.abs(got - want).max():.2e}, "
                  f"rel-L2 {np.linalg.norm(got - want) / np.linalg.norm(want):.1e}, "
                  f"top-1 equal {(got.argmax(-1) == want.argmax(-1)).mean():.0%}")


# ---- main ---------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("llama_cpp", type=Path)
    ap.add_argument("--fixtures", type=Path, default=HERE.parents[3] / "shared" / "fixtures")
    ap.add_argument("--keep", type=Path, help="keep the HF checkpoint and peft adapters here (default: a temp dir)")
    ap.add_argument("--probe", type=Path, help="a built llamacpp_lora_probe: cross-check against llama.cpp")
    args = ap.parse_args()
    all_prompts = [p["ids"] for p in json.loads((args.fixtures / "prompts.json").read_text())["prompts"]]
    prompts = [ids[:n] for ids, n in zip(all_prompts, PROMPT_TOKENS)]
    ids = [torch.tensor(p) for p in prompts]
    refs = {f"prompts/p{i}": np.array(p, np.int32) for i, p in enumerate(prompts)}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        # The folder names become the files' general.name ("Qwen3moe Tiny", "Attn Lora", "Experts Lora").
        base_dir, base_gguf, base_f32 = work / "qwen3moe-tiny", HERE / "base-qwen3moe.gguf", work / "base-f32.gguf"
        write_base(args.fixtures, base_dir)
        convert_base(args.llama_cpp, base_dir, base_gguf, "bf16")
        convert_base(args.llama_cpp, base_dir, base_f32, "f32")
        check_base_lossless(args.llama_cpp, base_gguf, base_f32)
        base = peft_logits(load_model(base_dir), ids)
        for i, x in enumerate(base):
            refs[f"base/p{i}/logits"] = x.numpy()
            shared = np.load(args.fixtures / "qwen3moe" / "ref" / f"hf_float32_p{i}.npy")[:len(prompts[i])]
            print(f"base p{i} vs the fixture's hf_float32 (transformers 4.57.6): "
                  f"max-abs {np.abs(x.numpy() - shared).max():.1e}")
        for a in ADAPTERS:
            model, out = make_peft(a, base_dir), HERE / f"{a.name}-lora.gguf"
            lora_dir = work / (f"{a.name}-lora-peft" if a.target_parameters else f"{a.name}-lora")
            save_peft(model, lora_dir)
            if a.target_parameters:
                print("converter on peft's parameter-LoRA:", check_direct_conversion_fails(
                    args.llama_cpp, base_dir, lora_dir, work))
                per_expert_adapter(model, lora_dir, work / f"{a.name}-lora")
                lora_dir = work / f"{a.name}-lora"
            done = convert_lora(args.llama_cpp, base_dir, lora_dir, out)
            assert done.returncode == 0, done.stderr[-2000:]
            shapes = check_adapter_gguf(args.llama_cpp, a, out)
            print(f"{out.name}: {out.stat().st_size:,} bytes, {len(shapes)} tensors")
            for name, shape in shapes.items():
                print(f"  {name} {list(shape)}")
            got = peft_logits(model, ids)
            merged = merged_logits(base_dir, tensors_f32(args.llama_cpp, out), a.alpha, ids)
            for i, (x, y, b) in enumerate(zip(got, merged, base)):
                change, err = rel_l2(x, b), float((x - y).abs().max())
                print(f"{a.name} p{i}: rel-L2 from base {change:.3f}, merged GGUF vs peft max-abs {err:.1e}")
                assert change > 1e-2 and err < 1e-5, (change, err)
                refs[f"{a.name}/p{i}/logits"] = x.numpy()
            refs |= {f"{a.name}/delta/{k}": v for k, v in sample_deltas(model, a).items()}
        np.savez_compressed(HERE / "references.npz", **refs)
        if args.probe:
            cross_check(args.probe, base_f32, prompts, refs)


if __name__ == "__main__":
    main()
