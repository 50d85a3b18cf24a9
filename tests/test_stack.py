"""The whole stack as real processes: gateway -> attention -> two expert services, over loopback.

The acceptance checks of the services issue: the official `openai` client against the gateway
equals the single-process reference, batching changes no one's tokens, and an expert service
killed mid-request ends that request cleanly, shows in /health, and is picked up again when it
comes back.
"""
from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import openai
import pytest

from splitmoe.modelfile.gguf_file import GGUFFile
from tests.support.expert_services import ExpertServices
from tests.support.processes import REPO, run_splitmoe
from tests.support.stack import running_stack

pytestmark = pytest.mark.stack  # the whole stack as real processes

EXPERT_TIMEOUT_S = 5.0
PROMPT = "Write one line about the sea."


@pytest.fixture(scope="module")
def model(demo_gguf):
    """A llama.cpp-made fixture when CI has one beside the clone, else the built-in demo model."""
    fixture = REPO.parent / "shared" / "fixtures" / "qwen2moe" / "qwen2moe-q8_0.gguf"
    return fixture if fixture.exists() else demo_gguf


@pytest.fixture(scope="module")
def stack(model, tmp_path_factory):
    with running_stack(model, tmp_path_factory.mktemp("logs"), "--expert-timeout-s", str(EXPERT_TIMEOUT_S)) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def test_streamed_chat_equals_single_process_generate(stack, client, model_id):
    stream = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=24, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    reference = run_splitmoe("generate", str(stack.model), "--prompt", PROMPT, "--chat", "-n", "24")
    assert text == reference[:-1]  # print() added the newline


def test_prompt_logprobs_equal_log_softmax_of_logits(stack, model_id, tmp_path):
    vocab_size = len(GGUFFile(stack.model).require("tokenizer.ggml.tokens"))
    ids = np.random.default_rng(0).integers(0, vocab_size, 8).tolist()  # any model's vocabulary
    response = httpx.post(stack.url + "/v1/completions", timeout=60, json={
        "model": model_id, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert response.status_code == 200, response.text
    got = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    run_splitmoe("logits", str(stack.model), "--token-ids", ",".join(map(str, ids)), "--out", str(tmp_path / "l.npy"))
    logits = np.load(tmp_path / "l.npy").astype(np.float64)
    top = logits.max(1, keepdims=True)
    logprobs = logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))
    assert got[0] is None
    np.testing.assert_allclose(got[1:], [logprobs[i, ids[i + 1]] for i in range(len(ids) - 1)], atol=1e-3)


def test_concurrent_streams_get_their_own_greedy_tokens_and_are_batched(stack, client, model_id):
    prompts = [f"Item {i}: name a colour and a number." for i in range(8)]

    def run(prompt: str) -> str:
        stream = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=16, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    alone = [run(p) for p in prompts]
    together: list[str | None] = [None] * len(prompts)
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, run(prompts[i]))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
    metrics = httpx.get(stack.url + "/metrics", timeout=10).text
    batch = [line for line in metrics.splitlines() if line.startswith("splitmoe:max_batch_seqs")]
    assert batch and float(batch[0].split()[-1]) > 1


def test_a_killed_expert_service_fails_requests_cleanly_and_is_picked_up_again(stack, client, model_id):
    experts: ExpertServices = stack.experts
    stream = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=2000, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    next(iter(stream))
    experts.kill("high")
    started = time.monotonic()
    with pytest.raises(openai.APIError) as failure:
        for _ in stream:
            pass
    assert time.monotonic() - started < EXPERT_TIMEOUT_S + 10
    assert "expert" in str(failure.value).lower()

    health = httpx.get(stack.url + "/health", timeout=10)
    assert health.status_code == 503 and "expert" in health.text.lower()

    experts.restart("high")
    deadline = time.monotonic() + 30
    while httpx.get(stack.url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the restarted expert service was not picked up"
        time.sleep(0.5)
    reply = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop")
