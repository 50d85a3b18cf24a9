"""attention_service/gpu/vram.py: the estimate from hyper-parameters is, byte for byte, what the
loader and the KV cache allocate off the CPU, for the demo model and every llama.cpp fixture family;
the three shapes users ask about match figures worked out by hand below."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from splitmoe.attention_service.gpu.vram import (
    DEEPSEEK_V3,
    GPT_OSS_120B,
    QWEN3_235B_A22B,
    SHAPES,
    OptionalTensors,
    ServingSizes,
    estimate,
    estimate_file,
)
from splitmoe.attention_service.model.attention_kinds import attention_class
from splitmoe.attention_service.model.kv_cache import KVCache
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.weight_loader import quantized_mode
from splitmoe.attention_service.model.weights import load_weights
from splitmoe.bench import make_model
from splitmoe.kernels.linear import LinearGroup
from splitmoe.modelfile.architectures import arch_spec
from splitmoe.modelfile.gguf_file import GGUFFile
from tests.support.gguf_edit import rewrite_gguf

FAMILIES = ["qwen3moe", "qwen2moe", "mixtral", "olmoe", "dbrx", "deepseek", "deepseek2", "deepseek3", "glm4moe",
            "llama4", "gptoss"]
# Files edited into what the fixtures do not show: a tied output head, the q/k norm an ArchSpec
# leaves optional missing (as GLM-4.5-Air), FFN widths only the tensors state.
EDITS = {
    "demo-tied": ("demo", dict(drop_tensors=("output.weight",))),
    "glm4moe-air": ("glm4moe", dict(drop_tensors=tuple(f"blk.{i}.attn_{n}_norm.weight" for i in range(2)
                                                       for n in "qk"))),
    "deepseek-no-ffn-width": ("deepseek", dict(drop_keys=("deepseek.feed_forward_length",))),
    "qwen2moe-no-shared-width": ("qwen2moe", dict(drop_keys=("qwen2moe.expert_shared_feed_forward_length",))),
}
# The meta device loads exactly as a GPU does (quantized_mode is False off the CPU: every linear
# dense, norms and router float32) and allocates nothing, so the test runs on any machine.
META = torch.device("meta")
# The CUDA caching allocator rounds every allocation up to a multiple of this.
CUDA_ROUNDING_BYTES = 512
# What a CUDA load allocates beyond weights and KV cache: the rope inverse frequencies (a few hundred bytes).
CUDA_EXTRA_BYTES = 64 << 10


def _model_path(name: str, request: pytest.FixtureRequest) -> Path:
    if name in EDITS:
        base, edits = EDITS[name]
        path = request.getfixturevalue("tmp_path") / f"{name}.gguf"
        rewrite_gguf(_model_path(base, request), path, **edits)
        return path
    if name == "demo":
        return request.getfixturevalue("demo_gguf")
    path = request.getfixturevalue("fixtures_dir") / name / f"{name}-q8_0.gguf"
    if not path.exists():
        pytest.skip(f"{path} not found")
    return path


def _dense_tensors(weights: object) -> list[torch.Tensor]:
    """Every tensor the loaded weights hold, each once (a tied output head is the embedding itself).
    A weight kept quantized, or any holder this walk does not know, fails: it would go uncounted."""
    found: dict[int, torch.Tensor] = {}

    def walk(x: object) -> None:
        if isinstance(x, torch.Tensor):
            found[id(x)] = x
        elif isinstance(x, LinearGroup):
            walk(x.weights)
        elif dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, (list, tuple)):
            for item in x:
                walk(item)
        elif x is not None:
            raise TypeError(f"{type(x).__name__} in the loaded weights: not a dense tensor")

    walk(weights)
    return list(found.values())


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["demo", *FAMILIES, *EDITS])
def test_weights_are_the_bytes_a_gpu_load_allocates(request, name, dtype):
    assert not quantized_mode(dtype, META)
    g = GGUFFile(_model_path(name, request))
    spec = arch_spec(g.arch, g.path.name)
    weights = load_weights(g, spec, spec.architecture.config(g), dtype, META)
    assert estimate_file(g, ServingSizes(dtype=dtype)).weights_bytes == _nbytes(_dense_tensors(weights))


def test_the_edited_files_lack_what_they_are_meant_to(request):
    """So that the weights test above reaches each path of OptionalTensors."""
    found = {}
    for name in EDITS:
        g = GGUFFile(_model_path(name, request))
        cfg = arch_spec(g.arch).architecture.config(g)
        found[name] = (OptionalTensors.of_file(g, cfg), cfg)
    assert not found["demo-tied"][0].output_head
    assert not found["glm4moe-air"][0].qk_norm
    tensors, cfg = found["deepseek-no-ffn-width"]
    assert (cfg.dense_ffn, tensors.dense_ffn) == (0, 128)
    tensors, cfg = found["qwen2moe-no-shared-width"]
    assert (cfg.shared_expert_ffn, tensors.shared_expert_ffn) == (0, 256)


@pytest.mark.parametrize("name", ["demo", *FAMILIES])
def test_kv_figures_are_the_runners_cache_on_a_gpu(request, name):
    """As a GPU runner sizes its cache (the static decode on: one scratch block more), here on the CPU."""
    options = RunnerOptions(dtype=torch.bfloat16, device=torch.device("cpu"), kv_cache_tokens=1000,
                            kv_block_tokens=16, static_decode=True)
    runner = ModelRunner.from_gguf(_model_path(name, request), options)
    e = estimate_file(runner.gguf, ServingSizes(kv_cache_tokens=1000, kv_block_tokens=16))
    assert e.kv_bytes_per_token == runner.kv.bytes_per_token
    assert (e.kv_slots, e.kv_cache_bytes) == (1024, runner.kv.reserved_bytes)  # 63 blocks of 16, and the scratch one


# ---- the shapes users ask about, by hand: bfloat16 2 bytes, float32 4 -----------------------------

def test_gpt_oss_120b():
    e = GPT_OSS_120B.estimate(ServingSizes(kv_cache_tokens=32768))
    # embedding + output head, bf16: 2 x 201088 x 2880 x 2                        = 2,316,533,760
    # output norm, f32: 2880 x 4                                                   =        11,520
    # a layer, bf16: q 64*64 x 2880 + k 8*64 x 2880 + v 8*64 x 2880 + o 2880 x 64*64
    #   = (4096 + 512 + 512) x 2880 + 2880 x 4096 = 26,542,080 elements x 2      =    53,084,160
    # a layer, f32: q/k/v biases 5120 + o bias 2880 + sinks 64 + 2 norms 5760
    #   + router 128 x 2880 = 368,640 + router bias 128 = 382,592 elements x 4    =     1,530,368
    # 36 layers x (53,084,160 + 1,530,368 = 54,614,528)                            = 1,966,123,008
    assert e.weights_bytes == 2_316_533_760 + 11_520 + 1_966_123_008 == 4_282_668_288  # 3.99 GiB
    # KV, every layer (the sliding ones too): 36 x 8 kv heads x (64 + 64) x 2
    assert e.kv_bytes_per_token == 73_728  # 72 KiB
    assert e.kv_cache_bytes == 73_728 * (32768 + 16) == 2_417_098_752  # 2.25 GiB, with the scratch block


def test_qwen3_235b_a22b():
    e = QWEN3_235B_A22B.estimate(ServingSizes(kv_cache_tokens=32768))
    # embedding + output head: 2 x 151936 x 4096 x 2                              = 2,489,319,424
    # output norm: 4096 x 4                                                        =        16,384
    # a layer, bf16: (64*128 + 4*128 + 4*128) x 4096 + 4096 x 64*128
    #   = 9216 x 4096 + 33,554,432 = 71,303,168 elements x 2                      =   142,606,336
    # a layer, f32: q/k norm 2 x 128 + 2 norms 8192 + router 128 x 4096 = 532,736 x 4 = 2,130,944
    # 94 layers x 144,737,280 (no dense layer: intermediate_size 12288 is unused) = 13,605,304,320
    assert e.weights_bytes == 2_489_319_424 + 16_384 + 13_605_304_320 == 16_094_640_128  # 14.99 GiB
    assert e.kv_bytes_per_token == 94 * 4 * (128 + 128) * 2 == 192_512  # 188 KiB
    assert e.kv_cache_bytes == 192_512 * (32768 + 16) == 6_311_313_408  # 5.88 GiB


def test_deepseek_v3():
    e = DEEPSEEK_V3.estimate(ServingSizes(kv_cache_tokens=32768))
    # embedding + output head: 2 x 129280 x 7168 x 2                              = 3,706,716,160
    # output norm: 7168 x 4                                                        =        28,672
    # a layer's MLA, bf16: q_a 1536 x 7168 = 11,010,048; q_b 128*192 x 1536 = 37,748,736;
    #   kv_a (512 + 64) x 7168 = 4,128,768; k_b 128 x 512 x 128 = 8,388,608; v_b 128 x 128 x 512
    #   = 8,388,608; o 7168 x 128*128 = 117,440,512: 187,105,280 elements x 2    =   374,210,560
    # a layer, f32: kv_a norm 512 + q_a norm 1536 + 2 norms 14336 = 16,384 x 4    =        65,536
    # 61 layers x 374,276,096                                                      = 22,830,841,856
    # 3 dense FFNs: 3 x (3 x 18432 x 7168 x 2 = 792,723,456)                      =  2,378,170,368
    # 58 MoE layers: router (256 x 7168 + correction bias 256) x 4 = 7,341,056
    #   + shared expert 3 x 2048 x 7168 x 2 = 88,080,384: 58 x 95,421,440         =  5,534,443,520
    parts = 3_706_716_160 + 28_672 + 22_830_841_856 + 2_378_170_368 + 5_534_443_520
    assert e.weights_bytes == parts == 34_450_200_576  # 32.08 GiB: more than a 24 GB card holds
    assert e.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70_272  # 68.6 KiB
    assert e.kv_cache_bytes == 70_272 * (32768 + 16) == 2_303_797_248  # 2.15 GiB


def test_workspace_and_graphs_of_qwen3_235b_at_the_service_defaults():
    e = QWEN3_235B_A22B.estimate()  # 512 tokens per step, 64 sequences, 16384 cache tokens
    residual = 3 * 512 * 4096 * 4  # x, the next x, the normed input
    widest = 512 * (8192 + 512 + 512 + 8192) * 4  # q, k, v and the attention output
    scores = 2 * (1 << 22) * 4  # one chunk of scores and probabilities
    context = 16384 * 4 * 256 * (2 + 4)  # one sequence's whole context, read and made float32
    logits = 64 * 151936 * (2 + 4)
    assert e.workspace_bytes == residual + widest + scores + context + logits == 253_378_560
    # a decode step of 64 rows, each padded to the cache's 16384 tokens and read 1024 positions at a
    # time: 4 kv heads x 256 dims of a chunk gathered in bfloat16 and float32; scores and
    # probabilities of 64 heads over a chunk; 2 x 64 rows of logits
    gathered = 64 * 1024 * 4 * 256 * (2 + 4)
    decode_scores = 2 * 64 * 64 * 1024 * 4
    assert e.graphs_bytes == gathered + decode_scores + 2 * 64 * 151936 * 4 == 513_998_848  # 490 MiB
    assert e.total_bytes == e.weights_bytes + e.kv_cache_bytes + e.workspace_bytes + e.graphs_bytes
    # 8 rows instead: an eighth of the decode step's memory
    fewer = QWEN3_235B_A22B.estimate(ServingSizes(max_running_seqs=8))
    assert fewer.graphs_bytes == (gathered + decode_scores) // 8 + 2 * 8 * 151936 * 4


def test_every_shape_adds_kv_cache_and_workspace_with_its_sizes():
    small, large = ServingSizes(kv_cache_tokens=1024), ServingSizes(kv_cache_tokens=65536, max_batch_tokens=2048)
    for shape in SHAPES.values():
        a, b = shape.estimate(small), shape.estimate(large)
        assert a.weights_bytes == b.weights_bytes and a.kv_bytes_per_token == b.kv_bytes_per_token
        assert (b.kv_slots, a.kv_slots) == (65552, 1040)  # and the scratch block's 16
        assert b.workspace_bytes > a.workspace_bytes
        assert b.graphs_bytes == a.graphs_bytes  # the decode step reads the context a chunk at a time
    assert "weights 32.08 GiB" in DEEPSEEK_V3.estimate().describe()
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        ServingSizes(kv_cache_tokens=0)


@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("name, quant", [("qwen3-235b-a22b", "q4_k_m"), ("gpt-oss-120b", "mxfp4_moe"),
                                         ("deepseek-v3", "ud_iq1_s")])
def test_a_generated_file_of_each_shape_has_the_estimated_non_expert_bytes(name, quant, num_layers):
    """bench/make_model.py's shape, tensor by tensor as its plan writes them: loaded float32 where
    F32 in the file (norms, router, biases, sinks), bfloat16 otherwise; the routed experts stay
    off the GPU. The two tables of these hyper-parameters (make_model's, vram's) must agree."""
    shape = make_model.bench_shape(name)
    specs = make_model.plan(shape, num_layers, quant)
    planned = sum(torch.Size(t.shape).numel() * (4 if t.ggml_type == T.F32 else 2)
                  for t in specs if "_exps." not in t.name)
    named = SHAPES[name]
    cfg = dataclasses.replace(named.cfg, num_layers=num_layers,
                              num_leading_dense_layers=min(shape.leading_dense, num_layers))
    assert estimate(cfg, named.spec, named.tensors).weights_bytes == planned


# ---- on a GPU --------------------------------------------------------------------------------------

def _cuda_used_bytes(load) -> tuple[int, object]:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loaded = load()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before, loaded


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["demo", "gptoss", "deepseek3", "llama4"])
def test_a_cuda_load_allocates_the_estimate(request, name):
    path = _model_path(name, request)
    options = RunnerOptions(dtype=torch.bfloat16, device=torch.device("cuda"), kv_cache_tokens=8192)
    used, runner = _cuda_used_bytes(lambda: ModelRunner.from_gguf(path, options))
    e = estimate_file(runner.gguf, ServingSizes(kv_cache_tokens=8192))
    num_tensors = len(_dense_tensors(runner.model.weights)) + sum(
        len(runner.kv.pools(i)) for i in range(runner.cfg.num_layers))
    want = e.weights_bytes + e.kv_cache_bytes
    # slack: each tensor rounded up to the allocator's 512 bytes, and the rope tables
    assert want <= used <= want + CUDA_ROUNDING_BYTES * num_tensors + CUDA_EXTRA_BYTES


@pytest.mark.cuda
def test_a_generated_qwen3_235b_layer_on_cuda(tmp_path):
    """The real shape, full vocabulary, one layer (a 2.1 GB file, some seconds): its non-expert
    weights and an 8192-token cache (and the scratch block) on the GPU take what the estimate says."""
    path = make_model.write_model(tmp_path / "m.gguf", "qwen3-235b-a22b", layers=1, quant="q4_0")
    g = GGUFFile(path)
    spec = arch_spec(g.arch, g.path.name)
    cfg = spec.architecture.config(g)
    cuda, sizes = torch.device("cuda"), ServingSizes(kv_cache_tokens=8192)

    def load():
        entries = attention_class(spec)(cfg, spec, cuda).kv_entry_shapes()
        kv = KVCache(1, sizes.kv_slots // sizes.kv_block_tokens, sizes.kv_block_tokens, entries, torch.bfloat16, cuda)
        return load_weights(g, spec, cfg, torch.bfloat16, cuda), kv

    used, (weights, kv) = _cuda_used_bytes(load)
    e = estimate_file(g, sizes)
    assert e.weights_bytes == estimate(dataclasses.replace(QWEN3_235B_A22B.cfg, num_layers=1),
                                       QWEN3_235B_A22B.spec).weights_bytes
    num_tensors = len(_dense_tensors(weights)) + 2
    want = e.weights_bytes + e.kv_cache_bytes
    assert want <= used <= want + CUDA_ROUNDING_BYTES * num_tensors + CUDA_EXTRA_BYTES
