"""The checks every fixture family shares (../shared/fixtures, see its README): logits of the
prompts, the bfloat16 bound, and tests/support/hf_to_gguf.py against llama.cpp's converter."""
from __future__ import annotations

import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch

from splitmoe.cli import main
from tests.support.gguf_compare import NAMING_KEYS, parse, q8_0_error_bound, torch_shape, values
from tests.support.hf_to_gguf import F32, Q8_0, convert

# A position whose logits are this far (rel-L2) from the exact-dequant reference is a flipped one:
# a routing near-tie decided the other way (the README's "positions > 5e-2").
FLIPPED = 5e-2
MEDIAN_BOUND = 2e-2


def fixture_logits(model: Path, prompts: list[list[int]], dtype: str = "float32") -> list[np.ndarray]:
    """`splitmoe logits` of each prompt on the CPU."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, ids in enumerate(prompts):
            path = Path(tmp) / f"p{i}.npy"
            args = ["logits", str(model), "--token-ids", ",".join(map(str, ids)), "--out", str(path),
                    "--dtype", dtype, "--device", "cpu"]
            assert main(args) == 0
            out.append(np.load(path))
    return out


def per_position_rel_l2(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)


def assert_like_llama_cpp(arch_dir: Path, quant: str, got: list[np.ndarray]) -> None:
    """bfloat16 against `hfdeq_<quant>`: median per-position rel-L2 within 2e-2, and no more flipped
    positions than llama.cpp's own run of the file has against the same reference."""
    ref = np.concatenate([np.load(arch_dir / "ref" / f"hfdeq_{quant}_p{i}.npy") for i in range(len(got))])
    llama_cpp = np.concatenate([np.load(arch_dir / "ref" / f"llamacpp_{quant}_p{i}.npy") for i in range(len(got))])
    ours = per_position_rel_l2(np.concatenate(got), ref)
    assert np.median(ours) <= MEDIAN_BOUND
    flipped = int((ours > FLIPPED).sum())
    assert flipped <= int((per_position_rel_l2(llama_cpp, ref) > FLIPPED).sum()), f"{flipped} positions flipped"


def assert_converter_matches_llama_cpp(arch_dir: Path, tmp_path: Path) -> None:
    """tests/support/hf_to_gguf.py on the fixture checkpoint: llama.cpp's names, shapes, types,
    Q8_0/F16 bytes and metadata; its f32 values are the checkpoint's, to Q8_0/F16 rounding."""
    from transformers import AutoModelForCausalLM

    reference_gguf = arch_dir / f"{arch_dir.name}-q8_0.gguf"
    model = AutoModelForCausalLM.from_pretrained(arch_dir / "hf", dtype=torch.float32)
    ref = parse(reference_gguf)
    got = parse(convert(model, tmp_path / "q8_0.gguf", Q8_0, tokenizer_from=reference_gguf))
    f32 = parse(convert(model, tmp_path / "f32.gguf", F32))
    assert sorted(got.tensors) == sorted(ref.tensors)
    for name, t in ref.tensors.items():
        assert (got.tensors[name].tensor_type, torch_shape(got.tensors[name])) == (t.tensor_type, torch_shape(t)), name
        assert np.array_equal(got.tensors[name].data, t.data), name
        _assert_within_rounding(values(f32.tensors[name]), t, name)
    assert sorted(set(got.metadata) - NAMING_KEYS) == sorted(set(ref.metadata) - NAMING_KEYS)
    for key in set(ref.metadata) - NAMING_KEYS:
        assert got.metadata[key] == ref.metadata[key], key


def _assert_within_rounding(ours: np.ndarray, t: gguf.ReaderTensor, name: str) -> None:
    expected = values(t)
    ours = ours.reshape(expected.shape)
    if t.tensor_type == gguf.GGMLQuantizationType.F16:  # rows no Q8_0 block divides (DeepSeek's attn_q_b, attn_k_b)
        ours = ours.astype(np.float16)
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        assert np.array_equal(ours.astype(np.float32), expected.astype(np.float32)), name
    else:
        assert np.all(np.abs(ours - expected) <= q8_0_error_bound(ours)), name
