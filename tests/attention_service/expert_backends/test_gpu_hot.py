"""expert_backends/gpu_hot.py: some experts in GPU memory, the rest through another backend. Here the
"GPU" is the CPU device (the same code, float32: exact against the in-process experts)."""
import pytest
import torch

from splitmoe.attention_service.expert_backends.backend import InProcessExperts
from splitmoe.attention_service.expert_backends.device_experts import DeviceExperts, expert_device_bytes
from splitmoe.attention_service.expert_backends.gpu_hot import GpuHotExperts, choose_gpu_experts
from splitmoe.attention_service.expert_backends.load_plan import HeatBudget
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.modelfile.expert_tensors import ExpertKey, expert_count, moe_layers
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.hparams import ModelConfig
from tests.support.decode_steps import decode_steps


def wrapped(path, keys, device="cpu", dtype=torch.float32):
    g = GGUFFile(path)
    cfg = ModelConfig.from_gguf(g)
    return GpuHotExperts(InProcessExperts(g), DeviceExperts(g, keys, device, dtype), cfg.num_layers, expert_count(g))


def routing(g, num_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    cfg = ModelConfig.from_gguf(g)
    hidden = torch.randn(num_tokens, cfg.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(expert_count(g), generator=gen)[:cfg.num_experts_used] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, cfg.num_experts_used, generator=gen)
    return hidden, ids, weights


def test_split_layers_sum_to_what_the_cpu_computes_alone(demo_gguf):
    g = GGUFFile(demo_gguf)
    layers = moe_layers(g)
    keys = [ExpertKey(layers[0], e) for e in (0, 3, 5)] + [ExpertKey(layers[-1], e) for e in range(expert_count(g))]
    backend = wrapped(demo_gguf, keys)
    alone = InProcessExperts(g)
    for layer in layers:
        for num_tokens, seed in ((1, 1), (5, 2), (40, 3)):
            hidden, ids, weights = routing(g, num_tokens, seed)
            got = backend.forward(layer, hidden, ids, weights)
            want = alone.forward(layer, hidden, ids, weights)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert backend.device_layers() == frozenset({layers[-1]})


def test_the_heat_counts_the_tokens_the_gpu_computed(demo_gguf):
    g = GGUFFile(demo_gguf)
    layer = moe_layers(g)[0]
    backend = wrapped(demo_gguf, [ExpertKey(layer, 0), ExpertKey(layer, 1)])
    ids = torch.tensor([[0, 2], [1, 0], [3, 4]])
    backend.forward(layer, torch.randn(3, ModelConfig.from_gguf(g).hidden_size), ids, torch.ones(3, 2))
    tokens = backend.expert_heat().tokens[layer]
    assert tokens[:5].tolist() == [2, 1, 1, 1, 1]  # 0 and 1 on the "GPU", 2..4 through the CPU backend
    backend.forward(layer, torch.randn(1, ModelConfig.from_gguf(g).hidden_size), torch.tensor([[1, 3]]), torch.ones(1, 2))
    assert backend.expert_heat().tokens[layer][:5].tolist() == [2, 2, 1, 2, 1]  # folded once, not twice
    counts = backend.expert_token_counts()
    assert counts[ExpertKey(layer, 1)] == 2
    assert backend.placement_view()[ExpertKey(layer, 0)] == ("gpu",)


def test_without_heat_whole_layers_from_the_first(demo_gguf):
    g = GGUFFile(demo_gguf)
    layers, num_experts = moe_layers(g), expert_count(g)
    per_layer = num_experts * expert_device_bytes(g, layers[0])
    keys = choose_gpu_experts(g, HeatBudget(num_bytes=int(per_layer * 1.5)), None)
    assert keys == [ExpertKey(layers[0], e) for e in range(num_experts)]
    assert choose_gpu_experts(g, HeatBudget(num_experts=num_experts - 1), None) == []
    assert len(choose_gpu_experts(g, HeatBudget(num_experts=2 * num_experts), None)) == 2 * num_experts


def test_with_heat_the_hottest_pairs(demo_gguf):
    g = GGUFFile(demo_gguf)
    rates = torch.zeros(ModelConfig.from_gguf(g).num_layers, expert_count(g), dtype=torch.float64)
    rates[moe_layers(g)[1], 4] = 9.0
    rates[moe_layers(g)[0], 2] = 5.0
    keys = choose_gpu_experts(g, HeatBudget(num_experts=2), rates)
    assert keys == [ExpertKey(moe_layers(g)[1], 4), ExpertKey(moe_layers(g)[0], 2)]


def test_static_decode_runs_whole_gpu_layers_inside_its_segments(demo_gguf):
    """Every layer's experts on the device: one segment, no hop; the logits of the generic path."""
    g = GGUFFile(demo_gguf)
    every = [ExpertKey(layer, e) for layer in moe_layers(g) for e in range(expert_count(g))]

    def decode(static):
        backend = wrapped(demo_gguf, every)
        r = ModelRunner.from_gguf(g, RunnerOptions(device=torch.device("cpu"), kv_cache_tokens=256,
                                                   static_decode=static), experts=backend)
        return r, decode_steps(r, [[5, 6, 7], [8, 9]], 4)

    generic_runner, generic = decode(False)
    static_runner, static = decode(True)
    assert len(static_runner.static_decode.plan) == 1 and static_runner.static_decode.plan[0].hop is None
    torch.testing.assert_close(static, generic, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_cuda_hot_experts_beside_the_cpu_experts(demo_gguf):
    g = GGUFFile(demo_gguf)
    layers = moe_layers(g)
    keys = [ExpertKey(layers[0], e) for e in (0, 3, 5)] + [ExpertKey(layers[-1], e) for e in range(expert_count(g))]
    backend = wrapped(demo_gguf, keys, device="cuda", dtype=torch.bfloat16)
    alone = InProcessExperts(g)
    for layer in layers:
        hidden, ids, weights = routing(g, 7, 5)
        got = backend.forward(layer, hidden.cuda(), ids.cuda(), weights.cuda())
        want = alone.forward(layer, hidden, ids, weights)
        assert got.device.type == "cuda"
        torch.testing.assert_close(got.cpu(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_gpu_experts_need_a_cuda_device(demo_gguf):
    from splitmoe.attention_service.settings import AttentionSettings, serving_runner_options
    from splitmoe.cli import main

    with pytest.raises(ValueError, match="--gpu-experts .* needs --device cuda"):
        AttentionSettings(model_path=str(demo_gguf), runner=serving_runner_options(device=torch.device("cpu")),
                          gpu_experts=HeatBudget(num_experts=4))
    assert main(["serve-attention", str(demo_gguf), "--device", "cpu", "--gpu-experts", "4"]) == 2
    assert main(["serve-attention", str(demo_gguf), "--device", "cpu", "--gpu-experts", "lots"]) == 2
