"""The KV cache in 8 bits (model/kv_formats.py, `--kv-cache-dtype`): each format's rounding against
float64 arithmetic written here from its definition, the cache's reads of it, and generation on it
(prefix caching, micro-batches, the serving path)."""
import threading
from pathlib import Path

import pytest
import torch

from splitmoe.attention_service.engine.sampling import SamplingOptions
from splitmoe.attention_service.model.kv_cache import KVCache
from splitmoe.attention_service.model.kv_formats import (
    Q8_0_BLOCK,
    dequantize_q8_0,
    kv_format,
    quantize_q8_0,
)
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.service import load_serving_model
from splitmoe.attention_service.settings import AttentionSettings

# A committed tiny file whose rows are whole q8_0 blocks (head dim 32; the demo model's is 16)
GLM = Path(__file__).parents[2] / "data" / "mtp" / "glm4moe-mtp.gguf"


def test_q8_0_rounds_each_block_of_32_to_its_amax_over_127():
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor([0.01, 1.0, 100.0])[:, None]
    q, d = quantize_q8_0(x)
    assert q.dtype == torch.int8 and d.dtype == torch.float16 and d.shape == (5, 3, 2)
    blocks = x.double().reshape(5, 3, 2, Q8_0_BLOCK)
    scale = blocks.abs().amax(-1) / 127
    assert torch.allclose(d.double(), scale, rtol=1e-3)  # float16, as llama.cpp stores it
    assert torch.equal(q.reshape(5, 3, 2, 32).double(), torch.round(blocks / scale[..., None].float().double()))
    error = (dequantize_q8_0(q, d).double() - x.double()).reshape(5, 3, 2, 32).abs()
    # half a step, plus what storing d in float16 moves the largest value (as llama.cpp stores it)
    bound = scale * 0.5 + 127 * (d.double() - scale).abs() + 1e-12
    assert (error <= bound[..., None]).all()
    zero_q, zero_d = quantize_q8_0(torch.zeros(1, 32))
    assert not zero_q.any() and not zero_d.any()  # an all-zero block stays zero, no NaN


@pytest.mark.parametrize("name,mantissa_bits", [("fp8_e4m3", 3), ("fp8_e5m2", 2)])
def test_fp8_keeps_its_mantissa_and_clamps_instead_of_overflowing(name, mantissa_bits):
    fmt = kv_format(name, torch.float32)
    x = torch.linspace(-20, 20, 401)
    pool = fmt.allocate((401,), torch.device("cpu"))
    fmt.write(pool, 0, torch.arange(401), x)
    back = fmt.read(pool, 0, torch.arange(401), 0, torch.float32)
    normal = x.abs() > 0.1
    assert ((back - x).abs()[normal] <= x.abs()[normal] * 2.0 ** -(mantissa_bits + 1)).all()
    fmt.write(pool, 0, torch.tensor([0, 1]), torch.tensor([1e9, -1e9]))
    top = fmt.read(pool, 0, torch.tensor([0, 1]), None, torch.float32)
    assert torch.equal(top, torch.tensor([1.0, -1.0]) * fmt.max_value)  # saturated, not NaN


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "q8_0", "float32"])
def test_the_cache_reads_back_what_its_format_rounds(name):
    shapes = {"k": (2, 64), "v": (2, 32)}
    kv = KVCache(2, num_blocks=4, kv_block_tokens=16, entry_shapes=shapes, dtype=torch.bfloat16,
                 device=torch.device("cpu"), fmt=kv_format(name, torch.bfloat16))
    assert not kv.as_computed
    values = {n: torch.randn(10, *s) for n, s in shapes.items()}
    slots = torch.tensor([3, 4, 5, 6, 7, 40, 41, 42, 43, 44])
    kv.write(1, slots, **values)
    gathered = kv.read(1, slots)
    run = kv.read(1, torch.arange(40, 45))  # consecutive: read without a gather
    for n, value in values.items():
        expected = value if name == "float32" else _rounded(name, value)
        assert gathered[n].dtype == torch.bfloat16
        assert torch.equal(gathered[n], expected.to(torch.bfloat16))
        assert torch.equal(run[n], gathered[n][5:])
    assert kv.bytes_per_token == 2 * 2 * 96 * kv.format.bytes_per_value
    with pytest.raises(RuntimeError, match="read through read"):
        kv.pools(0)


def _rounded(name: str, value: torch.Tensor) -> torch.Tensor:
    if name == "q8_0":
        return dequantize_q8_0(*quantize_q8_0(value))
    return value.to({"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[name]).float()


def test_q8_0_needs_whole_blocks_and_says_so_in_one_line():
    with pytest.raises(ValueError, match=r"^--kv-cache-dtype q8_0: the cache's 'latent' rows hold 40 values"):
        KVCache(1, 2, 16, {"latent": (40,)}, torch.float32, torch.device("cpu"), kv_format("q8_0", torch.float32))
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int4'"):
        RunnerOptions(kv_cache_dtype="int4")


def test_an_8_bit_cache_takes_half_a_bfloat16_ones_bytes():
    sizes = {}
    for name in ("auto", "fp8_e4m3", "q8_0"):
        runner = ModelRunner.from_gguf(GLM, RunnerOptions(dtype=torch.bfloat16, device=torch.device("cpu"),
                                                                kv_cache_tokens=256, kv_cache_dtype=name))
        sizes[name] = runner.kv.bytes_per_token
    assert sizes["fp8_e4m3"] * 2 == sizes["auto"] and sizes["q8_0"] == sizes["fp8_e4m3"] * 34 // 32


def generate(model_path, kv_cache_dtype: str, prompts, prefix_caching=True, micro_batches=1, max_tokens=24,
             together=False):
    runner = RunnerOptions(dtype=torch.float32, device=torch.device("cpu"), kv_cache_tokens=2048, kv_block_tokens=16,
                           kv_cache_dtype=kv_cache_dtype, prefix_caching=prefix_caching, micro_batches=micro_batches)
    model = load_serving_model(AttentionSettings(model_path=str(model_path), runner=runner))
    options = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    done, requests = threading.Semaphore(0), []
    model.engine.start()
    try:
        for i, ids in enumerate(prompts):  # one after another: the later ones find the earlier's blocks
            request = model.new_request(f"r{i}", list(ids), options, lambda out: out.finished and done.release())
            requests.append(request)
            model.engine.submit(request)
            assert together or done.acquire(timeout=120)
        for _ in prompts if together else ():
            assert done.acquire(timeout=120)
    finally:
        model.engine.stop()
    return [r.seq.token_ids[r.num_prompt_tokens:] for r in requests], model.runner.blocks.prefix_stats.hits


@pytest.mark.parametrize("name", ["fp8_e4m3", "q8_0"])
def test_prefix_caching_and_micro_batches_work_on_an_8_bit_cache(name):
    shared = [7, 8, 9, 10] * 8  # two whole blocks
    prompts = [shared + [40, 41], shared + [50, 51, 52], shared + [40, 41]]
    plain, hits = generate(GLM, name, prompts, prefix_caching=False)
    cached, hits = generate(GLM, name, prompts)
    assert cached == plain and hits >= 64  # the blocks an 8-bit cache named hold what a recompute would
    assert cached[0] == cached[2]
    # micro-batches: a step of several sequences cut in two, each half writing and reading the cache
    whole, _ = generate(GLM, name, prompts, prefix_caching=False, together=True)
    split, _ = generate(GLM, name, prompts, prefix_caching=False, micro_batches=2, together=True)
    assert split == whole
