"""LoRA adapters applied row by row (model/lora.py) against transformers + peft (tests/data/lora/).

The fixture: the qwen3moe fixture's checkpoint converted by llama.cpp, two adapters converted by
llama.cpp's convert_lora_to_gguf.py (`attn`: q, k, v, o and the output head; `experts`: the routed
experts' gate, up and down), and peft's float32 logits for two prompts with each (README there).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from splitmoe.attention_service.lora_adapters import LoraAdapters, LoraLimit, LoraSettings, UnknownLora
from splitmoe.attention_service.model.lora import AdapterWeights
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.lora_adapter import load_lora_adapter

DATA = Path(__file__).resolve().parents[2] / "data" / "lora"
BASE = DATA / "base-qwen3moe.gguf"
ADAPTERS = {"attn": DATA / "attn-lora.gguf", "experts": DATA / "experts-lora.gguf"}
PROMPTS = ("p0", "p1")
F32_TOL = 1e-4  # the bound; measured ~2e-6 (float32 rounding of two different orders of sums)


@pytest.fixture(scope="module")
def refs():
    return np.load(DATA / "references.npz")


@pytest.fixture(scope="module")
def base():
    return GGUFFile(BASE)


def adapter(base, name: str) -> AdapterWeights:
    return AdapterWeights.of(load_lora_adapter(ADAPTERS[name], base, name))


def runner(base, dtype=torch.float32, **options) -> ModelRunner:
    return ModelRunner.from_gguf(base, RunnerOptions(dtype=dtype, device=torch.device("cpu"), kv_cache_tokens=512,
                                                     **options))


def logits(r: ModelRunner, seqs: list[Sequence]) -> list[torch.Tensor]:
    """Every token's logits of each sequence's prompt, all in one step."""
    out = r.step(seqs, all_logits=True)
    rows, start = [], 0
    for s in seqs:
        rows.append(out[start:start + s.num_tokens])
        start += s.num_tokens
        r.release(s)
    return rows


@pytest.mark.parametrize("name", ["base", "attn", "experts"])
def test_float32_logits_match_peft(base, refs, name):
    r = runner(base)
    lora = None if name == "base" else adapter(base, name)
    for i, p in enumerate(PROMPTS):
        [got] = logits(r, [Sequence(i, refs[f"prompts/{p}"].tolist(), lora=lora)])
        want = torch.from_numpy(refs[f"{name}/{p}/logits"])
        assert (got - want).abs().max() <= F32_TOL, (name, p)
    if name != "base":  # the adapter moves the logits well past that bound: the test can tell
        assert (torch.from_numpy(refs[f"{name}/p0/logits"]) - torch.from_numpy(refs["base/p0/logits"])).abs().max() > 0.1


def test_one_batch_mixes_adapters_and_the_base(base, refs):
    """Each row gets its own adapter's delta: base, attn and experts rows in one step."""
    r = runner(base)
    loras = {"base": None, "attn": adapter(base, "attn"), "experts": adapter(base, "experts")}
    seqs = [Sequence(i, refs[f"prompts/{p}"].tolist(), lora=loras[n])
            for i, (n, p) in enumerate([("attn", "p0"), ("base", "p1"), ("experts", "p0"), ("attn", "p1")])]
    got = logits(r, seqs)
    for out, (n, p) in zip(got, [("attn", "p0"), ("base", "p1"), ("experts", "p0"), ("attn", "p1")]):
        assert (out - torch.from_numpy(refs[f"{n}/{p}/logits"])).abs().max() <= F32_TOL, (n, p)


def bfloat16_rows(r: ModelRunner, ids: list[int], lora) -> torch.Tensor:
    """Logits of positions 7.. of `ids`: an 8-token prompt, then one-token decode steps, beside a
    base-model sequence in every step."""
    s, other = Sequence(0, ids[:8], lora=lora), Sequence(1, ids[:8])
    rows = [r.step([s, other])[0]]
    for t in ids[8:]:
        s.token_ids.append(t)
        other.token_ids.append(t)
        rows.append(r.step([s, other])[0])
    r.release(s)
    r.release(other)
    return torch.stack(rows)


def median_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """The median over positions of each position's rel-L2: a near-tie routing flip moves one
    position by ~10% in bfloat16, adapter or not, and must not decide the test."""
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1)).median())


def test_bfloat16_decode_with_an_adapter_stays_near_peft(base, refs):
    """The fast path: adapted rows take the per-op attention (this fixture's float weights have no
    native front; test_native_front holds the front's deltas) and the adapted experts' own route; each position against peft's logits,
    no further off than the base model's bfloat16 decode is from its own reference."""
    r = runner(base, torch.bfloat16)
    ids = refs["prompts/p0"].tolist()
    base_rel = median_rel(bfloat16_rows(r, ids, None), torch.from_numpy(refs["base/p0/logits"])[7:])
    assert base_rel < 1e-2
    for name in ("attn", "experts"):
        got, want = bfloat16_rows(r, ids, adapter(base, name)), torch.from_numpy(refs[f"{name}/p0/logits"])[7:]
        assert median_rel(got, want) <= 1.5 * base_rel + 1e-3, name
        assert median_rel(got, torch.from_numpy(refs["base/p0/logits"])[7:]) > 10 * median_rel(got, want)


def test_prefix_caching_never_shares_blocks_across_adapters(base, refs):
    r = runner(base, prefix_caching=True, kv_block_tokens=4)
    ids = refs["prompts/p0"].tolist()
    lora = adapter(base, "attn")
    logits(r, [Sequence(0, ids)])  # the base fills and names the prompt's blocks
    s = Sequence(1, ids, lora=lora)
    assert r.blocks.cached_prefix(s).blocks == ()  # the adapter's blocks are other blocks
    [got] = logits(r, [s])
    assert (got - torch.from_numpy(refs["attn/p0/logits"])).abs().max() <= F32_TOL
    again = Sequence(2, ids, lora=lora)
    assert len(r.blocks.cached_prefix(again).blocks) == len(ids) // 4  # its own blocks are found


def test_the_registry_loads_lists_and_refuses(base, tmp_path):
    adapters = LoraAdapters(base, "base-qwen3moe", LoraSettings(modules=(("a", str(ADAPTERS["attn"])),), max_loras=2))
    assert [a.name for a in adapters.listed()] == ["a"]
    with pytest.raises(ValueError, match="already been loaded"):
        adapters.load("a", str(ADAPTERS["attn"]))
    with pytest.raises(ValueError, match="base model"):
        adapters.load("base-qwen3moe", str(ADAPTERS["attn"]))
    adapters.load("e", str(ADAPTERS["experts"]))
    with pytest.raises(LoraLimit, match="--max-loras 2"):
        adapters.load("third", str(ADAPTERS["attn"]))
    adapters.unload("a")
    with pytest.raises(UnknownLora, match="cannot be found"):
        adapters.unload("a")
    with pytest.raises(UnknownLora, match="does not exist"):
        adapters.get("a")
    assert adapters.get("") is None and adapters.get("base-qwen3moe") is None
    with pytest.raises(ValueError, match="missing.gguf"):
        adapters.load("m", str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="--max-lora-rank"):
        LoraAdapters(base, "b", LoraSettings(max_lora_rank=2)).load("a", str(ADAPTERS["attn"]))
    remote = LoraAdapters(base, "b", LoraSettings(), remote_experts=True)
    remote.load("a", str(ADAPTERS["attn"]))  # attention-side tensors: applied here whatever runs the experts
    with pytest.raises(ValueError, match="does not apply adapters"):
        remote.load("e", str(ADAPTERS["experts"]))
