"""model/static_decode.py: the GPU's decode path (fixed-shape segments between expert hops),
run here on the CPU against the generic path, and on CUDA with and without graphs."""
import json

import pytest
import torch

from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.attention_service.model.static_decode import DecodeRows, fill_inputs, plan_segments
from tests.support.decode_steps import decode_steps

FAMILIES = ["qwen3moe", "qwen2moe", "mixtral", "olmoe", "dbrx", "deepseek", "deepseek3", "glm4moe", "llama4",
            "gptoss"]


def runner(path, static: bool, device="cpu", dtype=torch.float32, kv_block_tokens=4, kv_cache_tokens=1024, **options):
    return ModelRunner.from_gguf(path, RunnerOptions(dtype=dtype, device=torch.device(device), kv_cache_tokens=kv_cache_tokens,
                                                     kv_block_tokens=kv_block_tokens, static_decode=static, **options))


decode = decode_steps


@pytest.fixture(scope="module")
def prompt_ids(fixtures_dir):
    return [p["ids"] for p in json.loads((fixtures_dir / "prompts.json").read_text())["prompts"]]


@pytest.mark.parametrize("arch", FAMILIES)
def test_static_decode_equals_the_generic_path(fixtures_dir, prompt_ids, arch):
    """Three sequences (a padded bucket of 4 rows), contexts of different lengths in non-contiguous
    blocks, past gpt-oss's window of 32: float32, so only the order of additions may differ."""
    path = fixtures_dir / arch / f"{arch}-q8_0.gguf"
    prompts = [prompt_ids[0], prompt_ids[1], prompt_ids[0][:5]]
    generic = decode(runner(path, static=False), prompts, 6)
    static_runner = runner(path, static=True)
    static = decode(static_runner, prompts, 6)
    assert static_runner.static_decode is not None
    assert torch.abs(static - generic).max().item() <= 1e-4


def test_static_decode_takes_decode_steps_and_only_those(demo_gguf):
    r = runner(demo_gguf, static=True)
    calls = []
    run = r.static_decode.run
    r.static_decode.run = lambda rows: calls.append(len(rows.token_ids)) or run(rows)
    a, b = Sequence(0, [5, 6, 7, 8]), Sequence(1, [9, 10])
    r.step([a, b])  # prompts: the generic path
    assert calls == []
    a.token_ids.append(11)
    b.token_ids.append(12)
    r.step([a, b])
    assert calls == [2]
    a.token_ids += [13, 14]  # two new tokens: not a decode step
    b.token_ids.append(15)
    r.step([a, b])
    assert calls == [2]


def test_a_context_crossing_a_bucket_and_many_rows(demo_gguf):
    """Contexts from 250 to 270 tokens (the 256 and 512 buckets) and 9 rows (the 16 bucket)."""
    prompts = [[(7 * i + j) % 90 + 3 for j in range(248 + i)] for i in range(9)]
    generic = decode(runner(demo_gguf, static=False, kv_block_tokens=16, kv_cache_tokens=4096), prompts, 12)
    static = decode(runner(demo_gguf, static=True, kv_block_tokens=16, kv_cache_tokens=4096), prompts, 12)
    assert torch.abs(static - generic).max().item() <= 1e-4


def test_padded_rows_point_at_the_scratch_slot():
    table = torch.full((4, 4 + 8), -7, dtype=torch.int64)
    contexts = [torch.tensor([10, 11, 12]), torch.tensor([40])]
    fill_inputs(table, DecodeRows([5, 6], contexts), scratch_slot=99)
    assert table[0, :4].tolist() == [5, 2, 12, 3] and table[0, 4:7].tolist() == [10, 11, 12]
    assert table[1, :4].tolist() == [6, 0, 40, 1] and table[1, 4].item() == 40
    assert (table[0, 7:] == 99).all() and (table[1, 5:] == 99).all()
    for padded in table[2:]:
        assert padded[:4].tolist() == [0, 0, 99, 1] and (padded[4:] == 99).all()


def test_segments_end_at_each_hop(fixtures_dir):
    """DeepSeek's first layer is dense: it joins the first segment; a layer whose experts the
    backend computes on the device joins the segment around it."""
    r = runner(fixtures_dir / "deepseek3" / "deepseek3-q8_0.gguf", static=True)
    assert [(list(s.layers), s.hop) for s in plan_segments(r.model)] == [([0, 1], 1), ([2], 2), ([], None)]
    assert [(list(s.layers), s.hop) for s in plan_segments(r.model, frozenset({1}))] == [([0, 1, 2], 2), ([], None)]
    assert [(list(s.layers), s.hop) for s in plan_segments(r.model, frozenset({1, 2}))] == [([0, 1, 2], None)]


def test_the_cpu_keeps_its_own_path_by_default(demo_gguf):
    r = ModelRunner.from_gguf(demo_gguf, RunnerOptions(device=torch.device("cpu")))
    assert r.static_decode is None
    assert r.kv.num_blocks == r.blocks.pool.num_blocks  # no scratch block


def test_asking_for_cuda_without_a_gpu_is_a_clear_error(demo_gguf, capsys):
    from splitmoe.cli import main

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here")
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        RunnerOptions(device=torch.device("cuda"))
    assert main(["logits", str(demo_gguf), "--device", "cuda", "--token-ids", "1,2", "--out", "/dev/null"]) == 2
    assert "--device cuda: torch sees no CUDA GPU" in capsys.readouterr().err


# ---- on a GPU -------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("arch", FAMILIES)
def test_cuda_graphs_on_equal_off(fixtures_dir, prompt_ids, arch):
    """The same kernels on the same shapes, launched one by one or replayed from graphs."""
    path = fixtures_dir / arch / f"{arch}-q8_0.gguf"
    prompts = [prompt_ids[0], prompt_ids[1], prompt_ids[0][:5]]
    eager = decode(runner(path, static=True, device="cuda", dtype=torch.bfloat16, cuda_graphs=False), prompts, 6)
    graphed_runner = runner(path, static=True, device="cuda", dtype=torch.bfloat16, cuda_graphs=True)
    graphed = decode(graphed_runner, prompts, 6)
    assert len(graphed_runner.static_decode.graphs) > 0
    assert torch.equal(graphed, eager)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", FAMILIES)
def test_cuda_decode_equals_the_cpu_float32_path_within_bfloat16(fixtures_dir, prompt_ids, arch):
    path = fixtures_dir / arch / f"{arch}-q8_0.gguf"
    prompts = [prompt_ids[0], prompt_ids[1]]
    exact = decode(runner(path, static=False), prompts, 4)
    gpu = decode(runner(path, static=True, device="cuda", dtype=torch.bfloat16), prompts, 4)
    per_row = (gpu - exact).flatten(0, 1).norm(dim=-1) / exact.flatten(0, 1).norm(dim=-1)
    assert per_row.median().item() <= 2e-2
