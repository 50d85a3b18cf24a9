"""Issue 31 through compose.yaml: an 8-bit KV cache and LoRA adapters, as a vLLM user runs them.

The stack serves tests/data/lora's base (MODEL_DIR mounted at /models) with `KV_CACHE_DTYPE=q8_0`,
float32 compute (DTYPE) and two expert replicas. Both adapters are loaded while it serves, through
vLLM's /v1/load_lora_adapter with paths inside the containers: the attention side applies the one on
q/k and the head; the expert replicas open the other (on routed experts) from the same mount when a
hop names it. The official openai client lists them and scores the prompt under each name: each
within the q8_0 cache's distance of peft's float32 logprobs for that adapter, and far from the
others' (a request served by the wrong weights cannot pass).

Marked `compose` like test_compose_stack.py: `python -m pytest -m compose tests/compose`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.compose.test_compose_stack import API_KEY, running_stack

pytestmark = [pytest.mark.compose, pytest.mark.stack]
DATA = Path(__file__).resolve().parents[1] / "data" / "lora"
BASE = "base-qwen3moe"
ADAPTERS = {"attn": "/models/attn-lora.gguf", "experts": "/models/experts-lora.gguf"}
# In-process on the same file (float32, q8_0 cache): 0.008-0.011 from the adapter's own reference,
# 0.39-0.62 from the others'.
OWN_TOLERANCE = 0.05
OTHERS_DISTANCE = 0.3


@pytest.fixture(scope="module")
def stack():
    env = {"MODEL_DIR": str(DATA), "MODEL": f"/models/{BASE}.gguf", "DTYPE": "float32", "KV_CACHE_DTYPE": "q8_0"}
    with running_stack(2, project="splitmoe-compose-lora", env=env) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key=API_KEY, max_retries=0)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_adapters_load_while_serving_and_score_as_peft_over_a_q8_0_cache(stack, client):
    import httpx

    assert "stored as q8_0" in stack.logs("attention")
    with httpx.Client(base_url=f"http://127.0.0.1:{stack.port}", headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60) as http:
        for name, path in ADAPTERS.items():
            loaded = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            assert loaded.status_code == 200, loaded.text
    cards = {card.id: card for card in client.models.list().data}
    assert list(cards) == [BASE, *ADAPTERS]
    assert all(getattr(cards[name], "parent") == BASE for name in ADAPTERS)

    refs = np.load(DATA / "references.npz")
    ids = refs["prompts/p1"].tolist()
    want = {name: log_softmax(refs[f"{name}/p1/logits"])[np.arange(len(ids) - 1), ids[1:]]
            for name in ("base", *ADAPTERS)}
    for model, own in ((BASE, "base"), ("attn", "attn"), ("experts", "experts")):
        reply = client.completions.create(model=model, prompt=ids, max_tokens=0, echo=True, logprobs=0)
        assert reply.model == model
        got = np.array(reply.choices[0].logprobs.token_logprobs[1:])
        assert np.abs(got - want[own]).max() < OWN_TOLERANCE, model
        for other in set(want) - {own}:
            assert np.abs(got - want[other]).max() > OTHERS_DISTANCE, (model, other)
    hops = stack.hops_by_address()
    assert len(hops) == 2 and all(n > 0 for n in hops.values()), hops
    chat = client.chat.completions.create(model="experts", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "experts" and chat.choices[0].finish_reason in ("length", "stop")
