"""`reasoning_content` through the gateway, as vLLM and llama-server return it, on a harmony model.

The model's generation prompt opens harmony's analysis channel and its random weights never pick
a marker, so everything it writes is reasoning: deterministic without a trained model.
"""
from __future__ import annotations

import httpx
import pytest

from tests.support.gateway_http import running_gateway, sse_chunks, wait_http
from tests.support.harmony_model import write_harmony_demo_model
from tests.support.processes import free_port, grpc_service

pytestmark = pytest.mark.stack  # `serve-attention` and `serve-gateway` as real processes

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model = write_harmony_demo_model(tmp_path_factory.mktemp("harmony"))
    logs = tmp_path_factory.mktemp("logs")
    port = free_port()
    with grpc_service(["serve-attention", str(model), "--port", str(port), "--kv-cache-tokens", "512"], port,
                      logs / "attention.log"):
        with running_gateway(port, logs / "splitmoe.gateway.log") as gateway:
            wait_http(gateway + "/health", None, lambda r: r.status_code == 200)
            yield gateway


def post(url, **extra):
    response = httpx.post(url + "/v1/chat/completions", json={**CHAT, "model": "harmony", **extra}, timeout=60)
    assert response.status_code == 200, response.text
    return response


def test_the_reasoning_comes_apart_from_the_content(url):
    message = post(url).json()["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] == ""


def test_streamed_reasoning_deltas_add_up_to_the_whole(url):
    whole = post(url).json()["choices"][0]["message"]["reasoning_content"]
    chunks = sse_chunks(post(url, stream=True))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole
    assert not any(d.get("content") for d in deltas)


def test_reasoning_format_none_returns_it_inline(url):
    whole = post(url).json()["choices"][0]["message"]["reasoning_content"]
    message = post(url, reasoning_format="none").json()["choices"][0]["message"]
    assert message["content"] == whole and message.get("reasoning_content") is None
