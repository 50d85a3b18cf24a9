"""Attention on CUDA (bfloat16) against the llama.cpp fixtures' exact references: held to the bound
the CPU's bfloat16 path keeps (test_fixtures.py), prompts and token-by-token decode alike."""
import numpy as np
import pytest
import torch

from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.cli import main
from tests.attention_service.model.test_fixtures import (
    AGGREGATE_ARCHS,
    ARCHS,
    FLIPPED,
    PER_POSITION_ARCHS,
    QUANTS,
    exact_reference,
    per_position_rel_l2,
    prompts,
    references,
    rel_l2,
)

pytestmark = pytest.mark.cuda
FAMILIES = [*ARCHS, "gptoss"]


def prompt_logits(tmp_path, model, ids) -> np.ndarray:
    out = tmp_path / "logits.npy"
    assert main(["logits", str(model), "--token-ids", ",".join(map(str, ids)), "--out", str(out),
                 "--dtype", "bfloat16", "--device", "cuda"]) == 0
    return np.load(out)


def decoded_logits(runner: ModelRunner, ids: list[int]) -> np.ndarray:
    """Every position's logits as decode steps make them: the first token alone, then one token a
    step (the static decode path, from CUDA graphs)."""
    seq = Sequence(0, ids[:1])
    rows = [runner.step([seq])]
    for token in ids[1:]:
        seq.token_ids.append(token)
        rows.append(runner.step([seq]))
    runner.release(seq)
    return torch.cat(rows).cpu().numpy()


def check_bounds(arch: str, quant: str, model, per_prompt: list[np.ndarray]) -> None:
    refs = references(model.parent, exact_reference(arch, quant))
    ours = np.concatenate([per_position_rel_l2(got, ref) for got, ref in zip(per_prompt, refs)])
    assert np.median(ours) <= 2e-2
    if arch in PER_POSITION_ARCHS:
        llamacpp = np.concatenate([per_position_rel_l2(np.load(model.parent / "ref" / f"llamacpp_{quant}_p{i}.npy"), ref)
                                   for i, ref in enumerate(refs)])
        assert (ours > FLIPPED).sum() <= (llamacpp > FLIPPED).sum()
    if arch in AGGREGATE_ARCHS:
        assert all(rel_l2(got, ref) <= 3e-2 for got, ref in zip(per_prompt, refs))


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", FAMILIES)
def test_cuda_prompts_within_the_cpu_bfloat16_bound(fixtures_dir, tmp_path, arch, quant):
    model = fixtures_dir / arch / f"{arch}-{quant}.gguf"
    check_bounds(arch, quant, model, [prompt_logits(tmp_path, model, p["ids"]) for p in prompts(fixtures_dir)])


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", FAMILIES)
def test_cuda_decode_within_the_cpu_bfloat16_bound(fixtures_dir, arch, quant):
    model = fixtures_dir / arch / f"{arch}-{quant}.gguf"
    runner = ModelRunner.from_gguf(model, RunnerOptions(dtype=torch.bfloat16, device=torch.device("cuda"),
                                                        kv_cache_tokens=256))
    check_bounds(arch, quant, model, [decoded_logits(runner, p["ids"]) for p in prompts(fixtures_dir)])
    assert len(runner.static_decode.graphs) > 0
