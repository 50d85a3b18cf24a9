"""kernels.moe against a float64 reference: biases, both activations, and which experts run.

The weights are Q8_0 (a real block type); the reference uses their exact dequantized values in
float64, so the only difference left is the kernel's float32 arithmetic.
"""
from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from splitmoe.kernels.moe import ACT_SILU, ACT_SWIGLU_OAI, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, ExpertFFN, moe_forward
from splitmoe.kernels.quants import QuantTensor, dequantize

HIDDEN, FFN, NUM_EXPERTS, TOP_K, NUM_TOKENS = 64, 32, 6, 2, 40


def q8_0(name: str, values: torch.Tensor) -> QuantTensor:
    return QuantTensor(name, int(T.Q8_0), tuple(values.shape), gq.quantize(values.numpy(), T.Q8_0))


def make_experts(gen: torch.Generator, activation: str, biases: bool, gain: float = 1.0) -> dict[int, ExpertFFN]:
    """`gain` scales gate/up so the clamped activation's limits are reached."""
    def matrix(e: int, m: str, rows: int, cols: int, scale: float) -> QuantTensor:
        return q8_0(f"{m}{e}", torch.randn(rows, cols, generator=gen) * scale / cols**0.5)

    def bias(size: int) -> torch.Tensor | None:
        return 0.5 * torch.randn(size, generator=gen) if biases else None

    return {e: ExpertFFN(matrix(e, "gate", FFN, HIDDEN, gain), matrix(e, "up", FFN, HIDDEN, gain),
                         matrix(e, "down", HIDDEN, FFN, 1.0), bias(FFN), bias(FFN), bias(HIDDEN), activation)
            for e in range(NUM_EXPERTS)}


def reference(hidden, ids, weights, experts) -> torch.Tensor:
    """Token by token, slot by slot, in float64: the definition, not the grouped algorithm."""
    ffns = {e: Float64FFN(f) for e, f in experts.items()}
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            ffn = ffns.get(int(ids[t, k]))
            if ffn is not None:
                out[t] += float(weights[t, k]) * ffn(hidden[t].double())
    return out


class Float64FFN:
    def __init__(self, ffn: ExpertFFN):
        self.activation = ffn.activation
        self.layers = [(dequantize(w).double(), None if b is None else b.double())
                       for w, b in ((ffn.gate, ffn.gate_bias), (ffn.up, ffn.up_bias), (ffn.down, ffn.down_bias))]

    def pre_activation(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._linear(0, x), self._linear(1, x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.pre_activation(x)
        if self.activation == ACT_SILU:
            act = gate * torch.sigmoid(gate) * up
        else:  # transformers' GptOssExperts._apply_gate, written out
            gate = torch.minimum(gate, torch.tensor(SWIGLU_OAI_LIMIT, dtype=torch.float64))
            up = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
            act = (up + 1) * gate / (1 + torch.exp(-SWIGLU_OAI_ALPHA * gate))
        return self._linear(2, act)

    def _linear(self, i: int, x: torch.Tensor) -> torch.Tensor:
        w, b = self.layers[i]
        y = x @ w.T
        return y if b is None else y + b


def routing(gen: torch.Generator, allowed: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token drawn from `allowed`, softmax-like weights."""
    choice = torch.stack([torch.randperm(len(allowed), generator=gen)[:TOP_K] for _ in range(NUM_TOKENS)])
    ids = torch.tensor(allowed)[choice]
    weights = torch.softmax(torch.randn(NUM_TOKENS, TOP_K, generator=gen), dim=-1)
    return ids, weights


def check(hidden, ids, weights, experts) -> None:
    got = moe_forward(hidden, ids, weights, experts)
    want = reference(hidden, ids, weights, experts)
    assert got.dtype == hidden.dtype
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= 2e-6 * scale


@pytest.mark.parametrize("activation", [ACT_SILU, ACT_SWIGLU_OAI])
@pytest.mark.parametrize("biases", [False, True])
def test_every_expert_hit(activation, biases):
    gen = torch.Generator().manual_seed(1)
    experts = make_experts(gen, activation, biases, gain=4.0)
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=gen)
    ids, weights = routing(gen, list(range(NUM_EXPERTS)))
    assert set(ids.flatten().tolist()) == set(range(NUM_EXPERTS))
    check(hidden, ids, weights, experts)


def test_clamped_swiglu_reaches_both_limits():
    """The clamps must be exercised, or the test above proves nothing about them."""
    gen = torch.Generator().manual_seed(1)
    experts = make_experts(gen, ACT_SWIGLU_OAI, biases=True, gain=4.0)
    x = torch.randn(NUM_TOKENS, HIDDEN, generator=gen).double()
    gate, up = map(torch.cat, zip(*(Float64FFN(f).pre_activation(x) for f in experts.values())))
    assert (gate > SWIGLU_OAI_LIMIT).any() and (up > SWIGLU_OAI_LIMIT).any() and (up < -SWIGLU_OAI_LIMIT).any()


def test_idle_and_foreign_experts_add_nothing():
    """An expert no token chose adds no bias; ids a shard does not hold (and -1) add nothing."""
    gen = torch.Generator().manual_seed(2)
    experts = make_experts(gen, ACT_SWIGLU_OAI, biases=True)
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=gen)
    ids, weights = routing(gen, [0, 1, 3, 4])  # expert 2 and 5 idle
    check(hidden, ids, weights, experts)
    shard = {e: experts[e] for e in (0, 1)}
    ids[0, 0] = -1
    check(hidden, ids, weights, shard)


def test_bfloat16_hidden_is_computed_in_float32():
    gen = torch.Generator().manual_seed(3)
    experts = make_experts(gen, ACT_SWIGLU_OAI, biases=True)
    hidden = torch.randn(NUM_TOKENS, HIDDEN, generator=gen).bfloat16()
    ids, weights = routing(gen, list(range(NUM_EXPERTS)))
    got = moe_forward(hidden, ids, weights, experts)
    want = reference(hidden.float(), ids, weights, experts)
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max().item() <= 1e-2 * want.abs().max().item()


def test_no_tokens():
    experts = make_experts(torch.Generator().manual_seed(4), ACT_SWIGLU_OAI, biases=True)
    out = moe_forward(torch.zeros(0, HIDDEN), torch.zeros(0, TOP_K, dtype=torch.long), torch.zeros(0, TOP_K), experts)
    assert out.shape == (0, HIDDEN)


def test_unknown_activation_is_refused():
    ffn = next(iter(make_experts(torch.Generator().manual_seed(5), ACT_SILU, biases=False).values()))
    with pytest.raises(ValueError, match="activation"):
        ExpertFFN(ffn.gate, ffn.up, ffn.down, activation="gelu")


@pytest.mark.parametrize("num_tokens", [1, 5, 9, NUM_TOKENS])
def test_float32_does_not_depend_on_the_thread_count(num_tokens):
    """The exact path gives the same bits in a 1-thread expert service as in a 2-thread process
    (MKL picks its float32 kernel by thread count on some CPUs unless made reproducible), for
    any thread count up to the cores (oversubscribed counts are not covered)."""
    gen = torch.Generator().manual_seed(num_tokens)
    experts = make_experts(gen, ACT_SILU, biases=False)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, TOP_K, generator=gen)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in range(1, min(4, os.cpu_count() or 1) + 1):
            torch.set_num_threads(n)
            outs.append(moe_forward(hidden, ids, weights, experts))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
