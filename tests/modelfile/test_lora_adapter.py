"""LoRA adapters in llama.cpp's GGUF format: the two fixture adapters (tests/data/lora, made by peft and
llama.cpp's converter) load as llama.cpp reads them, their deltas equal peft's, and a file that does not
fit the base is refused in one line naming the file and the key or tensor."""
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from splitmoe.modelfile.gguf_file import GGUFError, GGUFFile
from splitmoe.modelfile.lora_adapter import (
    LoraAdapterError,
    adapter_identity,
    is_routed_expert,
    load_lora_adapter,
)
from tests.support.gguf_edit import rewrite_gguf

DATA = Path(__file__).resolve().parents[1] / "data" / "lora"
ATTN, EXPERTS = DATA / "attn-lora.gguf", DATA / "experts-lora.gguf"
F32 = GGMLQuantizationType.F32


@pytest.fixture(scope="module")
def base() -> GGUFFile:
    return GGUFFile(DATA / "base-qwen3moe.gguf")


@pytest.fixture(scope="module")
def refs() -> dict[str, np.ndarray]:
    with np.load(DATA / "references.npz") as z:
        return {k: z[k] for k in z.files}


def test_attention_adapter_as_llama_cpp_reads_it(base):
    lora = load_lora_adapter(ATTN, base, "attn")
    names = {f"blk.{i}.attn_{m}.weight" for i in (0, 1) for m in ("q", "k", "v", "output")} | {"output.weight"}
    assert lora.name == "attn" and lora.alpha == 16.0 and set(lora.tensors) == names
    assert lora.attention_side() == lora.tensors and lora.expert_side() == {}
    q, k, out = lora.tensors["blk.0.attn_q.weight"], lora.tensors["blk.1.attn_k.weight"], lora.tensors["output.weight"]
    assert (q.a.shape, q.b.shape) == ((8, 128), (128, 8))
    assert (k.a.shape, k.b.shape) == ((8, 128), (64, 8))
    assert (out.a.shape, out.b.shape) == ((4, 128), (2048, 4))  # peft's rank_pattern: lm_head at rank 4
    # llama.cpp's scale is alpha over each tensor's own rank: 16 / 8, and 16 / 4 for the output head.
    assert q.scale == k.scale == 2.0 and out.scale == 4.0 and lora.rank == 8
    assert all(t.a.dtype == t.b.dtype == torch.float32 for t in lora.tensors.values())


def test_expert_adapter_as_llama_cpp_reads_it(base):
    lora = load_lora_adapter(EXPERTS, base, "experts")
    names = {f"blk.{i}.ffn_{m}_exps.weight" for i in (0, 1) for m in ("gate", "up", "down")}
    assert set(lora.tensors) == names and lora.expert_side() == lora.tensors and lora.attention_side() == {}
    gate, down = lora.tensors["blk.0.ffn_gate_exps.weight"], lora.tensors["blk.1.ffn_down_exps.weight"]
    assert (gate.a.shape, gate.b.shape) == ((16, 4, 128), (16, 32, 4))  # base [16, 32, 128]
    assert (down.a.shape, down.b.shape) == ((16, 4, 32), (16, 128, 4))  # base [16, 128, 32]
    assert lora.alpha == 6.0 and lora.rank == 4 and all(t.scale == 1.5 for t in lora.tensors.values())


@pytest.mark.parametrize("adapter", ["attn", "experts"])
def test_deltas_equal_peft_delta_weights(base, refs, adapter):
    """scale * B @ A against peft's own `get_delta_weight`, saved by make_lora_fixtures.py: the output head's
    first 64 rows, and experts 0 and 5 of each expert tensor."""
    lora = load_lora_adapter(DATA / f"{adapter}-lora.gguf", base, adapter)
    keys = [k for k in refs if k.startswith(f"{adapter}/delta/")]
    assert len(keys) == (3 if adapter == "attn" else 6)
    for key in keys:
        delta = lora.tensors[key.removeprefix(f"{adapter}/delta/")].delta()
        delta = delta[:64] if key.endswith("/output.weight") else delta[[0, 5]] if delta.dim() == 3 else delta
        want = torch.from_numpy(refs[key])
        torch.testing.assert_close(delta, want, rtol=0, atol=1e-6, msg=key)
        assert want.abs().max() > 1e-2  # a delta of visible size, so the check can fail


def test_routed_expert_names():
    assert is_routed_expert("blk.3.ffn_gate_exps.weight") and is_routed_expert("blk.3.ffn_gate_up_exps.weight")
    assert is_routed_expert("blk.3.ffn_down.7.weight")  # the older one-tensor-per-expert layout
    for name in ("blk.3.ffn_gate_shexp.weight", "blk.3.ffn_gate.weight", "blk.3.ffn_gate_inp.weight",
                 "output.weight", "blk.3.attn_q.weight"):
        assert not is_routed_expert(name), name


def test_identity_tells_same_sized_adapters_apart(tmp_path):
    ident = adapter_identity(ATTN)
    assert ident.startswith("attn-lora.gguf:93632:") and ident != adapter_identity(EXPERTS)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    copy, changed = tmp_path / "a" / ATTN.name, tmp_path / "b" / ATTN.name
    rewrite_gguf(ATTN, copy)

    def nudge(name, data, qtype):
        if name == "blk.1.attn_v.weight.lora_b":
            data = data.copy()
            data[7, 3] += 0.5
        return data, qtype

    rewrite_gguf(ATTN, changed, edit_tensor=nudge)
    assert copy.stat().st_size == changed.stat().st_size
    assert adapter_identity(copy) == ident != adapter_identity(changed)
    assert load_lora_adapter(changed, GGUFFile(DATA / "base-qwen3moe.gguf"), "x").identity == adapter_identity(changed)


def test_alpha_zero_or_absent_means_scale_one(base, tmp_path):
    """As llama.cpp: `alpha ? alpha / rank : 1`."""
    for path, kw in ((tmp_path / "zero.gguf", {"set_keys": {"adapter.lora.alpha": 0.0}}),
                     (tmp_path / "none.gguf", {"drop_keys": ("adapter.lora.alpha",)})):
        rewrite_gguf(ATTN, path, **kw)
        lora = load_lora_adapter(path, base, "x")
        assert lora.alpha == 0.0 and all(t.scale == 1.0 for t in lora.tensors.values())


def test_norm_vectors_are_skipped_as_llama_cpp_skips_them(base, tmp_path):
    path = tmp_path / "norm.gguf"
    rewrite_gguf(ATTN, path, add_tensors={"blk.0.attn_norm.weight": (np.ones(128, np.float32), F32)})
    lora = load_lora_adapter(path, base, "x")
    assert lora.skipped == ("blk.0.attn_norm.weight",) and len(lora.tensors) == 9


def test_max_rank(base):
    assert load_lora_adapter(ATTN, base, "x", max_rank=8).rank == 8
    line = refusal(ATTN, base, max_rank=7)
    assert "'blk.0.attn_k.weight.lora_b' has rank 8" in line and "--max-lora-rank" in line


def refusal(path: Path, base: GGUFFile, max_rank: int | None = None) -> str:
    with pytest.raises(GGUFError) as e:
        load_lora_adapter(path, base, "x", max_rank=max_rank)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{path.name}: "), line
    return line


def _resize(target: str, shape: tuple[int, ...]):
    def edit(name, data, qtype):
        return (np.zeros(shape, np.float32), F32) if name == target else (data, qtype)
    return edit


REFUSALS = {
    # name: (source, rewrite_gguf arguments, what the line must say)
    "not an adapter": (None, {}, "not a LoRA adapter: metadata key 'general.type' is 'model'"),
    "not lora": (ATTN, {"set_keys": {"adapter.type": "cvec"}},
                 "metadata key 'adapter.type' is 'cvec', expected 'lora'"),
    "other architecture": (ATTN, {"arch": "qwen2moe"}, "'general.architecture' is 'qwen2moe', but the base model "
                                                       "base-qwen3moe.gguf is 'qwen3moe'"),
    "activated lora": (ATTN, {"set_keys": {"adapter.alora.invocation_tokens": [5, 6]}},
                       "'adapter.alora.invocation_tokens': activated LoRA (aLoRA) is not supported"),
    "tensor the base lacks": (ATTN, {"rename_tensors": {"blk.1.attn_q.weight.lora_a": "blk.2.attn_q.weight.lora_a",
                                                        "blk.1.attn_q.weight.lora_b": "blk.2.attn_q.weight.lora_b"}},
                              "has no tensor 'blk.2.attn_q.weight'"),
    "in dim": (ATTN, {"edit_tensor": _resize("blk.0.attn_v.weight.lora_a", (8, 96))},
               "'blk.0.attn_v.weight.lora_a' / '.lora_b' have shapes [8, 96] / [64, 8], which do not fit base "
               "tensor [64, 128]"),
    "out dim": (ATTN, {"edit_tensor": _resize("output.weight.lora_b", (1024, 4))},
                "'output.weight.lora_a' / '.lora_b' have shapes [4, 128] / [1024, 4]"),
    "ranks differ": (ATTN, {"edit_tensor": _resize("blk.0.attn_q.weight.lora_b", (128, 6))},
                     "'blk.0.attn_q.weight.lora_a' / '.lora_b' have shapes [8, 128] / [128, 6]"),
    "expert count": (EXPERTS, {"edit_tensor": _resize("blk.1.ffn_up_exps.weight.lora_a", (8, 4, 128))},
                     "'blk.1.ffn_up_exps.weight.lora_a' / '.lora_b' have shapes [8, 4, 128] / [16, 32, 4], which "
                     "do not fit base tensor [16, 32, 128]"),
    "2-D pair on experts": (EXPERTS, {"edit_tensor": _resize("blk.0.ffn_down_exps.weight.lora_a", (4, 32))},
                            "'blk.0.ffn_down_exps.weight.lora_a' / '.lora_b' have shapes [4, 32] / [16, 128, 4]"),
    "half a pair": (ATTN, {"drop_tensors": ("blk.0.attn_k.weight.lora_b",)},
                    "tensor 'blk.0.attn_k.weight.lora_a' has no 'blk.0.attn_k.weight.lora_b' to pair with"),
    "unexpected suffix": (ATTN, {"add_tensors": {"blk.0.attn_q.weight.lora_c": (np.zeros((8, 128), np.float32), F32)}},
                          "tensor 'blk.0.attn_q.weight.lora_c' is neither"),
    "on a vector": (ATTN, {"add_tensors": {"blk.0.attn_q_norm.weight.lora_a": (np.zeros((8, 32), np.float32), F32),
                                           "blk.0.attn_q_norm.weight.lora_b": (np.zeros((1, 8), np.float32), F32)}},
                    "base tensor 'blk.0.attn_q_norm.weight' of shape [32] is not a matrix"),
    "embedding": (ATTN, {"add_tensors": {"token_embd.weight.lora_a": (np.zeros((2048, 8), np.float32), F32),
                                         "token_embd.weight.lora_b": (np.zeros((128, 8), np.float32), F32)}},
                  "'token_embd.weight.lora_a' / '.lora_b': LoRA on the token embedding is not supported"),
    "no pairs": (ATTN, {"drop_tensors": tuple(GGUFFile(ATTN).tensor_names)}, "no LoRA tensor pairs"),
    "not finite alpha": (ATTN, {"set_keys": {"adapter.lora.alpha": float("nan")}},
                         "'adapter.lora.alpha' is nan, not a finite number"),
    "alpha not a float": (ATTN, {"set_keys": {"adapter.lora.alpha": 16}},
                          "'adapter.lora.alpha' is INT32, expected a float"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_in_one_line(base, tmp_path, case):
    source, edits, says = REFUSALS[case]
    path = base.path if source is None else tmp_path / "adapter.gguf"
    if source is not None:
        rewrite_gguf(source, path, **edits)
    line = refusal(path, base)
    assert says in line, line
    if case != "alpha not a float":  # the reader's own typed-key error is a plain GGUFError
        with pytest.raises(LoraAdapterError):
            load_lora_adapter(path, base, "x")


def test_not_a_gguf(base, tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not an adapter" * 10)
    assert "not a readable GGUF file" in refusal(path, base)
