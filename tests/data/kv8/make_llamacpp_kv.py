"""Remake llamacpp_kv.json: llama.cpp's logits under each KV-cache setting, measured against the fixtures'
exact-dequant references (README.md here). Not run by the tests; they read only the JSON.

    python make_llamacpp_kv.py LLAMA_CPP_DIR FIXTURES_DIR KV_PROBE_BINARY

Run from the repository root or anywhere: it imports tests.support.gguf_edit by path.
"""

import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.support.gguf_edit import rewrite_gguf  # noqa: E402

FAMILIES = ("qwen3moe", "qwen2moe", "mixtral", "olmoe", "deepseek2", "deepseek3", "gptoss", "glm4moe", "dbrx", "llama4",
            "deepseek")
# name -> (type_k, type_v, flash attention): f16_fa and q8_0_fa differ only in the KV type.
SETTINGS = {
    "f16_fa": ("f16", "f16", "on"),
    "q8_0_fa": ("q8_0", "q8_0", "on"),
    "q8_0k_f16v_fa": ("q8_0", "f16", "on"),
    "f32_fa": ("f32", "f32", "on"),
    "f32_nofa": ("f32", "f32", "off"),
    "f16_nofa": ("f16", "f16", "off"),
}
DEFAULT_SETTING = ("f16", "f16", "auto")  # llama_context_default_params(): what -ctk/-ctv/-fa leave alone
# On the all-F32 copy only the attention settings that matter for the comparison.
DEQUANTIZED_SETTINGS = ("f16_fa", "q8_0_fa", "q8_0k_f16v_fa", "f32_nofa")
# llama.cpp against itself: what the KV type alone moves (each pair differs in nothing else), and how far its
# default attention is from its most exact one.
BETWEEN_SETTINGS = (("q8_0_fa", "f16_fa"), ("q8_0k_f16v_fa", "f16_fa"), ("f16_fa", "f32_nofa"))
# Per-row max-abs is kept only for these (on the q8_0 file), to keep the JSON small; f32_fa is f16_fa bit for bit.
PER_ROW_MAX_ABS = ("f16_fa", "q8_0_fa", "q8_0k_f16v_fa", "f32_nofa")
NEAR_TIE_MARGIN = 1e-3
SIG_DIGITS = 4


def round_sig(values) -> list:
    return [float(f"{v:.{SIG_DIGITS - 1}e}") for v in values]


def reference_path(family_dir: Path, prompt_index: int) -> Path:
    """transformers on the q8_0 file's dequantized weights; deepseek has no transformers class, so its exact
    reference is llama.cpp on an all-F32 copy of the file (fixtures README)."""
    hfdeq = family_dir / "ref" / f"hfdeq_q8_0_p{prompt_index}.npy"
    return hfdeq if hfdeq.exists() else family_dir / "ref" / f"llamacpp_deq_q8_0_p{prompt_index}.npy"


def write_f32_copy(src: Path, dst: Path) -> None:
    """Every tensor dequantized by gguf-py, metadata unchanged: llama.cpp then runs its matmuls in f32 on
    unquantized activations, so what is left between it and the reference is its attention and KV cache."""
    def to_f32(_name, data, qtype):
        return dequantize(data, qtype).astype(np.float32), GGMLQuantizationType.F32
    rewrite_gguf(src, dst, edit_tensor=to_f32)


def run_probe(probe: str, gguf: Path, setting: tuple, ids: list, out: Path):
    """Logits [T, V], the resolved flash-attention flag, and llama.cpp's complaint if it refused."""
    type_k, type_v, fa = setting
    cmd = [probe, str(gguf), str(out), type_k, type_v, fa, *map(str, ids)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        errors = [line.strip() for line in proc.stderr.splitlines() if line.strip().strip(".")]
        return None, None, " | ".join(errors[-3:])
    resolved_fa = next(line.split("=")[1] for line in proc.stderr.splitlines() if line.startswith("kv_probe:"))
    n_tokens, n_vocab = np.fromfile(out, dtype=np.int32, count=2)
    return np.fromfile(out, dtype=np.float32, offset=8).reshape(n_tokens, n_vocab), resolved_fa, None


def compare(logits: np.ndarray, ref: np.ndarray, per_row_max_abs: bool) -> dict:
    rel_l2 = np.linalg.norm(logits - ref, axis=1) / np.linalg.norm(ref, axis=1)
    max_abs = np.abs(logits - ref).max(axis=1)
    flipped = np.nonzero(logits.argmax(1) != ref.argmax(1))[0]
    result = {
        "flipped_positions": flipped.tolist(),
        "num_flipped": int(flipped.size),
        "rel_l2": round_sig(rel_l2),
        "max_rel_l2": round_sig([rel_l2.max()])[0],
        "median_rel_l2": round_sig([np.median(rel_l2)])[0],
        "max_abs": round_sig(max_abs) if per_row_max_abs else round_sig([max_abs.max()])[0],
    }
    return result


def near_ties(ref: np.ndarray) -> list:
    top2 = np.sort(ref, axis=1)[:, -2:]
    return np.nonzero(top2[:, 1] - top2[:, 0] < NEAR_TIE_MARGIN)[0].tolist()


def measure_file(probe: str, gguf: Path, settings: tuple, prompts: list, refs: list, tmp: Path,
                 per_row_max_abs: bool) -> dict:
    """Every setting on every prompt of one file, against the references and against each other."""
    result = {"refused": {}, "resolved_flash_attn": {}, "prompts": []}
    for prompt, ref in zip(prompts, refs):
        entry, raw = {"settings": {}}, {}
        for name in settings:
            logits, resolved_fa, refusal = run_probe(probe, gguf, SETTINGS[name], prompt["ids"], tmp / "out.bin")
            if logits is None:
                result["refused"][name] = refusal
                continue
            result["resolved_flash_attn"][name] = resolved_fa
            raw[name] = logits
            entry["settings"][name] = compare(logits, ref, per_row_max_abs and name in PER_ROW_MAX_ABS)
        entry["between_settings"] = {f"{a}_vs_{b}": compare(raw[a], raw[b], per_row_max_abs=False)
                                     for a, b in BETWEEN_SETTINGS if a in raw and b in raw}
        entry["bit_identical"] = [[a, b] for a in raw for b in raw if a < b and np.array_equal(raw[a], raw[b])]
        if per_row_max_abs:
            logits, resolved_fa, _ = run_probe(probe, gguf, DEFAULT_SETTING, prompt["ids"], tmp / "out.bin")
            same = [name for name in raw if np.array_equal(raw[name], logits)]
            entry["default_bit_identical_to"] = same
            result["resolved_flash_attn"]["default"] = resolved_fa
        result["prompts"].append(entry)
    return result


def measure_family(probe: str, family_dir: Path, prompts: list, tmp: Path) -> dict:
    gguf = family_dir / f"{family_dir.name}-q8_0.gguf"
    ref_files = [reference_path(family_dir, index) for index in range(len(prompts))]
    refs = [np.load(path) for path in ref_files]
    result = {"gguf": gguf.name, "references": [path.name for path in ref_files],
              "reference_top1": [ref.argmax(1).tolist() for ref in refs],
              "near_tie_positions": [near_ties(ref) for ref in refs]}
    result.update(measure_file(probe, gguf, tuple(SETTINGS), prompts, refs, tmp, per_row_max_abs=True))
    f32_copy = tmp / f"{family_dir.name}-q8_0-as-f32.gguf"
    write_f32_copy(gguf, f32_copy)
    result["dequantized_f32_copy"] = measure_file(probe, f32_copy, DEQUANTIZED_SETTINGS, prompts, refs, tmp,
                                                  per_row_max_abs=False)
    return result


def provenance(llama_cpp: Path) -> dict:
    tree = subprocess.run(
        "find src ggml/src ggml/include include -type f | LC_ALL=C sort | xargs sha256sum | sha256sum",
        shell=True, cwd=llama_cpp, capture_output=True, text=True, check=True).stdout.split()[0]
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()

    def field(key):
        return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.split(":")[0].strip() == key)

    return {
        "llama_cpp": {"tree": "../peers/llama.cpp (no .git; build-info commit 'unknown')",
                      "ggml_version": "0.25.3", "libllama_version": "0.5.0", "gguf_py": "0.19.0",
                      "tree_sha256": tree,
                      "tree_sha256_is": "sha256 of `find src ggml/src ggml/include include -type f | LC_ALL=C sort "
                                        "| xargs sha256sum`, run in the tree",
                      "build": "CMake Release, GGML_NATIVE=ON, OpenMP, CPU backend only"},
        "cpu": {"model_name": field("model name"), "cpu_family": int(field("cpu family")),
                "model": int(field("model")), "machine": platform.machine()},
    }


def main():
    llama_cpp, fixtures, probe = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    prompts = json.loads((fixtures / "prompts.json").read_text())["prompts"]
    doc = {
        **provenance(llama_cpp),
        "threads": 2,
        "run": "libllama, n_gpu_layers 0, n_ctx = n_batch = n_ubatch = 256, one llama_decode per prompt with "
               "logits at every position, empty cache, ids as given (no BOS)",
        "settings": {name: {"type_k": k, "type_v": v, "flash_attn": fa} for name, (k, v, fa) in SETTINGS.items()},
        "default_setting": dict(zip(("type_k", "type_v", "flash_attn"), DEFAULT_SETTING)),
        "metrics": "per position against the reference: flipped = argmax differs; rel_l2 = ||x - ref|| / ||ref||; "
                   f"max_abs; {SIG_DIGITS} significant digits. near_tie_positions: reference top-2 margin "
                   f"< {NEAR_TIE_MARGIN}. between_settings: the same metrics with the second setting's logits as "
                   "the reference. dequantized_f32_copy: the same runs on the q8_0 file with every tensor "
                   "dequantized to F32 by gguf-py (no activation quantization in llama.cpp's matmuls)",
        "prompts": [prompt["ids"] for prompt in prompts],
        "families": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            family_dir = fixtures / family
            if (family_dir / f"{family}-q8_0.gguf").exists():
                doc["families"][family] = measure_family(probe, family_dir, prompts, Path(tmp))
    out = Path(__file__).with_name("llamacpp_kv.json")
    out.write_text(json.dumps(doc, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
