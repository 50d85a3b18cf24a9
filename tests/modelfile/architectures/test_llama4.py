"""llama4 (Llama-4 Scout / Maverick): iRoPE attention and input-weighted top-1 experts.

The fixtures (../shared/fixtures/llama4, see its README) are llama.cpp's GGUFs of a 4-layer model:
MoE on layers 1 and 3, layer 3 NoPE, L2 q/k norm, llama3 rope scaling as `rope_freqs`, a top-1
sigmoid router whose weight scales the expert's input. Chunked attention and the temperature act
from position 8191 on, beyond its prompts: the tiny transformers model here has a chunk and floor
of 8 (SplitMoE's own `llama4.splitmoe.*` keys carry them), so 40 tokens cross four chunks.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from splitmoe.attention_service.expert_backends.backend import InProcessExperts
from splitmoe.attention_service.expert_backends.remote import RemoteExperts, RemoteExpertsSettings
from splitmoe.attention_service.model import attention as attention_module
from splitmoe.attention_service.model.attention import grouped_attention
from splitmoe.attention_service.model.batch import SeqSlice, StepBatch
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.kernels import native
from splitmoe.kernels.decode_attention import decode_attention
from splitmoe.modelfile.architectures.llama4 import ARCHITECTURE as LLAMA4
from splitmoe.modelfile.gguf_file import GGUFError, GGUFFile
from tests.attention_service.model.test_native_decode import checked_decode, decode
from tests.support.expert_services import ExpertServices
from tests.support.fixture_refs import assert_converter_matches_llama_cpp
from tests.support.gguf_edit import rewrite_gguf
from tests.support.hf_reference import build_model, hf_logits, max_abs, rel_l2, splitmoe_logits, token_ids
from tests.support.hf_to_gguf import convert
from tests.support.processes import CLUSTER

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
ARCH = "llama4"


# ---- the llama.cpp fixtures ------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_ids(fixtures_dir) -> list[list[int]]:
    return [p["ids"] for p in json.loads((fixtures_dir / "prompts.json").read_text())["prompts"]]


# Logits against the references: tests/attention_service/model/test_fixtures.py, with the other families.


def test_converter_matches_llama_cpp(fixtures_dir, tmp_path):
    assert_converter_matches_llama_cpp(fixtures_dir / ARCH, tmp_path)


def test_the_file_states_the_iRoPE_of_llama_cpp(fixtures_dir, tmp_path):
    cfg = LLAMA4.config(GGUFFile(fixtures_dir / ARCH / f"{ARCH}-q8_0.gguf"))
    assert (cfg.nope_layer_interval, cfg.attention_chunk_tokens, cfg.moe_layer_interval) == (4, 8192, 2)
    assert (cfg.attention_temperature_floor_tokens, cfg.attention_temperature_scale) == (8192, 0.1)
    # A config whose every layer is full attention converts with sliding_window = 0: no chunks, no
    # temperature, and llama.cpp's NoPE interval becomes the layer count.
    full = tmp_path / "full.gguf"
    rewrite_gguf(fixtures_dir / ARCH / f"{ARCH}-q8_0.gguf", full, set_keys={"llama4.attention.sliding_window": 0})
    cfg = LLAMA4.config(GGUFFile(full))
    assert (cfg.nope_layer_interval, cfg.attention_chunk_tokens, cfg.attention_temperature_floor_tokens) == (4, 0, 0)


@pytest.mark.parametrize("edit, message", [
    ({"drop_keys": ("llama4.interleave_moe_layer_step",)}, "'llama4.interleave_moe_layer_step'"),
    ({"drop_keys": ("llama4.expert_feed_forward_length",)}, "'llama4.expert_feed_forward_length'"),
    ({"set_keys": {"llama4.interleave_moe_layer_step": 1}},
     "layer 0 lacks a router ('blk.0.ffn_gate_inp.weight'), against metadata key 'llama4.interleave_moe_layer_step' = 1"),
])
def test_the_moe_layer_step_is_required_and_checked(fixtures_dir, tmp_path, edit, message):
    broken = tmp_path / "broken.gguf"
    rewrite_gguf(fixtures_dir / ARCH / f"{ARCH}-q8_0.gguf", broken, **edit)
    with pytest.raises(GGUFError) as e:
        runner(broken)
    assert "broken.gguf" in str(e.value) and message in str(e.value)


# ---- a tiny transformers model with chunks of 8 ------------------------------------------------

NUM_TOKENS = 40
CHUNK = 8


def llama4_config(chunk: int = CHUNK, floor: int = CHUNK, **changes):
    from transformers import Llama4TextConfig

    # llama3 rope with an original context of 16 and high > low frequency factor: every branch of
    # its divisors (1, factor, smoothed) occurs among the 8 pairs.
    rope = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 5e5}
    return Llama4TextConfig(**{
        "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 16, "intermediate_size_mlp": 48,
        "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
        "attention_chunk_size": chunk, "floor_scale": floor, "attn_scale": 0.1, "no_rope_layer_interval": 4,
        "use_qk_norm": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "tie_word_embeddings": False,
        "rope_parameters": rope, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **changes})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(ids, transformers' float32 logits, f32 GGUF) of the chunk-8 model."""
    model = build_model(llama4_config(), 500)
    ids = token_ids(NUM_TOKENS, 500)
    path = convert(model, tmp_path_factory.mktemp("llama4") / "llama4-tiny-f32.gguf")
    return ids, hf_logits(model, ids), path


def test_tiny_float32_matches_transformers(tiny):
    ids, ref, path = tiny
    assert max_abs(splitmoe_logits(path, ids), ref) <= 1e-4


def test_the_chunks_and_the_temperature_change_the_tiny_models_logits(tiny):
    """What the test above checks is not plain causal attention: the same weights with llama.cpp's
    chunk and floor (8192: no effect on 40 tokens) answer otherwise."""
    ids, ref, _ = tiny
    plain = hf_logits(build_model(llama4_config(chunk=8192, floor=8192), 500), ids)
    assert max_abs(plain, ref) > 0.1


def runner(path, dtype=torch.float32, experts=None) -> ModelRunner:
    options = RunnerOptions(dtype=dtype, device=torch.device("cpu"), kv_cache_tokens=256, kv_block_tokens=4)
    return ModelRunner.from_gguf(path, options, experts)


def stepped(r: ModelRunner, ids: list[int], step_tokens: int) -> np.ndarray:
    """Every position's logits, computed `step_tokens` new tokens per step (steps straddle chunks)."""
    seq, out = Sequence(0, ids), []
    for start in range(0, len(ids), step_tokens):
        n = min(step_tokens, len(ids) - start)
        out.append(r.step([seq], [n], all_logits=True))
    return torch.cat(out).numpy()


@pytest.mark.parametrize("step_tokens", [1, 3])
def test_tiny_decode_steps_equal_transformers(tiny, step_tokens):
    ids, ref, path = tiny
    assert max_abs(stepped(runner(path), ids, step_tokens), ref) <= 1e-4


@pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels: {native.UNAVAILABLE_REASON}")
@pytest.mark.parametrize("step_tokens", [1, 3])
def test_tiny_native_decode_attention_over_chunks(tiny, monkeypatch, step_tokens):
    """bfloat16 on the CPU: each decode step's chunked layers take the native kernel over their
    chunk's context, checked call by call against the torch attention; the logits stay those of
    transformers to bfloat16's error."""
    ids, ref, path = tiny
    checked = checked_decode(monkeypatch)
    got = stepped(runner(path, torch.bfloat16), ids, step_tokens)
    assert len(checked) == 4 * -(-NUM_TOKENS // step_tokens)  # every layer of every step
    assert rel_l2(got, ref) <= 3e-2


@pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels: {native.UNAVAILABLE_REASON}")
def test_tiny_native_decode_of_two_sequences_over_chunks(tiny, monkeypatch):
    """Two sequences of different lengths in one step: each row's chunk is its own sequence's."""
    ids, _, path = tiny
    checked = checked_decode(monkeypatch)
    decode(path, ids)
    assert checked


def test_maverick_has_no_l2_qk_norm(tmp_path):
    """llama.cpp keys the L2 q/k norm off the expert count: 128 experts (Maverick) have none, as
    Maverick's config says (use_qk_norm false)."""
    model = build_model(llama4_config(num_local_experts=128, use_qk_norm=False), 503)
    ids = token_ids(NUM_TOKENS, 503)
    path = convert(model, tmp_path / "maverick.gguf")
    assert max_abs(splitmoe_logits(path, ids), hf_logits(model, ids)) <= 1e-4


def test_chunked_context_groups_rows_by_chunk():
    """Rows at positions 6..9 with chunks of 8: 6 and 7 see 0..7, 8 and 9 see only 8..9."""
    slots = torch.arange(100, 110)
    batch = StepBatch(token_ids=torch.zeros(4, dtype=torch.long), positions=torch.arange(6, 10),
                      new_slots=slots[6:], seqs=(SeqSlice(0, 4, slots),), logits_rows=torch.arange(4))
    ctx = batch.chunked_attention_context(8)
    assert ctx.seqs.tolist() == [[0, 2, 0, 8], [2, 2, 8, 2]]
    assert ctx.slots.tolist() == [*range(100, 108), 108, 109]


@pytest.mark.parametrize("host_positions", [True, False], ids=["cpu", "accelerator"])
def test_chunked_grouped_attention_is_masked_attention(monkeypatch, host_positions):
    """On the CPU the keys before the chunk are skipped; on an accelerator (no host positions) the
    whole context is masked instead."""
    if not host_positions:
        monkeypatch.setattr(attention_module, "host_positions", lambda positions: None)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 8, generator=gen) for n in (7, 23, 23))
    positions = torch.arange(16, 23)
    got = grouped_attention(q, k.transpose(0, 1), v.transpose(0, 1), positions, 0.3, chunk_tokens=5)
    keys = torch.arange(23)
    allowed = (keys[None, :] <= positions[:, None]) & (keys[None, :] >= positions[:, None] // 5 * 5)
    scores = torch.einsum("thd,chd->thc", q, k) * 0.3
    probs = torch.softmax(scores.masked_fill(~allowed[:, None, :], float("-inf")), dim=-1)
    torch.testing.assert_close(got, torch.einsum("thc,chd->thd", probs, v), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels: {native.UNAVAILABLE_REASON}")
def test_native_kernel_over_a_chunked_context_equals_the_torch_path():
    gen = torch.Generator().manual_seed(1)
    pool_k, pool_v = torch.randn(2, 64, 16, generator=gen), torch.randn(2, 64, 16, generator=gen)
    slots = torch.randperm(64, generator=gen)[:30]
    batch = StepBatch(token_ids=torch.zeros(3, dtype=torch.long), positions=torch.arange(27, 30),
                      new_slots=slots[27:], seqs=(SeqSlice(0, 3, slots),), logits_rows=torch.arange(3))
    q = torch.randn(3, 4, 16, generator=gen)
    got = decode_attention(batch.chunked_attention_context(14), q, pool_k, pool_v, 0.25)
    want = grouped_attention(q, pool_k[:, slots], pool_v[:, slots], batch.positions, 0.25, chunk_tokens=14)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---- experts whose weight scales their input, computed elsewhere -------------------------------


def test_top_k_over_one_weighs_each_experts_input(tiny):
    """Two experts per token: each gets the token's input times its own weight (HF's Llama4TextMoe
    with top_k 2), through the same per-row path remote experts take."""
    ids = token_ids(12, 501)
    model = build_model(llama4_config(num_experts_per_tok=2), 502)
    path = convert(model, tiny[2].parent / "top2.gguf")
    assert max_abs(splitmoe_logits(path, ids), hf_logits(model, ids)) <= 1e-4


def test_micro_batches_give_the_unsplit_logits(tiny):
    """Two sequences as two pipelined halves: each half's input-weighted rows submitted, then summed."""
    ids, _, path = tiny

    def run(micro_batches: int) -> torch.Tensor:
        options = RunnerOptions(device=torch.device("cpu"), kv_cache_tokens=256, kv_block_tokens=4,
                                micro_batches=micro_batches)
        r = ModelRunner.from_gguf(path, options)
        seqs = [Sequence(0, ids), Sequence(1, ids[5:])]
        first = r.step(seqs, [20, 17], all_logits=True)
        return torch.cat([first, *(r.step(seqs, [1, 1]) for _ in range(3))])

    assert (run(2) - run(1)).abs().max().item() <= 1e-5


@pytest.mark.stack
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_remote_experts_give_the_in_process_logits(tiny, tmp_path, transport):
    ids, ref, path = tiny
    g = GGUFFile(path)
    services = ExpertServices(tmp_path)
    services.start("low", path, "--experts", "0-1")
    services.start("high", path, "--experts", "2-3")
    try:
        services.wait()
        settings = RemoteExpertsSettings(addresses=(services.address("low"), services.address("high")),
                                         transport=transport, security=CLUSTER)
        backend = RemoteExperts(g, settings)
        try:
            got = runner(path, experts=backend).step([Sequence(0, ids)], all_logits=True).numpy()
        finally:
            backend.close()
    finally:
        services.stop_all()
    in_process = runner(path, experts=InProcessExperts(g)).step([Sequence(0, ids)], all_logits=True).numpy()
    assert max_abs(got, in_process) <= 1e-5
    assert max_abs(got, ref) <= 1e-4
