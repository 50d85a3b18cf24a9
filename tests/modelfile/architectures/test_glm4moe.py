"""glm4moe (GLM-4.5 / 4.5-Air / 4.6): partial rotary, q width ≠ hidden, q/k/v bias, per-head q/k
norm, sigmoid grouped routing with a correction bias and a routed scale, a leading dense layer, a
shared expert, and the NextN/MTP block a converted GLM-4.5 carries.

The fixtures (../shared/fixtures/glm4moe, see its README) are llama.cpp's GGUFs of a 2-layer model
with all of these but NextN. The tiny transformers models run everywhere: GLM-4.5 (q/k norm) and
4.5-Air (none), with 4 groups of which 2 compete; a file of our own adds a NextN block.
"""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.kernels import native
from splitmoe.modelfile.expert_tensors import ExpertShard, moe_layers
from splitmoe.modelfile.gguf_file import GGUFError, GGUFFile
from tests.attention_service.model.test_native_front import check as check_native_front
from tests.support.fixture_refs import assert_converter_matches_llama_cpp
from tests.support.gguf_edit import rewrite_gguf
from tests.support.hf_reference import build_model, hf_logits, max_abs, splitmoe_logits, token_ids
from tests.support.hf_to_gguf import Q8_0, convert

ARCH = "glm4moe"


# ---- the llama.cpp fixtures ------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_ids(fixtures_dir) -> list[list[int]]:
    return [p["ids"] for p in json.loads((fixtures_dir / "prompts.json").read_text())["prompts"]]


# Logits against the references: tests/attention_service/model/test_fixtures.py, with the other families.


def test_converter_matches_llama_cpp(fixtures_dir, tmp_path):
    assert_converter_matches_llama_cpp(fixtures_dir / ARCH, tmp_path)


def test_the_expert_width_is_required(fixtures_dir, tmp_path):
    broken = tmp_path / "broken.gguf"
    rewrite_gguf(fixtures_dir / ARCH / f"{ARCH}-q8_0.gguf", broken, drop_keys=("glm4moe.expert_feed_forward_length",))
    with pytest.raises(GGUFError, match=r"broken.gguf: .*'glm4moe.expert_feed_forward_length'"):
        runner(broken)


def test_decode_token_by_token_equals_prefill(fixtures_dir, prompt_ids):
    r = runner(fixtures_dir / ARCH / f"{ARCH}-q8_0.gguf")
    ids = prompt_ids[1]
    prefill = r.step([Sequence(0, ids)], all_logits=True)
    seq = Sequence(1, ids)
    decoded = torch.cat([r.step([seq], [1]) for _ in ids])
    assert torch.abs(decoded - prefill).max().item() <= 1e-4


def runner(path, dtype: torch.dtype = torch.float32) -> ModelRunner:
    options = RunnerOptions(dtype=dtype, device=torch.device("cpu"), kv_cache_tokens=256, kv_block_tokens=4)
    return ModelRunner.from_gguf(path, options)


# ---- tiny transformers models ------------------------------------------------------------------

NUM_TOKENS = 40


def glm_config(use_qk_norm: bool, **changes):
    from transformers import Glm4MoeConfig

    # q width 4 x 24 = 96 against a hidden 64; rope on 12 of 24 dims; 8 experts in 4 groups, 2 used.
    return Glm4MoeConfig(**{
        "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 24, "partial_rotary_factor": 0.5, "intermediate_size": 96,
        "moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "use_qk_norm": use_qk_norm, "num_nextn_predict_layers": 0, "attention_bias": True, "rms_norm_eps": 1e-5,
        "rope_theta": 1e6, "max_position_embeddings": 256, "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **changes})


def build_glm(config, seed: int) -> torch.nn.Module:
    model = build_model(config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:  # a buffer, which build_model's re-initialisation does not reach
                bias.copy_(0.1 * torch.randn(bias.shape, generator=gen))
    return model


TINY = {"glm-4.5": True, "glm-4.5-air": False}


@pytest.fixture(scope="module", params=list(TINY))
def tiny(request, tmp_path_factory):
    """(model, ids, transformers' float32 logits, f32 GGUF)."""
    seed = 600 + list(TINY).index(request.param)
    model = build_glm(glm_config(TINY[request.param]), seed)
    ids = token_ids(NUM_TOKENS, seed)
    path = convert(model, tmp_path_factory.mktemp(request.param) / f"{request.param}-f32.gguf")
    return model, ids, hf_logits(model, ids), path


def test_tiny_float32_matches_transformers(tiny):
    _, ids, ref, path = tiny
    assert max_abs(splitmoe_logits(path, ids), ref) <= 1e-4


def test_tiny_decode_equals_prefill(tiny):
    _, ids, ref, path = tiny
    r, seq = runner(path), Sequence(0, ids)
    assert max_abs(torch.cat([r.step([seq], [1]) for _ in ids]).numpy(), ref) <= 1e-4


@pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels: {native.UNAVAILABLE_REASON}")
def test_tiny_q8_0_decodes_through_the_native_front(tiny, tmp_path):
    """The fast mode's one-call attention half, with and without q/k norms (4.5 / 4.5-Air), partial
    rotary and a q wider than the hidden state, against the torch path and a float64 reference."""
    model = tiny[0]
    check_native_front(convert(model, tmp_path / "q8_0.gguf", Q8_0))


def test_the_tiny_models_groups_decide(tiny):
    """With every group competing (n_group 1) the same weights answer otherwise: the test above
    checks the group selection, not only the biased top-k."""
    model, ids, ref, _ = tiny
    ungrouped = build_glm(glm_config(model.config.use_qk_norm, n_group=1, topk_group=1), 600 + (not model.config.use_qk_norm))
    assert max_abs(hf_logits(ungrouped, ids), ref) > 0.1


# ---- NextN / MTP ------------------------------------------------------------------------------

NEXTN_TENSORS = ("eh_proj", "enorm", "hnorm", "shared_head_head", "shared_head_norm", "embed_tokens")


def with_nextn_block(path, out):
    """`path` as a converted GLM-4.5 is: one more block (a copy of the last layer's tensors) with its
    `nextn.*` tensors, counted in block_count, and `nextn_predict_layers` = 1."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader

    reader = GGUFReader(path)
    layers = int(reader.fields["glm4moe.block_count"].contents())
    hidden = int(reader.fields["glm4moe.embedding_length"].contents())
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    last = f"blk.{layers - 1}."
    added = {t.name.replace(last, f"blk.{layers}."): (np.array(t.data), t.tensor_type)
             for t in reader.tensors if t.name.startswith(last)}
    shapes = {"eh_proj": (hidden, 2 * hidden), "enorm": (hidden,), "hnorm": (hidden,),
              "shared_head_head": (vocab, hidden), "shared_head_norm": (hidden,), "embed_tokens": (vocab, hidden)}
    for name in NEXTN_TENSORS:
        added[f"blk.{layers}.nextn.{name}.weight"] = (np.ones(shapes[name], dtype=np.float32), T.F32)
    rewrite_gguf(path, out, set_keys={"glm4moe.block_count": layers + 1,
                                      "glm4moe.nextn_predict_layers": 1}, add_tensors=added)
    return out


def test_a_nextn_block_is_skipped_at_load(tiny, tmp_path, caplog):
    _, ids, ref, path = tiny
    nextn = with_nextn_block(path, tmp_path / "nextn.gguf")
    with caplog.at_level(logging.INFO):
        got = splitmoe_logits(nextn, ids)
    assert max_abs(got, ref) <= 1e-4
    assert "skipping the NextN/MTP layers 3" in caplog.text
    g = GGUFFile(nextn)
    assert moe_layers(g) == [1, 2]  # the expert services host no NextN experts either
    assert ExpertShard(g).layers == [1, 2]


def test_a_block_past_the_nextn_ones_is_still_an_error(tiny, tmp_path):
    _, ids, _, path = tiny
    nextn = with_nextn_block(path, tmp_path / "nextn.gguf")
    broken = tmp_path / "broken.gguf"
    rewrite_gguf(nextn, broken, set_keys={"glm4moe.nextn_predict_layers": 0,
                                          "glm4moe.block_count": 3})
    with pytest.raises(Exception, match="past the last layer"):
        runner(broken)
