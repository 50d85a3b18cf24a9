"""attention_service/expert_backends/device_experts.py: hot experts dequantized into device memory give the exact
float32 reference's expert sum (kernels.moe through ExpertShard) on both strategies, both file layouts and
every activation; the split sends every wanted slot to one side; sizes and the choice fit a byte budget."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from splitmoe.attention_service.expert_backends import device_experts
from splitmoe.attention_service.expert_backends.device_experts import (
    DeviceExperts,
    choose_device_experts,
    expert_device_bytes,
)
from splitmoe.attention_service.expert_backends.load_plan import HeatBudget
from splitmoe.modelfile.expert_tensors import ExpertKey, ExpertShard, expert_tensor_names
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.hparams import ModelConfig
from tests.support.cuda_graphs import captured

FIXTURES = ["gptoss/gptoss-q8_0.gguf", "mixtral/mixtral-q8_0.gguf", "qwen3moe/qwen3moe-q4_k_m.gguf"]
FLOAT32_RTOL = 1e-5
# bfloat16 keeps 8 significant bits: x, the weights and the activation are each rounded once (2^-9
# relative), and products of D and F terms add such errors. Measured: <= 8e-3 of the output's largest
# magnitude on every model here; a wrong expert or weight is off by O(1).
BF16_TOL = 2e-2


def routing(num_tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per row, about a fifth of the slots -1 (not wanted), weights in [0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids[torch.rand(num_tokens, top_k, generator=gen) < 0.2] = -1
    return ids, torch.rand(num_tokens, top_k, generator=gen)


def hosted_pairs(g: GGUFFile) -> dict[int, list[int]]:
    """Every other expert of the first MoE layer, all of the last: ids not hosted must add nothing."""
    cfg = ModelConfig.from_gguf(g)
    return {0: list(range(1, cfg.num_experts, 2)), cfg.num_layers - 1: list(range(cfg.num_experts))}


def keys_of(by_layer: dict[int, list[int]]) -> list[ExpertKey]:
    return [ExpertKey(layer, e) for layer, experts in by_layer.items() for e in experts]


def assert_matches_reference(g: GGUFFile, dtype: torch.dtype, device: str = "cpu", num_tokens=(1, 3, 40)) -> None:
    """Both strategies, and the one the sizes choose, against ExpertShard's float32 reference."""
    cfg = ModelConfig.from_gguf(g)
    by_layer = hosted_pairs(g)
    reference, experts = ExpertShard(g, by_layer=by_layer), DeviceExperts(g, keys_of(by_layer), device, dtype)
    for layer in by_layer:
        for seed, n in enumerate(num_tokens):
            ids, weights = routing(n, cfg.num_experts, cfg.num_experts_used, seed)
            hidden = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
            want = reference.forward(layer, hidden, ids, weights)
            for gather in (True, False, None):
                got = experts.forward(layer, hidden.to(device), ids.to(device), weights.to(device), gather=gather)
                assert got.dtype == torch.float32 and got.shape == want.shape
                assert_close(got.cpu(), want, dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=FLOAT32_RTOL, atol=FLOAT32_RTOL * float(want.abs().max()))
    else:
        torch.testing.assert_close(got, want, rtol=BF16_TOL, atol=BF16_TOL * float(want.abs().max()))


def write_llama_moe(path: Path, per_expert_tensors: bool, num_experts: int = 4, hidden: int = 64,
                    ffn: int = 32) -> None:
    """A two-layer llama (Mixtral) file holding only routers and Q8_0 experts: the 3-D layout, or the
    old one with one 2-D tensor per expert. The same seed gives the same weights in either layout."""
    rng = np.random.default_rng(7)
    w = GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 2), (w.add_embedding_length, hidden), (w.add_feed_forward_length, ffn),
                       (w.add_head_count, 4), (w.add_expert_count, num_experts), (w.add_expert_used_count, 2),
                       (w.add_vocab_size, 16)):
        add(value)
    q8 = GGMLQuantizationType.Q8_0
    for layer in range(2):
        w.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", rng.standard_normal((num_experts, hidden)).astype(np.float32))
        for m, shape in (("gate", (ffn, hidden)), ("up", (ffn, hidden)), ("down", (hidden, ffn))):
            stacked = (rng.standard_normal((num_experts, *shape)) / np.sqrt(shape[1])).astype(np.float32)
            if per_expert_tensors:
                for e in range(num_experts):
                    w.add_tensor(f"blk.{layer}.ffn_{m}.{e}.weight", quantize(stacked[e], q8), raw_dtype=q8)
            else:
                w.add_tensor(f"blk.{layer}.ffn_{m}_exps.weight", quantize(stacked, q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def demo(demo_gguf) -> GGUFFile:
    return GGUFFile(demo_gguf)


@pytest.fixture(scope="module", params=FIXTURES)
def fixture_file(request, fixtures_dir) -> GGUFFile:
    return GGUFFile(fixtures_dir / request.param)


# ---- numerics on the CPU ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_demo_model_matches_the_float32_reference(demo, dtype):
    assert_matches_reference(demo, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_cpp_fixtures_match_the_float32_reference(fixture_file, dtype):
    """gpt-oss: biases and swiglu_oai; mixtral (3-D layout in this fixture), qwen3moe Q4_K_M: SiLU."""
    assert_matches_reference(fixture_file, dtype)


def test_gpt_oss_fixture_has_what_it_is_here_to_test(fixtures_dir):
    g = GGUFFile(fixtures_dir / FIXTURES[0])
    assert {"blk.0.ffn_gate_exps.bias", "blk.0.ffn_down_exps.bias"} <= expert_tensor_names(g, 0)
    assert DeviceExperts(g, [ExpertKey(0, 0)], "cpu")._stacks[0].activation == "swiglu_oai"


def test_old_mixtral_per_expert_layout_matches_the_reference_and_the_3d_layout(tmp_path):
    for per_expert in (True, False):
        write_llama_moe(tmp_path / f"{per_expert}.gguf", per_expert)
    old, new = GGUFFile(tmp_path / "True.gguf"), GGUFFile(tmp_path / "False.gguf")
    assert "blk.0.ffn_gate.3.weight" in expert_tensor_names(old, 0)
    assert_matches_reference(old, torch.float32)
    ids, weights = routing(5, 4, 2, seed=3)
    hidden = torch.randn(5, 64)
    keys = [ExpertKey(0, 1), ExpertKey(0, 2), ExpertKey(1, 0)]
    for layer in (0, 1):
        torch.testing.assert_close(DeviceExperts(old, keys, "cpu", torch.float32).forward(layer, hidden, ids, weights),
                                   DeviceExperts(new, keys, "cpu", torch.float32).forward(layer, hidden, ids, weights),
                                   rtol=0, atol=0)


def test_dense_path_in_several_expert_groups_matches(demo, monkeypatch):
    """Prefill bounds its intermediates by computing the hosted experts a few at a time."""
    monkeypatch.setattr(device_experts, "_DENSE_WORK_BYTES", 40 * 3 * 32 * 4 * 3)  # 3 experts per group at T=40
    assert_matches_reference(demo, torch.float32, num_tokens=(40,))


def test_rows_with_nothing_here_are_zero_even_when_their_hidden_is_not_finite(demo):
    """Padding rows of a captured batch may hold anything; a row routed elsewhere must still add 0."""
    experts = DeviceExperts(demo, [ExpertKey(0, 2), ExpertKey(0, 5)], "cpu", torch.float32)
    hidden = torch.randn(4, 64)
    hidden[1], hidden[3] = float("nan"), float("inf")
    ids = torch.tensor([[2, 0], [-1, -1], [1, 5], [3, 4]])  # rows 1 and 3: nothing hosted here
    weights = torch.rand(4, 2)
    want = ExpertShard(demo, by_layer={0: [2, 5]}).forward(0, hidden, ids, weights)
    for gather in (True, False):
        got = experts.forward(0, hidden, ids, weights, gather=gather)
        assert got[1].eq(0).all() and got[3].eq(0).all()
        torch.testing.assert_close(got, want, rtol=FLOAT32_RTOL, atol=1e-6)


def test_an_empty_batch_gives_an_empty_sum(demo):
    experts = DeviceExperts(demo, [ExpertKey(0, 2)], "cpu", torch.float32)
    empty = torch.zeros(0, 2, dtype=torch.int64)
    for gather in (True, False):
        assert experts.forward(0, torch.zeros(0, 64), empty, empty.float(), gather=gather).shape == (0, 64)


# ---- split, sizes, choice --------------------------------------------------------------------------


def test_split_sends_every_wanted_slot_to_exactly_one_side(demo):
    experts = DeviceExperts(demo, [ExpertKey(0, 1), ExpertKey(0, 6), ExpertKey(1, 3)], "cpu", torch.float32)
    hosted = {0: {1, 6}, 1: {3}}
    ids, _ = routing(64, 8, 2, seed=5)
    for layer in (0, 1):
        here, there = experts.split(layer, ids)
        assert here.shape == there.shape == ids.shape
        assert torch.equal(torch.where(here >= 0, here, there), ids)  # each slot, -1 included, on one side
        assert not ((here >= 0) & (there >= 0)).any()
        assert set(here[here >= 0].tolist()) <= hosted[layer]
        assert set(there[there >= 0].tolist()).isdisjoint(hosted[layer])
        assert (here >= 0).sum() == sum(int((ids == e).sum()) for e in hosted[layer])


def test_split_of_a_layer_with_nothing_here_leaves_everything_to_the_services(demo):
    experts = DeviceExperts(demo, [ExpertKey(0, 1)], "cpu", torch.float32)
    ids, _ = routing(6, 8, 2, seed=1)
    here, there = experts.split(1, ids)
    assert here.eq(-1).all() and torch.equal(there, ids) and not experts.has_layer(1)
    with pytest.raises(KeyError, match="layer 1"):
        experts.forward(1, torch.zeros(6, 64), ids, torch.ones(6, 2))


def test_bytes_per_expert_by_hand(demo, fixtures_dir):
    assert expert_device_bytes(demo, 0) == 3 * 64 * 32 * 2  # demo: D 64, F 32, bfloat16
    assert expert_device_bytes(demo, 0, torch.float32) == 3 * 64 * 32 * 4
    gpt_oss = GGUFFile(fixtures_dir / FIXTURES[0])  # D 128, F 32, float32 biases for gate, up [F] and down [D]
    assert expert_device_bytes(gpt_oss, 1) == 3 * 128 * 32 * 2 + (32 + 32 + 128) * 4


def test_device_bytes_are_the_sum_of_the_experts_sizes(demo):
    keys = [ExpertKey(0, 0), ExpertKey(0, 7), ExpertKey(1, 4)]
    for dtype in (torch.float32, torch.bfloat16):
        assert DeviceExperts(demo, keys, "cpu", dtype).num_bytes == 3 * expert_device_bytes(demo, 0, dtype)


def test_choice_within_a_byte_budget_is_the_hottest_that_fit(demo):
    heat = torch.zeros(2, 8)
    heat[0, 3], heat[1, 5], heat[1, 0], heat[0, 6], heat[0, 1] = 50.0, 40.0, 30.0, 20.0, 10.0
    bf16 = expert_device_bytes(demo, 0)
    budget = HeatBudget.parse(f"{3 * bf16 + bf16 // 2}B")
    hottest = [ExpertKey(0, 3), ExpertKey(1, 5), ExpertKey(1, 0)]
    assert choose_device_experts(demo, heat, budget) == hottest
    assert choose_device_experts(demo, heat, budget, torch.float32) == hottest[:1]  # twice the bytes each
    assert choose_device_experts(demo, heat, HeatBudget.parse("1G")) == [*hottest, ExpertKey(0, 6), ExpertKey(0, 1)]
    assert choose_device_experts(demo, heat, HeatBudget.parse("1G"), layers=[1]) == hottest[1:]


def test_a_pair_the_model_does_not_have_is_refused(demo):
    with pytest.raises(ValueError, match="L0.E8"):
        DeviceExperts(demo, [ExpertKey(0, 8)], "cpu")
    with pytest.raises(ValueError, match="L5.E0"):
        DeviceExperts(demo, [ExpertKey(5, 0)], "cpu")


# ---- CUDA ------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_bfloat16_matches_the_float32_reference(demo):
    assert_matches_reference(demo, torch.bfloat16, device="cuda")


@pytest.mark.cuda
def test_cuda_bfloat16_matches_the_float32_reference_on_the_gpt_oss_fixture(fixtures_dir):
    assert_matches_reference(GGUFFile(fixtures_dir / FIXTURES[0]), torch.bfloat16, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("gather", [True, False])
def test_cuda_graph_replay_gives_the_eager_result(demo, gather):
    experts = DeviceExperts(demo, keys_of(hosted_pairs(demo)), "cuda")
    num_tokens, layer = 6, 0
    ids, weights = routing(num_tokens, 8, 2, seed=0)
    static = [torch.randn(num_tokens, 64).cuda().bfloat16(), ids.cuda(), weights.cuda()]

    def step():
        return experts.forward(layer, *static, gather=gather)

    graph, out = captured(step)
    for seed in (1, 2):
        ids, weights = routing(num_tokens, 8, 2, seed)
        hidden = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(seed))
        for buffer, value in zip(static, (hidden.bfloat16(), ids, weights)):
            buffer.copy_(value)
        graph.replay()
        eager = experts.forward(layer, hidden.cuda().bfloat16(), ids.cuda(), weights.cuda(), gather=gather)
        # bitwise in practice; the tolerance only allows cuBLAS another algorithm, while stale inputs are O(1) off
        torch.testing.assert_close(out, eager, rtol=0, atol=2e-3 * float(eager.abs().max()))
        assert out.abs().sum() > 0  # the layer hosts experts these rows route to


@pytest.mark.cuda
def test_cuda_split_is_the_host_split_on_either_device(demo):
    experts = DeviceExperts(demo, [ExpertKey(0, 1), ExpertKey(0, 6)], "cuda")
    ids, _ = routing(32, 8, 2, seed=4)
    on_host, on_device = experts.split(0, ids), experts.split(0, ids.cuda())
    for host, device in zip(on_host, on_device):
        assert device.is_cuda and not host.is_cuda and torch.equal(host, device.cpu())
