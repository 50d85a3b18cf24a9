"""Tiny transformers models as the numeric reference, and how to compare logits with them."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from splitmoe.cli import main

VOCAB = 300
NEAR_TIE = 0.05  # a routing flip between float32 and bfloat16 is acceptable only at a near-tie

SpecialInit = Callable[[str, torch.nn.Parameter, torch.Tensor], bool]
"""(name, parameter, noise) -> True when it initialised the parameter itself."""


def build_model(config, seed: int, special: SpecialInit | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager")
    reinitialise(model, torch.Generator().manual_seed(seed), special)
    return model.eval()


@torch.no_grad()
def reinitialise(model: torch.nn.Module, gen: torch.Generator, special: SpecialInit | None = None) -> None:
    """Weights that keep activations O(1), as the fixtures' are: transformers' 0.02 init would not."""
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if special is not None and special(name, p, noise):
            continue
        if name.endswith(".weight") and "norm" in name.split(".")[-2]:  # ...layernorm, DBRX's norm_1 / norm_f
            p.copy_(1 + 0.1 * noise)
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        elif "embed_tokens" in name or name.endswith("wte.weight"):
            p.copy_(noise)
        else:  # matrices, 3-D experts included: the last dim is the input
            p.copy_(noise / p.shape[-1] ** 0.5)


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


def splitmoe_logits(path: Path, ids: list[int], dtype: str = "float32") -> np.ndarray:
    out = path.with_suffix(f".{dtype}.npy")
    args = ["logits", str(path), "--token-ids", ",".join(map(str, ids)), "--out", str(out), "--dtype", dtype,
            "--device", "cpu"]
    assert main(args) == 0
    return np.load(out)


def token_ids(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def max_abs(x: np.ndarray, ref: np.ndarray) -> float:
    assert x.shape == ref.shape
    return float(np.abs(x - ref).max())


def rel_l2(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def routing_flips(reference, other) -> dict[int, tuple[int, float]]:
    """position -> (first layer whose expert set differs, that layer's top-k boundary logit gap)."""
    flips: dict[int, tuple[int, float]] = {}
    for layer, ((logits, ids), (_, other_ids)) in enumerate(zip(reference, other)):
        top_k = ids.shape[1]
        ranked = logits.sort(dim=-1, descending=True).values
        for t in range(ids.shape[0]):
            if t not in flips and set(ids[t].tolist()) != set(other_ids[t].tolist()):
                flips[t] = (layer, float(ranked[t, top_k - 1] - ranked[t, top_k]))
    return flips


@contextmanager
def recorded_routes(monkeypatch):
    """A list that fills with (router logits [T, E] float32, chosen ids [T, K]) per MoE layer call of
    every in-process run inside the block."""
    from splitmoe.attention_service.model import transformer

    routes = []
    real_route = transformer.route

    def recording_route(router_logits, top_k, *args, **kwargs):
        ids, weights = real_route(router_logits, top_k, *args, **kwargs)
        routes.append((router_logits.float(), ids))
        return ids, weights

    monkeypatch.setattr(transformer, "route", recording_route)
    try:
        yield routes
    finally:
        monkeypatch.setattr(transformer, "route", real_route)


def assert_close_but_near_tie_flips(got: np.ndarray, reference: np.ndarray, exact_routes, routes,
                                    bound: float) -> None:
    """rel-L2 within `bound` except at positions where routing flipped against the exact run's
    routes, each of which must be a near-tie there (a different expert is a different function)."""
    flipped = routing_flips(exact_routes, routes)
    for position, (layer, logit_gap) in flipped.items():
        assert logit_gap < NEAR_TIE, f"position {position}, layer {layer}: a clear expert choice changed"
    kept = [t for t in range(len(reference)) if t not in flipped]
    assert len(kept) >= 0.75 * len(reference), f"routing flipped at positions {sorted(flipped)}"
    assert rel_l2(got[kept], reference[kept]) <= bound
