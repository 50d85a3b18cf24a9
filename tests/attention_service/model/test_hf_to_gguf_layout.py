"""tests/support/hf_to_gguf.py against llama.cpp's own files: same names, shapes, values, metadata.

Each fixture's HF checkpoint is converted here and compared with the GGUF that llama.cpp's
converter (and llama-quantize) made from it. The bf16 checkpoint loads exactly into float32, so
the f32 conversion must equal `qwen3moe-f32.gguf` bit for bit, sit within Q8_0 rounding of the
dequantized `-q8_0.gguf` files, and our own Q8_0 must reproduce llama-quantize's bytes.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.support.gguf_compare import NAMING_KEYS, parse, q8_0_error_bound, torch_shape, values
from tests.support.hf_to_gguf import F32, Q8_0, convert, load_checkpoint

FIXTURES = Path(__file__).resolve().parents[3].parent / "shared" / "fixtures"
pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"llama.cpp fixtures not found at {FIXTURES}")

# arch dir -> the llama.cpp GGUF to compare with (only qwen3moe ships an f32 one).
REFERENCE = {
    "qwen3moe": "qwen3moe-f32.gguf",
    "qwen2moe": "qwen2moe-q8_0.gguf",
    "mixtral": "mixtral-q8_0.gguf",
    "olmoe": "olmoe-q8_0.gguf",
    "dbrx": "dbrx-q8_0.gguf",
    "deepseek": "deepseek-q8_0.gguf",
}
# Naming keys derived from the directory and parameter count, not hyper-parameters.
@pytest.fixture(scope="module", params=list(REFERENCE))
def case(request, tmp_path_factory):
    """(reference GGUF, our conversion in the reference's tensor type, our f32 conversion), parsed."""
    arch = request.param
    reference = FIXTURES / arch / REFERENCE[arch]
    model = load_checkpoint(FIXTURES / arch / "hf")
    out = tmp_path_factory.mktemp(arch)
    if "-f32" in reference.name:
        f32 = same_type = parse(convert(model, out / "f32.gguf", F32, tokenizer_from=reference))
    else:
        same_type = parse(convert(model, out / "q8_0.gguf", Q8_0, tokenizer_from=reference))
        f32 = parse(convert(model, out / "f32.gguf", F32))
    return parse(reference), same_type, f32


def test_same_tensor_names_types_and_shapes(case):
    ref, got, _ = case
    assert sorted(got.tensors) == sorted(ref.tensors)
    for name, t in ref.tensors.items():
        assert got.tensors[name].tensor_type == t.tensor_type, name
        assert torch_shape(got.tensors[name]) == torch_shape(t), name


def test_same_bytes_as_llama_cpp(case):
    """F32 is the checkpoint's exact values; gguf-py's Q8_0 rounds as llama-quantize's reference does."""
    ref, got, _ = case
    for name, t in ref.tensors.items():
        assert np.array_equal(got.tensors[name].data, t.data), name


def test_f32_within_q8_0_rounding_of_llama_cpp(case):
    """Our f32 values against the reference dequantized: exact for F32, half a Q8_0 step otherwise."""
    ref, _, f32 = case
    for name, t in ref.tensors.items():
        expected = values(t)
        ours = values(f32.tensors[name])
        assert ours.size == expected.size, name
        ours = ours.reshape(expected.shape)  # llama-quantize drops the 1 of [1, D]: compare values
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            assert np.array_equal(ours, expected.astype(np.float32)), name
        else:
            assert np.all(np.abs(ours - expected) <= q8_0_error_bound(ours)), name


def test_same_metadata(case):
    """Hyper-parameters, file type and tokenizer keys: same keys, same values."""
    ref, got, _ = case
    assert sorted(set(got.metadata) - NAMING_KEYS) == sorted(set(ref.metadata) - NAMING_KEYS)
    for key in set(ref.metadata) - NAMING_KEYS:
        assert got.metadata[key] == ref.metadata[key], key
