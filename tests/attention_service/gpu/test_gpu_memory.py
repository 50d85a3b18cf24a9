"""gpu/memory.py: the attention device's memory by use; and its /metrics family."""
from dataclasses import dataclass

import pytest
import torch

from splitmoe.attention_service.gpu.memory import DeviceMemory, device_memory, tensor_bytes
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.gateway.attention_types import AttentionStats
from splitmoe.gateway.attention_types import DeviceMemory as DeviceMemoryStat
from splitmoe.gateway.metrics import StatsCollector


@dataclass
class Layer:
    q: torch.Tensor
    norm: torch.Tensor


@dataclass
class Weights:
    embedding: torch.Tensor
    output: torch.Tensor
    layers: list


def test_tensor_bytes_counts_each_tensor_once_and_only_on_its_device():
    embedding = torch.zeros(10, 4, dtype=torch.bfloat16)
    layers = [Layer(torch.zeros(4, 4, dtype=torch.bfloat16), torch.zeros(4)) for _ in range(3)]
    w = Weights(embedding, embedding, layers)  # tied: one tensor in two fields
    assert tensor_bytes(w, torch.device("cpu")) == 10 * 4 * 2 + 3 * (4 * 4 * 2 + 4 * 4)
    assert tensor_bytes(w, torch.device("meta")) == 0


def test_a_runner_on_the_cpu_reports_no_device_memory(demo_gguf):
    r = ModelRunner.from_gguf(demo_gguf, RunnerOptions(device=torch.device("cpu"), kv_cache_tokens=64))
    assert r.device_memory() is None
    assert device_memory(torch.device("cpu"), weights_bytes=1, kv_cache_bytes=1) is None


def test_the_log_line_names_every_use():
    gib = 2**30
    memory = DeviceMemory("NVIDIA H200", {"weights": 3 * gib, "kv_cache": gib, "gpu_experts": 0, "graphs": gib // 2,
                                          "workspace": gib // 4, "reserved": 5 * gib, "capacity": 141 * gib,
                                          "pinned_host": 8 * 2**20})
    assert memory.describe() == ("NVIDIA H200: weights 3.00 GiB, kv cache 1.00 GiB, gpu experts 0.00 GiB, graphs "
                                 "0.50 GiB, workspace 0.25 GiB; torch holds 5.00 of 141.0 GiB; 8 MiB of page-locked "
                                 "host buffers")


def test_metrics_publish_gpu_memory_by_kind():
    collector = StatsCollector()
    collector.update(AttentionStats(device="NVIDIA H200", device_memory=(DeviceMemoryStat("weights", 123),
                                                                         DeviceMemoryStat("kv_cache", 45))))
    families = {f.name: f for f in collector.collect()}
    samples = {(s.labels["kind"], s.labels["device"]): s.value for s in families["splitmoe:gpu_memory_bytes"].samples}
    assert samples == {("weights", "NVIDIA H200"): 123, ("kv_cache", "NVIDIA H200"): 45}
    collector.update(AttentionStats(device="cpu"))
    assert "splitmoe:gpu_memory_bytes" not in {f.name for f in collector.collect()}


@pytest.mark.cuda
def test_cuda_runner_reports_what_it_loaded(demo_gguf):
    before = torch.cuda.memory_allocated()
    r = ModelRunner.from_gguf(demo_gguf, RunnerOptions(dtype=torch.bfloat16, device=torch.device("cuda"),
                                                       kv_cache_tokens=4096))
    memory = r.device_memory()
    assert memory is not None and memory.device == torch.cuda.get_device_name()
    kinds = memory.by_kind
    assert kinds["kv_cache"] == r.kv.reserved_bytes > 0
    assert 0 < kinds["weights"] <= torch.cuda.memory_allocated() - before
    assert kinds["weights"] + kinds["kv_cache"] <= kinds["reserved"] <= kinds["capacity"]
