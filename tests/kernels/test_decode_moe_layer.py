"""The native router (kernels.decode_moe_layer.route) against torch's (model/routing.py `route`):
the same experts in the same order, the same weights to float32 rounding, for every gating the
fused decode layer takes; and the calls it refuses."""
from __future__ import annotations

import pytest
import torch

from splitmoe.attention_service.model.routing import route as torch_route
from splitmoe.kernels import native
from splitmoe.kernels.decode_moe_layer import Gating, Router, route
from splitmoe.modelfile.hparams import GATING_SIGMOID, GATING_SOFTMAX, GATING_SOFTMAX_WEIGHT

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels: {native.UNAVAILABLE_REASON}")

CASES = [  # (gating, torch's name, renormalize, scale, with a selection bias)
    (Gating.SOFTMAX, GATING_SOFTMAX, True, 1.0, False),     # Qwen3, OLMoE, Mixtral
    (Gating.SOFTMAX, GATING_SOFTMAX, False, 1.0, False),    # Qwen2-MoE
    (Gating.SIGMOID, GATING_SIGMOID, True, 2.5, True),      # DeepSeek-V3's rule without groups, GLM-4.5
    (Gating.SIGMOID, GATING_SIGMOID, False, 1.0, False),
    (Gating.SOFTMAX_WEIGHT, GATING_SOFTMAX_WEIGHT, False, 1.0, False),  # gpt-oss
]


@pytest.mark.parametrize("gating,name,renormalize,scale,biased", CASES)
@pytest.mark.parametrize("num_experts,top_k", [(128, 8), (32, 4), (8, 2), (4, 4)])
def test_same_choice_as_torch(gating, name, renormalize, scale, biased, num_experts, top_k):
    gen = torch.Generator().manual_seed(num_experts * 10 + top_k)
    logits = torch.randn(7, num_experts, generator=gen) * 3
    bias = torch.randn(num_experts, generator=gen) * 0.2 if biased else None
    ids, weights = route(Router(num_experts, top_k, gating, renormalize, scale, bias), logits)
    want_ids, want_weights = torch_route(logits, top_k, name, renormalize, scale, selection_bias=bias)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=4e-7, atol=1e-7)


def test_ties_keep_the_lower_id_first():
    ids, weights = route(Router(6, 3, Gating.SOFTMAX, True), torch.tensor([[1.0, 5.0, 1.0, 5.0, 0.0, 5.0]]))
    assert ids.tolist() == [[1, 3, 5]]
    torch.testing.assert_close(weights, torch.full((1, 3), 1 / 3))


def test_refused():
    with pytest.raises(ValueError, match="top 9 of 8"):
        Router(8, 9, Gating.SOFTMAX, True)
    with pytest.raises(ValueError, match="selection bias of shape"):
        Router(8, 2, Gating.SIGMOID, True, selection_bias=torch.zeros(7))
    with pytest.raises(ValueError, match="want \\[T, 8\\]"):
        route(Router(8, 2, Gating.SOFTMAX, True), torch.zeros(3, 9))
