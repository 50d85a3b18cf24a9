"""The IQ and TQ types, and files mixing types, against transformers on exactly dequantized weights.

Tiny qwen3moe models whose experts and some attention tensors are random valid blocks of a type
(tests/support/quant_model.py); transformers runs float32 eager on the values gguf-py dequantizes
them to. The exact float32 path must match within 1e-3 max-abs in-process, and the mixed file
also end to end: gateway -> `serve-attention` -> two `serve-experts`, and an in-process attention
on those services. The fast path (bfloat16: int8 activations, bf16 GEMMs, dense copies where no
native kernel exists) is held to the bound the fast mode keeps for the other types (test_fast_mode.py).
"""
from __future__ import annotations

import re

import gguf
import httpx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from splitmoe.attention_service.expert_backends.remote import RemoteExperts, RemoteExpertsSettings
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.modelfile.gguf_file import GGUFFile
from tests.kernels.test_quants import IQ_TYPES
from tests.support.cpu_paths import PATHS, forced_path
from tests.support.hf_reference import (
    assert_close_but_near_tie_flips,
    hf_logits,
    max_abs,
    recorded_routes,
    splitmoe_logits,
    token_ids,
)
from tests.support.processes import CLUSTER
from tests.support.quant_model import TypeChoice, quantized_model, qwen3moe_config
from tests.support.stack import running_stack

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
EXACT = 1e-3
FAST = 3e-2  # test_fast_mode: dequantize + GEMM over a prompt, bf16 activations


def assert_fast_path_close(monkeypatch, reference: np.ndarray, run) -> None:
    """`run(dtype)` -> logits: float32 within EXACT of `reference`, bfloat16 within FAST except
    at near-tie routing flips (test_hf_reference.py's rule for bfloat16)."""
    with recorded_routes(monkeypatch) as exact_routes:
        assert max_abs(run("float32"), reference) <= EXACT
    with recorded_routes(monkeypatch) as routes:
        got = run("bfloat16")
    assert_close_but_near_tie_flips(got, reference, exact_routes, routes, FAST)


def one_type(qtype: T) -> TypeChoice:
    """Experts, q, attention output and the embedding in `qtype`; k, v and lm_head F16/BF16/Q8_0."""
    def choose(name: str) -> T | None:
        if re.search(r"_exps\.weight$|attn_q\.weight$|attn_output\.weight$|^token_embd", name):
            return qtype
        return {"attn_k": T.F16, "attn_v": T.BF16, "output": T.Q8_0}.get(_kind(name))
    return choose


# layer -> expert (gate, up, down) types: every IQ/TQ type, gate unlike down, native beside not.
MIXED_EXPERTS = {
    0: (T.IQ2_XXS, T.IQ2_XXS, T.IQ4_XS),
    1: (T.IQ3_XXS, T.IQ3_S, T.IQ2_S),
    2: (T.IQ1_S, T.IQ1_M, T.IQ2_XS),
    3: (T.TQ1_0, T.TQ2_0, T.IQ4_NL),
    4: (T.Q4_K, T.Q4_K, T.IQ3_S),
    5: (T.IQ4_NL, T.IQ4_NL, T.Q6_K),
}
ATTENTION = (T.F16, T.BF16, T.Q8_0)


def mixed(name: str) -> T | None:
    """Experts per MIXED_EXPERTS; per layer q/k/v rotate through F16/BF16/Q8_0 and the output takes
    the layer's gate type; embedding IQ4_XS, lm_head IQ2_S."""
    kind = _kind(name)
    if kind in ("token_embd", "output"):
        return T.IQ4_XS if kind == "token_embd" else T.IQ2_S
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        return MIXED_EXPERTS[layer][("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps").index(kind)]
    if kind in ("attn_q", "attn_k", "attn_v"):
        return ATTENTION[(layer + "qkv".index(kind[-1])) % 3]
    return MIXED_EXPERTS[layer][0] if kind == "attn_output" else None


def _kind(name: str) -> str:
    """blk.3.attn_q.weight -> attn_q; output.weight -> output."""
    return name.removesuffix(".weight").split(".")[-1]


def stored_types(path) -> dict[str, T]:
    return {t.name: T(t.tensor_type) for t in gguf.GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "qwen3moe-mixed.gguf"
    model = quantized_model(qwen3moe_config(len(MIXED_EXPERTS)), 500, path, mixed)
    ids = token_ids(24, seed=500)
    return path, ids, hf_logits(model, ids)


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda t: t.name)
def test_each_type_matches_transformers_on_its_dequantized_weights(qtype, tmp_path, monkeypatch):
    path = tmp_path / f"qwen3moe-{qtype.name}.gguf"
    model = quantized_model(qwen3moe_config(2), 400 + int(qtype), path, one_type(qtype))
    types = stored_types(path)
    assert types["blk.1.ffn_down_exps.weight"] == qtype and types["blk.0.attn_q.weight"] == qtype
    assert types["token_embd.weight"] == qtype and types["blk.0.attn_v.weight"] == T.BF16
    ids = token_ids(20, seed=int(qtype))
    assert_fast_path_close(monkeypatch, hf_logits(model, ids), lambda dtype: splitmoe_logits(path, ids, dtype))


def test_mixed_file_stores_each_tensor_as_chosen(mixed_model):
    path, _, _ = mixed_model
    types = stored_types(path)
    assert {types[f"blk.{i}.ffn_{m}_exps.weight"] for i in MIXED_EXPERTS for m in ("gate", "up", "down")} \
        >= set(IQ_TYPES)
    assert types["blk.0.ffn_gate_exps.weight"] != types["blk.0.ffn_down_exps.weight"]
    assert {types[f"blk.0.attn_{p}.weight"] for p in "qkv"} == set(ATTENTION)


@pytest.mark.parametrize("cpu_path", PATHS)
def test_mixed_file_matches_transformers(mixed_model, monkeypatch, cpu_path):
    path, ids, reference = mixed_model
    with forced_path(cpu_path):
        assert_fast_path_close(monkeypatch, reference, lambda dtype: splitmoe_logits(path, ids, dtype))


@pytest.fixture(scope="module")
def stack(mixed_model, tmp_path_factory):
    path, _, _ = mixed_model
    with running_stack(path, tmp_path_factory.mktemp("stack-logs")) as s:
        yield s


@pytest.mark.stack
def test_mixed_file_through_the_stack_gives_transformers_logprobs(stack, mixed_model):
    """Gateway -> serve-attention (float32) -> two serve-experts: each prompt token's logprob."""
    path, ids, reference = mixed_model
    model_id = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    response = httpx.post(stack.url + "/v1/completions", timeout=120, json={
        "model": model_id, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert response.status_code == 200, response.text
    got = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    logprobs = torch.log_softmax(torch.from_numpy(reference).double(), dim=-1).numpy()
    assert got[0] is None
    np.testing.assert_allclose(got[1:], [logprobs[i, ids[i + 1]] for i in range(len(ids) - 1)], rtol=0, atol=EXACT)


def remote_logits(stack, path, ids, dtype: str) -> np.ndarray:
    """Every position's logits, attention in this process, experts on the stack's two services."""
    addresses = (stack.experts.address("low"), stack.experts.address("high"))
    experts = RemoteExperts(GGUFFile(path), RemoteExpertsSettings(addresses=addresses, startup_wait_s=60.0,
                                                                  security=CLUSTER))
    try:
        runner = ModelRunner.from_gguf(path, RunnerOptions(dtype=getattr(torch, dtype), device=torch.device("cpu"),
                                                           kv_cache_tokens=64), experts=experts)
        return runner.step([Sequence(0, list(ids))], all_logits=True).float().numpy()
    finally:
        experts.close()


@pytest.mark.stack
def test_mixed_file_through_expert_services_matches_transformers(stack, mixed_model, monkeypatch):
    """bfloat16 hidden states take the services' fast path (native where all three matrices of an
    expert are, else dequantize-once GEMMs) and the attention side's quantized linears."""
    path, ids, reference = mixed_model
    assert_fast_path_close(monkeypatch, reference, lambda dtype: remote_logits(stack, path, ids, dtype))
